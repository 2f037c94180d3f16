"""What a DSpark step's glue costs warm, and what it costs where it runs.

    python -m sglang.bench_glue_cache --temperature 1 --batch-size 1

On its own engine (thrown away after), once a few decode steps have filled
the step buffers, times the accept phase (``dspark_verify.accept``, the
code the engine runs, on the engine's own buffers and a fixed logits
tensor) three ways, interleaved trial by trial:

- ``warm``: right after another accept (the op paths and the tensors in cache);
- ``after verify forward``: right after the target's forward over the
  verify batch, where a decode step runs it;
- ``after 16 MB sweep``: after an add over a 16 MB tensor (the caches
  below the last level evicted, nothing else).

The ratios say how much of the glue's in-step cost is its ops' cold start
rather than their work: the bound on what trimming Python around them can
win. The engine is not used after the probe (its buffers are overwritten).
"""

import argparse
import json
import random
import statistics
import time
from typing import Dict

import torch

from sglang import Engine, bench_plots
from sglang.bench_stats import median_ratio
from sglang.srt.layers.sampler import SamplingMode
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.speculative.dspark_components.dspark_verify import accept


def probe(*, temperature: float, batch_size: int, trials: int, seed: int = 0) -> Dict:
    """The accept phase's median time per way, and each way's ratio to warm
    (median of the per-trial ratios, its 95% interval)."""
    if trials < 10:
        raise ValueError(f"trials must be >= 10 (an interval needs them), got {trials}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    engine = Engine(
        speculative_algorithm="DSPARK",
        device="cpu",
        max_running_requests=max(8, batch_size),
        max_total_tokens=max(4096, 64 * batch_size),
    )
    worker, rng = engine.worker, random.Random(seed)
    for i in range(batch_size):
        prompt = [rng.randrange(3, 200) for _ in range(16)]
        params = SamplingParams(max_new_tokens=400, temperature=temperature)
        engine.scheduler.add_request(
            Req(rid=str(i), origin_input_ids=prompt, sampling_params=params)
        )
    for _ in range(4):  # prefill, then decode steps: the buffers hold a step
        engine.scheduler.step()
    views = worker.buffers.at(batch_size)
    logits = torch.randn(
        views.verify_batch.num_tokens,
        worker.config.vocab_size,
        generator=torch.Generator().manual_seed(seed),
    )
    mode = SamplingMode.SAMPLED if temperature > 0 else SamplingMode.GREEDY
    sweep = torch.zeros(4 * 2**20)  # 16 MB of float32
    before = {
        "warm": lambda: accept(views=views, target_logits=logits, mode=mode),
        "after verify forward": lambda: worker.target_runner.forward(
            views.verify_batch
        ),
        "after 16 MB sweep": lambda: sweep.add_(1.0),
    }
    times = {name: [] for name in before}
    with torch.no_grad():
        # trials // 5 more trials first, discarded: the warm-up.
        for trial in range(trials + trials // 5):
            for name, run_before in before.items():
                run_before()
                start = time.perf_counter()
                accept(views=views, target_logits=logits, mode=mode)
                seconds = time.perf_counter() - start
                if trial >= trials // 5:
                    times[name].append(seconds)
    warm = times["warm"]
    out = {
        "temperature": temperature,
        "batch_size": batch_size,
        "trials": trials,
        "accept_us": {k: statistics.median(v) * 1e6 for k, v in times.items()},
    }
    out["ratio_to_warm"] = {}
    for name, seconds in times.items():
        if name != "warm":
            ratio = median_ratio(seconds, warm)
            out["ratio_to_warm"][name] = {k: ratio[k] for k in ("median", "ci95")}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--trials", type=int, default=400)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.trials < 10 or args.batch_size < 1:
        p.error("needs --trials >= 10, --batch-size >= 1")
    try:  # the engine's own rule for a temperature
        SamplingParams(max_new_tokens=1, temperature=args.temperature)
    except ValueError as e:
        p.error(f"--temperature: {e}")
    bench_plots.check_json_path(p, args.json)
    out = probe(
        temperature=args.temperature, batch_size=args.batch_size, trials=args.trials
    )
    for name, us in out["accept_us"].items():
        ratio = out["ratio_to_warm"].get(name)
        extra = ""
        if ratio is not None:
            lo, hi = ratio["ci95"]
            extra = f"  {ratio['median']:.2f}x warm [{lo:.2f}, {hi:.2f}]"
        print(f"accept {name:22s} {us:8.1f} us (median){extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Decode throughput of DSpark vs plain decoding, measured in one run.

    python -m sglang.bench_one_batch --batch-size 1 8 --input-len 64 --output-len 64

For each batch size both engines decode the same random prompts, in
``--repeats`` interleaved runs. Printed per batch size, from each engine's
median run: decode tokens/s (with the min-max over runs) and mean step time,
their ratio, DSpark's mean accepted length (accepted drafts + 1 per verify
step), and whether every DSpark greedy output equals plain greedy output
token for token (it must).
"""

import argparse
import json
import random
import sys
from typing import Dict, List

from tqdm import tqdm

from sglang.srt.entrypoints.engine import Engine


def _decode(engine: Engine, prompts, params, desc: str) -> Dict:
    """Run once and read the engine's decode-step timings."""
    engine.scheduler.decode_step_times.clear()
    total = len(prompts) * params["max_new_tokens"]
    with tqdm(total=total, desc=desc, unit="tok", leave=False, file=sys.stderr) as bar:
        outs = engine.generate(
            input_ids=prompts, sampling_params=params, progress=bar.update
        )
    steps = engine.scheduler.decode_step_times
    # The first token of each request comes from prefill, not a decode step.
    decode_tokens = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs)
    verify_ct = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    return {
        "output_ids": [o["output_ids"] for o in outs],
        "decode_steps": len(steps),
        "mean_step_ms": 1e3 * sum(steps) / max(len(steps), 1),
        "decode_tokens_per_s": decode_tokens / sum(steps) if steps else 0.0,
        # Committed tokens per verify step, before truncation at max_new_tokens.
        "accept_length": (
            sum(
                o["meta_info"]["spec_accept_length"] * o["meta_info"]["spec_verify_ct"]
                for o in outs
            )
            / verify_ct
            if verify_ct
            else 0.0
        ),
    }


def _median(runs: List[Dict]) -> Dict:
    ordered = sorted(runs, key=lambda r: r["decode_tokens_per_s"])
    return dict(
        ordered[len(ordered) // 2],
        tokens_per_s_range=[
            r["decode_tokens_per_s"] for r in (ordered[0], ordered[-1])
        ],
    )


def run(args: argparse.Namespace) -> List[Dict]:
    rng = random.Random(args.seed)
    common = dict(
        model_path=args.model_path,
        device=args.device,
        random_seed=args.seed,
        max_running_requests=max(args.batch_size),
        disable_cuda_graph=args.disable_cuda_graph,
    )
    plain = Engine(speculative_algorithm=None, **common)
    dspark = Engine(
        speculative_algorithm="DSPARK",
        # Upstream's speculative_num_draft_tokens is the verify width, gamma + 1.
        speculative_num_draft_tokens=None if args.gamma is None else args.gamma + 1,
        **common,
    )
    vocab = plain.vocab_size
    params = {"max_new_tokens": args.output_len, "temperature": args.temperature}
    rows = []
    for bs in args.batch_size:
        prompts = [
            [rng.randrange(vocab - 1) for _ in range(args.input_len)] for _ in range(bs)
        ]
        warmup = dict(params, max_new_tokens=4)
        for engine in (plain, dspark):
            engine.generate(input_ids=prompts, sampling_params=warmup)
        # Interleaved repeats; each engine's median run is reported, so one
        # noisy moment on a shared machine does not decide the ratio.
        runs = {"plain": [], "dspark": []}
        for r in range(args.repeats):
            for name, engine in (("plain", plain), ("dspark", dspark)):
                desc = f"{name} bs={bs} run {r + 1}/{args.repeats}"
                runs[name].append(_decode(engine, prompts, params, desc))
        base, spec = (_median(runs[name]) for name in ("plain", "dspark"))
        rows.append(
            {
                "batch_size": bs,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "temperature": args.temperature,
                "gamma": dspark.dspark_config.gamma,
                "device": plain.server_args.device,
                "cuda_graph": plain.server_args.use_cuda_graph,
                "repeats": args.repeats,
                "plain_tokens_per_s": base["decode_tokens_per_s"],
                "plain_tokens_per_s_range": base["tokens_per_s_range"],
                "plain_mean_step_ms": base["mean_step_ms"],
                "dspark_tokens_per_s": spec["decode_tokens_per_s"],
                "dspark_tokens_per_s_range": spec["tokens_per_s_range"],
                "dspark_mean_step_ms": spec["mean_step_ms"],
                "speedup": spec["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                "accept_length": spec["accept_length"],
                # Every run of both engines, not only the median ones.
                "greedy_output_equal": (
                    all(
                        run["output_ids"] == base["output_ids"]
                        for run in runs["plain"] + runs["dspark"]
                    )
                    if args.temperature == 0
                    else None
                ),
            }
        )
        print(_format(rows[-1]), flush=True)
    return rows


def _format(r: Dict) -> str:
    equal = r["greedy_output_equal"]

    def engine(name: str) -> str:
        lo, hi = r[f"{name}_tokens_per_s_range"]
        return (
            f"{name} {r[f'{name}_tokens_per_s']:7.1f} tok/s [{lo:.0f}-{hi:.0f}] "
            f"{r[f'{name}_mean_step_ms']:.3f} ms/step"
        )

    return (
        f"bs={r['batch_size']:<3} {engine('plain')} | {engine('dspark')} | "
        f"dspark/plain {r['speedup']:.3f}x | accept length "
        f"{r['accept_length']:.2f} | greedy equal: "
        f"{'n/a (sampling)' if equal is None else equal}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="draft block size gamma (the engine's speculative_num_draft_tokens "
        "is gamma + 1); default: the draft's block size",
    )
    p.add_argument("--model-path", default=None, help="default: embedded tiny-moe")
    p.add_argument("--device", default=None, help="default: cuda when present")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs; the median is shown"
    )
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.input_len < 1:
        p.error("--input-len must be >= 1")
    if args.output_len < 2:  # the first token comes from prefill: no decode step
        p.error("--output-len must be >= 2")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if min(args.batch_size) < 1:
        p.error("--batch-size values must be >= 1")
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(r["greedy_output_equal"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

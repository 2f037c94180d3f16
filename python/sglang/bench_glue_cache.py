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

``--compiled`` also times the same accept compiled ahead of time with
AOTInductor (``torch.export`` of ``dspark_verify.accept`` over the engine's
own buffers, which enter as its inputs, then one call of the loaded kernel
per accept), interleaved with the eager one the same three ways, and checks
that it leaves the same accept lengths and bonus as eager from the same
state: what fusing the glue into one compiled call per piece would cost in
a step (docs/benchmarks.md, "what bounds them here").
"""

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict

import torch

from sglang import Engine, bench_plots
from sglang.bench_stats import median_ratio
from sglang.srt.layers.sampler import SamplingMode
from sglang.srt.managers.schedule_batch import Req, SamplingParams, kv_slots_needed
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.dspark_components.dspark_verify import accept
from sglang.srt.utils.common import interrupted

# torch.export (2.13) fails to functionalize rejection_accept's first write,
# out= into a view of a flat buffer of a product over the transposed logits,
# above one request ("Cannot view a tensor ... as a tensor with shape").
_SAMPLED_COMPILE_LIMIT = (
    "compiled: the sampled accept exports at batch size 1 only (torch.export "
    "cannot functionalize its out= write of a transposed product above one row)"
)


# Each request's prompt and new tokens: long enough that no request ends
# during the probe's steps.
_PROMPT_LEN, _NEW_TOKENS = 16, 400


def compile_accept(worker, bs: int, logits: torch.Tensor, mode) -> Callable[[], None]:
    """``accept`` over the worker's buffers at ``bs`` rows, compiled with
    AOTInductor: the arena's storages are the program's inputs (each once;
    inside, the arena is rebuilt over them and cut by its own ``_cut``, so
    the views alias as they do eagerly), the writes land in them. Returns
    one call of the loaded kernel on ``logits``."""
    arena = worker.buffers
    items = arena.tensors()
    if any(not isinstance(name, str) for path, _ in items for name in path):
        raise ValueError("compile_accept rebuilds attributes only, not list items")
    bases: Dict[int, torch.Tensor] = {}
    for _, t in items:
        storage = t.untyped_storage()
        if storage.data_ptr() not in bases:
            size = storage.nbytes() // t.element_size()
            bases[storage.data_ptr()] = t.new_empty(0).set_(storage, 0, (size,))
    keys = list(bases)

    def rebuilt(traced):
        """A shallow copy of the arena whose tensors view ``traced``."""
        over = dict(zip(keys, traced))
        root, copies = copy.copy(arena), {}
        root._views = {}
        for path, t in items:
            obj = root
            for i, name in enumerate(path[:-1]):
                if path[: i + 1] not in copies:
                    copies[path[: i + 1]] = copy.copy(getattr(obj, name))
                    object.__setattr__(obj, name, copies[path[: i + 1]])
                obj = copies[path[: i + 1]]
            base = over[t.untyped_storage().data_ptr()]
            view = base.as_strided(t.shape, t.stride(), t.storage_offset())
            object.__setattr__(obj, path[-1], view)
        return root

    class Accept(torch.nn.Module):
        def forward(self, target_logits, *storages):
            views = rebuilt(storages)._cut(bs)
            accept(views=views, target_logits=target_logits, mode=mode)
            return (storages[0],)

    args = [logits, *bases.values()]
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        program = torch.export.export(Accept(), tuple(args), strict=False)
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=f"{tmp}/accept.pt2"
        )
        loader = torch._inductor.aoti_load_package(package).loader
    return lambda: loader.run(args)


def probe(
    *,
    temperature: float,
    batch_size: int,
    trials: int,
    seed: int = 0,
    compiled: bool = False,
) -> Dict:
    """The accept phase's median time per way, and each way's ratio to warm
    (median of the per-trial ratios, its 95% interval); with ``compiled``,
    the same for the AOTInductor-compiled accept, its ratio to eager per
    way, and whether it left eager's accept lengths and bonus."""
    if trials < 10:
        raise ValueError(f"trials must be >= 10 (an interval needs them), got {trials}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if compiled and temperature > 0 and batch_size > 1:
        raise ValueError(_SAMPLED_COMPILE_LIMIT)
    gamma = ServerArgs(speculative_algorithm="DSPARK").speculative_dspark_block_size
    need = kv_slots_needed(
        prompt_len=_PROMPT_LEN, max_new_tokens=_NEW_TOKENS, lookahead=gamma
    )
    engine = Engine(
        speculative_algorithm="DSPARK",
        device="cpu",
        max_running_requests=max(8, batch_size),
        max_total_tokens=max(4096, need * batch_size),
    )
    worker, rng = engine.worker, random.Random(seed)
    for i in range(batch_size):
        prompt = [rng.randrange(3, 200) for _ in range(_PROMPT_LEN)]
        params = SamplingParams(max_new_tokens=_NEW_TOKENS, temperature=temperature)
        engine.scheduler.add_request(
            Req(rid=str(i), origin_input_ids=prompt, sampling_params=params)
        )
    for _ in range(4):  # prefill, then decode steps: the buffers hold a step
        engine.scheduler.step()
    running = len(engine.scheduler.running)
    if running != batch_size:  # the rows timed would be stale
        raise ValueError(
            f"{running} of the batch's {batch_size} requests are decoding: the "
            f"KV pool holds no more"
        )
    views = worker.buffers.at(batch_size)
    logits = torch.randn(
        views.verify_batch.num_tokens,
        worker.config.vocab_size,
        generator=torch.Generator().manual_seed(seed),
    )
    mode = SamplingMode.SAMPLED if temperature > 0 else SamplingMode.GREEDY
    variants = {"eager": lambda: accept(views=views, target_logits=logits, mode=mode)}
    out = {
        "temperature": temperature,
        "batch_size": batch_size,
        "requests_decoding": running,
        "trials": trials,
    }
    if compiled:
        variants["compiled"] = compile_accept(worker, batch_size, logits, mode)
        out["compiled_same_as_eager"] = _same_results(worker, views, variants)
    sweep = torch.zeros(4 * 2**20)  # 16 MB of float32
    before = {
        "warm": None,  # right after the same accept
        "after verify forward": lambda: worker.target_runner.forward(
            views.verify_batch
        ),
        "after 16 MB sweep": lambda: sweep.add_(1.0),
    }
    times = {(v, way): [] for v in variants for way in before}
    with torch.no_grad():
        # trials // 5 more trials first, discarded: the warm-up.
        for trial in range(trials + trials // 5):
            for way, run_before in before.items():
                for variant, run in variants.items():
                    (run_before or run)()
                    start = time.perf_counter()
                    run()
                    seconds = time.perf_counter() - start
                    if trial >= trials // 5:
                        times[variant, way].append(seconds)
    for variant in variants:
        prefix = "" if variant == "eager" else "compiled_"
        out[prefix + "accept_us"] = {
            way: statistics.median(times[variant, way]) * 1e6 for way in before
        }
        out[prefix + "ratio_to_warm"] = {
            way: _ratio(times[variant, way], times[variant, "warm"])
            for way in before
            if way != "warm"
        }
    if compiled:
        out["compiled_to_eager"] = {
            way: _ratio(times["compiled", way], times["eager", way]) for way in before
        }
    return out


def _ratio(a, b) -> Dict:
    ratio = median_ratio(a, b)
    return {k: ratio[k] for k in ("median", "ci95")}


def _same_results(worker, views, variants) -> bool:
    """Eager's and the compiled accept's accept lengths and bonus, each run
    from the same state of every buffer (restored between them)."""
    storages = {t.untyped_storage().data_ptr(): t for _, t in worker.buffers.tensors()}
    state = [t.untyped_storage() for t in storages.values()]
    saved = [s.clone() for s in state]
    results = []
    with torch.no_grad():
        for run in variants.values():
            for s, copy_of in zip(state, saved):
                s.copy_(copy_of)
            run()
            results.append((views.accept_lens.clone(), views.bonus.clone()))
    (lens_a, bonus_a), (lens_b, bonus_b) = results
    return torch.equal(lens_a, lens_b) and torch.equal(bonus_a, bonus_b)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--trials", type=int, default=400)
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also time the accept compiled with AOTInductor (about 10 s to compile)",
    )
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.trials < 10 or args.batch_size < 1:
        p.error("needs --trials >= 10, --batch-size >= 1")
    if args.compiled and args.temperature > 0 and args.batch_size > 1:
        p.error("--" + _SAMPLED_COMPILE_LIMIT)
    try:  # the engine's own rule for a temperature
        SamplingParams(max_new_tokens=1, temperature=args.temperature)
    except ValueError as e:
        p.error(f"--temperature: {e}")
    bench_plots.check_json_path(p, args.json)
    try:
        out = probe(
            temperature=args.temperature,
            batch_size=args.batch_size,
            trials=args.trials,
            compiled=args.compiled,
        )
    except ValueError as e:  # what the engine refuses (e.g. sizes past memory)
        print(f"bench_glue_cache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted("bench_glue_cache")
    for prefix, label in (("", "accept"), ("compiled_", "compiled accept")):
        for way, us in out.get(prefix + "accept_us", {}).items():
            extra = ""
            ratio = out[prefix + "ratio_to_warm"].get(way)
            if ratio is not None:
                extra = "  {:.2f}x warm [{:.2f}, {:.2f}]".format(
                    ratio["median"], *ratio["ci95"]
                )
            to_eager = out.get("compiled_to_eager", {}).get(way) if prefix else None
            if to_eager is not None:
                extra += "  {:.2f}x eager [{:.2f}, {:.2f}]".format(
                    to_eager["median"], *to_eager["ci95"]
                )
            print(f"{label:16s} {way:22s} {us:8.1f} us (median){extra}")
    if args.compiled:
        print(
            "compiled accept leaves eager's accept lengths and bonus:",
            out["compiled_same_as_eager"],
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

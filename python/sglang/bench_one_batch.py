"""DSpark vs plain decoding, measured in lockstep in one run.

    python -m sglang.bench_one_batch --batch-size 1 8 --input-len 64 --output-len 64

For each temperature (default: 0 and 1) and batch size both engines decode
the same prompts in ``--repeats`` rounds: held-out stdlib source by default
(``--prompts stdlib``: the trained pair's held-out files), or random ids
(``--prompts random``). The batch size is the number of requests decoding
at once: a round submits ``--num-prompts`` prompts (default 16 x the batch
size; ``--repeats`` default 2) and the scheduler admits the next one as soon as a running request
finishes, as a server does (``--num-prompts`` equal to the batch size is
one static batch, whose last steps run part-empty under speculation:
requests finish at different steps). Within a round the engines advance in
lockstep, ``--block-steps`` decode steps (default 16) of each in turn (who
goes first alternates), so the two blocks of a turn saw the same machine
load. Blocks, not single steps: an engine stepped right after the other
runs on the other's cache state, which slows one engine's steps more than
the other's (docs/benchmarks.md has the comparison); a deployment runs one
engine, warm.
Printed per temperature and batch size: each engine's decode tokens/s and
mean step time over the turns in which both engines decoded (the JSON also
keeps them over all of an engine's steps, ``{name}_tokens_per_s`` and
``{name}_mean_step_ms``, which count the tail one engine runs alone, warm,
once the other is done); the DSpark/plain step-cost ratio, the geometric
mean of the turns' ratios of mean block step times, with its 95% confidence
interval (a t-interval on the log ratios); the speedup, DSpark's decode
tokens per step over plain's divided by the ratio of their mean step times
(what throughput follows: the ratio of their tokens/s), both over the turns
in which both engines decoded, with a 95% interval (delta method, ``bench_stats.mean_product``)
that carries the spread of the tokens each block committed (random under
sampling) as well as of the step times; DSpark's mean accepted
length (accepted drafts + 1 per verify step); each engine's mean requests
per decode step (below the batch size while a round's last requests
drain); and whether DSpark's greedy output equals plain greedy output
token for token (it must).
``--count-ops`` adds the aten ops, allocations and host reads (before the
output phase) of one decode step of each engine, and of its glue: the
step outside the model's own spans (exact counts, from OpCounter, in a
separate untimed pass).
``--phases`` adds where a decode step's time goes, in plain steps (one
more lockstep round, with timers around each phase; its figures are not
in the ones above): each engine's phases and the model's spans inside
them (DSpark: draft, verify, accept, commit, output; attention metadata,
draft forward, verify forward, context write); the model compute's share
of the DSpark step; and the speedup DSpark would reach if only its two
forwards cost time (this run's tokens per step over their cost), a bound
no change outside the forwards can pass. On CUDA it needs
``--disable-cuda-graph`` (a graph replay runs no span), and each phase is
synchronized before and after, which serializes launches: a breakdown,
not a step time. ``--json F`` is written after every row, to ``F.partial``,
renamed to ``F`` when the run ends: an interrupted run keeps its finished
rows, in a file that does not pass for a whole run.

Data-parallel attention, one process per rank, as upstream launches it:

    torchrun --nproc-per-node 2 -m sglang.bench_one_batch --enable-dp-attention

Each rank runs both engines over its own share of the prompts (the batch
size and ``--num-prompts`` are per rank; rank r gets prompts r, r + N, ...)
in lockstep with the other ranks: their MoE layers are expert-parallel over
all of them. Rank 0 prints its figures and writes the JSON.
"""

import argparse
import itertools
import json
import os
import random
import statistics
import sys
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from sglang import bench_plots
from sglang.bench_stats import geometric_mean_ratio, mean_product
from sglang.srt.distributed.parallel_state import check_ranks_agree, digest_of
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.server_args import device_arg
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
from sglang.srt.utils.common import check_seed, interrupted
from sglang.srt.utils.op_counter import OpCounter
from sglang.srt.utils.phases import PhaseRecorder
from sglang.stdlib_corpus import load_stdlib_corpus, sample_prompts

ENGINES = ("plain", "dspark")
# Default prompts per round: this many per request decoding at once. Many
# distinct prompts, few rounds: at bs 1, 4 prompts x 8 rounds sampled an
# accepted length of 3.03-3.08 at T=1 where the held-out set's is 3.14 (16
# prompts: 3.15), and a round's draining tail weighs less.
PROMPTS_PER_REQUEST_SLOT = 16
_rids = itertools.count()


def make_prompts(
    *, rng: random.Random, vocab_size: int, batch_size: int, input_len: int
) -> List[List[int]]:
    """The prompts both engines decode: random ids (below the last id, the
    draft's mask token in the embedded pair)."""
    return [
        [rng.randrange(vocab_size - 1) for _ in range(input_len)]
        for _ in range(batch_size)
    ]


def _submit(engine: Engine, prompts, params: Dict) -> List[Req]:
    """Queue this rank's share of ``prompts`` (all of them without DP)."""
    prompts = prompts[engine.dp_rank :: engine.dp_size]
    reqs = [
        Req(
            rid=next(_rids),
            origin_input_ids=list(p),
            sampling_params=SamplingParams(**params),
        )
        for p in prompts
    ]
    for req in reqs:
        engine.scheduler.add_request(req)
    engine.scheduler.start_round()
    return reqs


# One engine's block of a turn: decode tokens committed, decode steps, and
# their mean seconds.
Block = Tuple[int, int, float]


def _lockstep_round(
    engines: Dict[str, Engine], prompts, params: Dict, bar, block_steps: int = 1
) -> Tuple[Dict[str, List[Req]], Dict[str, List[float]], List[Tuple[Block, Block]]]:
    """One round: the same prompts on every engine, advanced ``block_steps``
    steps at a time in turn. Returns the requests, each engine's decode step
    times, and per turn where both decoded the (plain, dspark) pair of their
    blocks (``Block``)."""
    reqs = {name: _submit(e, prompts, params) for name, e in engines.items()}
    times: Dict[str, List[float]] = {name: [] for name in engines}
    pairs = []
    order = list(engines)
    while any(e.scheduler.has_work() for e in engines.values()):
        turn = {}
        for name in order:
            scheduler = engines[name].scheduler
            decoded = _decode_tokens(reqs[name])
            with scheduler.record_step_times() as block:
                for _ in range(block_steps):
                    if not scheduler.has_work():
                        break
                    committed = _committed(reqs[name])
                    scheduler.step()
                    bar.update(_committed(reqs[name]) - committed)
            if block:
                tokens = _decode_tokens(reqs[name]) - decoded
                turn[name] = (tokens, len(block), statistics.fmean(block))
                times[name] += block
        if len(turn) == len(engines):
            pairs.append(tuple(turn[name] for name in ENGINES))
        order.reverse()  # neither engine always runs right after the other
    return reqs, times, pairs


def _committed(reqs: List[Req]) -> int:
    return sum(len(r.output_ids) for r in reqs)


def _decode_tokens(reqs: List[Req]) -> int:
    """Tokens decode steps committed: a request's first comes from prefill."""
    return sum(max(len(r.output_ids) - 1, 0) for r in reqs)


def _count_ops(engine: Engine, prompts, params: Dict, steps: int = 8) -> Dict:
    """Mean aten ops, allocations and host reads of a decode step with the
    whole batch running: ``steps`` decode steps after the batch's first
    (the step that admits and prefills it decodes once, uncounted). Host
    reads are counted before the output phase (whose read of the tokens is
    the step's one), through the worker's phase spans; so are
    the glue's ops and allocations: the step's outside the model's own
    spans (``MODEL_SPANS``: its forwards, their attention metadata, the
    draft's context write).

    The counted requests get enough ``max_new_tokens`` that none finishes
    inside them, even when a draft accepts every token (a step commits up
    to ``lookahead + 1``); what is left of them is aborted afterwards.
    Only steps that every request runs through are counted (an EOS could
    end one early).
    """
    scheduler = engine.scheduler
    per_step = engine.worker.lookahead + 1  # the most a decode step commits
    room = engine.server_args.context_length - max(map(len, prompts))
    max_new = min((steps + 1) * per_step + 1, room - engine.worker.lookahead)
    reqs = _submit(engine, prompts, dict(params, max_new_tokens=max(1, max_new)))
    counts = []
    spans = engine.worker.spans
    try:
        scheduler.step()  # admission and prefill, then the first decode step
        for _ in range(steps):
            if len(scheduler.running) != len(reqs):
                break
            with OpCounter() as c:
                spans.hook = recorder = PhaseRecorder(counter=c)
                scheduler.step()
            spans.hook = None
            totals = recorder.totals
            output = totals.get("output", {}).get("host_reads", 0)
            model = [totals.get(k, {}) for k in engine.worker.MODEL_SPANS]
            glue_ops = c.ops - sum(t.get("ops", 0) for t in model)
            glue_allocs = c.allocs - sum(t.get("allocs", 0) for t in model)
            if len(scheduler.running) == len(reqs):
                counts.append(
                    (c.ops, c.allocs, c.host_reads - output, glue_ops, glue_allocs)
                )
    finally:
        spans.hook = None
        scheduler.abort_requests(reqs)
    keys = (
        "ops_per_step",
        "allocs_per_step",
        "host_reads_per_step",
        "glue_ops_per_step",
        "glue_allocs_per_step",
    )
    if not counts:
        return dict.fromkeys(keys)
    return {key: statistics.fmean(c[i] for c in counts) for i, key in enumerate(keys)}


def _phase_round(engines: Dict[str, Engine], prompts, params: Dict, block_steps):
    """One more lockstep round with each engine's phase spans timed (a hook
    on its worker: the code that runs is the code timed). Seconds per
    decode step by engine and span, and "step": the decode step as the
    scheduler times it, from outside the worker (an independent total)."""
    recorders = {}
    for name, engine in engines.items():
        cuda = torch.device(engine.server_args.device).type == "cuda"
        recorders[name] = PhaseRecorder(sync=torch.cuda.synchronize if cuda else None)
    try:
        for name, engine in engines.items():
            engine.worker.spans.hook = recorders[name]
        with tqdm(disable=True) as bar:
            _, times, _ = _lockstep_round(
                engines, prompts, params, bar, block_steps=block_steps
            )
    finally:
        for engine in engines.values():
            engine.worker.spans.hook = None
    out = {}
    for name, recorder in recorders.items():
        steps = len(times[name])
        spans = {k: t["seconds"] / steps for k, t in recorder.totals.items()}
        spans["step"] = statistics.fmean(times[name])
        out[name] = spans
    return out


SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_extras(args: argparse.Namespace) -> Dict:
    """The sampling parameters beyond the temperature the run was given."""
    return {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}


def _num_prompts(args: argparse.Namespace, bs: int) -> int:
    if args.num_prompts is None:
        return PROMPTS_PER_REQUEST_SLOT * bs
    return args.num_prompts


def run(
    args: argparse.Namespace, on_row: Callable[[List[Dict]], None] = lambda rows: None
) -> List[Dict]:
    """The rows, one per temperature and batch size; ``on_row`` gets the rows
    so far after each (the JSON is written as they come)."""
    common = dict(
        model_path=args.model_path,
        device=args.device,
        random_seed=args.seed,
        max_running_requests=max(args.batch_size),
        disable_cuda_graph=args.disable_cuda_graph,
    )
    if args.enable_dp_attention:
        common.update(
            enable_dp_attention=True,
            dp_size=args.dp_size,
            moe_a2a_backend=args.moe_a2a_backend,
            dist_timeout=args.dist_timeout,
        )
    engines = {
        "plain": Engine(speculative_algorithm=None, **common),
        "dspark": Engine(
            speculative_algorithm="DSPARK",
            # Upstream's speculative_num_draft_tokens is the verify width.
            speculative_num_draft_tokens=None if args.gamma is None else args.gamma + 1,
            speculative_verify_budget=args.speculative_verify_budget,
            speculative_dspark_sps_table_path=args.speculative_dspark_sps_table_path,
            **common,
        ),
    }
    plain, dspark = engines["plain"], engines["dspark"]
    if dist.is_initialized():  # the ranks step in lockstep: one command line
        check_ranks_agree(
            digest=digest_of(vars(args)),
            group=plain._check_group,
            what="the bench's arguments",
        )
    dp = plain.dp_size  # every rank gets num prompts: N x num in all
    printing = plain.dp_rank == 0
    heldout = load_stdlib_corpus().read("heldout") if args.prompts == "stdlib" else None
    rows = []
    for engine in engines.values():  # before building prompts of that length
        engine.scheduler.check_lengths(
            prompt_len=args.input_len, max_new_tokens=args.output_len
        )
    for temperature, bs in itertools.product(args.temperature, args.batch_size):
        params = {
            "max_new_tokens": args.output_len,
            "temperature": temperature,
            **_sampling_extras(args),
        }
        num = _num_prompts(args, bs)
        if heldout is not None:
            prompts = sample_prompts(
                heldout, num=num * dp, length=args.input_len, seed=args.seed * 1000 + bs
            )
        else:
            prompts = make_prompts(  # seeded per row, as the stdlib sample
                rng=random.Random(args.seed * 1000 + bs),
                vocab_size=plain.vocab_size,
                batch_size=num * dp,
                input_len=args.input_len,
            )
        for name, engine in engines.items():
            engine.scheduler.max_running_requests = bs  # requests decoding at once
            engine.generate(  # warm up
                input_ids=prompts[: bs * dp],
                sampling_params=dict(params, max_new_tokens=4),
            )
            # Each row draws from the seed, whatever ran before it (other rows,
            # warm-ups, --count-ops passes), its prompts are seeded per row,
            # and the verify planner starts it as new: its figures do not
            # depend on the rows before it.
            engine.reseed(args.seed)
            if not engine.flush_cache():
                raise RuntimeError(f"{name}: requests left after the warm-up")
        outputs = {name: [] for name in ENGINES}
        times = {name: [] for name in ENGINES}
        all_reqs = {name: [] for name in ENGINES}
        pairs: List[Tuple[Block, Block]] = []
        total = args.repeats * len(ENGINES) * num * args.output_len
        with tqdm(
            total=total,
            desc=f"bs={bs}",
            unit="tok",
            leave=False,
            file=sys.stderr,
            disable=not printing,
        ) as bar:
            for _ in range(args.repeats):
                reqs, step_times, round_pairs = _lockstep_round(
                    engines, prompts, params, bar, block_steps=args.block_steps
                )
                pairs += round_pairs
                for name in ENGINES:
                    outputs[name].append([list(r.output_ids) for r in reqs[name]])
                    times[name] += step_times[name]
                    all_reqs[name] += reqs[name]
        row = {
            "batch_size": bs,
            "num_prompts": num,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "temperature": temperature,
            "gamma": dspark.dspark_config.gamma,
            "device": plain.server_args.device,
            "cuda_graph": plain.server_args.use_cuda_graph,
            "repeats": args.repeats,
            "block_steps": args.block_steps,
            "sampling_params": _sampling_extras(args),
            "dp_size": dp,  # the figures are rank 0's
            "moe_a2a_backend": plain.server_args.moe_a2a_backend,
        }
        for name in ENGINES:
            # The first token of each request comes from prefill, not a decode step.
            decode_tokens = sum(len(r.output_ids) - 1 for r in all_reqs[name])
            row[f"{name}_decode_steps"] = len(times[name])
            row[f"{name}_mean_step_ms"] = 1e3 * statistics.fmean(times[name])
            row[f"{name}_tokens_per_s"] = decode_tokens / sum(times[name])
            # Requests decoding per step: below the batch size while a round's
            # last requests drain (DSpark's finish at different steps).
            row_steps = sum(r.spec_verify_ct for r in all_reqs[name])
            row[f"{name}_rows_per_step"] = row_steps / len(times[name])
        # Over the turns both engines decoded (paired blocks, timed under the
        # same conditions): DSpark's mean step time over plain's, and the
        # speedup, the tokens-per-step ratio over it: the tokens/s ratio of
        # the paired blocks. Its interval carries both: under sampling the
        # tokens a block commits are random too.
        ratio, lo, hi = geometric_mean_ratio([(p[2], d[2]) for p, d in pairs])
        (tok_p, n_p, t_p), (tok_d, n_d, t_d) = (list(zip(*c)) for c in zip(*pairs))
        sec_p = [n * t for n, t in zip(n_p, t_p)]
        sec_d = [n * t for n, t in zip(n_d, t_d)]
        gain = (sum(tok_d) / sum(n_d)) / (sum(tok_p) / sum(n_p))
        cost_ratio = (sum(sec_d) / sum(n_d)) / (sum(sec_p) / sum(n_p))
        speedup, s_lo, s_hi = mean_product([tok_d, sec_d, tok_p, sec_p], [1, -1, -1, 1])
        verify_ct = sum(r.spec_verify_ct for r in all_reqs["dspark"])
        accepted = sum(r.spec_accepted_drafts for r in all_reqs["dspark"])
        verified = sum(r.spec_verified_drafts for r in all_reqs["dspark"])
        row.update(
            step_pairs=len(pairs),
            plain_paired_decode_tokens=sum(tok_p),
            plain_paired_decode_steps=sum(n_p),
            dspark_paired_decode_tokens=sum(tok_d),
            dspark_paired_decode_steps=sum(n_d),
            step_cost_ratio=ratio,
            step_cost_ratio_ci95=[lo, hi],
            step_cost_mean_ratio=cost_ratio,
            tokens_per_step_ratio=gain,
            speedup=speedup,
            speedup_ci95=[s_lo, s_hi],
            tokens_per_s_ratio=row["dspark_tokens_per_s"] / row["plain_tokens_per_s"],
            # Each engine over the paired turns (what the line prints): their
            # tokens/s ratio is the speedup.
            plain_paired_tokens_per_s=sum(tok_p) / sum(sec_p),
            dspark_paired_tokens_per_s=sum(tok_d) / sum(sec_d),
            plain_paired_mean_step_ms=1e3 * sum(sec_p) / sum(n_p),
            dspark_paired_mean_step_ms=1e3 * sum(sec_d) / sum(n_d),
            # Committed tokens per verify step, before truncation at max_new_tokens.
            accept_length=(verify_ct + accepted) / verify_ct,
            # Drafts the target verified per request and step (gamma: all).
            verify_tokens=verified / verify_ct,
            verify_budget=args.speculative_verify_budget,
            # Every round of both engines against the first plain round.
            greedy_output_equal=(
                all(o == outputs["plain"][0] for name in ENGINES for o in outputs[name])
                if temperature == 0
                else None
            ),
        )
        planner = dspark.worker.planner
        if planner is not None:  # what the draft's confidence predicted
            row["calibration"] = planner.calibration_table()
        if args.phases:
            phases = _phase_round(engines, prompts, params, args.block_steps)
            unit = phases["plain"]["step"]
            row["phases_plain_steps"] = {
                name: {k: v / unit for k, v in phases[name].items()} for name in ENGINES
            }
            spec = row["phases_plain_steps"]["dspark"]
            model = sum(spec.get(k, 0.0) for k in dspark.worker.MODEL_SPANS)
            row["dspark_model_share"] = model / spec["step"]
            row["speedup_forwards_only"] = gain / (
                spec["verify forward"] + spec["draft forward"]
            )
        if args.count_ops:
            for name, engine in engines.items():
                for key, value in _count_ops(engine, prompts[:bs], params).items():
                    row[f"{name}_{key}"] = value
        rows.append(row)
        if printing:
            print(_format(row, engines), flush=True)
            on_row(rows)
    return rows


def _format(r: Dict, engines: Dict[str, Engine]) -> str:
    equal = r["greedy_output_equal"]
    lo, hi = r["step_cost_ratio_ci95"]
    ci = "n/a" if lo is None else f"[{lo:.3f}, {hi:.3f}]"
    s_lo, s_hi = r["speedup_ci95"]
    speedup_ci = "" if s_lo is None else f" [{s_lo:.3f}, {s_hi:.3f}]"
    per_engine = " | ".join(
        f"{name} {r[f'{name}_paired_tokens_per_s']:7.1f} tok/s "
        f"{r[f'{name}_paired_mean_step_ms']:.3f} ms/step"
        for name in ENGINES
    )
    extras = "".join(f" {k}={v:g}" for k, v in r["sampling_params"].items())
    text = (
        f"T={r['temperature']:g}{extras} bs={r['batch_size']:<3} {per_engine} | step cost "
        f"dspark/plain {r['step_cost_ratio']:.3f} {ci} ({r['step_pairs']} pairs) | "
        f"tokens/step {r['tokens_per_step_ratio']:.2f}x / mean step cost "
        f"{r['step_cost_mean_ratio']:.3f} = speedup "
        f"{r['speedup']:.3f}x{speedup_ci} | accept length {r['accept_length']:.2f} | "
        f"verified drafts {r['verify_tokens']:.2f} (budget {r['verify_budget']}) | "
        f"requests per step {r['plain_rows_per_step']:.2f} plain, "
        f"{r['dspark_rows_per_step']:.2f} dspark | "
        f"greedy equal: {'n/a (sampling)' if equal is None else equal}"
    )
    if "phases_plain_steps" in r:
        for name in ENGINES:
            phases, worker = r["phases_plain_steps"][name], engines[name].worker
            inner = [k for k in worker.MODEL_SPANS if k not in worker.PHASES]
            text += (
                f"\n       {name} phases, in plain steps: "
                + ", ".join(f"{k} {phases.get(k, 0.0):.3f}" for k in worker.PHASES)
                + (
                    " (model: "
                    + ", ".join(f"{k} {phases.get(k, 0.0):.3f}" for k in inner)
                    + ")"
                    if inner
                    else ""
                )
                + f"; step {phases['step']:.3f}"
            )
        text += (
            f"\n       DSpark model compute share {r['dspark_model_share']:.3f} | "
            f"speedup if only the forwards cost time "
            f"{r['speedup_forwards_only']:.3f}x"
        )
    if "plain_ops_per_step" in r:
        text += "\n       per decode step: " + " | ".join(
            f"{name} {_fmt(r[f'{name}_ops_per_step'])} aten ops, "
            f"{_fmt(r[f'{name}_allocs_per_step'])} allocations, "
            f"{_fmt(r[f'{name}_host_reads_per_step'])} host reads before the output "
            f"(glue, outside the model's spans: {_fmt(r[f'{name}_glue_ops_per_step'])} "
            f"ops, {_fmt(r[f'{name}_glue_allocs_per_step'])} allocations)"
            for name in ENGINES
        )
    return text


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _budget(text: str):
    if text in ("auto", "off"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected auto, off or an int >= 0, got {text!r}"
        )
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1, 8],
        help="requests decoding at once (the engines' running cap)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="prompts per round and batch size, admitted as running requests "
        f"finish; default {PROMPTS_PER_REQUEST_SLOT} x the batch size; the batch "
        "size itself is one static batch",
    )
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="each is run for every batch size; 0 also checks greedy equality",
    )
    for flag, kind, what in (
        ("--top-p", float, "nucleus mass, (0, 1]"),
        ("--top-k", int, "most likely tokens kept, >= 1"),
        ("--min-p", float, "drop tokens below this x the top one's p"),
        ("--repetition-penalty", float, "[1e-6, 2]; > 1 discourages repeats"),
    ):
        p.add_argument(flag, type=kind, default=None, help=f"every request's {what}")
    p.add_argument(
        "--prompts",
        choices=("stdlib", "random"),
        default="stdlib",
        help="held-out stdlib source (the trained pair's held-out files), or "
        "random ids",
    )
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="draft block size gamma (the engine's speculative_num_draft_tokens "
        "is gamma + 1); it must be the block size the draft was trained with "
        "(the engine refuses another; 5 for the embedded pair), the default",
    )
    p.add_argument(
        "--speculative-verify-budget",
        type=_budget,
        default="auto",
        help="drafted tokens a DSpark step verifies: auto (planned per step), "
        "off (all of them) or N (at most N per step)",
    )
    p.add_argument(
        "--speculative-dspark-sps-table-path",
        default=None,
        help="the cost table 'auto' plans with: read when it exists, else "
        "measured at start-up and saved there",
    )
    p.add_argument("--model-path", default=None, help="default: the embedded pair")
    p.add_argument(
        "--device", type=device_arg, default=None, help="default: cuda when present"
    )
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="lockstep rounds per batch size; their block pairs are pooled",
    )
    p.add_argument(
        "--block-steps",
        type=int,
        default=16,
        help="decode steps an engine runs per turn (1: alternate single steps)",
    )
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="also print aten ops, allocations and host reads per decode step, "
        "and the glue's (OpCounter)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="also print where a decode step's time goes, in plain steps "
        "(one more lockstep round, timed by phase)",
    )
    p.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="data-parallel attention over the torch.distributed world (launch "
        "with torchrun --nproc-per-node N): each rank decodes its own share",
    )
    p.add_argument(
        "--dp-size",
        type=int,
        default=None,
        help="DP attention ranks; default: the torchrun world (WORLD_SIZE)",
    )
    p.add_argument(
        "--moe-a2a-backend",
        choices=("none", "all_to_all"),
        default="none",
        help="under DP attention: gather every rank's MoE rows and all-reduce "
        "(none), or send each row only to its experts' ranks (all_to_all)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        help="under DP attention: seconds a rank waits for the others in a "
        "collective before the run ends with an error",
    )
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument(
        "--plot-dir",
        default=None,
        help="write PNGs here: the speedups with their intervals; with "
        "--phases the phases as stacked bars (needs the [plot] extra)",
    )
    args = p.parse_args(argv)
    check_seed(p, "--seed", args.seed)
    if args.enable_dp_attention:
        if args.dp_size is None:
            args.dp_size = int(os.environ.get("WORLD_SIZE", "1"))
        if args.dp_size < 2:
            p.error(
                "--enable-dp-attention needs 2 or more ranks: launch with torchrun "
                "--nproc-per-node N (or pass --dp-size N to each rank of a world)"
            )
        if args.count_ops:
            p.error("--count-ops counts one process's steps: run it without DP")
        if args.device not in (None, "cpu"):
            p.error("--enable-dp-attention runs gloo ranks: CPU only here")
        args.device = "cpu"
    elif args.dp_size is not None or args.moe_a2a_backend != "none":
        p.error("--dp-size and --moe-a2a-backend need --enable-dp-attention")
    if not 0 < args.dist_timeout <= 7 * 24 * 3600:  # NaN fails too
        p.error("--dist-timeout must be in (0, 604800] seconds")
    if args.input_len < 1:
        p.error("--input-len must be >= 1")
    if args.output_len < 2:  # the first token comes from prefill: no decode step
        p.error("--output-len must be >= 2")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.block_steps < 1:
        p.error("--block-steps must be >= 1")
    if min(args.batch_size) < 1:
        p.error("--batch-size values must be >= 1")
    if args.num_prompts is not None and args.num_prompts < max(args.batch_size):
        p.error(
            f"--num-prompts {args.num_prompts} is below --batch-size "
            f"{max(args.batch_size)}: the batch would never fill"
        )
    try:  # the sampling parameters, as the engine will check them
        for t in args.temperature:
            SamplingParams(temperature=t, **_sampling_extras(args))
    except ValueError as e:
        p.error(str(e))
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu"
    if args.phases and cuda and not args.disable_cuda_graph:
        p.error(
            "--phases times the spans inside a step, which a CUDA graph replay "
            "does not run: add --disable-cuda-graph"
        )
    bench_plots.check_json_path(p, args.json)
    bench_plots.prepare_plot_dir(p, args.plot_dir)

    partial = f"{args.json}.partial"
    # Where this run's rows are: F.partial once written (a file there may be
    # older), F once the run is whole.
    saved: List[str] = []

    def write_json(rows: List[Dict]) -> None:  # after each row: none is lost
        if args.json:  # (the printing rank's rows: rank 0's under DP)
            if len(rows) == 1 and os.path.exists(args.json):
                os.remove(args.json)  # an earlier run's: not beside this one
            with open(partial + ".tmp", "w") as f:
                json.dump(rows, f, indent=2)
            os.replace(partial + ".tmp", partial)
            saved[:] = [partial]

    try:
        return _run_and_report(args, write_json, saved)
    except ValueError as e:  # e.g. a model path or a length the engine refuses
        print(f"bench_one_batch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = ""  # an earlier run's F.partial holds none of these
        if saved == [partial]:
            hint = f"the rows done so far are in {partial}"
        elif saved:  # stopped while plotting
            hint = f"every row is in {args.json}; the plots are not all drawn"
        return interrupted("bench_one_batch", hint)
    finally:
        if dist.is_initialized():  # a live gloo group aborts the exit
            dist.destroy_process_group()


def _run_and_report(
    args: argparse.Namespace,
    write_json: Callable[[List[Dict]], None],
    saved: List[str],
) -> int:
    """The rows, then the JSON's final name (``saved`` names where the rows
    are: F.partial, then F), the plots and the exit code."""
    rows = run(args, on_row=write_json)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if args.json:  # the run is whole: its name
            os.replace(saved[0], args.json)
            saved[:] = [args.json]
            print(f"wrote {args.json}")
        if args.plot_dir is not None:
            paths = [bench_plots.speedup_plot(rows, args.plot_dir)]
            if args.phases:
                phases = {
                    "plain": TpModelWorker.PHASES,
                    "dspark": DSparkWorkerV2.PHASES,
                }
                paths.append(bench_plots.phases_plot(rows, args.plot_dir, phases))
            print("wrote " + ", ".join(paths))
    return 0 if all(r["greedy_output_equal"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

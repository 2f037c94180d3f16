"""Data-parallel attention with an expert-parallel MoE over real gloo ranks.

Every rank is given the same requests, decodes its share (request i on rank
i % N) and returns every request's result; the outputs (greedy) equal one
process decoding them all, for plain decoding and DSpark, with the MoE rows
gathered (``moe_a2a_backend="none"``) or sent all-to-all. Ranks get uneven
shares and a small running cap, so one rank prefills while another has
nothing to prefill, and one decodes while another has finished: their idle
forwards keep the collectives in step. The all-to-all dispatch never sends
a padded row: what it sends equals the real rows' copies (each real row once
per other rank owning one of its experts, counted from the router by a
forward hook) x hidden size x 4 bytes. A rank that raises mid-call makes
its peer stop with a clear error within ``dist_timeout``; both give back
every row and slot, and refuse later calls (their collectives are out of
step).
"""

import json
import multiprocessing
import os
import tempfile
import time
import unittest
from collections import Counter
from dataclasses import asdict

import torch
import torch.distributed as dist

from sglang import Engine
from sglang.srt.distributed.parallel_state import (
    get_open_port,
    init_distributed_environment,
)
from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.layers.moe.topk import select_experts
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, spawn_ranks

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

PROMPTS = [[7, 3, 9, 1], [4, 4, 8], [12, 50, 2, 77, 5], [1, 2, 3], [9, 9, 9, 9, 9]]
PARAMS = [{"max_new_tokens": n} for n in (14, 6, 12, 3, 9)]
BASE = dict(device="cpu", random_seed=0, max_running_requests=2, cuda_graph_bs=[1, 2])
# name: (speculative_algorithm, moe_a2a_backend, verify budget)
CONFIGS = {
    "plain-gather": (None, "none", None),
    "dspark-gather": ("DSPARK", "none", "off"),
    "dspark-a2a": ("DSPARK", "all_to_all", "off"),
    "dspark-a2a-auto": ("DSPARK", "all_to_all", "auto"),
    # Ragged verifies in padded buckets whatever auto's timings pick.
    "dspark-a2a-ragged": ("DSPARK", "all_to_all", 4),
}
FOUR_RANK_CONFIGS = ("plain-gather", "dspark-a2a-auto")


def _engine_args(name: str) -> dict:
    algo, backend, budget = CONFIGS[name]
    args = dict(BASE, speculative_algorithm=algo, moe_a2a_backend=backend)
    if budget is not None:
        args["speculative_verify_budget"] = budget
    return args


def _target(engine):
    return getattr(engine.worker, "target_worker", engine.worker).model


def _moe_layers(engine):
    models = [_target(engine), getattr(engine.worker, "draft_model", None)]
    return [
        m
        for model in models
        if model is not None
        for m in model.modules()
        if isinstance(m, EPMoE)
    ]


def _copies_hook(counter: Counter):
    """Per forward mode, the (real row, other rank owning one of its
    experts) pairs, from the router: what never sending a padded row sends."""

    def hook(module, args, kwargs, output):
        fb = kwargs["forward_batch"]
        x = args[0][: fb.num_token_non_padded_cpu]
        topk = select_experts(router_logits=module.gate(x), top_k=module.top_k)
        owners = (topk.topk_ids // module.num_local).tolist()
        me = module.ep_rank  # its own share never leaves the rank
        counter[fb.forward_mode.name] += sum(len(set(r) - {me}) for r in owners)

    return hook


def _run(name: str, world: int) -> dict:
    engine = Engine(enable_dp_attention=True, dp_size=world, **_engine_args(name))
    copies: Counter = Counter()
    layers = _moe_layers(engine)
    for m in layers:
        m.dispatcher.stats.clear()  # the start-up cost measurement's
        m.register_forward_hook(_copies_hook(copies), with_kwargs=True)
    out = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    engine.scheduler.check_pool_accounting()
    stats = {}
    for m in layers:
        for mode, st in m.dispatcher.stats.items():
            total = stats.setdefault(mode, Counter())
            total.update(asdict(st))
    result = {
        "outputs": [o["output_ids"] for o in out],
        "ids": [o["meta_info"]["id"] for o in out],
        "steps": engine.scheduler.num_dp_steps,
        "decode_steps": engine.scheduler.num_decode_steps,
        "stats": {mode: dict(c) for mode, c in stats.items()},
        "copies": dict(copies),
        "hidden_size": _target(engine).config.hidden_size,
    }
    # One prompt sampled four times: requests 0 and 1 sit at the same batch
    # place on ranks 0 and 1, so they differ only if the ranks' draws do.
    sampled = engine.generate(
        input_ids=[PROMPTS[0]] * 4,
        sampling_params={"max_new_tokens": 16, "temperature": 1.0},
    )
    result["sampled"] = [o["output_ids"] for o in sampled]
    return result


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(rank=rank, world_size=world, port=port, timeout_s=60)
    try:
        names = CONFIGS if world == 2 else FOUR_RANK_CONFIGS
        result = {name: _run(name, world) for name in names}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _single(name: str) -> list:
    args = _engine_args(name)
    args.update(moe_a2a_backend="none", max_running_requests=4)
    out = Engine(**args).generate(input_ids=PROMPTS, sampling_params=PARAMS)
    return [o["output_ids"] for o in out]


class _DpAttention(CustomTestCase):
    world = 2
    configs = tuple(CONFIGS)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ranks = spawn_ranks(_rank_main, world_size=cls.world)
        cls.single = {name: _single(name) for name in cls.configs}

    def test_every_rank_returns_what_one_process_decodes(self):
        for name in self.configs:
            for rank, result in enumerate(self.ranks):
                with self.subTest(config=name, rank=rank):
                    self.assertEqual(result[name]["outputs"], self.single[name])
                    self.assertEqual(
                        [len(o) for o in result[name]["outputs"]],
                        [p["max_new_tokens"] for p in PARAMS],
                    )

    def test_ranks_sample_with_their_own_draws(self):
        # Every rank returns every result; requests 0 and 1 (rank 0's and rank
        # 1's first) came out equal when each rank drew the same noise.
        for name in self.configs:
            with self.subTest(config=name):
                sampled = [r[name]["sampled"] for r in self.ranks]
                self.assertEqual(sampled[0], sampled[-1])
                self.assertNotEqual(sampled[0][0], sampled[0][1])
                self.assertNotEqual(sampled[0][2], sampled[0][3])

    def test_ranks_step_in_lockstep(self):
        for name in self.configs:
            steps = {r[name]["steps"] for r in self.ranks}
            with self.subTest(config=name):
                self.assertEqual(len(steps), 1, steps)

    def test_ranks_with_fewer_requests_ran_idle_forwards(self):
        # The last rank has the fewest requests: it idles while others work.
        for name in self.configs:
            last = self.ranks[-1][name]
            with self.subTest(config=name):
                self.assertGreater(last["stats"]["IDLE"]["calls"], 0)
                self.assertEqual(last["stats"]["IDLE"]["real_rows"], 0)
                self.assertLess(last["decode_steps"], last["steps"])


class TestDpAttentionTwoRanks(_DpAttention):
    def test_all_to_all_never_sends_a_padded_row(self):
        for name in ("dspark-a2a", "dspark-a2a-auto", "dspark-a2a-ragged"):
            for rank, result in enumerate(self.ranks):
                row_bytes = 4 * result[name]["hidden_size"]
                self.assertGreater(sum(result[name]["copies"].values()), 0)
                for mode, st in result[name]["stats"].items():
                    with self.subTest(config=name, rank=rank, mode=mode):
                        self.assertEqual(st["padded_rows_sent"], 0)
                        self.assertEqual(st["sent_rows"], result[name]["copies"][mode])
                        self.assertEqual(
                            st["hidden_bytes"],
                            result[name]["copies"][mode] * row_bytes,
                        )

    def test_ragged_verifies_ran_in_padded_buckets(self):
        # What the ragged config is for: a rank with fewer requests than
        # the bucket verified only part of the drafts.
        verify = [r["dspark-a2a-ragged"]["stats"]["TARGET_VERIFY"] for r in self.ranks]
        self.assertTrue(any(st["rows"] > st["real_rows"] for st in verify), verify)

    def test_gather_sends_padded_rows(self):
        # The gathered dispatch carries every rank's rows padded to the
        # longest to every other rank: the idle and padded ones travel too.
        def total(name, field):
            return [
                sum(s[field] for s in r[name]["stats"].values()) for r in self.ranks
            ]

        self.assertGreater(sum(total("dspark-gather", "padded_rows_sent")), 0)
        for gather, a2a in zip(
            total("dspark-gather", "hidden_bytes"), total("dspark-a2a", "hidden_bytes")
        ):
            self.assertGreater(gather, a2a)


class TestDpAttentionFourRanks(_DpAttention):
    world = 4
    configs = FOUR_RANK_CONFIGS


DIST_TIMEOUT = 5
HANG_SLACK = 20  # seconds past dist_timeout that count as "hung"


def _failing_rank_main(rank: int, port: int, out_dir: str) -> None:
    """Rank 1 raises from its progress callback at its second step, tries
    another call, then stays alive (stalled, as far as rank 0 can tell)."""
    torch.set_num_threads(1)
    init_distributed_environment(rank=rank, world_size=2, port=port, timeout_s=60)
    engine = Engine(
        enable_dp_attention=True,
        dp_size=2,
        dist_timeout=DIST_TIMEOUT,
        **_engine_args("dspark-a2a"),
    )
    steps = [0]

    def progress(_):
        steps[0] += 1
        if rank == 1 and steps[0] == 2:
            raise ValueError("injected failure")

    result = {}
    start = time.monotonic()
    for call in ("first", "second"):
        try:
            engine.generate(
                input_ids=PROMPTS, sampling_params=PARAMS, progress=progress
            )
            result[call] = None
        except Exception as e:  # noqa: BLE001 - the test records the type
            result[call] = [type(e).__name__, str(e)]
        result[f"{call}_elapsed"] = time.monotonic() - start
    engine.scheduler.check_pool_accounting()
    result["has_work"] = engine.scheduler.has_work()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 1:
        time.sleep(2 * DIST_TIMEOUT)
    os._exit(0)  # the group is broken: skip its teardown


class TestDpRankRaises(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        ctx = multiprocessing.get_context("spawn")
        with tempfile.TemporaryDirectory() as out_dir:
            port = get_open_port()
            procs = [
                ctx.Process(target=_failing_rank_main, args=(r, port, out_dir))
                for r in range(2)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=DIST_TIMEOUT + HANG_SLACK + 30)  # + start-up
                if p.exitcode is None:
                    p.kill()
                    p.join()
            cls.codes = [p.exitcode for p in procs]
            cls.results = []
            for r in range(2):
                path = os.path.join(out_dir, f"rank{r}.json")
                cls.results.append(
                    json.load(open(path)) if os.path.exists(path) else None
                )

    def test_the_raising_rank_reports_its_error(self):
        self.assertEqual(self.codes[1], 0)
        first = self.results[1]["first"]
        self.assertEqual(first, ["ValueError", "injected failure"])

    def test_its_peer_stops_with_a_clear_error_within_the_timeout(self):
        self.assertEqual(self.codes[0], 0, "rank 0 hung or crashed")
        kind, message = self.results[0]["first"]
        self.assertEqual(kind, "RuntimeError")
        self.assertIn("DP attention rank 0", message)
        self.assertIn("out of step", message)
        self.assertLess(self.results[0]["first_elapsed"], DIST_TIMEOUT + HANG_SLACK)

    def test_both_ranks_give_everything_back_and_refuse_later_calls(self):
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                self.assertFalse(result["has_work"])  # pools checked whole too
                kind, message = result["second"]
                self.assertEqual(kind, "RuntimeError")
                self.assertIn("restart every rank", message)


if __name__ == "__main__":
    unittest.main()

"""Expert-parallel ranks agree or all stop with a ValueError (gloo, 2 ranks).

At start-up the ranks all-gather a digest of the configuration and seed;
each ``generate()`` all-gathers a digest of its requests. A mismatch (a
different ``random_seed``, different prompts, different sampling params, a
request only one rank rejects) is a ValueError on both ranks, never a
SIGABRT or silently wrong output; the pools stay whole and the next agreed
call returns the single-process output.
"""

import json
import os
import unittest
from unittest import mock

import torch
import torch.distributed as dist

from sglang import Engine
from sglang.srt.distributed.parallel_state import init_distributed_environment
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.dspark_components import dspark_worker_v2
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase, spawn_ranks

register_cpu_ci(est_time=15, suite="base-a-test-cpu")
register_cuda_ci(est_time=20, stage="base-b", runner_config="1-gpu-large")

PROMPTS = [[7, 3, 9, 1], [4, 4, 8]]
PARAMS = {"max_new_tokens": 6}
ARGS = dict(device="cpu", max_running_requests=4, dist_timeout=10)
ALGORITHMS = (None, "DSPARK")


def _error(fn) -> list:
    """[exception type, message] of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test records the type
        return [type(e).__name__, str(e)]
    return None


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(rank=rank, world_size=world, port=port, timeout_s=30)
    result = {"seed": _error(lambda: Engine(random_seed=rank, **ARGS))}
    for algo in ALGORITHMS:
        engine = Engine(speculative_algorithm=algo, **ARGS)
        calls, pools_whole = {}, []

        def call(name, input_ids, params):
            calls[name] = _error(
                lambda: engine.generate(input_ids=input_ids, sampling_params=params)
            )
            engine.scheduler.check_pool_accounting()  # raises on a leak
            pools_whole.append(not engine.scheduler.has_work())

        other = [[t + rank for t in ids] for ids in PROMPTS]
        call("prompts", other, PARAMS)
        call("params", PROMPTS, {"max_new_tokens": 6 + rank})
        # Rank 1 alone gets an out-of-vocabulary id: it names it, rank 0
        # learns the ranks disagree; neither waits for the other.
        bad = PROMPTS if rank == 0 else [PROMPTS[0], [1, 999]]
        call("one_rank_rejects", bad, PARAMS)
        call("count", PROMPTS[: 1 + rank], PARAMS)  # rank 1 one request more
        outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        engine.scheduler.check_pool_accounting()
        result[str(algo)] = {
            "calls": calls,
            "pools_whole": pools_whole,
            "output_ids": [o["output_ids"] for o in outs],
            "ids": [o["meta_info"]["id"] for o in outs],
        }
    result["lockstep"] = _lockstep(rank)
    # A cost table file only rank 0 sees (each rank in its own folder):
    # rank 0 would load it while rank 1 measures, running collectives alone.
    cwd, folder = os.getcwd(), os.path.join(out_dir, f"cwd{rank}")
    os.makedirs(folder)
    os.chdir(folder)
    try:
        if rank == 0:
            with open("table.json", "w") as f:
                f.write("{}")
        result["table"] = _error(
            lambda: Engine(
                speculative_algorithm="DSPARK",
                speculative_dspark_sps_table_path="table.json",
                **ARGS,
            )
        )
    finally:
        os.chdir(cwd)
    # One table file for both, measured at different thread counts: on the
    # restart the last writer's key fails the other rank's check, which
    # refused alone (the other rank then waited at its first exchange).
    shared = dict(
        ARGS,
        num_threads=1 + rank,
        speculative_algorithm="DSPARK",
        speculative_dspark_sps_table_path=os.path.join(out_dir, "shared.json"),
    )
    result["table_threads"] = [_error(lambda: Engine(**shared)) for _ in range(2)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _lockstep(rank: int) -> dict:
    """Expert parallelism alone: the ranks run the same steps, so what
    decides them must agree: the generator state, the verify budget's held
    plan, the group its exchange runs on."""
    engine = Engine(speculative_algorithm="DSPARK", **ARGS)  # budget auto
    out = {}
    sampled = dict(PARAMS, temperature=1.0)

    def sample():
        return engine.generate(input_ids=PROMPTS, sampling_params=sampled)

    engine.reseed(100 + rank)  # one rank's stream alone
    out["reseeded_alone"] = _error(sample)
    engine.reseed(5)
    out["reseeded_alike"] = [o["output_ids"] for o in sample()]
    # A plan held from one call into the next (one request throughout), then
    # rank 0 alone flushes and forgets it: the next call plans on both.
    one = dict(input_ids=PROMPTS[:1], sampling_params={"max_new_tokens": 13})
    engine.generate(**one)
    out["held_before_flush"] = engine.worker.planner._countdown
    if rank == 0:
        engine.flush_cache()
    out["after_flush_alone"] = _error(lambda: engine.generate(**one))
    # Another engine built after this one: its exchanges keep this one's group.
    Engine(speculative_algorithm=None, **ARGS)
    groups, real = [], dspark_worker_v2.all_gather_ints

    def spy(*, values, group, what):
        groups.append(group is engine._check_group)
        return real(values=values, group=group, what=what)

    with mock.patch.object(dspark_worker_v2, "all_gather_ints", spy):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    out["own_group"] = groups
    return out


def _cuda_graph_rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(rank=rank, world_size=world, port=port, timeout_s=30)
    result = {"graphs": _error(lambda: Engine(device="cuda", max_running_requests=4))}
    result["no_groups_left"] = get_parallel().moe_ep_group is None
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class TestExpertParallelCudaGraphsNeedNccl(CustomTestCase):
    def test_gloo_with_cuda_graphs_is_a_value_error_on_both_ranks(self):
        # The MoE's all-reduce runs inside the captured step; gloo's goes
        # through the host, which a graph cannot capture.
        for rank in spawn_ranks(_cuda_graph_rank_main, world_size=2):
            kind, message = rank["graphs"]
            self.assertEqual(kind, "ValueError")
            self.assertIn("needs CUDA collectives on nccl", message)
            self.assertIn("cuda:gloo", message)
            self.assertTrue(rank["no_groups_left"])  # refused before building


class TestExpertParallelAgreement(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ranks = spawn_ranks(_rank_main, world_size=2)
        cls.single = {
            str(algo): [
                o["output_ids"]
                for o in Engine(speculative_algorithm=algo, **ARGS).generate(
                    input_ids=PROMPTS, sampling_params=PARAMS
                )
            ]
            for algo in ALGORITHMS
        }

    def test_different_seed_is_a_value_error_on_both_ranks(self):
        for rank in self.ranks:
            kind, message = rank["seed"]
            self.assertEqual(kind, "ValueError")
            self.assertIn("EP ranks disagree on the engine configuration", message)
            self.assertIn("[0]", message)
            self.assertIn("[1]", message)

    def test_different_requests_are_a_value_error_on_both_ranks(self):
        for algo in map(str, ALGORITHMS):
            for rank in self.ranks:
                calls = rank[algo]["calls"]
                for name in ("prompts", "params"):
                    with self.subTest(algo=algo, call=name):
                        kind, message = calls[name]
                        self.assertEqual(kind, "ValueError")
                        self.assertIn("EP ranks disagree on the requests", message)

    def test_a_request_one_rank_rejects_stops_both(self):
        for algo in map(str, ALGORITHMS):
            rank0, rank1 = (r[algo]["calls"]["one_rank_rejects"] for r in self.ranks)
            self.assertEqual(rank0[0], "ValueError")
            self.assertIn("EP ranks disagree on the requests", rank0[1])
            self.assertEqual(rank1[0], "ValueError")
            self.assertIn("input 1", rank1[1])
            self.assertIn("token id 999", rank1[1])

    def test_pools_whole_and_later_output_equals_single_process(self):
        for algo in map(str, ALGORITHMS):
            for rank in self.ranks:
                self.assertEqual(rank[algo]["pools_whole"], [True] * 4)
                self.assertEqual(rank[algo]["output_ids"], self.single[algo])

    def test_a_cost_table_only_some_ranks_have_is_a_value_error_on_all(self):
        for rank in self.ranks:
            kind, message = rank["table"]
            self.assertEqual(kind, "ValueError")
            self.assertIn("present on some ranks only", message)

    def test_a_cost_table_that_fits_some_ranks_only_stops_all(self):
        for rank in self.ranks:
            first, restart = rank["table_threads"]
            self.assertIsNone(first)  # measured and saved
            kind, message = restart
            self.assertEqual(kind, "ValueError")
            self.assertIn("fits some ranks' configuration only", message)

    def test_expert_parallel_ranks_keep_their_steps_in_lockstep(self):
        # A rank reseeded alone is refused on both (it used to sum other
        # tokens' shares silently, or abort in gloo under DSpark); a plan one
        # rank held while the other, flushed, planned anew no longer splits
        # their collectives (a timeout, then every call refused); another
        # engine built later does not take this one's exchanges.
        lockstep = [rank["lockstep"] for rank in self.ranks]
        for rank in lockstep:
            kind, message = rank["reseeded_alone"]
            self.assertEqual(kind, "ValueError")
            self.assertIn("the requests and the generator state", message)
            self.assertIsNone(rank["after_flush_alone"])
            self.assertGreater(len(rank["own_group"]), 0)
            self.assertTrue(all(rank["own_group"]))
        self.assertGreater(lockstep[1]["held_before_flush"], 0)
        self.assertEqual(lockstep[0]["reseeded_alike"], lockstep[1]["reseeded_alike"])

    def test_refused_calls_take_no_request_ids(self):
        # Ranks given different calls must still number the next agreed
        # call's requests alike (DP ranks gather each other's results by
        # them): a refused call takes no id, on any rank.
        for algo in map(str, ALGORITHMS):
            for rank in self.ranks:
                with self.subTest(algo=algo):
                    self.assertEqual(rank[algo]["calls"]["count"][0], "ValueError")
                    self.assertEqual(rank[algo]["ids"], [0, 1])


if __name__ == "__main__":
    unittest.main()

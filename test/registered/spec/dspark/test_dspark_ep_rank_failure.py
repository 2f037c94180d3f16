"""A dead or stalled expert-parallel rank makes the survivor raise, within
``dist_timeout``, instead of hanging (gloo, 2 ranks, ``dist_timeout=5``).

Rank 1 dies (``os._exit``) or stalls (sleeps) from its progress callback in
the middle of a DSpark ``generate()``; rank 0 is then inside the MoE
all-reduce. Rank 0 must raise, abort its requests with the pools whole, and
exit. The bound below is a hang detector (timeout plus generous slack for a
loaded machine), not a speed assertion.
"""

import json
import multiprocessing
import os
import tempfile
import time
import unittest

import torch

from sglang import Engine
from sglang.srt.distributed.parallel_state import (
    get_open_port,
    init_distributed_environment,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

DIST_TIMEOUT = 5
HANG_SLACK = 20  # seconds past dist_timeout that count as "hung"
PROMPTS = [[7, 3, 9, 1], [4, 4, 8]]
# Room for many steps after rank 1 fails at its second: the trained draft
# can commit 6 tokens a step.
PARAMS = {"max_new_tokens": 40}


def _rank_main(rank: int, port: int, mode: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(rank=rank, world_size=2, port=port, timeout_s=30)
    engine = Engine(
        speculative_algorithm="DSPARK", device="cpu", dist_timeout=DIST_TIMEOUT
    )
    engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)  # both alive
    steps = [0]

    def progress(_):
        steps[0] += 1
        if rank == 1 and steps[0] == 2:
            if mode == "killed":
                os._exit(3)
            time.sleep(10 * DIST_TIMEOUT)  # stalled; the parent kills it
            os._exit(4)

    start = time.monotonic()
    try:
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS, progress=progress)
        error = None
    except Exception as e:  # noqa: BLE001 - the test records the type
        error = [type(e).__name__, str(e)]
    elapsed = time.monotonic() - start
    engine.scheduler.check_pool_accounting()
    result = {
        "error": error,
        "elapsed": elapsed,
        "steps": steps[0],
        "has_work": engine.scheduler.has_work(),
    }
    # The ranks' collectives are out of step now: a later call is refused
    # at once rather than waiting out another timeout.
    start = time.monotonic()
    try:
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        result["second"] = None
    except Exception as e:  # noqa: BLE001 - the test records the type
        result["second"] = [type(e).__name__, str(e)]
    result["second_elapsed"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the group is broken: skip its teardown


def _run(mode: str) -> tuple:
    """Start both ranks; return (rank 0's result, rank 0's exit code, rank
    1's exit code or None when it had to be killed)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = get_open_port()
        procs = [
            ctx.Process(target=_rank_main, args=(rank, port, mode, out_dir))
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        procs[0].join(timeout=DIST_TIMEOUT + HANG_SLACK + 30)  # + start-up
        survivor_code = procs[0].exitcode
        if survivor_code is None:
            procs[0].kill()
        procs[1].join(timeout=1)
        other_code = procs[1].exitcode
        if other_code is None:
            procs[1].kill()
        for p in procs:
            p.join()
        path = os.path.join(out_dir, "rank0.json")
        result = None
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
    return result, survivor_code, other_code


class TestExpertParallelRankFailure(CustomTestCase):
    def _check_survivor(self, mode: str) -> tuple:
        result, code, other = _run(mode)
        self.assertEqual(code, 0, f"rank 0 hung or crashed ({mode})")
        self.assertIsNotNone(result)
        self.assertIsNotNone(result["error"], "rank 0 returned as if nothing failed")
        self.assertEqual(result["error"][0], "RuntimeError")
        # It names the rank, the call and what it means, not gloo's words alone.
        self.assertIn("EP rank 0: call 2 did not complete", result["error"][1])
        self.assertIn("out of step", result["error"][1])
        self.assertLess(result["elapsed"], DIST_TIMEOUT + HANG_SLACK)
        self.assertFalse(result["has_work"])  # its requests were aborted
        kind, message = result["second"]
        self.assertEqual(kind, "RuntimeError")
        self.assertIn("restart every rank", message)
        self.assertLess(result["second_elapsed"], DIST_TIMEOUT)  # no new wait
        return result, other

    def test_killed_rank(self):
        result, other = self._check_survivor("killed")
        self.assertEqual(other, 3)  # rank 1 really died mid-call

    def test_stalled_rank(self):
        result, other = self._check_survivor("stalled")
        self.assertIsNone(other)  # rank 1 was still asleep: the survivor did not wait
        # It waited for the stalled peer about dist_timeout, not forever.
        self.assertGreaterEqual(result["elapsed"], DIST_TIMEOUT * 0.9)
        self.assertIn("Timed out", result["error"][1])


if __name__ == "__main__":
    unittest.main()

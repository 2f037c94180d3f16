"""GraphRunner runs a worker's whole device step at a bucket size: a batch
is padded to its bucket with dummy rows that touch only the scratch KV
slot. On the CPU the padded step runs eagerly and gives the unpadded
step's tokens; on CUDA each (bucket, variant) is one captured graph."""

import unittest

import torch

from sglang import Engine
from sglang.srt.layers.sampler import SamplingMode
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.mem_cache.memory_pool import SCRATCH_SLOT
from sglang.srt.model_executor.graph_runner import GraphRunner
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=8, suite="base-a-test-cpu")
register_cuda_ci(est_time=20, stage="base-b", runner_config="1-gpu-large")

PROMPTS = [[7, 3, 9, 1], [4, 4, 8], [12, 50, 2, 77, 5], [9, 9, 9, 9, 9, 1]]


class TestGraphRunner(CustomTestCase):
    def _runner(self, buckets, calls=None):
        calls = [] if calls is None else calls
        return GraphRunner(
            step=lambda rows, variant, bound: calls.append((rows, variant, bound)),
            bucket_sizes=buckets,
            use_cuda_graph=False,
        )

    def test_padded_size(self):
        runner = self._runner([4, 1, 2, 8, 4])
        self.assertEqual(runner.buckets, [1, 2, 4, 8])
        for bs, rows in ((1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 9)):
            self.assertEqual(runner.padded_size(bs), rows)  # past the last: as is
        self.assertEqual(self._runner(None).padded_size(3), 3)  # no buckets

    def test_eager_run_calls_the_step(self):
        calls = []
        runner = self._runner([1, 2, 4], calls)
        runner.capture(["greedy"])  # nothing to capture on the CPU
        runner.run(rows=4, variant="greedy", max_kv_len=17)
        self.assertEqual(calls, [(4, "greedy", 17)])
        self.assertFalse(runner.is_graphed(4))

    def test_bad_buckets(self):
        for buckets in ([], [0, 2], [-1]):
            with self.subTest(buckets=buckets):
                with self.assertRaisesRegex(ValueError, "bucket sizes"):
                    self._runner(buckets)
        with self.assertRaisesRegex(ValueError, "CUDA graphs need bucket sizes"):
            GraphRunner(step=None, bucket_sizes=None, use_cuda_graph=True)


class _PaddedChecks:
    """A padded step gives the unpadded step's tokens, and its dummy rows
    write only the scratch slot."""

    device = "cpu"

    def _engines(self, algorithm):
        kw = dict(
            speculative_algorithm=algorithm,
            device=self.device,
            random_seed=0,
            max_running_requests=8,
            max_total_tokens=512,
        )
        unpadded = Engine(cuda_graph_bs=None, disable_cuda_graph=True, **kw)
        return unpadded, Engine(cuda_graph_bs=[1, 2, 8], **kw)

    def _check(self, algorithm):
        params = {"max_new_tokens": 12}
        for bs in (1, 3, 4):  # 3 and 4 run in the bucket of 8
            with self.subTest(algorithm=algorithm, bs=bs):
                engines = self._engines(algorithm)
                for pool in self._pools(engines[1]):
                    # Written already (the capture's warm-up, DSpark's cost
                    # table): cleared, so that the check below sees this call.
                    pool.k[:, SCRATCH_SLOT] = 0
                    pool.v[:, SCRATCH_SLOT] = 0
                outs = [
                    e.generate(input_ids=PROMPTS[:bs], sampling_params=params)
                    for e in engines
                ]
                tokens = [[o["output_ids"] for o in out] for out in outs]
                self.assertEqual(tokens[0], tokens[1])
                # Slots 1..held were the requests' (one call, a fresh pool);
                # the rest were never written: dummy rows wrote scratch only.
                sched = engines[1].scheduler
                held = sum(sched.kv_need(r) for r in self._reqs(PROMPTS[:bs]))
                for pool in self._pools(engines[1]):
                    self.assertTrue(bool((pool.k[:, held + 1 :] == 0).all()))
                    if bs > 1:  # padded: the dummy rows wrote scratch
                        self.assertTrue(bool((pool.k[:, SCRATCH_SLOT] != 0).any()))

    def _reqs(self, prompts):
        params = SamplingParams(max_new_tokens=12)
        return [
            Req(rid=i, origin_input_ids=p, sampling_params=params)
            for i, p in enumerate(prompts)
        ]

    def _pools(self, engine):
        worker = engine.worker
        if hasattr(worker, "draft_runner"):
            return [
                worker.target_runner.token_to_kv_pool,
                worker.draft_runner.token_to_kv_pool,
            ]
        return [worker.model_runner.token_to_kv_pool]

    def test_plain(self):
        self._check(None)

    def test_dspark(self):
        self._check("DSPARK")


class TestPaddedStepCPU(_PaddedChecks, CustomTestCase):
    pass


BUDGETS = ("auto", "off", 0, 4)  # every kind of step: plain, ragged, full


class TestCaptureWarmUpCPU(CustomTestCase):
    def test_every_variant_runs_as_a_capture_runs_it(self):
        # What a capture's warm-up runs for each (bucket, variant) the worker
        # names, on dummy rows with static shapes (no host bound on the
        # keys), eagerly: it runs, touches only scratch, and the engine's
        # tokens afterwards are those of an engine that never ran it.
        kw = dict(device="cpu", random_seed=0, max_running_requests=8)
        params = {"max_new_tokens": 12}
        for budget in BUDGETS:
            with self.subTest(budget=budget):
                kw.update(speculative_algorithm="DSPARK")
                kw.update(speculative_verify_budget=budget, cuda_graph_bs=[1, 2, 8])
                fresh, warmed = Engine(**kw), Engine(**kw)
                worker, ran = warmed.worker, 0
                for rows in worker.graph_runner.buckets:
                    for variant in worker._variants(rows):
                        worker.buffers.state.reset()
                        worker._device_step(rows, variant, None)
                        ran += 1
                worker.buffers.state.reset()
                self.assertGreaterEqual(ran, 2 * len(SamplingMode))
                outs = [
                    e.generate(input_ids=PROMPTS[:3], sampling_params=params)
                    for e in (fresh, warmed)
                ]
                self.assertEqual(*[[o["output_ids"] for o in out] for out in outs])


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class TestPaddedStepCUDA(_PaddedChecks, CustomTestCase):
    device = "cuda"

    def test_graphs_captured_up_front_and_replayed(self):
        # Every budget's variants capture (a plain step's graph writes the
        # context stash, made before the capture), and a decode step is one
        # replay.
        for budget in BUDGETS:
            with self.subTest(budget=budget):
                padded = Engine(
                    speculative_algorithm="DSPARK",
                    speculative_verify_budget=budget,
                    device=self.device,
                    random_seed=0,
                    max_running_requests=8,
                    cuda_graph_bs=[1, 2, 8],
                )
                worker = padded.worker
                runner = worker.graph_runner
                keys = {(r, v) for r in (1, 2, 8) for v in worker._variants(r)}
                self.assertEqual(set(runner._graphs), keys)
                before = runner.replays  # auto's cost table replays too
                steps = padded.scheduler.num_decode_steps
                padded.generate(
                    input_ids=PROMPTS[:3], sampling_params={"max_new_tokens": 12}
                )
                steps = padded.scheduler.num_decode_steps - steps
                self.assertGreater(steps, 0)
                self.assertEqual(runner.replays - before, steps)


if __name__ == "__main__":
    unittest.main()

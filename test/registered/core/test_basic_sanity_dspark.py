"""End to end: DSpark greedy output equals plain greedy output, token for token.

Batches of 1 to 8 requests join and leave; drafts are accepted fully, partly
and not at all. The oracle proposer stands in for the draft model only: it
proposes the target's own continuation with errors injected where asked,
and the worker's verify, accept and commit path stays real.
"""

import random
import unittest
from typing import Callable, Dict, List

import torch

from sglang import Engine
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.speculative.dspark_components.dspark_draft import DraftProposal
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase, record_decode_batch_sizes

register_cpu_ci(est_time=40, suite="base-a-test-cpu")
register_cuda_ci(est_time=60, stage="base-b", runner_config="1-gpu-large")

VOCAB = 256


def make_prompts(n: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(VOCAB - 1) for _ in range(rng.randint(3, 24))] for _ in range(n)
    ]


class OracleProposer:
    """Proposes the reference continuation; ``corrupt(req, step, k)`` says
    whether draft k (0-based) of that request's step is made wrong."""

    def __init__(
        self,
        references: Dict[tuple, List[int]],
        gamma: int,
        corrupt: Callable[[Req, int, int], bool],
    ):
        self.references, self.gamma, self.corrupt = references, gamma, corrupt
        self._rows: List[List[int]] = []

    def prepare(self, *, views, batch, scalar) -> None:
        """On the host, from the requests: this step's block per request."""
        self._rows = []
        for req in batch.reqs:
            ref = self.references[tuple(req.origin_input_ids)]
            done = len(req.output_ids)  # the last one is the anchor
            row = []
            for k in range(self.gamma):
                tok = ref[done + k]
                if self.corrupt(req, req.spec_verify_ct, k):
                    tok = (tok + 1) % VOCAB
                row.append(tok)
            self._rows.append(row)

    def propose(self, *, views, mode, confidence=False, extras=None) -> DraftProposal:
        drafts = views.drafts[: len(self._rows)]  # padded rows keep anything
        drafts.copy_(torch.tensor(self._rows, device=drafts.device))
        return DraftProposal(
            draft_tokens=views.drafts, draft_probs=None, block_ids=views.drafts
        )


class TestDSparkMatchesPlainGreedy(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        kw = dict(device=device, random_seed=0, max_running_requests=8)
        cls.plain = Engine(speculative_algorithm=None, **kw)
        # Every draft verified: the oracle's verdicts are counted exactly.
        # Eager on CUDA too: a captured step would replay the real proposer.
        cls.dspark = Engine(
            speculative_algorithm="DSPARK",
            speculative_verify_budget="off",
            disable_cuda_graph=True,
            **kw,
        )
        cls.gamma = cls.dspark.dspark_config.gamma
        cls.real_proposer = cls.dspark.worker.proposer

    def tearDown(self):
        self.dspark.worker.proposer = self.real_proposer
        super().tearDown()

    def _reference(self, prompts, params):
        outs = self.plain.generate(input_ids=prompts, sampling_params=params)
        return {tuple(p): o["output_ids"] for p, o in zip(prompts, outs)}

    def _params(self, n: int, seed: int) -> List[Dict]:
        rng = random.Random(seed)
        return [{"max_new_tokens": rng.randint(1, 30)} for _ in range(n)]

    def test_real_draft_batch_sizes_1_to_8(self):
        accepted = verifies = 0  # over every request of every batch size
        for bs in range(1, 9):
            with self.subTest(bs=bs):
                prompts, params = make_prompts(bs, seed=bs), self._params(bs, seed=bs)
                ref = self._reference(prompts, params)
                outs = self.dspark.generate(input_ids=prompts, sampling_params=params)
                for p, o, sp in zip(prompts, outs, params):
                    self.assertEqual(o["output_ids"], ref[tuple(p)])
                    meta = o["meta_info"]
                    self.assertEqual(meta["completion_tokens"], sp["max_new_tokens"])
                    length, steps = meta["spec_accept_length"], meta["spec_verify_ct"]
                    self.assertTrue(1.0 <= length <= self.gamma + 1, length)
                    accepted += (length - 1) * steps
                    verifies += steps
        # The trained draft's blocks are accepted, not only verified: on
        # these random prompts about 2 drafts a verify (0 if none were).
        self.assertGreater(accepted / verifies, 1.0)

    def test_requests_join_and_leave(self):
        # 12 requests through at most 8 running slots: requests finish at
        # different steps and waiting ones join mid-flight.
        prompts, params = make_prompts(12, seed=99), self._params(12, seed=99)
        ref = self._reference(prompts, params)
        sched = self.dspark.scheduler
        with record_decode_batch_sizes(self.dspark) as sizes:
            outs = self.dspark.generate(input_ids=prompts, sampling_params=params)
        for p, o in zip(prompts, outs):
            self.assertEqual(o["output_ids"], ref[tuple(p)])
        self.assertEqual(max(sizes), 8)
        self.assertGreater(len(set(sizes)), 2)  # the batch shrank and grew
        self.assertFalse(sched.has_work())
        self.assertEqual(self.dspark.allocator.available(), 4096)

    def _run_oracle(self, corrupt, n=6, max_new=25):
        prompts = make_prompts(n, seed=7)
        # The oracle knows gamma tokens past the end, so every verdict is real.
        longer = {"max_new_tokens": max_new + self.gamma + 1}
        ref = self._reference(prompts, longer)
        self.dspark.worker.proposer = OracleProposer(ref, self.gamma, corrupt)
        params = {"max_new_tokens": max_new}
        outs = self.dspark.generate(input_ids=prompts, sampling_params=params)
        for p, o in zip(prompts, outs):
            self.assertEqual(o["output_ids"], ref[tuple(p)][:max_new])
        return outs

    def test_drafts_accepted_fully(self):
        outs = self._run_oracle(lambda req, step, k: False)
        # 24 decode tokens at gamma + 1 = 6 per step: exactly 4 verify steps.
        for o in outs:
            self.assertEqual(o["meta_info"]["spec_verify_ct"], 4)
            self.assertEqual(o["meta_info"]["spec_accept_length"], self.gamma + 1)

    def test_drafts_accepted_not_at_all(self):
        outs = self._run_oracle(lambda req, step, k: k == 0)
        for o in outs:
            self.assertEqual(o["meta_info"]["spec_verify_ct"], 24)
            self.assertEqual(o["meta_info"]["spec_accept_length"], 1.0)

    def test_drafts_accepted_partly(self):
        # Step s of each request breaks draft s % gamma: accept s % gamma.
        outs = self._run_oracle(lambda req, step, k: k == step % self.gamma)
        for o in outs:
            ct = o["meta_info"]["spec_verify_ct"]
            # Accepted 0,1,2,3,4,0,... -> committed 1,2,3,4,5,1,... per step.
            committed = [1 + s % self.gamma for s in range(ct)]
            self.assertGreaterEqual(sum(committed), 24)
            self.assertLess(sum(committed[:-1]), 24)
            accepted = sum(c - 1 for c in committed)
            self.assertAlmostEqual(
                o["meta_info"]["spec_accept_length"], 1 + accepted / ct
            )

    def test_eos_stops_both_the_same_way(self):
        prompts = make_prompts(4, seed=3)
        params = {"max_new_tokens": 20}
        ref = self._reference(prompts, params)
        eos = ref[tuple(prompts[0])][5]  # a token the first request emits
        for engine in (self.plain, self.dspark):
            engine.scheduler.eos_token_id = eos
        try:
            base = self.plain.generate(input_ids=prompts, sampling_params=params)
            spec = self.dspark.generate(input_ids=prompts, sampling_params=params)
        finally:
            for engine in (self.plain, self.dspark):
                engine.scheduler.eos_token_id = None
        self.assertEqual(base[0]["output_ids"][-1], eos)
        self.assertEqual(base[0]["meta_info"]["finish_reason"], "stop")
        self.assertEqual(
            [o["output_ids"] for o in base], [o["output_ids"] for o in spec]
        )


class TestDeterminism(CustomTestCase):
    def test_same_seed_same_sampled_tokens(self):
        prompts = make_prompts(3, seed=5)
        params = {"max_new_tokens": 16, "temperature": 0.8}
        # A fixed budget: "auto" plans from measured step times, and a step
        # it makes plain draws differently (a seeded request would not).
        args = dict(device="cpu", random_seed=11, speculative_verify_budget="off")
        runs = [
            Engine(speculative_algorithm="DSPARK", **args).generate(
                input_ids=prompts, sampling_params=params
            )
            for _ in range(2)
        ]
        self.assertEqual(
            [o["output_ids"] for o in runs[0]], [o["output_ids"] for o in runs[1]]
        )
        for o in runs[0]:
            self.assertEqual(o["meta_info"]["completion_tokens"], 16)


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class TestEagerCUDA(CustomTestCase):
    """On CUDA without graphs every batch runs as given, so the DSpark step
    shares the verify's attention metadata with the draft block (its mask a
    strided [bs, 1, 1, L] view) and the context write, as on the CPU: the
    greedy output still equals plain greedy output."""

    def test_shared_metadata_on_cuda(self):
        kw = dict(
            device="cuda",
            random_seed=0,
            max_running_requests=8,
            disable_cuda_graph=True,
        )
        plain = Engine(speculative_algorithm=None, **kw)
        dspark = Engine(speculative_algorithm="DSPARK", **kw)
        runner = dspark.worker.graph_runner  # eager: no buckets, no graphs
        self.assertFalse(runner.use_cuda_graph)
        self.assertEqual((runner.buckets, runner._graphs), ([], {}))
        for bs in (1, 3, 8):
            with self.subTest(bs=bs):
                prompts = make_prompts(bs, seed=bs)
                params = {"max_new_tokens": 24}
                ref = plain.generate(input_ids=prompts, sampling_params=params)
                outs = dspark.generate(input_ids=prompts, sampling_params=params)
                self.assertEqual(
                    [o["output_ids"] for o in outs], [o["output_ids"] for o in ref]
                )


if __name__ == "__main__":
    unittest.main()

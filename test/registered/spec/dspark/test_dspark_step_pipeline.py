"""The DSpark decode step as one pipeline: five phases in order, every op of
a step inside one of them, no host read before the output phase, and the
device step (draft -> verify -> accept -> commit) compiling as one graph
with torch.compile(fullgraph=True), so a graph break fails the test."""

import unittest
from contextlib import contextmanager

import torch

from sglang import Engine
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.utils.op_counter import OpCounter
from sglang.srt.utils.phases import PhaseRecorder
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

PROMPTS = [list(b"import os\n"), list(b"def main(argv):\n"), list(b"class A:\n")]
TEMPERATURES = {"greedy": (0, 0, 0), "sampled": (1, 0.7, 1.3), "mixed": (0, 1, 0.7)}


# Every sampling parameter beyond the temperature, a seed and logprobs on
# one request of the batch: the step's extras variant.
EXTRAS = dict(
    top_k=8,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.2,
    frequency_penalty=0.3,
    presence_penalty=0.2,
    min_new_tokens=3,
    sampling_seed=7,
)


def _running(temperatures, cuda_graph_bs=None, budget="off", extras=False):
    """An engine with PROMPTS admitted and decoding (one step done)."""
    engine = Engine(
        speculative_algorithm="DSPARK",
        device="cpu",
        random_seed=0,
        max_running_requests=4,
        cuda_graph_bs=cuda_graph_bs,
        speculative_verify_budget=budget,
    )
    sched = engine.scheduler
    for i, (ids, t) in enumerate(zip(PROMPTS, temperatures)):
        more = EXTRAS if extras and i == 1 else {}
        params = SamplingParams(max_new_tokens=40, temperature=t, **more)
        req = Req(rid=i, origin_input_ids=ids, sampling_params=params)
        req.return_logprob = extras
        sched.add_request(req)
    sched.step()
    return engine


class TestPhases(CustomTestCase):
    def test_every_op_in_a_phase_in_order(self):
        for name, temps in TEMPERATURES.items():
            for buckets in (None, [1, 2, 4]):  # exact, and padded to 4
                with self.subTest(mode=name, buckets=buckets):
                    self._check(_running(temps, buckets))

    def _check(self, engine):
        worker, order = engine.worker, []
        with OpCounter() as step:
            recorder = PhaseRecorder(counter=step)

            @contextmanager
            def hook(name):
                order.append(name)
                with recorder(name):
                    yield

            worker.spans.hook = hook
            try:
                engine.scheduler.step()
            finally:
                worker.spans.hook = None
        totals = recorder.totals
        phases = [n for n in order if n in worker.PHASES]
        # draft opens twice (its host part, then its device part).
        self.assertEqual(
            phases, ["draft", "draft", "verify", "accept", "commit", "output"]
        )
        self.assertEqual(set(totals) - set(worker.PHASES), set(worker.MODEL_SPANS))
        # Every op of the step is inside a phase: exact counts.
        inside = sum(totals[p]["ops"] for p in worker.PHASES)
        self.assertEqual(inside, step.ops)
        self.assertGreater(step.ops, 300)
        # The model's own compute is inside its phase.
        for span, phase in (
            ("attention metadata", "draft"),
            ("draft forward", "draft"),
            ("verify forward", "verify"),
            ("context write", "commit"),
        ):
            self.assertLess(totals[span]["ops"], totals[phase]["ops"] + 1)
            self.assertEqual(order.index(span) > order.index(phase), True)
        # No host read before the output phase. The output's own reads (on
        # the CPU a tolist of each result, dispatching no op) are seen: the
        # counter would see one anywhere else.
        reads = {n: t["host_reads"] for n, t in totals.items() if t["host_reads"]}
        self.assertEqual(set(reads), {"output"})
        self.assertGreaterEqual(reads["output"], 3)  # accept lengths, drafts, bonus
        self.assertEqual(totals["output"]["allocs"], 0)


class TestFullGraph(CustomTestCase):
    """The device step compiles whole and computes what it computes eagerly."""

    def _state(self, engine):
        worker = engine.worker
        st = worker.buffers.state.sampling  # what the extras advance
        tensors = [
            worker.buffers.state.seq_lens,
            worker.buffers.state.last_ids,
            worker.target_runner.token_to_kv_pool.k,
            worker.target_runner.token_to_kv_pool.v,
            worker.draft_runner.token_to_kv_pool.k,
            worker.draft_runner.token_to_kv_pool.v,
            st.counts,
            st.seen,
            st.out_lens,
        ]
        return tensors, [t.clone() for t in tensors]

    def _device_step(self, engine, compiled_with=None):
        """Prepare (bind, noise) and run the device step; its outputs, with
        the state put back as it was before."""
        worker = engine.worker
        batch = engine.scheduler._batch  # running since the first step
        mode = batch.sampling_mode
        rows, budget = worker._prepare(batch, mode)
        tensors, saved = self._state(engine)
        step = worker._device_step
        if compiled_with is not None:
            torch._dynamo.reset()
            step = torch.compile(step, fullgraph=True, backend=compiled_with)
        ragged = 0 < budget < rows * worker.gamma
        variant = (mode, budget, ragged, batch.sampling_info.extras)
        step(rows, variant, max(batch.seq_lens_cpu) + worker.gamma)
        v = worker.buffers.at(batch.batch_size)
        out = [
            t.clone()
            for t in (v.drafts, v.accept_lens, v.state.last_ids, v.state.seq_lens)
        ]
        out += [t.clone() for t in tensors[2:]]
        out.append(v.logprobs.clone())
        for t, s in zip(tensors, saved):
            t.copy_(s)
        return out

    def test_compiles_whole_and_matches_eager(self):
        # Every draft verified, a ragged verify (4 drafts of 15; also in a
        # bucket of 4, its padding request masked), and a plain step
        # (budget 0). With every sampling parameter too (processed, seeded,
        # logprobs).
        cases = [(name, "off", False, None) for name in TEMPERATURES] + [
            ("mixed", 4, False, None),
            ("mixed", 4, False, [1, 2, 4]),
            ("sampled", 0, False, None),
            ("mixed", "off", True, None),
            ("sampled", 4, True, None),
            ("greedy", 0, True, None),
        ]
        for name, budget, extras, buckets in cases:
            with self.subTest(mode=name, budget=budget, extras=extras, buckets=buckets):
                engine = _running(
                    TEMPERATURES[name], buckets, budget=budget, extras=extras
                )
                gen = engine.worker.generator
                seed = gen.initial_seed()
                gen.manual_seed(seed)
                eager = self._device_step(engine)
                gen.manual_seed(seed)  # the same noise, drawn before the step
                compiled = self._device_step(engine, compiled_with="aot_eager")
                for a, b in zip(eager, compiled):
                    self.assertTrue(torch.equal(a, b))

    def test_inductor_greedy_tokens(self):
        # Generated kernels round differently, but pick the same tokens.
        engine = _running(TEMPERATURES["greedy"])
        eager = self._device_step(engine)
        compiled = self._device_step(engine, compiled_with="inductor")
        for a, b in zip(eager[:4], compiled[:4]):
            self.assertTrue(torch.equal(a, b))
        for a, b in zip(eager[4:], compiled[4:]):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)


class TestRaggedSchedule(CustomTestCase):
    def test_a_seeded_row_is_scheduled_by_its_own_drafts(self):
        # Three sampled requests, the middle one seeded, 4 of 15 drafts
        # verified. The unseeded rows are blind (gains 0.5, 0.25, ...
        # whatever their drafts); the seeded row's output does not depend on
        # what is verified, so its own confidence decides its share: all of
        # the budget when it is sure, none when it is not. Were it blind too,
        # three equal rows would split the budget 2/1/1 either way.
        engine = _running(TEMPERATURES["sampled"], budget=4, extras=True)
        worker, batch = engine.worker, engine.scheduler._batch
        mode, extras = batch.sampling_mode, batch.sampling_info.extras
        rows, budget = worker._prepare(batch, mode)
        self.assertEqual((rows, budget), (3, 4))
        v = worker.buffers.at(rows)
        self.assertEqual(v.state.sampling.is_seeded.view(-1).tolist(), [0, 1, 0])
        for sure, lens in ((1.0, [0, 4, 0]), (0.0, [2, 0, 2])):
            with self.subTest(confidence=sure):
                v.confidence.fill_(0.9)  # the blind rows': never read
                v.confidence[:, 1] = sure
                worker._lay_out_ragged(v, rows, budget, mode, extras)
                self.assertEqual(v.verify_lens.tolist(), lens)


class TestPlainStep(CustomTestCase):
    def test_reads_the_anchors_keys_and_drops_the_blocks_confidence(self):
        # A step that verifies no draft (budget 0) attends up to the longest
        # sequence, its anchors' own kv_lens, not the verify window's gamma
        # keys more; and the next plan expects the running acceptance again:
        # no request keeps its last block's confidence.
        engine = _running(TEMPERATURES["greedy"], budget=0)
        worker, sched = engine.worker, engine.scheduler
        reqs = list(sched.running)
        for req in reqs:
            req.spec_draft_confidence = [0.9] * worker.gamma
        longest = max(len(r.origin_input_ids) + len(r.output_ids) for r in reqs)
        sched.step()
        rows = worker.graph_runner.padded_size(len(reqs))
        metadata = worker.buffers.at(rows).plain_batch.attn_metadata
        self.assertEqual(metadata.kv_bound, longest)
        self.assertEqual([r.spec_draft_confidence for r in reqs], [None] * len(reqs))
        self.assertEqual([len(r.output_ids) for r in reqs], [3] * len(reqs))


if __name__ == "__main__":
    unittest.main()

"""Allocation guard: real DSpark decode steps of the embedded pair, counted
exactly with OpCounter.

- EP size 1: the draft and verify paths create no int32 0-dim tensor (the
  seed's regression made one per step); the guard fails on the regressed
  helper, so it can fail.
- The per-step glue (proposer, acceptance, worker; plain decode too)
  allocates nothing outside the model's own compute (the worker's model
  spans), for greedy, sampled and mixed batches.

Counts come through the workers' phase spans: nothing is patched.
"""

import itertools
import unittest

import torch

from sglang import Engine
from sglang.bench_dspark_step import regressed_make_num_token_non_padded, with_proposer
from sglang.srt.layers.sampler import SamplingMode
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.op_counter import OpCounter
from sglang.srt.utils.phases import PhaseRecorder
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=8, suite="base-a-test-cpu")

PROMPTS = [[7, 3, 9, 1], [4, 4, 8], [12, 50, 2, 77, 5]]
STEPS = 3  # counted decode steps, after the admission step


def _engine(speculative_algorithm="DSPARK", variant="fixed", budget="off") -> Engine:
    # A fixed budget: "auto" plans from measured step times, so its steps
    # (and with them the counts) could differ between runs.
    spec = dict(speculative_verify_budget=budget) if speculative_algorithm else {}
    engine = Engine(
        speculative_algorithm=speculative_algorithm,
        device="cpu",
        random_seed=0,
        max_running_requests=4,
        cuda_graph_bs=[1, 2, 4],  # 3 requests pad to 4: padded rows exist
        **spec,
    )
    return with_proposer(engine, variant) if speculative_algorithm else engine


def _model_allocs(engine, recorder) -> int:
    """Allocations inside the model's own compute: the worker's model spans."""
    names = engine.worker.MODEL_SPANS
    return sum(recorder.totals.get(n, {}).get("allocs", 0) for n in names)


def count_decode_steps(engine, prompts=PROMPTS, steps=STEPS, temperature=0.0):
    """Admit ``prompts`` (uncounted), then count ``steps`` decode steps one by
    one: [(whole-step counter, allocations in the model spans), ...]."""
    sched = engine.scheduler
    # Nobody finishes: each step (the admission's too) commits <= gamma + 1.
    temps = (
        temperature if isinstance(temperature, list) else [temperature] * len(prompts)
    )
    params = [
        SamplingParams(max_new_tokens=2 + (steps + 1) * 8, temperature=t) for t in temps
    ]
    for i, (ids, p) in enumerate(zip(prompts, params)):
        sched.add_request(Req(rid=i, origin_input_ids=ids, sampling_params=p))
    sched.step()
    counted, spans = [], engine.worker.spans
    for _ in range(steps):
        with OpCounter() as step:
            spans.hook = recorder = PhaseRecorder(counter=step)
            try:
                sched.step()
            finally:
                spans.hook = None
        if len(sched.running) != len(prompts):
            raise AssertionError("a request finished inside the counted steps")
        counted.append((step, _model_allocs(engine, recorder)))
    while sched.has_work():
        sched.step()
    return counted


class TestNoPerStepScalar(CustomTestCase):
    def assert_no_int32_scalar(self, counted) -> None:
        """The guard: no step creates a 0-dim int32 tensor."""
        for i, (step, _) in enumerate(counted):
            self.assertEqual(
                step.int32_scalars,
                0,
                f"decode step {i} created {step.int32_scalars} int32 0-dim "
                f"tensor(s) at EP size 1 (num_token_non_padded is unread there): "
                f"{step.int32_scalar_sites}",
            )

    def test_ep1_steps_create_no_int32_scalar(self):
        counted = count_decode_steps(_engine())
        self.assert_no_int32_scalar(counted)
        # (No host-to-device copy to count on the CPU: the CUDA cases of
        # test_bench_dspark_step and test_op_counter guard those.)
        for step, _ in counted:
            self.assertGreater(step.ops, 100)  # the counter saw the real step

    def test_guard_fails_on_the_regressed_helper(self):
        counted = count_decode_steps(_engine(variant="after"))
        # Exactly the proposer's scalar, once per step.
        self.assertEqual([s.int32_scalars for s, _ in counted], [1] * STEPS)
        self.assertEqual(
            [s.int32_scalar_sites for s, _ in counted], [["aten::lift_fresh"]] * STEPS
        )
        with self.assertRaisesRegex(AssertionError, "int32 0-dim"):
            self.assert_no_int32_scalar(counted)

    def test_regressed_helper_costs_exactly_its_own_ops(self):
        # before == fixed op for op; after == fixed + torch.tensor(n) (CPU).
        by_variant = {}
        for name in ("before", "after", "fixed"):
            counted = count_decode_steps(_engine(variant=name))
            by_variant[name] = [dict(step.by_op) for step, _ in counted]
        self.assertEqual(by_variant["before"], by_variant["fixed"])
        for after, fixed in zip(by_variant["after"], by_variant["fixed"]):
            fixed = dict(fixed)
            fixed["aten::lift_fresh"] = fixed.get("aten::lift_fresh", 0) + 1
            self.assertEqual(after, fixed)

    def test_regressed_helper_matches_upstreams_line(self):
        value = regressed_make_num_token_non_padded(15, "cpu")
        self.assertIsNone(value)  # EP 1: built, then unread
        with get_parallel().override(moe_ep_size=2, moe_ep_rank=0):
            value = regressed_make_num_token_non_padded(15, "cpu")
        self.assertEqual((value.dtype, value.dim(), int(value)), (torch.int32, 0, 15))

    def test_ep2_predicate_fills_buffers_no_new_scalar(self):
        # The enabled path (predicate on) fills the buffers allocated once.
        ep1 = count_decode_steps(_engine())
        engine = _engine()  # built at EP 1: the experts stay local
        with get_parallel().override(moe_ep_size=2, moe_ep_rank=0):
            ep2 = count_decode_steps(engine)
        for (step, _), (step1, _) in zip(ep2, ep1):
            self.assertEqual(step.int32_scalars, 0)
            # Two in-place fills more than EP 1: the draft's and the verify's.
            fills = "aten::fill_.Scalar"
            self.assertEqual(step.by_op[fills] - step1.by_op[fills], 2)


class TestGlueAllocations(CustomTestCase):
    """Outside the model's own compute a decode step allocates nothing."""

    def _glue(self, counted):
        return [step.allocs - model for step, model in counted]

    def test_dspark_step_glue_allocates_nothing(self):
        # Every draft verified, a ragged verify (4 drafts), a plain step.
        for budget, prompts in itertools.product(
            ("off", 4, 0), (PROMPTS[:1], PROMPTS)  # bs 1, and bs 3 padded to 4
        ):
            for temperature in (0.0, 1.0, [0.0, 1.0, 0.7][: len(prompts)]):
                with self.subTest(
                    budget=budget, bs=len(prompts), temperature=temperature
                ):
                    counted = count_decode_steps(
                        _engine(budget=budget), prompts=prompts, temperature=temperature
                    )
                    self.assertEqual(self._glue(counted), [0] * STEPS)
                    for step, model in counted:
                        self.assertGreater(model, 0)  # the forwards were seen

    def test_sampling_adds_glue_ops_not_model_ops(self):
        engine = _engine()
        greedy = count_decode_steps(engine)
        sampled = count_decode_steps(engine, temperature=1.0)
        for (g_step, g_model), (s_step, s_model) in zip(greedy, sampled):
            self.assertEqual(s_model, g_model)
            self.assertGreater(s_step.ops, g_step.ops)

    def test_plain_step_glue_allocates_nothing(self):
        for temperature in (0.0, 1.0):
            counted = count_decode_steps(
                _engine(speculative_algorithm=None), temperature=temperature
            )
            self.assertEqual(self._glue(counted), [0] * STEPS)

    def test_counted_greedy_output_equals_plain(self):
        # The buffered glue keeps DSpark greedy == plain greedy, token for token.
        outs = [
            _engine(algo).generate(
                input_ids=PROMPTS, sampling_params={"max_new_tokens": 12}
            )
            for algo in ("DSPARK", None)
        ]
        self.assertEqual(
            [o["output_ids"] for o in outs[0]], [o["output_ids"] for o in outs[1]]
        )

    def test_markov_head_matches_the_models(self):
        # The proposer's buffered Markov head computes exactly
        # DSparkDraftModel.markov_correction: same corrections, and each
        # draft the argmax of base + correction, for the block it proposed.
        engine = _engine()
        worker = engine.worker
        count_decode_steps(engine, steps=1)  # the buffers hold a real step
        bs = len(PROMPTS)
        views, gamma = worker.buffers.at(bs), worker.gamma
        worker.proposer.propose(views=views, mode=SamplingMode.GREEDY)
        anchors = views.block_anchors.clone()
        base = worker.draft_runner.forward(views.draft_batch).logits.view(bs, gamma, -1)
        tokens = views.drafts.clone()
        prev = torch.cat([anchors.unsqueeze(1), tokens[:, :-1]], 1)
        draft = worker.draft_model
        for k in range(gamma):
            correction = draft.markov_correction(prev[:, k])
            self.assertTrue(torch.equal(views.corrections[k], correction))
            expected = base[:, k] + correction
            self.assertEqual(tokens[:, k].tolist(), expected.argmax(-1).tolist())


if __name__ == "__main__":
    unittest.main()

"""Expert parallelism over real torch.distributed groups (gloo, 2 ranks).

Each rank holds half the experts; the draft and verify batches carry the
int32 scalar, padded rows are masked (expert id -1) so they reach no expert
on any rank, and the greedy output equals the single-process run. The scalar lives in buffers
allocated once: every decode step, counted with OpCounter, creates no int32
0-dim tensor, on either rank (gloo runs on the CPU, where there is no
host-to-device copy to count).
"""

import json
import os
import unittest
from unittest import mock

import torch
import torch.distributed as dist

from sglang import Engine
from sglang.srt.distributed.parallel_state import (
    init_distributed_environment,
    init_parallel_from_distributed,
)
from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.utils.op_counter import OpCounter
from sglang.srt.utils.phases import PhaseRecorder
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, expert_groups, spawn_ranks

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

PREDICATE = (
    "sglang.srt.speculative.dspark_components.dspark_draft.enable_num_token_non_padded"
)
# Target batches get the scalar from forward_batch_info's construction path.
TARGET_PREDICATE = (
    "sglang.srt.model_executor.forward_batch_info.enable_num_token_non_padded"
)
PROMPTS = [[7, 3, 9, 1], [4, 4, 8], [12, 50, 2, 77, 5]]
PARAMS = {"max_new_tokens": 10}
ENGINE_ARGS = dict(
    speculative_algorithm="DSPARK",
    device="cpu",
    random_seed=0,
    max_running_requests=4,
    cuda_graph_bs=[1, 2, 4],  # 3 requests pad to 4: padded rows exist
    speculative_verify_budget="off",  # whole blocks: the scalar's counts below
)


def _count_expert_pairs(engine) -> list:
    """Patch every MoE to count the (row, expert) pairs that reach an expert:
    each local expert's rows in grouped calls,
    nonzero routing weights of dense forwards (a padded row's weights are
    all 0: it adds exactly 0 to the output)."""
    pairs = [0]
    for model in (engine.worker.target_worker.model, engine.worker.draft_model):
        for module in model.modules():
            if isinstance(module, EPMoE):
                grouped, routing = module._experts_grouped, module._routing_weights

                def counted_grouped(xs, offs, grouped=grouped, module=module):
                    pairs[0] += sum(x.shape[0] for _, x in expert_groups(xs, offs))
                    return grouped(xs, offs)

                def counted_routing(topk, *, masked, routing=routing):
                    weights = routing(topk, masked=masked)
                    pairs[0] += int((weights != 0).sum())
                    return weights

                module._experts_grouped = counted_grouped
                module._routing_weights = counted_routing
    return pairs


def _run(engine) -> dict:
    scalars = {"draft": [], "verify": []}
    for name, runner in (
        ("draft", engine.worker.proposer.draft_model_runner),
        ("verify", engine.worker.target_worker.model_runner),
    ):
        original = runner.forward

        def spy(fb, name=name, original=original):
            if not fb.forward_mode.is_extend_without_speculative():  # no prefill
                value = fb.num_token_non_padded
                scalars[name].append(
                    None if value is None else [str(value.dtype), int(value)]
                )
            return original(fb)

        runner.forward = spy
    pairs = _count_expert_pairs(engine)
    step_counts = _count_decode_steps(engine)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    return {
        "output_ids": [o["output_ids"] for o in outs],
        "scalars": scalars,
        "expert_pairs": pairs[0],
        "step_counts": step_counts,
    }


def _count_decode_steps(engine) -> list:
    """Count every decode step: [int32 0-dim tensors, allocations outside the
    model forwards, aten ops] (prefill is not a decode step)."""
    counts = []
    worker = engine.worker
    decode_step = worker.decode_step

    def counted(*, batch):
        with OpCounter() as step:
            worker.spans.hook = recorder = PhaseRecorder(counter=step)
            try:
                out = decode_step(batch=batch)
            finally:
                worker.spans.hook = None
        totals = recorder.totals
        model = sum(totals[name]["allocs"] for name in worker.MODEL_SPANS)
        glue_allocs = step.allocs - model
        counts.append([step.int32_scalars, glue_allocs, step.ops])
        return out

    worker.decode_step = counted
    return counts


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(
        rank=rank, world_size=world, port=port, timeout_s=60
    )  # a dead rank ends the run, never hangs it
    try:
        state = init_parallel_from_distributed(timeout_s=60)
        engine = Engine(**ENGINE_ARGS)
        result = _run(engine)
        moe = engine.worker.draft_model.layers[0].mlp
        # auto measures its cost table at start-up over dummy requests: their
        # rows count as real (the scalars filled), so the experts run.
        buffers = Engine(
            **dict(ENGINE_ARGS, speculative_verify_budget="auto")
        ).worker.buffers
        result.update(
            moe_ep_size=state.moe_ep_size,
            local_experts=moe.num_local,
            first_local=moe.first_local,
            measured_scalars=[int(buffers.verify_scalar), int(buffers.draft_scalar)],
        )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


class TestDSparkExpertParallel(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ranks = spawn_ranks(_rank_main, world_size=2)
        cls.single = _run(Engine(**ENGINE_ARGS))
        # One process, but with the scalar forced on, as EP would have it.
        with (
            mock.patch(PREDICATE, return_value=True),
            mock.patch(TARGET_PREDICATE, return_value=True),
        ):
            cls.single_masked = _run(Engine(**ENGINE_ARGS))

    def test_experts_split_over_ranks(self):
        self.assertEqual([r["moe_ep_size"] for r in self.ranks], [2, 2])
        self.assertEqual([r["local_experts"] for r in self.ranks], [2, 2])
        self.assertEqual([r["first_local"] for r in self.ranks], [0, 2])

    def test_single_process_builds_no_scalar(self):
        for name in ("draft", "verify"):
            self.assertTrue(self.single["scalars"][name])
            self.assertEqual(set(map(str, self.single["scalars"][name])), {"None"})

    def test_ep_batches_carry_the_int32_scalar(self):
        gamma = 5
        for rank in self.ranks:
            draft, verify = rank["scalars"]["draft"], rank["scalars"]["verify"]
            self.assertEqual(len(draft), len(self.single["scalars"]["draft"]))
            for dtype, value in draft:
                self.assertEqual(dtype, "torch.int32")
                self.assertIn(value, [bs * gamma for bs in (1, 2, 3)])
            for dtype, value in verify:
                self.assertEqual(dtype, "torch.int32")
                self.assertIn(value, [bs * (gamma + 1) for bs in (1, 2, 3)])
            self.assertEqual(draft[0][1], 3 * gamma)  # all three running, padded to 4

    def test_the_start_up_measurement_counts_its_rows_real(self):
        # auto's cost table times steps over dummy requests: under EP their
        # scalars say how many rows are real, or every row would be masked
        # and the table would time no expert (both were 0 before).
        for rank in self.ranks:
            verify, draft = rank["measured_scalars"]
            self.assertGreater(draft, 0)
            self.assertEqual(draft % 5, 0)  # gamma rows per request
            self.assertGreater(verify, 0)

    def test_padded_rows_reach_no_expert(self):
        # Every real (row, expert) pair reaches an expert on exactly one rank,
        # padded rows on none (weight 0 on the dense path, uncomputed on the
        # grouped one): the ranks together match a masked single-process
        # run, and reach fewer pairs than the unmasked one.
        total = sum(r["expert_pairs"] for r in self.ranks)
        self.assertEqual(total, self.single_masked["expert_pairs"])
        self.assertLess(total, self.single["expert_pairs"])
        self.assertEqual(self.single_masked["output_ids"], self.single["output_ids"])

    def test_steps_create_no_scalar_on_either_rank(self):
        # Enabled path: the draft's and the verify's buffers are filled in
        # place, so no step creates a scalar or allocates glue.
        for rank in self.ranks + [self.single, self.single_masked]:
            steps = rank["step_counts"]
            self.assertEqual(len(steps), len(self.single["step_counts"]))
            self.assertGreater(len(steps), 3)
            self.assertEqual([s[:2] for s in steps], [[0, 0]] * len(steps))
            self.assertGreater(min(s[2] for s in steps), 100)  # the step was seen

    def test_greedy_output_equals_single_process(self):
        for rank in self.ranks:
            self.assertEqual(rank["output_ids"], self.single["output_ids"])


class TestStepBatchesCarryTheScalarFromTheStart(CustomTestCase):
    """A CUDA graph is captured from the step buffers' batches before any
    step runs: under EP > 1 they carry the scalar buffers from the start, so
    a replay masks by what each step fills; at EP 1, None."""

    def test_built_with_the_buffers(self):
        plain_args = dict(ENGINE_ARGS, speculative_algorithm=None)
        del plain_args["speculative_verify_budget"]
        for enabled in (False, True):
            with (
                self.subTest(enabled=enabled),
                mock.patch(TARGET_PREDICATE, return_value=enabled),
            ):
                dspark = Engine(**dict(ENGINE_ARGS, speculative_verify_budget=4))
                plain = Engine(**plain_args)
                b = dspark.worker.buffers
                v = b.at(4)
                want = {
                    "verify": b.verify_scalar,
                    "plain step": b.verify_scalar,
                    "ragged verify": b.verify_scalar,
                    "draft": b.draft_scalar,
                    "plain decoding": plain.worker.buffers.num_token_non_padded,
                }
                got = {
                    "verify": v.verify_batch,
                    "plain step": v.plain_batch,
                    "ragged verify": b.ragged(4, 4).batch,
                    "draft": v.draft_batch,
                    "plain decoding": plain.worker.buffers.at(4).forward_batch,
                }
                for name, batch in got.items():
                    scalar = batch.num_token_non_padded
                    self.assertIs(scalar, want[name] if enabled else None, name)


if __name__ == "__main__":
    unittest.main()

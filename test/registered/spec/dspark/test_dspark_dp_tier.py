"""The num_token_non_padded helper: None on EP size 1, the int32 scalar on
EP > 1; the verify tier a rank runs under a verify budget; and data-parallel
attention's tiers, draft sync metadata and step shape (busy and idle ranks
alike)."""

import random
import unittest
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from sglang import Engine
from sglang.srt.managers.schedule_batch import Req, SamplingParams, ScheduleBatch
from sglang.srt.managers.tp_worker import dp_rows
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.dspark_components import dspark_draft as draft
from sglang.srt.speculative.dspark_components.dspark_draft import (
    DraftBlockProposer,
    _make_num_token_non_padded,
)
from sglang.srt.speculative.dspark_components.dspark_planner import (
    dp_global_verify_tier_num_tokens,
    dp_verify_drafts_per_req,
    local_verify_tier_num_tokens,
)
from sglang.srt.utils.op_counter import OpCounter
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")
register_cuda_ci(est_time=10, stage="base-b", runner_config="1-gpu-large")

PREDICATE = (
    "sglang.srt.speculative.dspark_components.dspark_draft.enable_num_token_non_padded"
)


def _ep(size: int):
    """Scoped EP size, the way upstream's tests override it."""
    return get_parallel().override(moe_ep_size=size, moe_ep_rank=size - 1)


def _three_decoding() -> ScheduleBatch:
    """A batch of 3 requests past their prefill (rows 1 to 3)."""
    params = SamplingParams(max_new_tokens=4)
    reqs = [
        Req(rid=i, origin_input_ids=[1, 2], sampling_params=params) for i in range(3)
    ]
    for i, req in enumerate(reqs):
        req.output_ids, req.req_pool_idx = [5], i + 1
    return ScheduleBatch.from_reqs(reqs, "cpu")


class TestPredicate(CustomTestCase):
    def test_ep_sizes(self):
        for size, expected in ((1, False), (2, True), (8, True)):
            with self.subTest(moe_ep_size=size):
                with _ep(size):
                    self.assertIs(
                        forward_batch_info.enable_num_token_non_padded(), expected
                    )
                self.assertFalse(forward_batch_info.enable_num_token_non_padded())

    def test_draft_imports_the_predicate_by_name(self):
        self.assertIs(
            draft.enable_num_token_non_padded,
            forward_batch_info.enable_num_token_non_padded,
        )

    def test_default_state_is_single_process(self):
        state = get_parallel()
        self.assertEqual((state.tp_size, state.moe_ep_size), (1, 1))
        self.assertFalse(forward_batch_info.enable_num_token_non_padded())

    def test_bad_parallel_state(self):
        for kwargs, needle in (
            ({"moe_ep_size": 0}, "moe_ep_size"),
            ({"moe_ep_size": 2, "moe_ep_rank": 2}, "moe_ep_rank"),
            ({"tp_size": 1, "tp_rank": -1}, "tp_rank"),
            ({"tp_size": 1.5}, "tp_size"),
        ):
            with self.subTest(**kwargs):
                with self.assertRaisesRegex(ValueError, needle):
                    with get_parallel().override(**kwargs):
                        pass
                self.assertEqual(get_parallel().moe_ep_size, 1)
        with self.assertRaisesRegex(ValueError, "unknown parallel field"):
            with get_parallel().override(ep_size=2):
                pass


class TestDisabledPath(CustomTestCase):
    def test_ep1_returns_none(self):
        for n in (0, 1, 5, 40):
            self.assertIsNone(_make_num_token_non_padded(n, "cpu"))

    def test_ep1_makes_no_tensor(self):
        with mock.patch.object(draft.torch, "tensor") as make:
            self.assertIsNone(_make_num_token_non_padded(8, "cpu"))
        make.assert_not_called()

    def test_ep1_dispatches_no_op(self):
        # Whatever would make a tensor (torch.tensor, torch.full, a copy, a
        # fill) dispatches an op, seen by the counter: the disabled path
        # dispatches none, with or without a buffer to fill.
        out = torch.zeros((), dtype=torch.int32)
        for kwargs in ({}, {"out": out}):
            with self.subTest(**{k: "buffer" for k in kwargs}), OpCounter() as c:
                self.assertIsNone(_make_num_token_non_padded(8, "cpu", **kwargs))
            self.assertEqual((c.ops, c.allocs, c.int32_scalars), (0, 0, 0), c.by_op)

    def test_patched_predicate_false(self):
        with _ep(2), mock.patch(PREDICATE, return_value=False):
            self.assertIsNone(_make_num_token_non_padded(8, "cpu"))

    def test_ep1_leaves_the_buffer_alone(self):
        out = torch.full((), -7, dtype=torch.int32)
        self.assertIsNone(_make_num_token_non_padded(8, "cpu", out=out))
        self.assertEqual(int(out), -7)


class TestEnabledPath(CustomTestCase):
    def _check(self, value, n, device):
        self.assertIsInstance(value, torch.Tensor)
        self.assertEqual(value.dtype, torch.int32)
        self.assertEqual(value.shape, torch.Size([]))
        self.assertEqual(value.device.type, torch.device(device).type)
        self.assertEqual(int(value.item()), n)

    def test_ep_gt1_builds_int32_scalar(self):
        for size in (2, 8):
            with _ep(size):
                for n in (0, 1, 7, 40, 2**20):
                    with self.subTest(moe_ep_size=size, n=n):
                        self._check(_make_num_token_non_padded(n, "cpu"), n, "cpu")

    def test_ep_gt1_fills_the_given_buffer_in_place(self):
        out = torch.zeros((), dtype=torch.int32)
        with _ep(2):
            for n in (3, 40):
                value = _make_num_token_non_padded(n, "cpu", out=out)
                self.assertIs(value, out)
                self._check(value, n, "cpu")
            for bad in (torch.zeros((), dtype=torch.int64), torch.zeros(1).int()):
                with self.assertRaisesRegex(ValueError, "0-dim int32"):
                    _make_num_token_non_padded(3, "cpu", out=bad)

    def test_patched_predicate_true(self):
        with mock.patch(PREDICATE, return_value=True):
            self._check(_make_num_token_non_padded(30, "cpu"), 30, "cpu")

    def test_numpy_integer_accepted(self):
        with _ep(2):
            self._check(_make_num_token_non_padded(np.int64(12), "cpu"), 12, "cpu")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_ep_gt1_scalar_lands_on_cuda(self):
        with _ep(2):
            value = _make_num_token_non_padded(24, torch.device("cuda"))
            torch.cuda.synchronize()
        self._check(value, 24, "cuda")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_ep1_on_cuda_is_none(self):
        self.assertIsNone(_make_num_token_non_padded(24, torch.device("cuda")))


class TestTargetBatchConstruction(CustomTestCase):
    """Target batches get the scalar from ForwardBatch.init_new, same predicate."""

    def _batch(self, buffer=None, bs=3, q=6):
        rows = torch.zeros(bs * q, dtype=torch.int64)
        return forward_batch_info.ForwardBatch.init_new(
            forward_mode=forward_batch_info.ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            tokens_per_req=q,
            input_ids=rows,
            positions=rows,
            out_cache_loc=rows,
            req_pool_indices=torch.zeros(bs, dtype=torch.int64),
            kv_lens=rows,
            num_token_non_padded_buffer=buffer,
        )

    def test_ep1_none(self):
        buffer = torch.full((), -1, dtype=torch.int32)
        fb = self._batch(buffer)
        self.assertIsNone(fb.num_token_non_padded)
        self.assertEqual(fb.num_token_non_padded_cpu, 18)
        self.assertEqual(int(buffer), -1)

    def test_ep_gt1_fills_the_buffer_or_makes_one(self):
        buffer = torch.zeros((), dtype=torch.int32)
        with _ep(2):
            fb = self._batch(buffer)
            self.assertIs(fb.num_token_non_padded, buffer)
            self.assertEqual(int(buffer), 18)
            fresh = self._batch(None, bs=2, q=1).num_token_non_padded
        self.assertEqual((fresh.dtype, fresh.shape, int(fresh)), (torch.int32, (), 2))


class TestParallelOverride(CustomTestCase):
    def test_scoped_nested_and_restored(self):
        parallel = get_parallel()
        with parallel.override(moe_ep_size=4, moe_ep_rank=3):
            with parallel.override(moe_ep_rank=1):
                self.assertEqual((parallel.moe_ep_size, parallel.moe_ep_rank), (4, 1))
            self.assertEqual(parallel.moe_ep_rank, 3)
        self.assertEqual((parallel.moe_ep_size, parallel.moe_ep_rank), (1, 0))

    def test_permanent_until_cleared_and_scoped_wins(self):
        parallel = get_parallel()
        parallel.override_permanently(moe_ep_size=2, moe_ep_rank=1)
        self.assertTrue(forward_batch_info.enable_num_token_non_padded())
        with parallel.override(moe_ep_size=1, moe_ep_rank=0):
            self.assertFalse(forward_batch_info.enable_num_token_non_padded())
        with self.assertRaisesRegex(ValueError, "moe_ep_rank"):
            parallel.override_permanently(moe_ep_size=1)
        self.assertEqual(parallel.moe_ep_size, 2)  # a refused change changes nothing
        parallel.clear_stamp()
        self.assertFalse(forward_batch_info.enable_num_token_non_padded())


class TestBadInput(CustomTestCase):
    def test_rejected_in_both_paths(self):
        for enabled in (False, True):
            with mock.patch(PREDICATE, return_value=enabled):
                for bad, needle in (
                    (-1, "-1"),
                    (2.0, "float"),
                    ("3", "str"),
                    (None, "NoneType"),
                    (True, "bool"),
                ):
                    with self.subTest(enabled=enabled, bad=bad):
                        with self.assertRaisesRegex(ValueError, needle):
                            _make_num_token_non_padded(bad, "cpu")


class TestLocalVerifyTierNumTokens(CustomTestCase):
    """Rows a rank verifies: each request's floor of max(min_verify_len, 1)
    rows plus the draft budget, at most every request's whole window."""

    def _tier(self, budget, min_verify_len=1, bs=8, width=6):
        return local_verify_tier_num_tokens(
            bs=bs,
            verify_token_budget=budget,
            verify_num_draft_tokens=width,
            min_verify_len=min_verify_len,
        )

    def test_no_budget_is_the_sentinel(self):
        self.assertEqual(self._tier(None), -1)

    def test_budget_on_top_of_the_anchor_rows(self):
        self.assertEqual(self._tier(10), 8 + 10)
        self.assertEqual(self._tier(0), 8)  # a plain step: the anchors alone

    def test_at_most_the_whole_window(self):
        self.assertEqual(self._tier(1000), 8 * 6)
        self.assertEqual(self._tier(40), 48)

    def test_min_verify_len_raises_the_floor(self):
        self.assertEqual(self._tier(10, min_verify_len=3), 8 * 3 + 10)
        self.assertEqual(self._tier(10, min_verify_len=0), 8 + 10)  # as 1


class TestDpGlobalVerifyTierNumTokens(CustomTestCase):
    """The tier every DP rank runs, from each rank's contribution."""

    def test_any_sentinel_pins_everyone(self):
        # One rank without a budget: all ranks on the plain (whole) tier.
        self.assertIsNone(
            dp_global_verify_tier_num_tokens(global_tier_num_tokens=[100, -1, 50, 0])
        )

    def test_every_rank_idle_is_none(self):
        self.assertIsNone(
            dp_global_verify_tier_num_tokens(global_tier_num_tokens=[0] * 3)
        )
        self.assertIsNone(dp_global_verify_tier_num_tokens(global_tier_num_tokens=None))

    def test_the_busiest_tier_covers_every_rank(self):
        tiers = [18, 0, 30, 12]
        self.assertEqual(
            dp_global_verify_tier_num_tokens(global_tier_num_tokens=tiers), 30
        )

    def test_between_every_floor_and_the_whole_window(self):
        width = 6
        for bs_list in ([8, 3], [1, 0, 5], [4]):
            tiers = [
                local_verify_tier_num_tokens(
                    bs=bs,
                    verify_token_budget=2 * bs,
                    verify_num_draft_tokens=width,
                    min_verify_len=1,
                )
                for bs in bs_list
            ]
            tier = dp_global_verify_tier_num_tokens(global_tier_num_tokens=tiers)
            self.assertGreaterEqual(tier, max(bs_list))  # every anchor row
            self.assertLessEqual(tier, max(bs_list) * width)


class TestDraftDpSyncMetadata(CustomTestCase):
    """The proposer's DP MoE sync of the draft forward: every rank's request
    count scaled to draft rows, the original counts kept, this rank's own
    real rows as the int32 scalar; built with ``__new__`` as upstream's test
    builds it."""

    def _proposer(self, dp_moe_sync=True):
        proposer = DraftBlockProposer.__new__(DraftBlockProposer)
        proposer._dp_moe_sync = dp_moe_sync
        proposer._draft_block_spec_info = SimpleNamespace(
            num_tokens_per_req=6, num_tokens_for_logprob_per_req=1
        )
        proposer.draft_model_runner = SimpleNamespace(device="cpu")
        return proposer

    def _run(self, *, can_run=True, dp_moe_sync=True, enabled=True, **kwargs):
        forward_batch = SimpleNamespace(input_ids=torch.arange(6))
        batch = SimpleNamespace(
            global_num_tokens=[1, 3, 0, 2],
            global_num_tokens_for_logprob=[1, 1, 0, 1],
            can_run_dp_cuda_graph=can_run,
        )
        with mock.patch(PREDICATE, return_value=enabled):
            self._proposer(dp_moe_sync)._fill_dp_moe_sync_metadata(
                forward_batch, batch, **kwargs
            )
        return forward_batch

    def test_request_counts_scale_to_draft_rows(self):
        fb = self._run()
        self.assertEqual(fb.original_global_num_tokens_cpu, [1, 3, 0, 2])
        self.assertEqual(fb.global_num_tokens_cpu, [6, 18, 0, 12])
        self.assertEqual(fb.global_num_tokens_for_logprob_cpu, [1, 1, 0, 1])
        self.assertEqual(fb.num_token_non_padded.dtype, torch.int32)
        self.assertEqual(fb.num_token_non_padded.dim(), 0)
        self.assertEqual(fb.num_token_non_padded.item(), 6)  # rank 0: 1 x 6
        self.assertEqual(fb.num_token_non_padded_cpu, 6)
        self.assertTrue(fb.can_run_dp_cuda_graph)

    def test_own_rank_rows(self):
        with get_parallel().override(attn_dp_size=4, attn_dp_rank=1):
            fb = self._run()
        self.assertEqual(fb.num_token_non_padded.item(), 18)
        self.assertEqual(fb.num_token_non_padded_cpu, 18)

    def test_graph_skips_the_device_copies(self):
        fb = self._run(can_run=True)
        self.assertIsNone(fb.global_num_tokens_gpu)
        self.assertIsNone(fb.global_num_tokens_for_logprob_gpu)

    def test_eager_uploads_the_device_copies(self):
        fb = self._run(can_run=False)
        self.assertFalse(fb.can_run_dp_cuda_graph)
        self.assertEqual(fb.global_num_tokens_gpu.tolist(), [6, 18, 0, 12])
        self.assertEqual(fb.global_num_tokens_for_logprob_gpu.tolist(), [1, 1, 0, 1])

    def test_fills_the_step_buffer_in_place(self):
        buffer = torch.full((), -1, dtype=torch.int32)
        fb = self._run(scalar=buffer)
        self.assertIs(fb.num_token_non_padded, buffer)
        self.assertEqual(buffer.item(), 6)

    def test_ep1_counts_without_a_scalar(self):
        fb = self._run(enabled=False)
        self.assertIsNone(fb.num_token_non_padded)
        self.assertEqual(fb.global_num_tokens_cpu, [6, 18, 0, 12])

    def test_dense_draft_keeps_its_local_count(self):
        local = torch.tensor(5, dtype=torch.int32)
        forward_batch = SimpleNamespace(
            input_ids=torch.arange(6),
            num_token_non_padded=local,
            num_token_non_padded_cpu=5,
        )
        batch = SimpleNamespace(
            global_num_tokens=[1, 3, 0, 2],
            global_num_tokens_for_logprob=[1, 1, 0, 1],
            can_run_dp_cuda_graph=False,
        )
        with mock.patch(PREDICATE, return_value=True):
            self._proposer(False)._fill_dp_moe_sync_metadata(forward_batch, batch)
            # Without DP counts (no DP attention) the MoE draft keeps it too.
            batch.global_num_tokens = None
            self._proposer(True)._fill_dp_moe_sync_metadata(forward_batch, batch)
        self.assertIs(forward_batch.num_token_non_padded, local)
        self.assertEqual(forward_batch.num_token_non_padded_cpu, 5)
        self.assertFalse(hasattr(forward_batch, "global_num_tokens_cpu"))


def _dp_worker():
    """A DSpark worker planning its budget (``auto``) with padded buckets."""
    engine = Engine(
        speculative_algorithm="DSPARK",
        device="cpu",
        max_running_requests=8,
        cuda_graph_bs=[1, 2, 4, 8],
    )
    return engine.worker


class TestDpTierGatherAdmission(CustomTestCase):
    """What the gathered tiers admit: a step shape the worker has a graph
    (variant) for, that verifies at least every rank's plan and runs at
    least the global tier."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.worker = _dp_worker()

    def test_gathered_tiers_admit_a_captured_shape(self):
        worker, g = self.worker, self.worker.gamma
        rng = random.Random(7)
        for _ in range(300):
            num_ranks = rng.randint(1, 4)
            reqs = [rng.choice([0, rng.randint(1, 8)]) for _ in range(num_ranks)]
            plans = [rng.randint(0, g) for _ in reqs]  # drafts per request
            tiers = [
                local_verify_tier_num_tokens(
                    bs=n,
                    verify_token_budget=k * n,
                    verify_num_draft_tokens=g + 1,
                    min_verify_len=1,
                )
                for n, k in zip(reqs, plans)
            ]
            k = dp_verify_drafts_per_req(
                global_num_reqs=reqs, global_tier_num_tokens=tiers, gamma=g
            )
            if not any(reqs):
                self.assertIsNone(k)
                continue
            rows = worker.graph_runner.padded_size(max(reqs))
            self.assertIn(rows * k, worker._budgets(rows))
            self.assertTrue(all(k >= p for n, p in zip(reqs, plans) if n))
            tier = dp_global_verify_tier_num_tokens(global_tier_num_tokens=tiers)
            self.assertGreaterEqual(rows * (1 + k), tier)

    def test_a_rank_without_budget_verifies_every_draft(self):
        g = self.worker.gamma
        k = dp_verify_drafts_per_req(
            global_num_reqs=[3, 2], global_tier_num_tokens=[-1, 4], gamma=g
        )
        self.assertEqual(k, g)


class TestBusyIdleGraphKeyIdentity(CustomTestCase):
    """Busy and idle ranks pick the same step shape from the same gather, so
    no rank waits on a collective another skipped."""

    def test_busy_and_idle_floors_agree_on_random_topologies(self):
        # Upstream's sweep: the global tier lies between the busiest rank's
        # floor and its whole window, so an idle rank's bucket input (its
        # dummy rows) never exceeds it.
        rng = random.Random(20260703)
        for _ in range(2000):
            width = rng.randint(2, 8)
            min_verify_len = rng.randint(0, width - 1)
            floor = max(min_verify_len, 1)
            contributions, num_reqs = [], []
            for _ in range(rng.randint(1, 8)):
                if rng.random() < 0.3:
                    num_reqs.append(0)
                    contributions.append(0)
                    continue
                bs = rng.randint(1, 512)
                num_reqs.append(bs)
                contributions.append(
                    local_verify_tier_num_tokens(
                        bs=bs,
                        verify_token_budget=rng.randint(0, bs * width),
                        verify_num_draft_tokens=width,
                        min_verify_len=min_verify_len,
                    )
                )
            tier = dp_global_verify_tier_num_tokens(
                global_tier_num_tokens=contributions
            )
            busiest = max(num_reqs)
            if tier is None:
                self.assertEqual(busiest, 0)
                continue
            self.assertGreaterEqual(tier, busiest * floor)
            self.assertLessEqual(tier, busiest * width)
            self.assertEqual(max(busiest, tier), tier)  # the idle bucket input

    def test_worker_picks_one_key_on_busy_and_idle_ranks(self):
        # The worker's own code: rank 0's batch of 3 requests and rank 1's
        # empty one, stamped with the same gather, give the same rows and
        # budget whatever the other ranks run.
        worker = _dp_worker()
        g = worker.gamma
        busy = _three_decoding()
        rng = random.Random(3)
        for _ in range(200):
            counts = [3, 0] + [rng.randint(0, 8) for _ in range(rng.randint(0, 2))]
            tiers = [0 if n == 0 else n * (1 + rng.randint(0, g)) for n in counts]
            keys = set()
            for batch in (busy, ScheduleBatch.idle("cpu")):
                batch.global_num_tokens = counts
                batch.global_verify_tier_num_tokens = tiers
                rows = worker.graph_runner.padded_size(dp_rows(batch))
                keys.add((rows, worker._plan(batch, rows)))
            self.assertEqual(len(keys), 1, (counts, tiers, keys))


class TestDpVerifyRows(CustomTestCase):
    def test_every_ranks_real_verify_rows(self):
        # Ranks with 3, 1 and 0 requests, each planning 1 draft a request:
        # rows 4 (the busiest, padded), budget 4 drafts. A rank's real rows
        # are its anchors and the budget's drafts, its real requests' first:
        # 3 + 4, 1 + 4 (all on its one request), 0; this rank (rank 0) masks
        # by its own.
        worker = _dp_worker()
        batch = _three_decoding()
        batch.global_num_tokens = batch.global_num_tokens_for_logprob = [3, 1, 0]
        batch.global_verify_tier_num_tokens = [6, 2, 0]
        rows, budget = worker._prepare(batch, batch.sampling_mode)
        self.assertEqual((rows, budget), (4, 4))
        verify = worker._verify_batch(worker.buffers.at(rows), rows, budget)
        self.assertEqual(verify.global_num_tokens_cpu, [7, 5, 0])
        self.assertEqual(verify.global_num_tokens_for_logprob_cpu, [7, 5, 0])
        self.assertEqual(verify.original_global_num_tokens_cpu, [3, 1, 0])
        self.assertEqual(verify.num_token_non_padded_cpu, 7)


if __name__ == "__main__":
    unittest.main()

"""The num_token_non_padded helper: None on EP size 1, the int32 scalar on
EP > 1; and the verify tier a rank runs under a verify budget."""

import unittest
from unittest import mock

import numpy as np
import torch

from sglang.srt.model_executor import forward_batch_info
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.dspark_components import dspark_draft as draft
from sglang.srt.speculative.dspark_components.dspark_draft import (
    _make_num_token_non_padded,
)
from sglang.srt.speculative.dspark_components.dspark_planner import (
    local_verify_tier_num_tokens,
)
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


if __name__ == "__main__":
    unittest.main()

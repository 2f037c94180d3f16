"""The num_token_non_padded helper: None on EP size 1, the int32 scalar on EP > 1."""

import unittest
from unittest import mock

import numpy as np
import torch

from sglang.srt.distributed.parallel_state import (
    ParallelState,
    get_parallel,
    set_parallel,
)
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.speculative.dspark import draft
from sglang.srt.speculative.dspark.draft import _make_num_token_non_padded
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")
register_cuda_ci(est_time=10, stage="base-b", runner_config="1-gpu-large")

PREDICATE = "sglang.srt.speculative.dspark.draft.enable_num_token_non_padded"


def _ep(size: int) -> ParallelState:
    return ParallelState(moe_ep_size=size, moe_ep_rank=size - 1)


class TestPredicate(CustomTestCase):
    def test_ep_sizes(self):
        for size, expected in ((1, False), (2, True), (8, True)):
            with self.subTest(moe_ep_size=size):
                set_parallel(_ep(size))
                self.assertIs(
                    forward_batch_info.enable_num_token_non_padded(), expected
                )

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
                    ParallelState(**kwargs)


class TestDisabledPath(CustomTestCase):
    def test_ep1_returns_none(self):
        for n in (0, 1, 5, 40):
            self.assertIsNone(_make_num_token_non_padded(n, "cpu"))

    def test_ep1_makes_no_tensor(self):
        with mock.patch.object(draft.torch, "tensor") as make:
            self.assertIsNone(_make_num_token_non_padded(8, "cpu"))
        make.assert_not_called()

    def test_patched_predicate_false(self):
        set_parallel(_ep(2))
        with mock.patch(PREDICATE, return_value=False):
            self.assertIsNone(_make_num_token_non_padded(8, "cpu"))


class TestEnabledPath(CustomTestCase):
    def _check(self, value, n, device):
        self.assertIsInstance(value, torch.Tensor)
        self.assertEqual(value.dtype, torch.int32)
        self.assertEqual(value.shape, torch.Size([]))
        self.assertEqual(value.device.type, torch.device(device).type)
        self.assertEqual(int(value.item()), n)

    def test_ep_gt1_builds_int32_scalar(self):
        for size in (2, 8):
            set_parallel(_ep(size))
            for n in (0, 1, 7, 40, 2**20):
                with self.subTest(moe_ep_size=size, n=n):
                    self._check(_make_num_token_non_padded(n, "cpu"), n, "cpu")

    def test_patched_predicate_true(self):
        with mock.patch(PREDICATE, return_value=True):
            self._check(_make_num_token_non_padded(30, "cpu"), 30, "cpu")

    def test_numpy_integer_accepted(self):
        set_parallel(_ep(2))
        self._check(_make_num_token_non_padded(np.int64(12), "cpu"), 12, "cpu")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_ep_gt1_scalar_lands_on_cuda(self):
        set_parallel(_ep(2))
        value = _make_num_token_non_padded(24, torch.device("cuda"))
        torch.cuda.synchronize()
        self._check(value, 24, "cuda")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_ep1_on_cuda_is_none(self):
        self.assertIsNone(_make_num_token_non_padded(24, torch.device("cuda")))


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


if __name__ == "__main__":
    unittest.main()

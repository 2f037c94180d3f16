"""Rotary positions: the per-forward tables and the four-kernel rotation give
exactly the neox formula's values, in place."""

import math
import unittest

import torch

from sglang.srt.layers.rotary_embedding import RotaryEmbedding, apply_rotary_
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")
register_cuda_ci(est_time=5, stage="base-b", runner_config="1-gpu-large")

HEAD_DIM, MAX_POS, BASE = 16, 64, 10000.0


def _neox(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The textbook rotation: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    inv_freq = 1.0 / (BASE ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
    cos = freqs.cos()[positions].unsqueeze(1)
    sin = freqs.sin()[positions].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TestRotaryEmbedding(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.rope = RotaryEmbedding(HEAD_DIM, MAX_POS, BASE)
        gen = torch.Generator().manual_seed(3)
        self.positions = torch.randint(0, MAX_POS, (11,), generator=gen)
        self.x = torch.randn(11, 6, HEAD_DIM, generator=gen)

    def test_bitwise_equal_to_the_neox_formula(self):
        ref = _neox(self.positions, self.x)
        x = self.x.clone()
        self.assertTrue(torch.equal(self.rope(self.positions, x), ref))
        self.assertTrue(torch.equal(x, self.x))  # the module rotates a copy
        cos, sin = self.rope.cos_sin(self.positions)
        out = apply_rotary_(x, cos, sin)
        self.assertTrue(torch.equal(out, ref))
        self.assertEqual(out.data_ptr(), x.data_ptr())  # in place

    def test_tables_of_another_dtype_are_refused(self):
        # In place, a float32 product would be rounded to x's bf16.
        cos, sin = self.rope.cos_sin(self.positions)
        with self.assertRaisesRegex(ValueError, "torch.float32, x is torch.bfloat16"):
            apply_rotary_(self.x.to(torch.bfloat16), cos, sin)

    def test_rotates_a_strided_view(self):
        # The attention rotates q and k together, a column slice of qkv.
        qkv = torch.randn(
            11, 3 * 6, HEAD_DIM, generator=torch.Generator().manual_seed(4)
        )
        cos, sin = self.rope.cos_sin(self.positions)
        ref = _neox(self.positions, qkv[:, :12].clone())
        v = qkv[:, 12:].clone()
        out = apply_rotary_(qkv[:, :12], cos, sin)
        self.assertTrue(torch.equal(out, ref))
        self.assertTrue(torch.equal(qkv[:, :12], ref))  # written into the view
        self.assertTrue(torch.equal(qkv[:, 12:], v))  # and nothing else

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_cuda_equals_the_cpu_on_a_strided_view(self):
        # CUDA swaps the halves with a flip, the CPU with a roll: the same
        # values, and the same elementwise products and sums after.
        qkv = torch.randn(
            11, 3 * 6, HEAD_DIM, generator=torch.Generator().manual_seed(5)
        )
        cos, sin = self.rope.cos_sin(self.positions)
        on_cuda = apply_rotary_(qkv.cuda()[:, :12], cos.cuda(), sin.cuda())
        on_cpu = apply_rotary_(qkv[:, :12], cos, sin)
        self.assertTrue(torch.equal(on_cuda.cpu(), on_cpu))

    def test_tables(self):
        cos, sin = self.rope.cos_sin(self.positions)
        self.assertEqual(tuple(cos.shape), (11, 1, HEAD_DIM))
        self.assertEqual(tuple(sin.shape), (11, 1, HEAD_DIM))
        # Position 0 is the identity; norms are kept at every position.
        zero = torch.zeros(1, dtype=torch.int64)
        self.assertTrue(torch.equal(self.rope(zero, self.x[:1]), self.x[:1]))
        torch.testing.assert_close(
            self.rope(self.positions, self.x).norm(dim=-1), self.x.norm(dim=-1)
        )
        angle = float(self.positions[0]) * 1.0  # first frequency is 1
        self.assertAlmostEqual(float(cos[0, 0, 0]), math.cos(angle), places=5)
        self.assertAlmostEqual(float(sin[0, 0, 0]), -math.sin(angle), places=5)

    def test_keeps_the_input_dtype(self):
        x = self.x.to(torch.bfloat16)
        self.assertEqual(self.rope(self.positions, x).dtype, torch.bfloat16)

    def test_odd_head_dim(self):
        with self.assertRaisesRegex(ValueError, "head_dim must be even, got 7"):
            RotaryEmbedding(7, MAX_POS)


if __name__ == "__main__":
    unittest.main()

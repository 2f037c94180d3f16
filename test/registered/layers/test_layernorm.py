"""RMSNorm: on the CPU torch's composite's values and gradients, bitwise, in
three fresh tensors where the composite makes five; on CUDA torch's fused
kernel."""

import unittest

import torch
import torch.nn.functional as F

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.utils.op_counter import OpCounter
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=1, suite="base-a-test-cpu")
register_cuda_ci(est_time=2, stage="base-b", runner_config="1-gpu-large")

HIDDEN = 64


def _norm(device: str = "cpu") -> RMSNorm:
    norm = RMSNorm(HIDDEN).to(device)
    with torch.no_grad():
        norm.weight.copy_(
            torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
        )
    return norm


class TestRMSNorm(CustomTestCase):
    def test_cpu_values_bitwise_equal_to_torch(self):
        norm, gen = _norm(), torch.Generator().manual_seed(2)
        for rows in (1, 5, 6, 48, 333):
            for scale in (1e-3, 1.0, 1e3):
                x = torch.randn(rows, HIDDEN, generator=gen) * scale
                ref = F.rms_norm(x, (HIDDEN,), norm.weight, norm.eps)
                with torch.no_grad():
                    self.assertTrue(torch.equal(norm(x), ref), (rows, scale))

    def test_cpu_gradients_bitwise_equal_to_torch(self):
        norm, gen = _norm(), torch.Generator().manual_seed(3)
        x = torch.randn(7, HIDDEN, generator=gen, requires_grad=True)
        grad = torch.randn(7, HIDDEN, generator=gen)
        ref = F.rms_norm(x, (HIDDEN,), norm.weight, norm.eps)
        ref_x, ref_w = torch.autograd.grad(ref, (x, norm.weight), grad)
        got_x, got_w = torch.autograd.grad(norm(x), (x, norm.weight), grad)
        self.assertTrue(torch.equal(got_x, ref_x))
        self.assertTrue(torch.equal(got_w, ref_w))

    def test_cpu_other_dtypes_take_torchs_upcasting_composite(self):
        norm = _norm().to(torch.bfloat16)
        x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4))
        x = (x * 100).to(torch.bfloat16)
        with torch.no_grad():
            ref = F.rms_norm(x, (HIDDEN,), norm.weight, norm.eps)
            self.assertEqual(norm(x).dtype, torch.bfloat16)
            self.assertTrue(torch.equal(norm(x), ref))

    def test_cpu_makes_three_tensors_where_torch_makes_five(self):
        norm, x = _norm(), torch.randn(48, HIDDEN)
        with torch.no_grad():
            with OpCounter() as ours:
                norm(x)
            with OpCounter() as torch_composite:
                F.rms_norm(x, (HIDDEN,), norm.weight, norm.eps)
        self.assertEqual((ours.ops, ours.allocs), (6, 3))
        self.assertEqual((torch_composite.ops, torch_composite.allocs), (6, 5))

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_cuda_runs_torch_fused_kernel(self):
        norm = _norm("cuda")
        x = torch.randn(48, HIDDEN, device="cuda")
        with torch.no_grad():
            ref = F.rms_norm(x, (HIDDEN,), norm.weight, norm.eps)
            self.assertTrue(torch.equal(norm(x), ref))


if __name__ == "__main__":
    unittest.main()

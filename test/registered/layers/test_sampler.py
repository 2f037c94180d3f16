"""The Gumbel-max sampler: argmax(logits - T log E) draws from
softmax(logits / T) and is the argmax where T = 0; log E noise is finite;
SamplingBatchInfo decides the batch's mode once."""

import math
import unittest
import unittest.mock

import torch

from sglang.srt.layers.sampler import (
    SamplingBatchInfo,
    SamplingMode,
    draw_log_exp1_,
    gumbel_argmax,
    sample_tokens,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


class TestGumbelArgmax(CustomTestCase):
    def test_greedy_rows_are_the_argmax_whatever_the_noise(self):
        logits = _logits(6)
        temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.5, 0.3])
        log_e = draw_log_exp1_(
            torch.empty_like(logits), torch.Generator().manual_seed(4)
        )
        out = torch.full((6,), -1, dtype=torch.int64)
        gumbel_argmax(
            scores=logits,
            log_e=log_e,
            neg_temperatures=-temps.unsqueeze(1),
            out=out,
            scratch=torch.empty_like(logits),
        )
        want = (logits - temps.unsqueeze(1) * log_e).argmax(-1)
        self.assertEqual(out.tolist(), want.tolist())
        greedy = temps == 0
        self.assertEqual(out[greedy].tolist(), logits[greedy].argmax(-1).tolist())

    def test_sampling_follows_the_probs(self):
        # 40k draws of one row at T = 0.8: frequencies within 5 sigma of p.
        logits = _logits(1, seed=2)[:, :8]
        rows = 40_000
        tokens = sample_tokens(
            logits=logits.expand(rows, 8).contiguous(),
            temperatures=[0.8] * rows,
            generator=torch.Generator().manual_seed(5),
        )
        p = torch.softmax(logits[0] / 0.8, dim=-1).double()
        freq = torch.bincount(tokens, minlength=8).double() / rows
        sigma = (p * (1 - p) / rows).sqrt()
        self.assertTrue(bool(((freq - p).abs() <= 5 * sigma + 1e-4).all()))

    def test_all_greedy_draws_no_noise(self):
        logits = _logits(3, seed=1)
        gen = torch.Generator().manual_seed(0)
        state = gen.get_state()
        tokens = sample_tokens(logits=logits, temperatures=[0, 0, 0], generator=gen)
        self.assertEqual(tokens.tolist(), logits.argmax(-1).tolist())
        self.assertTrue(torch.equal(gen.get_state(), state))


class TestSamplingBatchInfo(CustomTestCase):
    def test_modes(self):
        for temps, mode in (
            ([0.0, 0, 0.0], SamplingMode.GREEDY),
            ([0.5, 2.0], SamplingMode.SAMPLED),
            ([0.5, 0.0, 2.0], SamplingMode.MIXED),
            # 0 in float32 is greedy, as the kernels see it.
            ([1e-300, 1.0], SamplingMode.MIXED),
            ([1e-300], SamplingMode.GREEDY),
        ):
            with self.subTest(temps=temps):
                info = SamplingBatchInfo.from_temperatures(temps)
                self.assertIs(info.mode, mode)
                self.assertEqual(info.temperatures.device.type, "cpu")
                self.assertEqual(info.temperatures.dtype, torch.float32)


class TestLogExp1Noise(CustomTestCase):
    def test_draws_are_log_exp1(self):
        gen = torch.Generator().manual_seed(0)
        out = torch.empty(200_000)
        self.assertIs(draw_log_exp1_(out, gen), out)
        e = out.exp()
        self.assertGreater(e.min().item(), 0.0)
        self.assertAlmostEqual(e.mean().item(), 1.0, delta=0.015)  # 5 sigma
        # Exp(1): P(E > 1) = 1/e, P(E > 3) = e^-3 (5 sigma of a frequency)
        for x in (1.0, 3.0):
            frac = (e > x).double().mean().item()
            self.assertAlmostEqual(frac, math.exp(-x), delta=5 * 0.5 / 200_000**0.5)

    def test_extreme_uniform_draws_stay_finite(self):
        # U = 0 would give E = inf; U < 1 always, so E > 0 and log E finite.
        out = torch.zeros(3)
        edges = torch.tensor([0.0, 0.5, 1 - 2**-24])
        with unittest.mock.patch.object(
            torch.Tensor, "uniform_", lambda t, **k: t.copy_(edges)
        ):
            draw_log_exp1_(out)
        tiny = torch.finfo(torch.float32).tiny
        want = (-torch.tensor([tiny, 0.5, 1 - 2**-24]).log()).log()
        self.assertTrue(torch.equal(out, want))
        self.assertTrue(bool(torch.isfinite(out).all()))


if __name__ == "__main__":
    unittest.main()

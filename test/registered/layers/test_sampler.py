"""sample_tokens: greedy rows take the argmax, sampling rows argmax(probs /
Exp(1) noise); temperature_probs with and without the greedy one-hot;
SamplingBatchInfo derived once per batch; Exp(1) noise is never 0."""

import math
import unittest
import unittest.mock

import torch

from sglang.srt.layers.sampler import (
    SamplingBatchInfo,
    exp1_noise_,
    sample_tokens,
    temperature_probs,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


class TestSampleTokens(CustomTestCase):
    def test_greedy_and_sampled_rows(self):
        logits = _logits(6)
        temperatures = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.5, 0.3])
        tokens = sample_tokens(
            logits=logits,
            temperatures=temperatures,
            generator=torch.Generator().manual_seed(4),
        )
        # The reference: the one-hot probs, the same noise stream.
        probs = temperature_probs(logits, temperatures)
        noise = exp1_noise_(torch.empty_like(probs), torch.Generator().manual_seed(4))
        self.assertEqual(tokens.tolist(), (probs / noise).argmax(-1).tolist())
        greedy = temperatures == 0
        self.assertEqual(tokens[greedy].tolist(), logits[greedy].argmax(-1).tolist())

    def test_out_buffer_and_all_greedy(self):
        logits = _logits(4, seed=1)
        out = torch.full((4,), -1, dtype=torch.int64)
        tokens = sample_tokens(logits=logits, temperatures=None, out=out)
        self.assertEqual(tokens.data_ptr(), out.data_ptr())
        self.assertEqual(out.tolist(), logits.argmax(-1).tolist())
        temperatures = torch.tensor([0.0, 1.0, 0.0, 1.0])
        sample_tokens(
            logits=logits,
            temperatures=temperatures,
            generator=torch.Generator().manual_seed(0),
            out=out,
        )
        greedy = logits.argmax(-1)
        self.assertEqual(out[temperatures == 0].tolist(), greedy[[0, 2]].tolist())

    def test_sampling_follows_the_probs(self):
        # 40k draws of one row at T = 0.8: frequencies within 5 sigma of p.
        logits = _logits(1, seed=2)[:, :8]
        rows = 40_000
        tokens = sample_tokens(
            logits=logits.expand(rows, 8),
            temperatures=torch.full((rows,), 0.8),
            generator=torch.Generator().manual_seed(5),
        )
        p = torch.softmax(logits[0] / 0.8, dim=-1).double()
        freq = torch.bincount(tokens, minlength=8).double() / rows
        sigma = (p * (1 - p) / rows).sqrt()
        self.assertTrue(bool(((freq - p).abs() <= 5 * sigma + 1e-4).all()))


class TestTemperatureProbs(CustomTestCase):
    def test_one_hot_only_where_asked(self):
        logits = _logits(3, seed=3)
        temperatures = torch.tensor([0.0, 0.5, 2.0])
        with_one_hot = temperature_probs(logits, temperatures)
        plain = temperature_probs(logits, temperatures, greedy_one_hot=False)
        # Sampling rows: the same softmax(logits / T), bit for bit.
        self.assertTrue(torch.equal(with_one_hot[1:], plain[1:]))
        torch.testing.assert_close(plain[1:].sum(-1), torch.ones(2))
        one_hot = torch.zeros(VOCAB)
        one_hot[logits[0].argmax()] = 1.0
        self.assertTrue(torch.equal(with_one_hot[0], one_hot))
        # Without the one-hot a greedy row is softmax(logits / 1e-6).
        self.assertTrue(torch.equal(plain[0], torch.softmax(logits[0] / 1e-6, dim=-1)))


class TestSamplingBatchInfo(CustomTestCase):
    def test_all_greedy_is_none(self):
        self.assertIsNone(SamplingBatchInfo.from_temperatures([0.0, 0, 0.0], "cpu"))

    def test_fields(self):
        info = SamplingBatchInfo.from_temperatures([0.5, 0.0, 2.0], "cpu")
        self.assertEqual(info.temperatures.tolist(), [0.5, 0.0, 2.0])
        self.assertEqual(info.inv_temperatures.shape, (3, 1))
        self.assertEqual(info.inv_temperatures.view(-1).tolist(), [2.0, 1.0, 0.5])
        self.assertEqual(info.is_sampled.tolist(), [True, False, True])
        self.assertFalse(info.all_sampled)
        self.assertTrue(
            SamplingBatchInfo.from_temperatures([1, 0.3], "cpu").all_sampled
        )
        # A tiny temperature is clamped as temperature_probs clamps it.
        tiny = SamplingBatchInfo.from_temperatures([1e-12], "cpu")
        self.assertAlmostEqual(tiny.inv_temperatures.item(), 1e6, delta=1)
        # One that is 0 in float32 is greedy, as sample_tokens treats it.
        self.assertIsNone(SamplingBatchInfo.from_temperatures([1e-300], "cpu"))
        mixed = SamplingBatchInfo.from_temperatures([1e-300, 1.0], "cpu")
        self.assertFalse(mixed.all_sampled)
        self.assertEqual(mixed.is_sampled.tolist(), [False, True])


class TestExp1Noise(CustomTestCase):
    def test_draws_are_exp1_and_positive(self):
        gen = torch.Generator().manual_seed(0)
        out = torch.empty(200_000)
        self.assertIs(exp1_noise_(out, gen), out)
        self.assertGreater(out.min().item(), 0.0)
        self.assertAlmostEqual(out.mean().item(), 1.0, delta=0.015)  # 5 sigma
        # Exp(1): P(E > 1) = 1/e, P(E > 3) = e^-3 (5 sigma of a frequency)
        for x in (1.0, 3.0):
            frac = (out > x).double().mean().item()
            self.assertAlmostEqual(frac, math.exp(-x), delta=5 * 0.5 / 200_000**0.5)

    def test_extreme_uniform_draws_stay_finite_and_positive(self):
        # U = 0 would give an infinite noise; U < 1 always, so never 0.
        out = torch.zeros(3)
        edges = torch.tensor([0.0, 0.5, 1 - 2**-24])
        with unittest.mock.patch.object(
            torch.Tensor, "uniform_", lambda t, **k: t.copy_(edges)
        ):
            exp1_noise_(out)
        tiny = torch.finfo(torch.float32).tiny
        want = -torch.tensor([tiny, 0.5, 1 - 2**-24]).log()
        self.assertTrue(torch.equal(out, want))
        self.assertTrue(bool(torch.isfinite(out).all() and (out > 0).all()))


if __name__ == "__main__":
    unittest.main()

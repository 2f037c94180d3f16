"""DSpark verify: greedy prefix matching and lossless rejection sampling."""

import math
import unittest

import torch

from sglang.srt.speculative.dspark_components.dspark_verify import (
    VerifyBuffers,
    VerifyResult,
    greedy_verify,
    rejection_verify,
    rejection_verify_into,
    verify,
)
from sglang.srt.utils.op_counter import OpCounter
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

# Rows of the statistical tests; frequencies then have a standard deviation of
# at most 0.5 / sqrt(N) = 0.0011, and every check below allows 5 sigma.
N = 200_000
SIGMA_BOUND = 5.0


def _tolerance(n: int) -> float:
    # 5 sigma of an empirical frequency over n draws (p(1-p) <= 1/4).
    return SIGMA_BOUND * 0.5 / math.sqrt(n)


def _frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).double() / ids.numel()


def _one_hot_logits(argmax: torch.Tensor, vocab: int, gen: torch.Generator):
    # argmax: [bs, rows] -> [bs, rows, vocab] logits whose argmax is `argmax`
    noise = torch.rand(argmax.shape + (vocab,), generator=gen)
    return noise.scatter(-1, argmax.unsqueeze(-1), 10.0)


def _sample(probs: torch.Tensor, shape, gen: torch.Generator) -> torch.Tensor:
    flat = torch.multinomial(probs, math.prod(shape), replacement=True, generator=gen)
    return flat.view(shape)


def _assert_same(test: unittest.TestCase, a: VerifyResult, b: VerifyResult):
    test.assertTrue(torch.equal(a.accept_lens, b.accept_lens))
    test.assertTrue(torch.equal(a.bonus_ids, b.bonus_ids))
    test.assertTrue(torch.equal(a.output_ids, b.output_ids))


class TestGreedyVerify(CustomTestCase):
    GAMMA, VOCAB = 4, 16

    def _case(self):
        """Row i mismatches its draft at position i (row gamma matches all)."""
        gen = torch.Generator().manual_seed(1)
        bs = self.GAMMA + 1
        target = torch.randint(0, self.VOCAB, (bs, self.GAMMA + 1), generator=gen)
        drafts = target[:, : self.GAMMA].clone()
        for i in range(self.GAMMA):
            # Only position i differs: later matches must not count.
            drafts[i, i] = (target[i, i] + 1) % self.VOCAB
        return target, drafts, _one_hot_logits(target, self.VOCAB, gen)

    def test_every_accept_length_in_one_batch(self):
        target, drafts, logits = self._case()
        result = greedy_verify(draft_tokens=drafts, target_logits=logits)
        self.assertEqual(result.accept_lens.tolist(), list(range(self.GAMMA + 1)))
        self.assertEqual(result.accept_lens.dtype, torch.int64)
        self.assertEqual(tuple(result.output_ids.shape), (5, self.GAMMA + 1))
        for i in range(self.GAMMA + 1):
            with self.subTest(row=i):
                # Bonus: target argmax at the first mismatch, or the last row.
                self.assertEqual(result.bonus_ids[i].item(), target[i, i].item())
                expected = drafts[i, :i].tolist() + [target[i, i].item()]
                self.assertEqual(result.output_ids[i, : i + 1].tolist(), expected)

    def test_rows_are_independent(self):
        # Each row alone gives the same answer as inside the batch.
        target, drafts, logits = self._case()
        batched = greedy_verify(draft_tokens=drafts, target_logits=logits)
        for i in range(self.GAMMA + 1):
            alone = greedy_verify(
                draft_tokens=drafts[i : i + 1], target_logits=logits[i : i + 1]
            )
            self.assertEqual(alone.accept_lens.item(), batched.accept_lens[i].item())
            self.assertEqual(alone.bonus_ids.item(), batched.bonus_ids[i].item())

    def test_verify_without_temperatures_is_greedy(self):
        _, drafts, logits = self._case()
        _assert_same(
            self,
            verify(
                draft_tokens=drafts,
                draft_logits=None,
                target_logits=logits,
                temperatures=None,
            ),
            greedy_verify(draft_tokens=drafts, target_logits=logits),
        )

    def test_result_is_frozen(self):
        _, drafts, logits = self._case()
        result = greedy_verify(draft_tokens=drafts, target_logits=logits)
        with self.assertRaises(AttributeError):
            result.accept_lens = torch.zeros(1)


class TestRejectionVerify(CustomTestCase):
    VOCAB, GAMMA = 5, 2
    P = torch.tensor([0.40, 0.25, 0.15, 0.15, 0.05], dtype=torch.float64)
    Q = torch.tensor([0.10, 0.45, 0.05, 0.20, 0.20], dtype=torch.float64)

    def _run(self, p, q, seed=0, n=N):
        gen = torch.Generator().manual_seed(seed)
        drafts = _sample(q.float(), (n, self.GAMMA), gen)
        result = rejection_verify(
            draft_tokens=drafts,
            draft_probs=q.float().expand(n, self.GAMMA, self.VOCAB),
            target_probs=p.float().expand(n, self.GAMMA + 1, self.VOCAB),
            generator=gen,
        )
        return drafts, result

    def test_first_token_follows_p(self):
        drafts, result = self._run(self.P, self.Q)
        tol = _tolerance(N)
        # The drafts themselves follow q, far from p: the check can tell.
        self.assertLess((_frequencies(drafts[:, 0], 5) - self.Q).abs().max(), tol)
        self.assertGreater((self.P - self.Q).abs().max(), 20 * tol)
        first = _frequencies(result.output_ids[:, 0], self.VOCAB)
        self.assertLess((first - self.P).abs().max().item(), tol)

    def test_second_token_follows_p(self):
        _, result = self._run(self.P, self.Q)
        kept = result.accept_lens >= 1
        n_kept = int(kept.sum())
        self.assertGreater(n_kept, N // 4)
        second = _frequencies(result.output_ids[kept, 1], self.VOCAB)
        self.assertLess((second - self.P).abs().max().item(), _tolerance(n_kept))

    def test_acceptance_rate(self):
        _, result = self._run(self.P, self.Q)
        alpha = torch.minimum(self.P, self.Q).sum().item()  # 0.55
        tol = _tolerance(N)
        accepted_first = (result.accept_lens >= 1).double().mean().item()
        self.assertAlmostEqual(accepted_first, alpha, delta=tol)
        # Same p and q at every position: all gamma accepted with alpha**gamma.
        accepted_all = (result.accept_lens == self.GAMMA).double().mean().item()
        self.assertAlmostEqual(accepted_all, alpha**self.GAMMA, delta=tol)
        self.assertEqual(result.accept_lens.min().item(), 0)
        self.assertEqual(result.accept_lens.max().item(), self.GAMMA)

    def test_bonus_after_rejection_is_the_residual(self):
        _, result = self._run(self.P, self.Q)
        rejected = result.accept_lens == 0
        residual = (self.P - self.Q).clamp_min(0)
        residual = residual / residual.sum()
        bonus = _frequencies(result.bonus_ids[rejected], self.VOCAB)
        self.assertLess(
            (bonus - residual).abs().max().item(), _tolerance(int(rejected.sum()))
        )
        # Tokens where q >= p never come out of a rejection.
        self.assertEqual(bonus[self.Q >= self.P].sum().item(), 0.0)

    def test_q_equals_p_accepts_everything(self):
        drafts, result = self._run(self.P, self.P, n=20_000)
        self.assertTrue(bool((result.accept_lens == self.GAMMA).all()))
        self.assertTrue(torch.equal(result.output_ids[:, : self.GAMMA], drafts))
        # All accepted: the bonus is drawn from the last target row, p.
        bonus = _frequencies(result.bonus_ids, self.VOCAB)
        self.assertLess((bonus - self.P).abs().max().item(), _tolerance(20_000))

    def test_disjoint_q_rejects_everything(self):
        p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64)
        q = torch.tensor([0.0, 0.0, 0.0, 0.6, 0.4], dtype=torch.float64)
        _, result = self._run(p, q, n=50_000)
        self.assertTrue(bool((result.accept_lens == 0).all()))
        self.assertTrue(torch.equal(result.output_ids[:, 0], result.bonus_ids))
        bonus = _frequencies(result.bonus_ids, self.VOCAB)
        self.assertLess((bonus - p).abs().max().item(), _tolerance(50_000))
        self.assertEqual(bonus[3:].sum().item(), 0.0)

    def test_same_seed_same_result(self):
        _, a = self._run(self.P, self.Q, seed=7, n=5_000)
        _, b = self._run(self.P, self.Q, seed=7, n=5_000)
        _, c = self._run(self.P, self.Q, seed=8, n=5_000)
        _assert_same(self, a, b)
        self.assertFalse(torch.equal(a.output_ids, c.output_ids))


class TestRejectionVerifyInto(CustomTestCase):
    """The worker's path for all-sampling batches: ``rejection_verify``'s
    arithmetic and draws, into preallocated buffers."""

    MAX_BS, GAMMA, VOCAB = 8, 4, 13

    def setUp(self):
        super().setUp()
        self.buffers = VerifyBuffers(
            max_batch_size=self.MAX_BS,
            gamma=self.GAMMA,
            device="cpu",
            vocab_size=self.VOCAB,
        )

    def _case(self, bs, seed):
        gen = torch.Generator().manual_seed(100 + seed)
        target_logits = torch.randn(bs, self.GAMMA + 1, self.VOCAB, generator=gen)
        draft_logits = target_logits[:, : self.GAMMA] + torch.randn(
            bs, self.GAMMA, self.VOCAB, generator=gen
        )
        inv_t = 1 / torch.linspace(0.5, 1.7, bs).unsqueeze(1)  # [bs, 1]
        q = torch.softmax(draft_logits * inv_t.unsqueeze(-1), dim=-1)
        drafts = torch.stack(
            [torch.multinomial(r, 1, generator=gen) for r in q.view(-1, self.VOCAB)]
        ).view(bs, self.GAMMA)
        return drafts, q, target_logits, inv_t

    def _both(self, drafts, q, target_logits, inv_t, seed):
        into = rejection_verify_into(
            draft_tokens=drafts,
            draft_probs=q,
            target_logits=target_logits,
            inv_temperatures=inv_t,
            buffers=self.buffers,
            generator=torch.Generator().manual_seed(seed),
        )
        direct = rejection_verify(
            draft_tokens=drafts,
            draft_probs=q,
            target_probs=torch.softmax(target_logits * inv_t.unsqueeze(-1), dim=-1),
            generator=torch.Generator().manual_seed(seed),
        )
        return into, direct

    def test_equals_rejection_verify(self):
        accepts = set()
        for bs in (8, 3, 1, 8):  # views cut per size, buffers reused
            for seed in range(4):
                with self.subTest(bs=bs, seed=seed):
                    into, direct = self._both(*self._case(bs, seed), seed=seed)
                    _assert_same(self, into, direct)
                    accepts.update(into.accept_lens.tolist())
        self.assertGreater(len(accepts), 2)  # rejections at several positions

    def test_no_residual_mass_falls_back_to_p(self):
        # q = 2p is no distribution: every draft is judged against u * 2p(x)
        # and max(p - q, 0) is 0 everywhere; the bonus comes from p. Token 0
        # lies outside p's support: a bonus drawn from the empty residual
        # would be token 0 (the argmax of an all-zero or NaN row).
        drafts, _, target_logits, inv_t = self._case(8, 0)
        target_logits = target_logits.clone()
        target_logits[..., 0] = float("-inf")
        p = torch.softmax(target_logits * inv_t.unsqueeze(-1), dim=-1)
        q = 2 * p[:, : self.GAMMA]
        for seed in range(6):
            into, direct = self._both(drafts, q, target_logits, inv_t, seed=seed)
            _assert_same(self, into, direct)
            rejected = into.accept_lens < self.GAMMA
            self.assertTrue(bool(rejected.any()))
            self.assertTrue(bool((into.bonus_ids[rejected] != 0).all()))

    def test_allocates_nothing(self):
        case = self._case(8, 1)
        self._both(*case, seed=1)  # views cut
        with OpCounter() as c:
            rejection_verify_into(
                draft_tokens=case[0],
                draft_probs=case[1],
                target_logits=case[2],
                inv_temperatures=case[3],
                buffers=self.buffers,
            )
        self.assertEqual(c.allocs, 0)
        self.assertGreater(c.ops, 10)

    def test_bad_buffers(self):
        drafts, q, target_logits, inv_t = self._case(8, 0)
        args = dict(
            draft_tokens=drafts,
            draft_probs=q,
            target_logits=target_logits,
            inv_temperatures=inv_t,
        )
        no_vocab = VerifyBuffers(max_batch_size=8, gamma=self.GAMMA, device="cpu")
        with self.assertRaisesRegex(ValueError, "vocab_size"):
            rejection_verify_into(buffers=no_vocab, **args)
        small = VerifyBuffers(
            max_batch_size=4, gamma=self.GAMMA, device="cpu", vocab_size=self.VOCAB
        )
        with self.assertRaisesRegex(ValueError, "max_batch_size=4"):
            rejection_verify_into(buffers=small, **args)


class TestVerifyMixedTemperatures(CustomTestCase):
    BS, GAMMA, VOCAB = 6, 3, 11

    def _inputs(self):
        gen = torch.Generator().manual_seed(3)
        target_logits = torch.randn(self.BS, self.GAMMA + 1, self.VOCAB, generator=gen)
        draft_logits = torch.randn(self.BS, self.GAMMA, self.VOCAB, generator=gen)
        # Drafts agree with the target argmax on exactly i % (gamma + 1) tokens.
        argmax = target_logits.argmax(-1)
        drafts = argmax[:, : self.GAMMA].clone()
        for i in range(self.BS):
            k = i % (self.GAMMA + 1)
            if k < self.GAMMA:
                drafts[i, k] = (argmax[i, k] + 1) % self.VOCAB
        return drafts, draft_logits, target_logits

    def _verify(self, temperatures, seed=0):
        drafts, draft_logits, target_logits = self._inputs()
        return verify(
            draft_tokens=drafts,
            draft_logits=draft_logits,
            target_logits=target_logits,
            temperatures=temperatures,
            generator=torch.Generator().manual_seed(seed),
        )

    def test_greedy_rows_match_greedy_verify(self):
        drafts, _, target_logits = self._inputs()
        greedy = greedy_verify(draft_tokens=drafts, target_logits=target_logits)
        self.assertEqual(greedy.accept_lens.tolist(), [0, 1, 2, 3, 0, 1])
        temperatures = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 1.3])
        is_greedy = temperatures == 0
        for seed in range(5):
            mixed = self._verify(temperatures, seed=seed)
            for name in ("accept_lens", "bonus_ids", "output_ids"):
                got, want = getattr(mixed, name), getattr(greedy, name)
                self.assertTrue(torch.equal(got[is_greedy], want[is_greedy]), name)
            self.assertTrue(bool((mixed.accept_lens <= self.GAMMA).all()))

    def test_all_zero_temperatures_equal_greedy(self):
        drafts, _, target_logits = self._inputs()
        _assert_same(
            self,
            self._verify(torch.zeros(self.BS)),
            greedy_verify(draft_tokens=drafts, target_logits=target_logits),
        )

    def test_sampled_rows_are_rejection_verify_on_softmax(self):
        drafts, draft_logits, target_logits = self._inputs()
        t = torch.full((self.BS,), 0.8)
        direct = rejection_verify(
            draft_tokens=drafts,
            draft_probs=torch.softmax(draft_logits / 0.8, dim=-1),
            target_probs=torch.softmax(target_logits / 0.8, dim=-1),
            generator=torch.Generator().manual_seed(4),
        )
        _assert_same(self, self._verify(t, seed=4), direct)

    def test_temperatures_without_draft_logits_raise(self):
        drafts, _, target_logits = self._inputs()
        with self.assertRaisesRegex(ValueError, "draft logits"):
            verify(
                draft_tokens=drafts,
                draft_logits=None,
                target_logits=target_logits,
                temperatures=torch.zeros(self.BS),
            )

    def test_same_seed_same_result(self):
        t = torch.tensor([1.0, 0.0, 1.0, 2.0, 0.5, 1.0])
        _assert_same(self, self._verify(t, seed=11), self._verify(t, seed=11))


if __name__ == "__main__":
    unittest.main()

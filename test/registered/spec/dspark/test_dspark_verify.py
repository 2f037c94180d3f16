"""DSpark acceptance: greedy prefix matching and lossless rejection sampling,
each rule once, into the step buffers (the code the engine runs)."""

import math
import unittest

import torch

from sglang.srt.layers.sampler import SamplingMode, draw_log_exp1_
from sglang.srt.speculative.dspark_components.dspark_verify import (
    accept,
    greedy_accept,
    rejection_accept,
)
from sglang.srt.utils.op_counter import OpCounter
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, dspark_step_views

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


_views = dspark_step_views


def _set_temperatures(views, temperatures) -> None:
    t = torch.as_tensor(temperatures, dtype=torch.float32)
    state = views.state
    state.temperatures.copy_(t)
    state.is_sampled.copy_(t > 0)
    state.neg_temperatures.copy_(-t.unsqueeze(1))
    inv = torch.where(t > 0, 1 / t.clamp_min(1e-6), torch.ones_like(t))
    state.inv_temperatures.copy_(inv.unsqueeze(1))


def _accept(views, *, drafts, target_logits, q=None, mode, seed=0):
    """Run ``accept`` with fresh draws; (accept lengths, bonus, outputs)."""
    gen = torch.Generator().manual_seed(seed)
    views.drafts.copy_(drafts)
    if q is not None:
        views.q_drafts.copy_(q.transpose(0, 1))  # [g, bs, V], slot-major
    views.u.uniform_(generator=gen)
    draw_log_exp1_(views.log_e, gen)
    accept(
        views=views,
        target_logits=target_logits.reshape(-1, target_logits.shape[-1]),
        mode=mode,
    )
    accept_lens = views.accept_lens.clone()
    bonus = views.state.last_ids.clone()
    outputs = [
        drafts[i, :a].tolist() + [b]
        for i, (a, b) in enumerate(zip(accept_lens.tolist(), bonus.tolist()))
    ]
    return accept_lens, bonus, outputs


def _one_hot_logits(argmax: torch.Tensor, vocab: int, gen: torch.Generator):
    # argmax: [bs, rows] -> [bs, rows, vocab] logits whose argmax is `argmax`
    noise = torch.rand(argmax.shape + (vocab,), generator=gen)
    return noise.scatter(-1, argmax.unsqueeze(-1), 10.0)


class TestGreedyAccept(CustomTestCase):
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
        views = _views(self.GAMMA + 1, self.GAMMA, self.VOCAB)
        lens, bonus, outputs = _accept(
            views, drafts=drafts, target_logits=logits, mode=SamplingMode.GREEDY
        )
        self.assertEqual(lens.tolist(), list(range(self.GAMMA + 1)))
        for i in range(self.GAMMA + 1):
            with self.subTest(row=i):
                # Bonus: target argmax at the first mismatch, or the last row.
                self.assertEqual(bonus[i].item(), target[i, i].item())
                self.assertEqual(
                    outputs[i], drafts[i, :i].tolist() + [target[i, i].item()]
                )

    def test_rows_are_independent_of_batch_size(self):
        # Each row alone, through views cut at size 1 of the same buffers,
        # gives the answer it gets inside the batch.
        target, drafts, logits = self._case()
        bs = self.GAMMA + 1
        batched = _accept(
            _views(bs, self.GAMMA, self.VOCAB),
            drafts=drafts,
            target_logits=logits,
            mode=SamplingMode.GREEDY,
        )
        for i in range(bs):
            alone = _accept(
                _views(1, self.GAMMA, self.VOCAB, max_bs=bs),
                drafts=drafts[i : i + 1],
                target_logits=logits[i : i + 1],
                mode=SamplingMode.GREEDY,
            )
            self.assertEqual(alone[2][0], batched[2][i])

    def test_allocates_nothing_and_reads_nothing(self):
        _, drafts, logits = self._case()
        views = _views(self.GAMMA + 1, self.GAMMA, self.VOCAB)
        views.drafts.copy_(drafts)
        flat = logits.reshape(-1, self.VOCAB)
        for mode in SamplingMode:
            accept(views=views, target_logits=flat, mode=mode)  # warm
            with OpCounter() as c:
                accept(views=views, target_logits=flat, mode=mode)
            with self.subTest(mode=mode):
                self.assertEqual((c.allocs, c.host_reads), (0, 0))
                self.assertGreater(c.ops, 4)


class TestRejectionAccept(CustomTestCase):
    VOCAB, GAMMA = 5, 2
    P = torch.tensor([0.40, 0.25, 0.15, 0.15, 0.05], dtype=torch.float64)
    Q = torch.tensor([0.10, 0.45, 0.05, 0.20, 0.20], dtype=torch.float64)

    def _run(self, p, q, seed=0, n=N):
        gen = torch.Generator().manual_seed(1000 + seed)
        drafts = torch.multinomial(
            q.float(), n * self.GAMMA, replacement=True, generator=gen
        ).view(n, self.GAMMA)
        views = _views(n, self.GAMMA, self.VOCAB)
        _set_temperatures(views, torch.ones(n))
        logits = p.float().log().expand(n, self.GAMMA + 1, self.VOCAB)
        q_rows = q.float().expand(n, self.GAMMA, self.VOCAB)
        lens, bonus, outputs = _accept(
            views,
            drafts=drafts,
            target_logits=logits,
            q=q_rows,
            mode=SamplingMode.SAMPLED,
            seed=seed,
        )
        first = torch.tensor([o[0] for o in outputs])
        return drafts, lens, bonus, first, outputs

    def test_first_token_follows_p(self):
        drafts, _, _, first, _ = self._run(self.P, self.Q)
        tol = _tolerance(N)
        # The drafts themselves follow q, far from p: the check can tell.
        self.assertLess((_frequencies(drafts[:, 0], 5) - self.Q).abs().max(), tol)
        self.assertGreater((self.P - self.Q).abs().max(), 20 * tol)
        self.assertLess((_frequencies(first, self.VOCAB) - self.P).abs().max(), tol)

    def test_second_token_follows_p(self):
        _, lens, _, _, outputs = self._run(self.P, self.Q)
        second = torch.tensor([o[1] for o, a in zip(outputs, lens.tolist()) if a >= 1])
        self.assertGreater(second.numel(), N // 4)
        freq = _frequencies(second, self.VOCAB)
        self.assertLess((freq - self.P).abs().max(), _tolerance(second.numel()))

    def test_acceptance_rate(self):
        _, lens, _, _, _ = self._run(self.P, self.Q)
        alpha = torch.minimum(self.P, self.Q).sum().item()  # 0.55
        tol = _tolerance(N)
        self.assertAlmostEqual((lens >= 1).double().mean().item(), alpha, delta=tol)
        # Same p and q at every position: all gamma accepted with alpha**gamma.
        all_in = (lens == self.GAMMA).double().mean().item()
        self.assertAlmostEqual(all_in, alpha**self.GAMMA, delta=tol)
        self.assertEqual((lens.min().item(), lens.max().item()), (0, self.GAMMA))

    def test_bonus_after_rejection_is_the_residual(self):
        _, lens, bonus, _, _ = self._run(self.P, self.Q)
        rejected = lens == 0
        residual = (self.P - self.Q).clamp_min(0)
        residual = residual / residual.sum()
        freq = _frequencies(bonus[rejected], self.VOCAB)
        self.assertLess((freq - residual).abs().max(), _tolerance(int(rejected.sum())))
        # Tokens where q >= p never come out of a rejection.
        self.assertEqual(freq[self.Q >= self.P].sum().item(), 0.0)

    def test_q_equals_p_accepts_everything(self):
        drafts, lens, bonus, _, outputs = self._run(self.P, self.P, n=20_000)
        self.assertTrue(bool((lens == self.GAMMA).all()))
        self.assertEqual([o[: self.GAMMA] for o in outputs], drafts.tolist())
        # All accepted: the bonus is drawn from the last target row, p.
        freq = _frequencies(bonus, self.VOCAB)
        self.assertLess((freq - self.P).abs().max(), _tolerance(20_000))

    def test_disjoint_q_rejects_everything(self):
        p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64)
        q = torch.tensor([0.0, 0.0, 0.0, 0.6, 0.4], dtype=torch.float64)
        _, lens, bonus, first, _ = self._run(p, q, n=50_000)
        self.assertTrue(bool((lens == 0).all()))
        self.assertTrue(torch.equal(first, bonus))
        freq = _frequencies(bonus, self.VOCAB)
        self.assertLess((freq - p).abs().max(), _tolerance(50_000))
        self.assertEqual(freq[3:].sum().item(), 0.0)

    def test_no_residual_mass_falls_back_to_p(self):
        # q = 2p is no distribution: every draft is judged against u * 2p(x)
        # and max(p - q, 0) is 0 everywhere; the bonus comes from p. Token 0
        # lies outside p's support: a bonus drawn from the empty residual
        # would be token 0 (the argmax of an all -inf row).
        p = torch.tensor([0.0, 0.3, 0.3, 0.2, 0.2], dtype=torch.float64)
        _, lens, bonus, _, _ = self._run(p, 2 * p, n=5_000)
        rejected = lens < self.GAMMA
        self.assertTrue(bool(rejected.any()))
        self.assertTrue(bool((bonus != 0).all()))

    def test_same_seed_same_result(self):
        a = self._run(self.P, self.Q, seed=7, n=5_000)[4]
        b = self._run(self.P, self.Q, seed=7, n=5_000)[4]
        c = self._run(self.P, self.Q, seed=8, n=5_000)[4]
        self.assertEqual(a, b)
        self.assertNotEqual(a, c)


class TestMixedBatch(CustomTestCase):
    BS, GAMMA, VOCAB = 6, 3, 11

    def _inputs(self):
        gen = torch.Generator().manual_seed(3)
        target_logits = torch.randn(self.BS, self.GAMMA + 1, self.VOCAB, generator=gen)
        q = torch.softmax(
            torch.randn(self.BS, self.GAMMA, self.VOCAB, generator=gen), -1
        )
        # Drafts agree with the target argmax on exactly i % (gamma + 1) tokens.
        argmax = target_logits.argmax(-1)
        drafts = argmax[:, : self.GAMMA].clone()
        for i in range(self.BS):
            k = i % (self.GAMMA + 1)
            if k < self.GAMMA:
                drafts[i, k] = (argmax[i, k] + 1) % self.VOCAB
        return drafts, q, target_logits

    def _run(self, temperatures, mode, seed=0):
        drafts, q, logits = self._inputs()
        views = _views(self.BS, self.GAMMA, self.VOCAB)
        _set_temperatures(views, temperatures)
        return _accept(
            views, drafts=drafts, target_logits=logits, q=q, mode=mode, seed=seed
        )

    def test_each_row_takes_its_own_rule(self):
        temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.3]
        greedy = self._run(temps, SamplingMode.GREEDY)
        self.assertEqual(greedy[0].tolist(), [0, 1, 2, 3, 0, 1])
        for seed in range(5):
            mixed = self._run(temps, SamplingMode.MIXED, seed=seed)
            sampled = self._run(temps, SamplingMode.SAMPLED, seed=seed)
            for i, t in enumerate(temps):
                want = greedy if t == 0 else sampled
                self.assertEqual(mixed[2][i], want[2][i], (seed, i))

    def test_rules_write_where_they_are_told(self):
        # A rule fills only the outputs it is given: the mixed batch's greedy
        # pass leaves the sampled result alone until the merge.
        drafts, q, logits = self._inputs()
        views = _views(self.BS, self.GAMMA, self.VOCAB)
        views.drafts.copy_(drafts)
        flat = logits.reshape(-1, self.VOCAB)
        views.accept_row.fill_(-1)
        greedy_accept(
            views=views,
            target_logits=flat,
            accept_lens=views.greedy_accept_lens,
            bonus=views.greedy_bonus,
        )
        self.assertEqual(views.accept_lens.tolist(), [-1] * self.BS)
        self.assertEqual(views.greedy_accept_lens.view(-1).tolist(), [0, 1, 2, 3, 0, 1])
        views.q_drafts.copy_(q.transpose(0, 1))
        draw_log_exp1_(views.log_e, torch.Generator().manual_seed(0))
        views.u.uniform_()
        rejection_accept(
            views=views,
            target_logits=flat,
            accept_lens=views.accept_row,
            bonus=views.bonus,
        )
        self.assertTrue(bool((views.accept_lens >= 0).all()))


class TestRaggedAccept(CustomTestCase):
    """After a ragged verify (request b verified its first verify_lens[b]
    drafts), an unverified draft ends the block; a full accept of the
    verified ones draws the bonus from p alone."""

    VOCAB, GAMMA = 5, 3
    P = TestRejectionAccept.P
    Q = TestRejectionAccept.Q

    def _run(self, verify_len, n=N, seed=0, mode=SamplingMode.SAMPLED, q_last=None):
        gen = torch.Generator().manual_seed(3000 + seed)
        views = _views(n, self.GAMMA, self.VOCAB)
        _set_temperatures(
            views, torch.ones(n) if mode is not SamplingMode.GREEDY else torch.zeros(n)
        )
        # Every draft equal to p's argmax and q = p: all would be accepted.
        drafts = torch.zeros(n, self.GAMMA, dtype=torch.int64)
        views.drafts.copy_(drafts)
        views.q_drafts.copy_(self.P.float().expand(self.GAMMA, n, self.VOCAB))
        if q_last is not None:  # the last draft's q, for a draft not verified
            views.q_drafts[-1].copy_(q_last.float().expand(n, self.VOCAB))
        views.verify_lens.fill_(verify_len)
        views.u.uniform_(generator=gen)
        draw_log_exp1_(views.log_e, gen)
        logits = self.P.float().log().expand(n * (self.GAMMA + 1), self.VOCAB)
        places = torch.arange(n * (self.GAMMA + 1))  # every place placed
        accept(
            views=views,
            target_logits=logits.contiguous(),
            mode=mode,
            query_index=places,
        )
        return views.accept_lens.clone(), views.state.last_ids.clone()

    def test_unverified_drafts_end_the_block(self):
        for verify_len in range(self.GAMMA + 1):
            for mode in (SamplingMode.GREEDY, SamplingMode.SAMPLED):
                with self.subTest(verify_len=verify_len, mode=mode):
                    lens, _ = self._run(verify_len, n=64, mode=mode)
                    self.assertTrue(bool((lens == verify_len).all()))

    def test_bonus_after_a_full_accept_of_fewer_drafts_follows_p(self):
        # Two drafts verified and accepted: the bonus follows p. The third
        # draft's q (never verified) is made far from p: a bonus drawn from
        # max(p - q, 0) of its row would follow the residual instead.
        lens, bonus = self._run(2, q_last=self.Q)
        self.assertTrue(bool((lens == 2).all()))
        freq = _frequencies(bonus, self.VOCAB)
        self.assertLess((freq - self.P).abs().max(), _tolerance(N))
        residual = (self.P - self.Q).clamp_min(0)
        self.assertGreater((residual / residual.sum() - self.P).abs().max(), 0.1)


if __name__ == "__main__":
    unittest.main()

"""Acceptance: greedy prefix matching and lossless rejection sampling.

Target row i is the target's distribution for the token after verify input
i, where the inputs are ``[bonus, d_1, ..., d_gamma]``; so draft ``d_j``
(1-based) is judged by target row ``j - 1``.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from sglang.srt.layers.sampler import exp1_noise_, temperature_probs


@dataclass(frozen=True)
class VerifyResult:
    accept_lens: torch.Tensor  # [bs] int64, drafts accepted, 0..gamma
    bonus_ids: torch.Tensor  # [bs] int64, the token after the accepted drafts
    # d_1..d_a then the bonus; entries past accept_lens + 1 are junk.
    output_ids: torch.Tensor  # [bs, gamma + 1]


class VerifyBuffers:
    """Verify's per-step tensors, allocated once at the largest batch: greedy
    verify's, and with ``vocab_size`` rejection sampling's.

    A result computed into them is a set of views, valid until the next verify
    that uses the same buffers.
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        gamma: int,
        device,
        vocab_size: Optional[int] = None,
    ) -> None:
        self.max_batch_size, self.vocab_size = max_batch_size, vocab_size
        rows, dev = (max_batch_size, gamma + 1), device
        self.target = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.matched = torch.zeros(
            (max_batch_size, gamma), dtype=torch.bool, device=dev
        )
        self.run = torch.zeros((max_batch_size, gamma), dtype=torch.int64, device=dev)
        self.accept_lens = torch.zeros(max_batch_size, dtype=torch.int64, device=dev)
        self.bonus_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=dev)
        self.output_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._views: Dict[int, _VerifyViews] = {}
        self._sampling_views: Dict[int, _SamplingViews] = {}
        if vocab_size is not None:
            full, one = rows + (vocab_size,), (max_batch_size, 1, vocab_size)
            self.p = torch.zeros(full, device=dev)
            self.residual = torch.zeros(full, device=dev)  # also scaled logits
            self.q_tok = torch.zeros(max_batch_size, gamma, device=dev)
            self.p_tok = torch.zeros(max_batch_size, gamma, device=dev)
            self.u = torch.zeros(max_batch_size, gamma, device=dev)
            self.row = torch.zeros(one, device=dev)
            self.fallback = torch.zeros(one, device=dev)
            self.noise = torch.zeros(one, device=dev)
            self.mass = torch.zeros(max_batch_size, 1, 1, device=dev)
            self.has_mass = torch.zeros(
                max_batch_size, 1, 1, dtype=torch.bool, device=dev
            )

    def cut(self, bs: int) -> "_VerifyViews":
        """The buffers cut to ``bs`` rows, made once per batch size."""
        views = self._views.get(bs)
        if views is None:
            target, accept_lens = self.target[:bs], self.accept_lens[:bs]
            bonus, output_ids = self.bonus_ids[:bs], self.output_ids[:bs]
            views = _VerifyViews(
                target=target,
                target_drafts=target[:, :-1],
                matched=self.matched[:bs],
                run=self.run[:bs],
                accept_lens=accept_lens,
                accept_col=accept_lens.unsqueeze(1),
                bonus=bonus,
                bonus_col=bonus.unsqueeze(1),
                output_ids=output_ids,
                output_drafts=output_ids[:, :-1],
                output_spare=output_ids[:, -1],
            )
            self._views[bs] = views
        return views

    def cut_sampling(self, bs: int) -> "_SamplingViews":
        """Rejection sampling's buffers cut to ``bs`` rows, made once per size."""
        if self.vocab_size is None:
            raise ValueError("rejection sampling into buffers needs vocab_size")
        views = self._sampling_views.get(bs)
        if views is None:
            gamma, vocab = self.u.shape[1], self.vocab_size
            p, residual = self.p[:bs], self.residual[:bs]
            views = _SamplingViews(
                p=p,
                p_drafts=p[:, :gamma],
                p_last=p[:, gamma],
                residual=residual,
                residual_drafts=residual[:, :gamma],
                residual_last=residual[:, gamma],
                q_tok=self.q_tok[:bs],
                p_tok=self.p_tok[:bs],
                q_tok_col=self.q_tok[:bs].unsqueeze(-1),
                p_tok_col=self.p_tok[:bs].unsqueeze(-1),
                u=self.u[:bs],
                row=self.row[:bs],
                fallback=self.fallback[:bs],
                noise=self.noise[:bs],
                mass=self.mass[:bs],
                has_mass=self.has_mass[:bs],
                at=self.accept_lens[:bs].view(bs, 1, 1).expand(bs, 1, vocab),
                bonus=self.bonus_ids[:bs].view(bs, 1, 1),
            )
            self._sampling_views[bs] = views
        return views


@dataclass(frozen=True)
class _SamplingViews:
    p: torch.Tensor  # [bs, gamma + 1, vocab]: the target's probabilities
    p_drafts: torch.Tensor  # [bs, gamma, vocab]
    p_last: torch.Tensor  # [bs, vocab]
    residual: torch.Tensor  # [bs, gamma + 1, vocab]
    residual_drafts: torch.Tensor  # [bs, gamma, vocab]
    residual_last: torch.Tensor  # [bs, vocab]
    q_tok: torch.Tensor  # [bs, gamma]: q of each draft
    p_tok: torch.Tensor  # [bs, gamma]: p of each draft
    q_tok_col: torch.Tensor  # [bs, gamma, 1]: the same two, as gather outputs
    p_tok_col: torch.Tensor  # [bs, gamma, 1]
    u: torch.Tensor  # [bs, gamma]
    row: torch.Tensor  # [bs, 1, vocab]: the bonus distribution (unnormalized)
    fallback: torch.Tensor  # [bs, 1, vocab]
    noise: torch.Tensor  # [bs, 1, vocab]
    mass: torch.Tensor  # [bs, 1, 1]
    has_mass: torch.Tensor  # [bs, 1, 1] bool
    at: torch.Tensor  # [bs, 1, vocab]: accept_lens, expanded
    bonus: torch.Tensor  # [bs, 1, 1]: bonus_ids


@dataclass(frozen=True)
class _VerifyViews:
    target: torch.Tensor  # [bs, gamma + 1]
    target_drafts: torch.Tensor  # [bs, gamma]: the rows that judge d_1..d_gamma
    matched: torch.Tensor  # [bs, gamma] bool
    run: torch.Tensor  # [bs, gamma]
    accept_lens: torch.Tensor  # [bs]
    accept_col: torch.Tensor  # [bs, 1]
    bonus: torch.Tensor  # [bs]
    bonus_col: torch.Tensor  # [bs, 1]
    output_ids: torch.Tensor  # [bs, gamma + 1]
    output_drafts: torch.Tensor  # [bs, gamma]
    output_spare: torch.Tensor  # [bs]: the last column


def _leading_run(accepted: torch.Tensor) -> torch.Tensor:
    # accepted: [bs, gamma] bool per draft -> [bs] length of the leading True run
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _result(draft_tokens, accept_lens, bonus) -> VerifyResult:
    output_ids = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
    output_ids.scatter_(1, accept_lens.unsqueeze(1), bonus.unsqueeze(1))
    return VerifyResult(accept_lens=accept_lens, bonus_ids=bonus, output_ids=output_ids)


def _greedy_verify_into(
    draft_tokens: torch.Tensor,  # [bs, gamma]
    target_logits: torch.Tensor,  # [bs, gamma + 1, vocab]
    buffers: VerifyBuffers,
) -> VerifyResult:
    """``greedy_verify``'s arithmetic with ``out=`` ops: no new tensors."""
    bs = draft_tokens.shape[0]
    if bs > buffers.max_batch_size:
        raise ValueError(
            f"batch of {bs} exceeds the verify buffers' max_batch_size="
            f"{buffers.max_batch_size}"
        )
    v = buffers.cut(bs)
    torch.argmax(target_logits, dim=-1, out=v.target)
    torch.eq(draft_tokens, v.target_drafts, out=v.matched)
    torch.cumprod(v.matched, dim=1, dtype=torch.int64, out=v.run)
    torch.sum(v.run, dim=1, out=v.accept_lens)
    torch.gather(v.target, 1, v.accept_col, out=v.bonus_col)
    # As _result: the drafts, the first draft in the spare column, the bonus
    # scattered in at the accept length.
    v.output_drafts.copy_(draft_tokens)
    v.output_spare.copy_(draft_tokens[:, 0])
    v.output_ids.scatter_(1, v.accept_col, v.bonus_col)
    return VerifyResult(
        accept_lens=v.accept_lens, bonus_ids=v.bonus, output_ids=v.output_ids
    )


def greedy_verify(
    *,
    draft_tokens: torch.Tensor,  # [bs, gamma]
    target_logits: torch.Tensor,  # [bs, gamma + 1, vocab]
    buffers: Optional[VerifyBuffers] = None,
) -> VerifyResult:
    """With ``buffers`` the result is views of them (see ``VerifyBuffers``)."""
    if buffers is not None:
        return _greedy_verify_into(draft_tokens, target_logits, buffers)
    target = target_logits.argmax(dim=-1)  # [bs, gamma + 1]
    accept_lens = _leading_run(draft_tokens == target[:, :-1])
    bonus = target.gather(1, accept_lens.unsqueeze(1)).squeeze(1)
    return _result(draft_tokens, accept_lens, bonus)


def rejection_verify(
    *,
    draft_tokens: torch.Tensor,  # [bs, gamma]
    draft_probs: torch.Tensor,  # [bs, gamma, vocab], q
    target_probs: torch.Tensor,  # [bs, gamma + 1, vocab], p
    generator: Optional[torch.Generator] = None,
) -> VerifyResult:
    bs, gamma = draft_tokens.shape
    idx = draft_tokens.unsqueeze(-1)
    q = draft_probs.gather(2, idx).squeeze(-1)  # [bs, gamma]
    p = target_probs[:, :gamma].gather(2, idx).squeeze(-1)
    u = torch.rand((bs, gamma), generator=generator, device=draft_tokens.device)
    accept_lens = _leading_run(u * q < p)
    # The bonus comes from normalize(max(p - q, 0)) at the first rejection,
    # or from the last target row when every draft is accepted.
    residual = (target_probs[:, :gamma] - draft_probs).clamp_min(0)
    residual = torch.cat([residual, target_probs[:, gamma:]], dim=1)
    at = accept_lens.view(bs, 1, 1).expand(bs, 1, residual.shape[-1])
    row = residual.gather(1, at).squeeze(1)  # [bs, vocab]
    fallback = target_probs.gather(1, at).squeeze(1)
    # p == q leaves no residual mass; then rejection cannot happen, keep p.
    row = torch.where(row.sum(-1, keepdim=True) > 0, row, fallback)
    # Normalized first: a residual of subnormal values divided by the noise
    # could flush to all zeros, and argmax would then return token 0.
    noise = exp1_noise_(torch.empty_like(row), generator)
    bonus = (row / row.sum(-1, keepdim=True) / noise).argmax(dim=-1)
    return _result(draft_tokens, accept_lens, bonus)


def rejection_verify_into(
    *,
    draft_tokens: torch.Tensor,  # [bs, gamma]
    draft_probs: torch.Tensor,  # [bs, gamma, vocab], q
    target_logits: torch.Tensor,  # [bs, gamma + 1, vocab]
    inv_temperatures: torch.Tensor,  # [bs, 1]
    buffers: VerifyBuffers,
    generator: Optional[torch.Generator] = None,
) -> VerifyResult:
    """``rejection_verify`` with p = softmax(target_logits * inv_temperatures),
    the same arithmetic and random draws, into ``buffers``: no new tensors.
    For batches whose every row samples."""
    bs, gamma = draft_tokens.shape
    if bs > buffers.max_batch_size:
        raise ValueError(
            f"batch of {bs} exceeds the verify buffers' max_batch_size="
            f"{buffers.max_batch_size}"
        )
    v, s = buffers.cut(bs), buffers.cut_sampling(bs)
    torch.mul(target_logits, inv_temperatures.unsqueeze(-1), out=s.residual)
    torch._softmax(s.residual, -1, False, out=s.p)
    idx = draft_tokens.unsqueeze(-1)
    torch.gather(draft_probs, 2, idx, out=s.q_tok_col)
    torch.gather(s.p_drafts, 2, idx, out=s.p_tok_col)
    s.u.uniform_(generator=generator).mul_(s.q_tok)  # the draws of torch.rand
    torch.lt(s.u, s.p_tok, out=v.matched)
    torch.cumprod(v.matched, dim=1, dtype=torch.int64, out=v.run)
    torch.sum(v.run, dim=1, out=v.accept_lens)
    torch.sub(s.p_drafts, draft_probs, out=s.residual_drafts).clamp_min_(0)
    s.residual_last.copy_(s.p_last)
    torch.gather(s.residual, 1, s.at, out=s.row)
    torch.gather(s.p, 1, s.at, out=s.fallback)
    torch.sum(s.row, -1, keepdim=True, out=s.mass)
    torch.gt(s.mass, 0, out=s.has_mass)
    torch.where(s.has_mass, s.row, s.fallback, out=s.row)
    s.row.div_(torch.sum(s.row, -1, keepdim=True, out=s.mass))
    s.row.div_(exp1_noise_(s.noise, generator))
    torch.argmax(s.row, dim=-1, keepdim=True, out=s.bonus)
    v.output_drafts.copy_(draft_tokens)
    v.output_spare.copy_(draft_tokens[:, 0])
    v.output_ids.scatter_(1, v.accept_col, v.bonus_col)
    return VerifyResult(
        accept_lens=v.accept_lens, bonus_ids=v.bonus, output_ids=v.output_ids
    )


def verify(
    *,
    draft_tokens: torch.Tensor,  # [bs, gamma]
    draft_logits: Optional[torch.Tensor],  # [bs, gamma, vocab]; None if all greedy
    target_logits: torch.Tensor,  # [bs, gamma + 1, vocab]
    temperatures: Optional[torch.Tensor],  # [bs]; None = all greedy
    generator: Optional[torch.Generator] = None,
    buffers: Optional[VerifyBuffers] = None,
    draft_probs: Optional[torch.Tensor] = None,  # q, when already computed
) -> VerifyResult:
    """Greedy rows (temperature 0) match prefixes; the others rejection-sample
    against q (``draft_probs``, or softmax(draft_logits / T)).

    An all-greedy batch verified into ``buffers`` allocates nothing (for an
    all-sampling batch, see ``rejection_verify_into``).
    """
    greedy = greedy_verify(
        draft_tokens=draft_tokens, target_logits=target_logits, buffers=buffers
    )
    if temperatures is None:
        return greedy
    if draft_logits is None and draft_probs is None:
        raise ValueError("sampling requests need the draft logits (q)")
    t = temperatures.unsqueeze(1)  # [bs, 1]
    if draft_probs is None:
        # Greedy rows take the greedy result below: no one-hot needed.
        draft_probs = temperature_probs(draft_logits, t, greedy_one_hot=False)
    sampled = rejection_verify(
        draft_tokens=draft_tokens,
        draft_probs=draft_probs,
        target_probs=temperature_probs(target_logits, t, greedy_one_hot=False),
        generator=generator,
    )
    is_greedy = temperatures == 0
    return VerifyResult(
        accept_lens=torch.where(is_greedy, greedy.accept_lens, sampled.accept_lens),
        bonus_ids=torch.where(is_greedy, greedy.bonus_ids, sampled.bonus_ids),
        output_ids=torch.where(
            is_greedy.unsqueeze(1), greedy.output_ids, sampled.output_ids
        ),
    )

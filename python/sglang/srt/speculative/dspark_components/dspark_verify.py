"""Acceptance: greedy prefix matching and lossless rejection sampling.

Target row i is the target's distribution for the token after verify input
i, where the inputs are ``[bonus, d_1, ..., d_gamma]``; so draft ``d_j``
(1-based) is judged by target row ``j - 1``, and the bonus after ``a``
accepted drafts comes from row ``a``.

Each rule is written once, into the step buffers (``DSparkStepViews``,
slot-major: ``[slot, request, vocab]``), with no host read. A rule leaves
the accept lengths and the bonus in the tensors it is given; ``accept``
picks the rule once per batch, and for a mixed batch runs both and keeps
each row's. After a ragged verify (each request verified its first
``verify_lens`` drafts), an unverified draft ends the block as a rejection
would, but the bonus after it follows p alone (q is 0 where nothing was
proposed), as after a full accept. A step that verifies no draft (budget
0) samples the anchor's next token: a plain decode step's rule.

- greedy: a = the length of the leading run of d_j == argmax(target row
  j - 1); bonus = argmax(target row a);
- rejection sampling: d_j is accepted when u * q(d_j) < p(d_j); at the
  first rejection the bonus is drawn from normalize(max(p - q, 0)) of that
  row, after a full accept from p of the last row (q's extra row is 0).
  Exactly lossless: the output follows p.

With the sampling parameters beyond the temperature (``SamplingExtras``):
the target's rows are processed (``process_logits``, each row with the
drafts before it as history) before either rule, so p is the processed
target distribution and, the draft's q processed alike, the output keeps
it. A seeded sampled row takes the greedy rule over its Gumbel-perturbed
rows, argmax(p-logits / T + G) with the noise the draft drew its block
with (both from the seed and the output position): lossless, since the
token at a position is always the target's perturbed argmax, and a
function of the seed alone. The committed tokens (drafts up to the accept
length, then the bonus) and their log-probabilities under the target's
own logits are left in the views for the commit and the output.
"""

from typing import Optional

import torch

from sglang.srt.layers.sampler import (
    NO_EXTRAS,
    SamplingExtras,
    SamplingMode,
    process_logits,
    sample_next_,
    token_logprobs,
)
from sglang.srt.speculative.dspark_components.dspark_buffers import DSparkStepViews


def _by_slot(target_logits: torch.Tensor, views: DSparkStepViews) -> torch.Tensor:
    # [bs * (g + 1), V] request-major -> [g + 1, bs, V], a view
    bs = views.accept_lens.shape[0]
    return target_logits.view(bs, -1, target_logits.shape[-1]).transpose(0, 1)


def _first_rejection(views: DSparkStepViews, accept_lens: torch.Tensor) -> None:
    # matched [g + 1, bs] ends in a row of 0: its first 0 per request is the
    # number of drafts accepted.
    torch.argmin(views.matched, dim=0, keepdim=True, out=accept_lens)


def greedy_accept(
    *,
    views: DSparkStepViews,
    target_logits: torch.Tensor,  # [bs * (g + 1), V]
    accept_lens: torch.Tensor,  # [1, bs] int64, out
    bonus: torch.Tensor,  # [1, bs] int64, out
    ragged: bool = False,  # only drafts under views.verify_mask were verified
) -> None:
    v = views
    torch.argmax(_by_slot(target_logits, v), dim=-1, out=v.target_ids)
    torch.eq(v.drafts_by_slot, v.target_drafts, out=v.matched_drafts)
    if ragged:
        v.matched_drafts.mul_(v.verify_mask)
    _first_rejection(v, accept_lens)
    torch.gather(v.target_ids, 0, accept_lens, out=bonus)


def rejection_accept(
    *,
    views: DSparkStepViews,
    target_logits: torch.Tensor,  # [bs * (g + 1), V]
    accept_lens: torch.Tensor,  # [1, bs] int64, out: views.accept_row
    bonus: torch.Tensor,  # [1, bs] int64, out
    ragged: bool = False,  # only drafts under views.verify_mask were verified
) -> None:
    """Reads q (``views.q``), the draws ``views.u`` and the bonus noise."""
    v, state = views, views.state
    # p = softmax(target / T), per slot
    torch.mul(_by_slot(target_logits, v), state.inv_temperatures, out=v.target_scaled)
    torch._softmax(v.target_scaled, -1, False, out=v.p)
    # p(d_j) and q(d_j) side by side: one gather, [2, g, bs, 1]
    torch.gather(v.pq_drafts, 3, v.pq_draft_index, out=v.pq_tok)
    u = v.u.mul_(v.q_tok_flat)  # u * q(d_j), in place of the draws
    torch.lt(u, v.p_tok_flat, out=v.matched_drafts)
    if ragged:
        v.matched_drafts.mul_(v.verify_mask)
    _first_rejection(v, accept_lens)
    # The bonus row: max(p - q, 0) at the first rejection; after a full
    # accept q's row is 0, so it is p of the last row.
    torch.gather(v.pq, 1, v.pq_accept_rows, out=v.pq_row)  # p's and q's [1, bs, V]
    if ragged:  # every verified draft accepted: nothing past them was proposed
        torch.ge(v.accept_cell, v.verify_lens_cell, out=v.full_accept)
        v.q_row.masked_fill_(v.full_accept, 0.0)
    row = torch.sub(v.p_row, v.q_row, out=v.bonus_row).clamp_min_(0)
    # p == q leaves no mass: rejection cannot happen there; keep p.
    torch.sum(row, -1, keepdim=True, out=v.mass)
    torch.gt(v.mass, 0, out=v.has_mass)
    torch.where(v.has_mass, row, v.p_row, out=row)
    # A draw from row (unnormalized): argmax(log row - log E), E ~ Exp(1).
    # In log space a row of tiny (subnormal) masses keeps its proportions.
    torch.sub(row.log_(), v.bonus_noise, out=row)
    torch.argmax(row, dim=-1, out=bonus)


def sample_anchor(
    *,
    views: DSparkStepViews,
    logits: torch.Tensor,
    mode: SamplingMode,
    extras: SamplingExtras = NO_EXTRAS,
) -> None:
    """A step that verified no draft (budget 0): the anchor's next token by
    plain decoding's rule, into the batch state's ``last_ids``."""
    v, state = views, views.state
    raw = sample_next_(
        logits,
        mode,
        sampling=state.sampling,
        neg_temperatures=state.neg_temperatures,
        log_e=v.bonus_noise_rows,
        scratch=v.scratch,
        out=state.last_ids,
        extras=extras,
    )
    v.accept_lens.zero_()
    if extras.counted or extras.logprobs:
        _committed(v)
        if extras.logprobs:
            v.logprobs[:, 0].copy_(token_logprobs(raw, state.last_ids))


def _draft_history(v: DSparkStepViews) -> torch.Tensor:
    """[g + 1, bs, V]: row j counts the drafts d_1..d_j before it."""
    history = torch.zeros_like(v.p)
    history[1:].scatter_(2, v.draft_index, 1.0)
    return history.cumsum_(0)


def _committed(v: DSparkStepViews) -> None:
    """The step's committed tokens, d_1..d_a then the bonus, into
    ``v.committed`` (its columns past a flagged off in ``committed_valid``)."""
    g = v.drafts.shape[1]
    v.committed[:, :g].copy_(v.drafts)
    v.committed.scatter_(1, v.accept_lens.unsqueeze(1), v.state.last_ids.unsqueeze(1))
    torch.le(
        v.slot_offsets.view(1, -1), v.accept_lens.unsqueeze(1), out=v.committed_valid
    )


def _coupled_accept(v: DSparkStepViews, target_logits: torch.Tensor, ragged: bool):
    """Seeded sampled rows: the greedy rule over target / T + G, G the noise
    the draft drew with (-log E, per output position); their results
    replace the others' in ``accept_row`` and ``bonus``."""
    state = v.state
    bs = v.accept_lens.shape[0]
    # G = -log E: target / T + G, per slot.
    perturbed = torch.sub(_by_slot(target_logits, v) * state.inv_temperatures, v.log_e)
    greedy_accept(
        views=v,
        target_logits=perturbed.transpose(0, 1).reshape(bs * perturbed.shape[0], -1),
        accept_lens=v.greedy_accept_lens,
        bonus=v.greedy_bonus,
        ragged=ragged,
    )
    seeded = state.sampling.is_seeded.view(1, bs)
    torch.where(seeded, v.greedy_accept_lens, v.accept_row, out=v.accept_row)
    torch.where(seeded, v.greedy_bonus, v.bonus, out=v.bonus)


def accept(
    *,
    views: DSparkStepViews,
    target_logits: torch.Tensor,  # [rows run, V]
    mode: SamplingMode,
    query_index: Optional[torch.Tensor] = None,  # a ragged verify's places
    extras: SamplingExtras = NO_EXTRAS,
) -> None:
    """Accept lengths into ``views.accept_lens``, the bonus into the batch
    state's ``last_ids``, by the batch's rule (chosen once, by ``mode``).
    After a ragged verify its rows' logits are placed in the window first,
    and the drafts it did not verify end each block."""
    v, ragged = views, query_index is not None
    if ragged:
        target_logits = v.grid_logits.index_copy_(0, query_index, target_logits)
        torch.lt(v.slot_index, v.verify_lens_row, out=v.verify_mask)
    raw = target_logits  # the model's own, for the logprobs
    if extras.processed:  # request-major again, as the rules read it
        processed = process_logits(
            _by_slot(target_logits, v),
            v.state.sampling,
            history=_draft_history(v) if extras.penalized else None,
            slot_offsets=v.slot_offsets,
            extras=extras,
        )
        target_logits = processed.transpose(0, 1).reshape(raw.shape)
    rule = dict(views=v, target_logits=target_logits, ragged=ragged)
    if mode is SamplingMode.GREEDY:
        greedy_accept(accept_lens=v.accept_row, bonus=v.bonus, **rule)
    else:
        rejection_accept(accept_lens=v.accept_row, bonus=v.bonus, **rule)
        if mode is SamplingMode.MIXED:  # greedy rows take the greedy rule's
            greedy_accept(
                accept_lens=v.greedy_accept_lens, bonus=v.greedy_bonus, **rule
            )
            torch.where(
                v.is_sampled, v.accept_row, v.greedy_accept_lens, out=v.accept_row
            )
            torch.where(v.is_sampled, v.bonus, v.greedy_bonus, out=v.bonus)
        if extras.seeded:
            _coupled_accept(v, target_logits, ragged)
    if extras.counted or extras.logprobs:
        _committed(v)
        if extras.logprobs:
            bs = v.accept_lens.shape[0]
            rows = raw.view(bs, -1, raw.shape[-1])  # request-major
            v.logprobs.copy_(token_logprobs(rows, v.committed))

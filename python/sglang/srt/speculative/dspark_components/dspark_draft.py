"""DSpark draft: one forward pass proposes a block of gamma tokens."""

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from sglang.srt.layers.sampler import exp1_noise_
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)

if TYPE_CHECKING:
    from sglang.srt.layers.attention import AttentionMetadata
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.models.dspark import DSparkDraftModel
    from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
    from sglang.srt.speculative.dspark_components.dspark_planner import VerifyWindow


def _make_num_token_non_padded(
    num_tokens: int,
    device: torch.device | str,
    *,
    out: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """The int32 device scalar the EP MoE router reads, or None when unread.

    Building it per step was a host-to-device copy on every decode step; on
    EP size 1 nothing reads it, so nothing is made. With ``out`` (an int32
    0-dim buffer on ``device``, allocated once) the count is filled in place
    instead of building a new tensor.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
        raise ValueError(
            f"num_tokens must be an int, got {type(num_tokens).__name__} "
            f"{num_tokens!r}"
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not enable_num_token_non_padded():
        return None
    if out is not None:
        if out.dtype != torch.int32 or out.dim() != 0:
            raise ValueError(
                f"out must be a 0-dim int32 tensor, got {out.dtype} {tuple(out.shape)}"
            )
        return out.fill_(int(num_tokens))
    return torch.tensor(int(num_tokens), dtype=torch.int32).to(
        device, non_blocking=True
    )


@dataclass(frozen=True)
class DraftProposal:
    """Views of the proposer's buffers: valid until the next ``propose``."""

    draft_tokens: torch.Tensor  # [bs, gamma] int64
    # Markov-corrected logits; None when all greedy.
    draft_logits: Optional[torch.Tensor]  # [bs, gamma, vocab]
    block_ids: torch.Tensor  # [bs, gamma]: anchor, then mask_token_id
    # q = softmax(draft_logits / T), what verify judges the drafts by (rows
    # of greedy requests hold softmax(draft_logits)); None when all greedy.
    draft_probs: Optional[torch.Tensor] = None  # [bs, gamma, vocab]


@dataclass(frozen=True)
class _BlockViews:
    """The proposer's buffers cut to one batch size: made once per size, so
    a step dispatches no slicing ops of its own."""

    anchors: torch.Tensor  # [bs]: column 0 of block_ids
    positions: torch.Tensor  # [bs, gamma]
    last_positions: torch.Tensor  # [bs, 1]
    out_cache_loc: torch.Tensor  # [bs, gamma]
    kv_lens: torch.Tensor  # [bs, gamma]
    block_ids: torch.Tensor  # [bs, gamma]
    flat: Tuple[torch.Tensor, ...]  # input ids, positions, slots, kv_lens: [bs * gamma]
    tokens: torch.Tensor  # [bs, gamma]
    logits: torch.Tensor  # [bs, gamma, vocab]
    flat_logits: torch.Tensor  # [bs * gamma, vocab]
    correction: torch.Tensor  # [bs, vocab]
    hidden: torch.Tensor  # [bs, rank]
    scaled: torch.Tensor  # [bs, gamma, vocab]: logits / T
    gumbel: torch.Tensor  # [bs, gamma, vocab]: log Exp(1), then scaled - it
    probs: torch.Tensor  # [bs, gamma, vocab]: softmax(scaled)
    greedy: torch.Tensor  # [bs]: a slot's argmax, for mixed batches
    # per k: logits, tokens, scaled, gumbel ([bs, vocab], [bs], ...)
    slots: Tuple[Tuple[torch.Tensor, ...], ...]


class DraftBlockProposer:
    """Builds the draft block batch, runs it once, samples the block left to
    right through the Markov head."""

    def __init__(
        self,
        *,
        draft_model: "DSparkDraftModel",
        draft_runner: "ModelRunner",
        config: "DSparkConfig",
        max_batch_size: int,
        device,
    ) -> None:
        self.draft_model, self.draft_runner = draft_model, draft_runner
        self.gamma, self.device = config.gamma, device
        self.max_batch_size = max_batch_size
        shape = (max_batch_size, config.gamma)
        # Preallocated at the largest batch; propose() fills slices in place.
        self._block_ids = torch.full(
            shape, config.mask_token_id, dtype=torch.int64, device=device
        )
        self._positions = torch.zeros(shape, dtype=torch.int64, device=device)
        self._out_cache_loc = torch.zeros(shape, dtype=torch.int64, device=device)
        self._kv_lens = torch.zeros(shape, dtype=torch.int64, device=device)
        self._draft_tokens = torch.zeros(shape, dtype=torch.int64, device=device)
        # Filled per step only when EP > 1 reads it; never re-allocated.
        self._num_token_non_padded = torch.zeros((), dtype=torch.int32, device=device)
        vocab = draft_model.lm_head.weight.shape[0]
        self._draft_logits = torch.zeros(shape + (vocab,), device=device)
        # The Markov head's per-slot intermediates: W1[x] and W2(W1[x]).
        rank = draft_model.markov_w1.weight.shape[1]
        self._markov_hidden = torch.zeros(max_batch_size, rank, device=device)
        self._markov_correction = torch.zeros(max_batch_size, vocab, device=device)
        # Sampling requests: scaled logits, Gumbel noise and q, per block slot.
        self._scaled = torch.zeros(shape + (vocab,), device=device)
        self._gumbel = torch.zeros(shape + (vocab,), device=device)
        self._draft_probs = torch.zeros(shape + (vocab,), device=device)
        self._greedy = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        # Tabulate the Markov head now (small vocabularies), not in a step.
        draft_model.markov_table()
        # kv_lens = last block position + these ones: one broadcast add.
        self._ones = torch.ones(config.gamma, dtype=torch.int64, device=device)
        self._block_views: Dict[int, _BlockViews] = {}

    def _views(self, bs: int) -> _BlockViews:
        views = self._block_views.get(bs)
        if views is None:
            block_ids, positions = self._block_ids[:bs], self._positions[:bs]
            out_cache_loc, kv_lens = self._out_cache_loc[:bs], self._kv_lens[:bs]
            tokens, logits = self._draft_tokens[:bs], self._draft_logits[:bs]
            scaled, gumbel = self._scaled[:bs], self._gumbel[:bs]
            views = _BlockViews(
                anchors=block_ids[:, 0],
                positions=positions,
                last_positions=positions[:, -1:],
                out_cache_loc=out_cache_loc,
                kv_lens=kv_lens,
                block_ids=block_ids,
                flat=tuple(
                    t.view(-1) for t in (block_ids, positions, out_cache_loc, kv_lens)
                ),
                tokens=tokens,
                logits=logits,
                flat_logits=logits.view(bs * self.gamma, -1),
                correction=self._markov_correction[:bs],
                hidden=self._markov_hidden[:bs],
                scaled=scaled,
                gumbel=gumbel,
                probs=self._draft_probs[:bs],
                greedy=self._greedy[:bs],
                slots=tuple(
                    (logits[:, k], tokens[:, k], scaled[:, k], gumbel[:, k])
                    for k in range(self.gamma)
                ),
            )
            self._block_views[bs] = views
        return views

    @torch.no_grad()  # the Markov head's out= ops read trainable weights
    def propose(
        self,
        *,
        batch: "ScheduleBatch",
        window: "VerifyWindow",
        generator: Optional[torch.Generator] = None,
        verify_metadata: Optional["AttentionMetadata"] = None,
    ) -> DraftProposal:
        """``verify_metadata``: the same step's verify metadata, when built
        ahead (see ``ForwardBatch.attn_metadata``); the block then reads its
        slots and its mask row ``gamma - 1`` up to the block's own bound, one
        key less: every block row sees the context and the whole block, as
        that verify row does (``DSparkDraftModel.init_forward_metadata``)."""
        bs, gamma = batch.batch_size, self.gamma
        if bs > self.max_batch_size:
            raise ValueError(
                f"batch of {bs} exceeds max_batch_size={self.max_batch_size}"
            )
        v = self._views(bs)
        v.anchors.copy_(batch.last_ids)  # the anchor is the last bonus token
        v.positions.copy_(window.positions[:, :gamma])
        v.out_cache_loc.copy_(window.out_cache_loc[:, :gamma])
        # Non-causal: every block row sees the context and the whole block.
        torch.add(v.last_positions, self._ones, out=v.kv_lens)
        input_ids, positions, out_cache_loc, kv_lens = v.flat
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            tokens_per_req=gamma,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            kv_lens=kv_lens,
            num_token_non_padded=_make_num_token_non_padded(
                bs * gamma, self.device, out=self._num_token_non_padded
            ),
            num_token_non_padded_cpu=bs * gamma,
        )
        if verify_metadata is not None and self.draft_runner.runs_as_given(
            forward_batch
        ):
            forward_batch.attn_metadata = self.draft_model.init_forward_metadata(
                forward_batch, verify_metadata=verify_metadata
            )
        base = self.draft_runner.forward(forward_batch).logits  # [bs * gamma, V]
        v.flat_logits.copy_(base)  # each slot then adds its correction
        # DSparkDraftModel.markov_correction's arithmetic, written into the
        # buffers instead of new tensors: a row of the tabulated head, or the
        # embedding row then the bias-free linear.
        table = self.draft_model.markov_table()  # [vocab, vocab] or None
        if table is None:
            w1 = self.draft_model.markov_w1.weight  # [vocab, rank]
            w2_t = self.draft_model.markov_w2.weight.t()  # [rank, vocab]
        info = batch.sampling_info
        if info is not None:
            # Gumbel-max: argmax(logits / T + G), G = -log E with E ~ Exp(1),
            # is a draw from softmax(logits / T); one draw for the whole block.
            # log E is kept and subtracted: s - log E == s + G exactly.
            exp1_noise_(v.gumbel, generator).log_()
        prev = batch.last_ids
        # x_0 = anchor; logits_k = base_k + W2(W1[x_(k-1)]), left to right.
        for logits_k, tokens_k, scaled_k, gumbel_k in v.slots:  # [bs, vocab], [bs]
            if table is not None:
                torch.index_select(table, 0, prev, out=v.correction)
            else:
                torch.index_select(w1, 0, prev, out=v.hidden)
                torch.mm(v.hidden, w2_t, out=v.correction)
            logits_k.add_(v.correction)
            if info is None:
                torch.argmax(logits_k, dim=-1, out=tokens_k)
            else:
                torch.mul(logits_k, info.inv_temperatures, out=scaled_k)
                torch.sub(scaled_k, gumbel_k, out=gumbel_k)
                torch.argmax(gumbel_k, dim=-1, out=tokens_k)
                if not info.all_sampled:  # greedy rows take the argmax
                    torch.argmax(logits_k, dim=-1, out=v.greedy)
                    torch.where(info.is_sampled, tokens_k, v.greedy, out=tokens_k)
            prev = tokens_k
        if info is not None:
            torch._softmax(v.scaled, -1, False, out=v.probs)  # q, one op
        return DraftProposal(
            draft_tokens=v.tokens,
            draft_logits=None if info is None else v.logits,
            draft_probs=None if info is None else v.probs,
            block_ids=v.block_ids,
        )

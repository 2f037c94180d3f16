"""DSpark draft: one forward pass proposes a block of gamma tokens."""

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from sglang.srt.layers.sampler import sample_tokens
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)

if TYPE_CHECKING:
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
    # Markov-corrected logits, the draft distribution q; None when all greedy.
    draft_logits: Optional[torch.Tensor]  # [bs, gamma, vocab]
    block_ids: torch.Tensor  # [bs, gamma]: anchor, then mask_token_id


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
        # Tabulate the Markov head now (small vocabularies), not in a step.
        draft_model.markov_table()
        # kv_lens = last block position + these ones: one broadcast add.
        self._ones = torch.ones(config.gamma, dtype=torch.int64, device=device)
        # Per batch size, each slot's (logits, token) views of the buffers:
        # made once, so the slot loop dispatches no view ops.
        self._slot_views: Dict[int, Tuple[Tuple[torch.Tensor, torch.Tensor], ...]] = {}

    def _slots(self, bs: int) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
        if bs not in self._slot_views:
            self._slot_views[bs] = tuple(
                (self._draft_logits[:bs, k], self._draft_tokens[:bs, k])
                for k in range(self.gamma)
            )
        return self._slot_views[bs]

    @torch.no_grad()  # the Markov head's out= ops read trainable weights
    def propose(
        self,
        *,
        batch: "ScheduleBatch",
        window: "VerifyWindow",
        generator: Optional[torch.Generator] = None,
    ) -> DraftProposal:
        bs, gamma = batch.batch_size, self.gamma
        if bs > self.max_batch_size:
            raise ValueError(
                f"batch of {bs} exceeds max_batch_size={self.max_batch_size}"
            )
        block_ids = self._block_ids[:bs]
        block_ids[:, 0].copy_(batch.last_ids)  # the anchor is the last bonus token
        positions = self._positions[:bs]
        positions.copy_(window.positions[:, :gamma])
        out_cache_loc = self._out_cache_loc[:bs]
        out_cache_loc.copy_(window.out_cache_loc[:, :gamma])
        # Non-causal: every block row sees the context and the whole block.
        kv_lens = torch.add(positions[:, -1:], self._ones, out=self._kv_lens[:bs])
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            tokens_per_req=gamma,
            input_ids=block_ids.view(-1),
            positions=positions.view(-1),
            out_cache_loc=out_cache_loc.view(-1),
            req_pool_indices=batch.req_pool_indices,
            kv_lens=kv_lens.view(-1),
            num_token_non_padded=_make_num_token_non_padded(
                bs * gamma, self.device, out=self._num_token_non_padded
            ),
            num_token_non_padded_cpu=bs * gamma,
        )
        base = self.draft_runner.forward(forward_batch).logits  # [bs * gamma, V]
        tokens, logits = self._draft_tokens[:bs], self._draft_logits[:bs]
        logits.view(bs * gamma, -1).copy_(base)  # each slot adds its correction
        correction = self._markov_correction[:bs]  # [bs, vocab]
        # DSparkDraftModel.markov_correction's arithmetic, written into the
        # buffers instead of new tensors: a row of the tabulated head, or the
        # embedding row then the bias-free linear.
        table = self.draft_model.markov_table()  # [vocab, vocab] or None
        hidden = self._markov_hidden[:bs]  # [bs, rank]
        w1 = self.draft_model.markov_w1.weight  # [vocab, rank]
        w2_t = self.draft_model.markov_w2.weight.t()  # [rank, vocab]
        prev = batch.last_ids
        # x_0 = anchor; logits_k = base_k + W2(W1[x_(k-1)]), left to right.
        for logits_k, tokens_k in self._slots(bs):  # [bs, vocab], [bs]
            if table is not None:
                torch.index_select(table, 0, prev, out=correction)
            else:
                torch.index_select(w1, 0, prev, out=hidden)
                torch.mm(hidden, w2_t, out=correction)
            sample_tokens(
                logits=logits_k.add_(correction),
                temperatures=batch.temperatures,
                generator=generator,
                out=tokens_k,
            )
            prev = tokens_k
        return DraftProposal(
            draft_tokens=tokens,
            draft_logits=logits if batch.temperatures is not None else None,
            block_ids=block_ids,
        )

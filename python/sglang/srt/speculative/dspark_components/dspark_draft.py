"""DSpark draft: one forward pass proposes a block of gamma tokens."""

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers.sampler import (
    NO_EXTRAS,
    SamplingExtras,
    SamplingMode,
    process_logits,
)
from sglang.srt.model_executor.forward_batch_info import (
    enable_num_token_non_padded,
    fill_mlp_sync_metadata,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.phases import PhaseSpans

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.models.dspark import DSparkDraftModel
    from sglang.srt.speculative.dspark_components.dspark_buffers import DSparkStepViews
    from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig


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
class DraftBlockSpecInfo:
    """The draft block's rows per request: what scales every DP rank's
    request count into its draft-forward rows."""

    num_tokens_per_req: int  # gamma
    num_tokens_for_logprob_per_req: int = 1


@dataclass(frozen=True)
class DraftProposal:
    """Views of the step buffers: valid until the next step."""

    draft_tokens: torch.Tensor  # [bs, gamma] int64 (the verify ids' drafts)
    # q = softmax(corrected logits / T) per slot, slot-major, what acceptance
    # judges the drafts by; None for an all-greedy batch.
    draft_probs: Optional[torch.Tensor]  # [gamma, bs, vocab]
    block_ids: torch.Tensor  # [bs, gamma]: anchor, then mask_token_id


class DraftBlockProposer:
    """Builds the draft block batch, runs it once, samples the block left to
    right through the Markov head, writing the drafts into the verify ids."""

    def __init__(
        self,
        *,
        draft_model: "DSparkDraftModel",
        draft_model_runner: "ModelRunner",
        config: "DSparkConfig",
        device,
        spans: Optional[PhaseSpans] = None,
    ) -> None:
        self.draft_model, self.draft_model_runner = draft_model, draft_model_runner
        self.gamma, self.device = config.gamma, device
        self._draft_block_spec_info = DraftBlockSpecInfo(num_tokens_per_req=self.gamma)
        # Under DP attention the draft's MoE syncs with the other DP ranks:
        # its forward carries every rank's rows (the dense draft would not).
        self._dp_moe_sync = get_parallel().enable_dp_attention
        self.spans = spans or PhaseSpans()
        # block kv_lens = the block's last position + these ones: one add.
        self._ones = torch.ones(config.gamma, dtype=torch.int64, device=device)
        # Tabulate the Markov head now (small vocabularies), not in a step.
        draft_model.markov_table()

    def prepare(
        self, *, views: "DSparkStepViews", batch: "ScheduleBatch", scalar: torch.Tensor
    ) -> None:
        """Per step, on the host, before the device step (a graph reads what
        it sets): the draft batch's ``num_token_non_padded`` for its real
        rows, filled into ``scalar`` (a 0-dim int32 buffer of the step's)
        when EP > 1 reads it; under DP attention, every rank's rows."""
        self.count_real_rows(
            views=views, num_tokens=batch.batch_size * self.gamma, scalar=scalar
        )
        self._fill_dp_moe_sync_metadata(views.draft_batch, batch, scalar=scalar)

    def count_real_rows(
        self, *, views: "DSparkStepViews", num_tokens: int, scalar: torch.Tensor
    ) -> None:
        """The draft batch's real rows, ``num_tokens``: its
        ``num_token_non_padded`` (``scalar`` filled when EP > 1 reads it) and
        the host's count."""
        draft_batch = views.draft_batch
        draft_batch.num_token_non_padded = _make_num_token_non_padded(
            num_tokens, self.device, out=scalar
        )
        draft_batch.num_token_non_padded_cpu = num_tokens

    def _fill_dp_moe_sync_metadata(
        self, forward_batch, batch, scalar: Optional[torch.Tensor] = None
    ) -> None:
        """Under DP attention with a MoE draft: every DP rank's request count
        (``batch.global_num_tokens``, kept as the original counts) scaled to
        draft rows, and this rank's ``num_token_non_padded`` for its own real
        rows (into ``scalar`` when given). Nothing for a dense draft or
        without the counts: the local count stands."""
        if not self._dp_moe_sync or batch.global_num_tokens is None:
            return
        spec = self._draft_block_spec_info
        device = self.draft_model_runner.device
        fill_mlp_sync_metadata(
            forward_batch,
            global_counts=batch.global_num_tokens,
            global_counts_for_logprob=batch.global_num_tokens_for_logprob,
            num_tokens_per_req=spec.num_tokens_per_req,
            num_tokens_for_logprob_per_req=spec.num_tokens_for_logprob_per_req,
            can_run_dp_cuda_graph=batch.can_run_dp_cuda_graph,
            device=device,
        )
        own = forward_batch.global_num_tokens_cpu[get_parallel().attn_dp_rank]
        forward_batch.num_token_non_padded = _make_num_token_non_padded(
            own, device, out=scalar
        )
        forward_batch.num_token_non_padded_cpu = own

    @torch.no_grad()  # the Markov head's out= ops read trainable weights
    def propose(
        self,
        *,
        views: "DSparkStepViews",
        mode: SamplingMode,
        confidence: bool = False,
        extras: SamplingExtras = NO_EXTRAS,
    ) -> DraftProposal:
        """The block of every request in ``views``: the window, the batch
        state and the step's attention metadata (the verify batch's, from
        which the block derives its own) are filled. With ``confidence``,
        also each draft's probability under the draft's own distribution
        (q(d), T = 1 for greedy rows), into ``views.confidence``: what the
        verify budget is planned by. With ``extras.processed`` each slot's
        logits go through the sampling parameters' processing first, with
        the drafts before it as history, so that q is the processed draft
        distribution the verify judges against."""
        v, state, gamma = views, views.state, self.gamma
        v.block_anchors.copy_(state.last_ids)  # the anchor is the last bonus token
        v.block_positions.copy_(v.window_block_positions)
        v.block_slots.copy_(v.window_block_slots)
        # Non-causal: every block row sees the context and the whole block.
        torch.add(v.window_last_block_position, self._ones, out=v.block_kv_lens)
        with self.spans("draft forward"):
            batch = v.draft_batch
            batch.attn_metadata = self.draft_model.init_forward_metadata(
                batch, verify_metadata=v.verify_batch.attn_metadata
            )
            base = self.draft_model_runner.forward(batch).logits  # [bs * gamma, V]
        base = base.view(-1, gamma, base.shape[-1])  # [bs, gamma, V]
        sampled = mode is not SamplingMode.GREEDY
        if extras.processed:
            self._sample_processed(v, base, sampled, extras)
        else:
            self._sample(v, base, sampled)
        v.drafts_by_slot.copy_(v.sampled)  # into the verify ids
        if not (sampled or confidence):
            return DraftProposal(
                draft_tokens=v.drafts, draft_probs=None, block_ids=v.block_ids
            )
        # q = softmax(corrected / T) per slot (greedy rows: T taken as 1).
        if not extras.processed:  # (the processed path filled corrected)
            torch.add(base.transpose(0, 1), v.corrections, out=v.corrected)
        if sampled:
            torch.mul(v.corrected, state.inv_temperatures, out=v.scaled)
        torch._softmax(v.scaled if sampled else v.corrected, -1, False, out=v.q_drafts)
        if confidence:
            torch.gather(v.q_drafts, 2, v.sampled_index, out=v.confidence_cells)
        return DraftProposal(
            draft_tokens=v.drafts,
            draft_probs=v.q_drafts if sampled else None,
            block_ids=v.block_ids,
        )

    def _markov_head(self):
        """The Markov head for this step's slots: its table, or None and the
        low-rank path's two weights."""
        table = self.draft_model.markov_table()  # [V, V] or None
        if table is not None:
            return table, None, None
        w1 = self.draft_model.markov_w1.weight  # [V, rank]
        return None, w1, self.draft_model.markov_w2.weight.t()  # [rank, V]

    @staticmethod
    def _correct(v, head, prev: torch.Tensor, out: torch.Tensor) -> None:
        """DSparkDraftModel.markov_correction's arithmetic, into ``out``: a
        row of the tabulated head, or the embedding row then the linear."""
        table, w1, w2_t = head
        if table is not None:
            torch.index_select(table, 0, prev, out=out)
        else:
            torch.index_select(w1, 0, prev, out=v.markov_hidden)
            torch.mm(v.markov_hidden, w2_t, out=out)

    def _sample(self, v, base: torch.Tensor, sampled: bool) -> None:
        """The block left to right: x_0 = anchor; slot k samples from
        base_k + W2(W1[x_(k-1)]), by the Gumbel rule (its noise added to
        every slot at once first)."""
        state = v.state
        if sampled:
            # argmax(logits / T + G) == argmax(logits - T log E): T = 0 rows
            # (a mixed batch's greedy ones) keep their plain logits.
            torch.addcmul(
                base.transpose(0, 1), v.block_noise, state.neg_temperatures, out=v.noisy
            )
            sources = v.noisy_slots
        else:
            sources = base.unbind(1)
        head, prev = self._markov_head(), state.last_ids
        for source, correction, tokens in zip(
            sources, v.correction_slots, v.sampled_slots
        ):  # [bs, V], [bs, V], [bs]
            self._correct(v, head, prev, correction)
            torch.add(source, correction, out=v.scratch)
            torch.argmax(v.scratch, dim=-1, out=tokens)
            prev = tokens

    def _sample_processed(
        self, v, base: torch.Tensor, sampled: bool, extras: SamplingExtras
    ) -> None:
        """``_sample`` with each slot's corrected logits processed by the
        sampling parameters (``process_logits``: penalties counting the
        drafts before the slot, min_new_tokens, truncation) into
        ``v.corrected`` before its draw."""
        state, st = v.state, v.state.sampling
        drafted = None  # [bs, V]: d_1..d_k so far, what penalties count
        if extras.penalized:
            drafted = torch.zeros_like(st.counts)
            ones = torch.ones_like(state.last_ids, dtype=drafted.dtype).unsqueeze(1)
        head, prev = self._markov_head(), state.last_ids
        for k, (correction, tokens) in enumerate(
            zip(v.correction_slots, v.sampled_slots)
        ):
            self._correct(v, head, prev, correction)
            corrected = v.corrected[k]  # [bs, V]
            torch.add(base[:, k], correction, out=corrected)
            processed = process_logits(
                corrected.unsqueeze(0),
                st,
                history=None if drafted is None else drafted.unsqueeze(0),
                slot_offsets=v.slot_offsets[k : k + 1],
                extras=extras,
            )
            corrected.copy_(processed[0])
            source = corrected
            if sampled:
                torch.addcmul(
                    corrected, v.block_noise[k], state.neg_temperatures, out=v.scratch
                )
                source = v.scratch
            torch.argmax(source, dim=-1, out=tokens)
            if drafted is not None:
                drafted.scatter_add_(1, tokens.unsqueeze(1), ones)
            prev = tokens

"""The DSpark step's buffer arena: every per-step tensor, allocated once.

``DSparkStepBuffers(...).at(bs)`` gives ``DSparkStepViews``: the batch
state, the verify window, the draft block and verify batches (prebuilt
``ForwardBatch``es over these very views), the Markov head's and the
sampler's scratch, and acceptance's. Shapes, for a batch of B requests,
block gamma (g) and vocabulary V:

    window     positions, slots                 [B, g + 1]
    verify     ids [bonus, d_1..d_g], kv_lens   [B, g + 1]
    block      ids [anchor, mask..], positions,
               slots, kv_lens                   [B, g]
    markov     corrections, noisy logits,
               corrected and scaled logits      [g, B, V]
    noise      log E, then u (one draw)         [g + 1, B, V], [g, B]
    accept     target argmax                    [g + 1, B]
               matches, then a row of 0         [g + 1, B] uint8
               target / T                       [g + 1, B, V]
               p = its softmax, and q =
               softmax(corrected / T), side
               by side (q's row g: 0)           [2, g + 1, B, V]
               the drafts' p and q, and the
               bonus row's                      [2, g, B], [2, 1, B, V]

Per-slot tensors are slot-major ([slot, request, vocab]) and contiguous at
every batch size (``at(bs)`` views the first elements of one flat buffer
as [slot, bs, vocab]): a slot's rows are contiguous, and so are q's first
g slots, which a softmax writes in place. p and q lie side by side, so that
one gather reads both at the drafts (and one at the bonus row); the draws
of a step lie in one buffer, so that one generator call fills them. Sizes
share that memory, so the two constant rows (q's and ``matched``'s last)
are refilled by ``set_constants(bs)`` whenever a step runs at another size.
The sampler writes the drafts slot by slot into a contiguous [g, B] buffer
(compiled code takes no strided ``out=``), copied once into the verify ids;
the bonus lands straight in the batch state's ``last_ids``.
"""

import math
from dataclasses import dataclass
from typing import Tuple

import torch

from sglang.srt.managers.schedule_batch import BatchState, BatchStateBuffers
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    step_num_token_non_padded,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.step_buffers import StepBuffers
from sglang.srt.speculative.dspark_components.dspark_planner import (
    VerifyWindow,
    blind_gains,
)


@dataclass(frozen=True)
class DSparkStepViews:
    state: BatchState
    # The verify window: positions seq_len - 1 .. seq_len - 1 + g, their slots.
    window: VerifyWindow  # [B, g + 1] each
    table_index: torch.Tensor  # [B, g + 1]: flat index into req->slot table
    flat_table_index: torch.Tensor  # [B * (g + 1)]
    seq_len_col: torch.Tensor  # [B, 1]: the state's seq_lens
    req_pool_col: torch.Tensor  # [B, 1]: the state's req_pool_indices
    verify_ids: torch.Tensor  # [B, g + 1]: bonus, then the drafts
    drafts: torch.Tensor  # [B, g]: verify_ids[:, 1:]
    verify_kv_lens: torch.Tensor  # [B, g + 1]
    verify_batch: ForwardBatch  # TARGET_VERIFY over the above
    verify_anchors: torch.Tensor  # [B]: verify_ids[:, 0]
    drafts_by_slot: torch.Tensor  # [g, B]: the verified drafts (a view)
    draft_index: torch.Tensor  # [g, B, 1]: the same, a gather index
    sampled: torch.Tensor  # [g, B]: the sampler's drafts, contiguous
    sampled_slots: Tuple[torch.Tensor, ...]  # g x [B]: its rows
    block_ids: torch.Tensor  # [B, g]: anchor, then mask_token_id
    block_anchors: torch.Tensor  # [B]: block_ids[:, 0]
    window_block_positions: torch.Tensor  # [B, g]: window positions[:, :g]
    window_block_slots: torch.Tensor  # [B, g]
    window_last_block_position: torch.Tensor  # [B, 1]: positions[:, g - 1]
    window_anchor_positions: torch.Tensor  # [B]: positions[:, 0]
    window_anchor_slots: torch.Tensor  # [B]: slots[:, 0]
    block_positions: torch.Tensor  # [B, g]
    block_slots: torch.Tensor  # [B, g]
    block_kv_lens: torch.Tensor  # [B, g]: non-causal, the block's last + 1
    draft_batch: ForwardBatch  # DRAFT_EXTEND_V2 over the block
    corrections: torch.Tensor  # [g, B, V]: W2(W1[x_(k-1)]) per slot
    correction_slots: Tuple[torch.Tensor, ...]  # g x [B, V]
    markov_hidden: torch.Tensor  # [B, rank]: W1[x], the low-rank path
    noisy: torch.Tensor  # [g, B, V]: base logits - T log E
    noisy_slots: Tuple[torch.Tensor, ...]  # g x [B, V]
    scratch: torch.Tensor  # [B, V]
    corrected: torch.Tensor  # [g, B, V]: base + corrections, the draft's logits
    scaled: torch.Tensor  # [g, B, V]: corrected / T
    q: torch.Tensor  # [g + 1, B, V]: q per slot, then a row of zeros (pq[1])
    q_drafts: torch.Tensor  # [g, B, V]: q[:g]
    draws: torch.Tensor  # [(g + 1) B V + g B]: log_e's uniforms, then u's
    log_e: torch.Tensor  # [g + 1, B, V]: noise of the block, then the bonus's
    block_noise: torch.Tensor  # [g, B, V]
    bonus_noise: torch.Tensor  # [1, B, V]
    u: torch.Tensor  # [g, B]: acceptance draws
    target_ids: torch.Tensor  # [g + 1, B]: the target's argmax per row
    target_drafts: torch.Tensor  # [g, B]: the rows that judge d_1..d_g
    matched: torch.Tensor  # [g + 1, B] uint8: draft j accepted, then 0
    matched_drafts: torch.Tensor  # [g, B]
    accept_lens: torch.Tensor  # [B] int64: drafts accepted, 0..g
    accept_row: torch.Tensor  # [1, B]: accept_lens (a gather index)
    target_scaled: torch.Tensor  # [g + 1, B, V]: target logits / T
    pq: torch.Tensor  # [2, g + 1, B, V]: p, then q
    pq_drafts: torch.Tensor  # [2, g, B, V]: pq[:, :g]
    pq_draft_index: torch.Tensor  # [2, g, B, 1]: draft_index, twice (a view)
    pq_accept_rows: torch.Tensor  # [2, 1, B, V]: accept_lens, expanded
    p: torch.Tensor  # [g + 1, B, V]: softmax(target / T) (pq[0])
    pq_tok: torch.Tensor  # [2, g, B, 1]: p, then q, of each draft
    q_tok_flat: torch.Tensor  # [g, B]
    p_tok_flat: torch.Tensor  # [g, B]
    pq_row: torch.Tensor  # [2, 1, B, V]: p and q at the first rejection
    p_row: torch.Tensor  # [1, B, V]: p at the first rejection (or the last)
    q_row: torch.Tensor  # [1, B, V]
    bonus_row: torch.Tensor  # [1, B, V]: max(p - q, 0), or p without mass
    mass: torch.Tensor  # [1, B, 1]
    has_mass: torch.Tensor  # [1, B, 1] bool
    bonus: torch.Tensor  # [1, B]: the state's last_ids (the bonus lands there)
    is_sampled: torch.Tensor  # [1, B]: the state's
    greedy_accept_lens: torch.Tensor  # [1, B]: a mixed batch's greedy rows'
    greedy_bonus: torch.Tensor  # [1, B]
    packed: torch.Tensor  # [B, g + 3]: accept length, verify length, drafts,
    # bonus (read once, on CUDA)
    # The verify budget (DSparkVerifyPlanner / ScheduleVerifyLensTopk):
    confidence: torch.Tensor  # [g, B]: q of each draft, the draft's confidence
    confidence_cells: torch.Tensor  # [g, B, 1]: the same (a gather output)
    sampled_index: torch.Tensor  # [g, B, 1]: the sampler's drafts (a gather index)
    slot_index: torch.Tensor  # [g, 1]: 0..g-1
    bonus_noise_rows: torch.Tensor  # [B, V]: bonus_noise[0]
    verify_lens: torch.Tensor  # [B] int64: drafts each request verifies
    verify_lens_row: torch.Tensor  # [1, B]
    verify_lens_cell: torch.Tensor  # [1, B, 1]
    verify_mask: torch.Tensor  # [g, B] bool: draft k is verified
    full_accept: torch.Tensor  # [1, B, 1] bool: every verified draft accepted
    accept_cell: torch.Tensor  # [1, B, 1]: accept_lens
    gains: torch.Tensor  # [g, B]: running products of the confidence
    requests_1: torch.Tensor  # [B] int64: 1..B
    padded_requests: torch.Tensor  # [B] bool scratch: past the real requests
    blind_requests: torch.Tensor  # [B] bool scratch: sampled, not seeded
    row_ends: torch.Tensor  # [B] int64 scratch
    grid_logits: torch.Tensor  # [B * (g + 1), V]: a ragged verify's, placed
    plain_batch: ForwardBatch  # budget 0: one row per request, the anchors
    plain_positions: torch.Tensor  # [B]
    plain_slots: torch.Tensor  # [B]
    # Sampling parameters beyond the temperature (SamplingExtras):
    slot_offsets: torch.Tensor  # [g + 1, 1]: 0..g, output position - out_lens
    committed: torch.Tensor  # [B, g + 1]: the step's committed tokens
    committed_valid: torch.Tensor  # [B, g + 1] bool: column <= accept length
    logprobs: torch.Tensor  # [B, g + 1]: the target's, of the committed tokens


@dataclass(frozen=True)
class RaggedViews:
    """A ragged verify of a batch size and budget (T = bs + budget rows)."""

    row_ids: torch.Tensor  # [T]: 0..T-1
    row_req: torch.Tensor  # [T]: each row's request
    query_index: torch.Tensor  # [T]: each row's place in the window
    top_values: torch.Tensor  # [budget] scratch of the top-k
    top_index: torch.Tensor  # [budget]
    ones: torch.Tensor  # [budget] int64 ones
    batch: ForwardBatch  # TARGET_VERIFY over the rows


def cut(flat: torch.Tensor, *shape: int) -> torch.Tensor:
    """The first elements of ``flat``, viewed as ``shape`` (contiguous)."""
    return flat[: math.prod(shape)].view(shape)


class DSparkStepBuffers(StepBuffers[DSparkStepViews]):
    def __init__(
        self,
        *,
        max_batch_size: int,
        gamma: int,
        vocab_size: int,
        markov_rank: int,
        mask_token_id: int,
        target_runner: ModelRunner,
        draft_runner: ModelRunner,
        query_shape: Tuple[int, int] = (1, 1),  # the target's (heads, head_dim)
    ) -> None:
        super().__init__(max_batch_size=max_batch_size)
        self.gamma, self.vocab_size = gamma, vocab_size
        self.target_runner, self.draft_runner = target_runner, draft_runner
        n, g, V, dev = max_batch_size, gamma, vocab_size, target_runner.device

        def ints(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=dev)

        def floats(*shape):
            return torch.zeros(shape, device=dev)

        self.state = BatchStateBuffers(max_batch_size=n, vocab_size=V, device=dev)
        self.positions, self.table_index = ints(n, g + 1), ints(n, g + 1)
        self.slots = ints(n, g + 1)
        self.verify_ids, self.verify_kv_lens = ints(n, g + 1), ints(n, g + 1)
        # Slot-major, then copied into the verify ids: out= must be contiguous
        # under torch.compile (argmax into a strided view is a graph break).
        self.draft_tokens = ints(g * n)
        self.block_ids = torch.full(
            (n, g), mask_token_id, dtype=torch.int64, device=dev
        )
        self.block_positions, self.block_slots = ints(n, g), ints(n, g)
        self.block_kv_lens = ints(n, g)
        # Slot-major, flat: cut per size into contiguous [slots, bs, ...] views.
        self.corrections, self.noisy = floats(g * n * V), floats(g * n * V)
        self.corrected, self.scaled = floats(g * n * V), floats(g * n * V)
        self.markov_hidden, self.scratch = floats(n, markov_rank), floats(n, V)
        # The step's uniform draws: the noise's, then acceptance's.
        self.draws = floats((g + 1) * n * V + g * n)
        self.target_ids = ints((g + 1) * n)
        # Row g is 0: the first 0 of a column is its accept length.
        self.matched = torch.zeros((g + 1) * n, dtype=torch.uint8, device=dev)
        self.accept_lens = ints(n)
        self.target_scaled = floats((g + 1) * n * V)
        # p, then q (its row g is 0: no draft past the block).
        self.pq = floats(2 * (g + 1) * n * V)
        self.pq_tok, self.pq_row = floats(2 * g * n), floats(2 * n * V)
        self.bonus_row, self.mass = floats(n * V), floats(n)
        self.has_mass = torch.zeros(n, dtype=torch.bool, device=dev)
        self.greedy_accept_lens, self.greedy_bonus = ints(n), ints(n)
        self.packed = ints(n, g + 3)
        self.confidence, self.gains = floats(g * n), floats(g * n)
        self.verify_lens = torch.full((n,), g, dtype=torch.int64, device=dev)
        self.verify_mask = torch.zeros(g * n, dtype=torch.bool, device=dev)
        self.full_accept = torch.zeros(n, dtype=torch.bool, device=dev)
        self.requests_1 = torch.arange(1, n + 1, device=dev)
        self.padded_requests = torch.zeros(n, dtype=torch.bool, device=dev)
        self.blind_requests = torch.zeros(n, dtype=torch.bool, device=dev)
        self.blind_gains = blind_gains(g, dev)
        self.row_ends = ints(n)
        # A ragged verify's rows (at most n * (g + 1)), and its scratch.
        t = n * (g + 1)
        self.row_ids = torch.arange(t, device=dev)
        self.row_req, self.query_index = ints(t), ints(t)
        self.ragged_ids, self.ragged_positions, self.ragged_slots = (
            ints(t),
            ints(t),
            ints(t),
        )
        self.top_values, self.top_index = floats(g * n), ints(g * n)
        self.ones = torch.ones(g * n, dtype=torch.int64, device=dev)
        self.slot_index = torch.arange(g, device=dev).unsqueeze(1)  # [g, 1]
        self.grid_logits = floats(t * V)
        self.plain_positions, self.plain_slots = ints(n), ints(n)
        self.query_shape = tuple(query_shape)
        self._query_grid = floats(t * math.prod(query_shape))  # ragged attention
        # A ragged verify's real requests (the rest pad the bucket).
        self.real_requests = torch.zeros((), dtype=torch.int64, device=dev)
        # Filled per step only when EP > 1 reads them; never re-allocated.
        self.verify_scalar = torch.zeros((), dtype=torch.int32, device=dev)
        self.draft_scalar = torch.zeros((), dtype=torch.int32, device=dev)
        self.slot_offsets = torch.arange(g + 1, device=dev).unsqueeze(1)
        self.committed = ints(n, g + 1)
        self.committed_valid = torch.zeros(n, g + 1, dtype=torch.bool, device=dev)
        self.logprobs = floats(n, g + 1)

    def set_constants(self, bs: int) -> None:
        """q's and ``matched``'s last rows back to 0 at this size (another
        size's step may have written there: its p, a larger size's, covers
        a smaller size's q)."""
        v = self.at(bs)
        v.q[-1].zero_()
        v.matched[-1].zero_()

    def _cut(self, bs: int) -> DSparkStepViews:
        g, V = self.gamma, self.vocab_size
        state = self.state.cut(bs)
        positions, slots = self.positions[:bs], self.slots[:bs]
        verify_ids, verify_kv_lens = self.verify_ids[:bs], self.verify_kv_lens[:bs]
        block_ids, block_positions = self.block_ids[:bs], self.block_positions[:bs]
        block_slots, block_kv_lens = self.block_slots[:bs], self.block_kv_lens[:bs]
        drafts, accept_lens = verify_ids[:, 1:], self.accept_lens[:bs]

        def batch(mode, q_len, ids, pos, locs, kv_lens, runner, capture, scalar):
            return ForwardBatch(
                forward_mode=mode,
                batch_size=bs,
                tokens_per_req=q_len,
                input_ids=ids.view(-1),
                positions=pos.view(-1),
                out_cache_loc=locs.view(-1),
                req_pool_indices=state.req_pool_indices,
                kv_lens=kv_lens.view(-1),
                num_token_non_padded=step_num_token_non_padded(scalar),
                num_token_non_padded_cpu=bs * q_len,
                capture_hidden_mode=capture,
                req_to_token_pool=runner.req_to_token_pool,
                token_to_kv_pool=runner.token_to_kv_pool,
            )

        verify_batch = batch(
            ForwardMode.TARGET_VERIFY,
            g + 1,
            verify_ids,
            positions,
            slots,
            verify_kv_lens,
            self.target_runner,
            CaptureHiddenMode.FULL,
            self.verify_scalar,
        )
        draft_batch = batch(
            ForwardMode.DRAFT_EXTEND_V2,
            g,
            block_ids,
            block_positions,
            block_slots,
            block_kv_lens,
            self.draft_runner,
            CaptureHiddenMode.NULL,
            self.draft_scalar,
        )
        corrections, noisy = cut(self.corrections, g, bs, V), cut(self.noisy, g, bs, V)
        pq = cut(self.pq, 2, g + 1, bs, V)
        q, noise = pq[1], (g + 1) * bs * V
        draws = self.draws[: noise + g * bs]
        log_e = draws[:noise].view(g + 1, bs, V)
        pq_row, pq_tok = cut(self.pq_row, 2, 1, bs, V), cut(self.pq_tok, 2, g, bs)
        target_ids, matched = cut(self.target_ids, g + 1, bs), cut(
            self.matched, g + 1, bs
        )
        sampled = cut(self.draft_tokens, g, bs)
        return DSparkStepViews(
            state=state,
            window=VerifyWindow(positions=positions, out_cache_loc=slots),
            table_index=self.table_index[:bs],
            flat_table_index=self.table_index[:bs].view(-1),
            seq_len_col=state.seq_lens.unsqueeze(1),
            req_pool_col=state.req_pool_indices.unsqueeze(1),
            verify_ids=verify_ids,
            drafts=drafts,
            verify_kv_lens=verify_kv_lens,
            verify_batch=verify_batch,
            verify_anchors=verify_ids[:, 0],
            drafts_by_slot=drafts.t(),
            draft_index=drafts.t().unsqueeze(-1),
            sampled=sampled,
            sampled_slots=sampled.unbind(0),
            block_ids=block_ids,
            block_anchors=block_ids[:, 0],
            window_block_positions=positions[:, :g],
            window_block_slots=slots[:, :g],
            window_last_block_position=positions[:, g - 1 : g],
            window_anchor_positions=positions[:, 0],
            window_anchor_slots=slots[:, 0],
            block_positions=block_positions,
            block_slots=block_slots,
            block_kv_lens=block_kv_lens,
            draft_batch=draft_batch,
            corrections=corrections,
            correction_slots=corrections.unbind(0),
            markov_hidden=self.markov_hidden[:bs],
            noisy=noisy,
            noisy_slots=noisy.unbind(0),
            scratch=self.scratch[:bs],
            corrected=cut(self.corrected, g, bs, V),
            scaled=cut(self.scaled, g, bs, V),
            q=q,
            q_drafts=q[:g],
            draws=draws,
            log_e=log_e,
            block_noise=log_e[:g],
            bonus_noise=log_e[g:],
            u=draws[noise:].view(g, bs),
            target_ids=target_ids,
            target_drafts=target_ids[:g],
            matched=matched,
            matched_drafts=matched[:g],
            accept_lens=accept_lens,
            accept_row=accept_lens.view(1, bs),
            target_scaled=cut(self.target_scaled, g + 1, bs, V),
            pq=pq,
            pq_drafts=pq[:, :g],
            pq_draft_index=drafts.t().unsqueeze(-1).expand(2, g, bs, 1),
            pq_accept_rows=accept_lens.view(1, 1, bs, 1).expand(2, 1, bs, V),
            p=pq[0],
            pq_tok=pq_tok.unsqueeze(-1),
            q_tok_flat=pq_tok[1],
            p_tok_flat=pq_tok[0],
            pq_row=pq_row,
            p_row=pq_row[0],
            q_row=pq_row[1],
            bonus_row=cut(self.bonus_row, 1, bs, V),
            mass=cut(self.mass, 1, bs, 1),
            has_mass=cut(self.has_mass, 1, bs, 1),
            bonus=state.last_ids.view(1, bs),
            is_sampled=state.is_sampled.view(1, bs),
            greedy_accept_lens=self.greedy_accept_lens[:bs].view(1, bs),
            greedy_bonus=self.greedy_bonus[:bs].view(1, bs),
            packed=self.packed[:bs],
            confidence=cut(self.confidence, g, bs),
            confidence_cells=cut(self.confidence, g, bs, 1),
            sampled_index=sampled.unsqueeze(-1),
            slot_index=self.slot_index,
            bonus_noise_rows=log_e[g],
            verify_lens=self.verify_lens[:bs],
            verify_lens_row=self.verify_lens[:bs].view(1, bs),
            verify_lens_cell=self.verify_lens[:bs].view(1, bs, 1),
            verify_mask=cut(self.verify_mask, g, bs),
            full_accept=self.full_accept[:bs].view(1, bs, 1),
            accept_cell=accept_lens.view(1, bs, 1),
            gains=cut(self.gains, g, bs),
            requests_1=self.requests_1[:bs],
            padded_requests=self.padded_requests[:bs],
            blind_requests=self.blind_requests[:bs],
            row_ends=self.row_ends[:bs],
            grid_logits=cut(self.grid_logits, bs * (g + 1), V),
            plain_batch=ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY,
                batch_size=bs,
                tokens_per_req=1,
                input_ids=state.last_ids,
                positions=self.plain_positions[:bs],
                out_cache_loc=self.plain_slots[:bs],
                req_pool_indices=state.req_pool_indices,
                kv_lens=state.seq_lens,  # the anchor at seq_len - 1
                num_token_non_padded=step_num_token_non_padded(self.verify_scalar),
                num_token_non_padded_cpu=bs,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                req_to_token_pool=self.target_runner.req_to_token_pool,
                token_to_kv_pool=self.target_runner.token_to_kv_pool,
            ),
            plain_positions=self.plain_positions[:bs],
            plain_slots=self.plain_slots[:bs],
            slot_offsets=self.slot_offsets,
            committed=self.committed[:bs],
            committed_valid=self.committed_valid[:bs],
            logprobs=self.logprobs[:bs],
        )

    def query_grid(self, bs: int) -> torch.Tensor:
        """[bs * (g + 1), heads, head_dim]: a ragged verify's query places."""
        return cut(self._query_grid, bs * (self.gamma + 1), *self.query_shape)

    def ragged(self, bs: int, budget: int) -> RaggedViews:
        """A ragged verify of ``bs`` requests and ``budget`` drafts: its rows'
        buffers and its batch (the rows' places filled per step)."""
        return self.cached(("ragged", bs, budget), lambda: self._cut_ragged(bs, budget))

    def _cut_ragged(self, bs: int, budget: int) -> RaggedViews:
        v, t = self.at(bs), bs + budget
        query_index = self.query_index[:t]
        return RaggedViews(
            row_ids=self.row_ids[:t],
            row_req=self.row_req[:t],
            query_index=query_index,
            top_values=self.top_values[:budget],
            top_index=self.top_index[:budget],
            ones=self.ones[:budget],
            batch=ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY,
                batch_size=bs,
                tokens_per_req=self.gamma + 1,
                input_ids=self.ragged_ids[:t],
                positions=self.ragged_positions[:t],
                out_cache_loc=self.ragged_slots[:t],
                req_pool_indices=v.state.req_pool_indices,
                kv_lens=v.verify_batch.kv_lens,  # every place of the window
                num_token_non_padded=step_num_token_non_padded(self.verify_scalar),
                num_token_non_padded_cpu=t,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                req_to_token_pool=self.target_runner.req_to_token_pool,
                token_to_kv_pool=self.target_runner.token_to_kv_pool,
                query_index=query_index,
            ),
        )

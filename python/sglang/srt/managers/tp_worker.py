"""The target model's worker: prefill, and plain one-token decode steps.

A decode step: bind the batch to the step buffers (once per batch), pad it
to its bucket, run the device step (positions and KV slots -> forward ->
sample -> commit), then read the tokens (the step's one host read). On
CUDA the device step is one graph replay per bucket.

Under data-parallel attention a step runs at the rows of the busiest rank
(padded to its bucket: every rank the same forward shape), with every
rank's counts on the forward batch for the MoE; a rank with no request
steps an idle batch of dummy rows, all masked.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from sglang.srt.layers.sampler import (
    NO_EXTRAS,
    SamplingExtras,
    SamplingMode,
    draw_log_exp1_,
    fill_seeded_log_e_,
    sample_first_token,
    sample_next_,
    token_logprobs,
)
from sglang.srt.managers.schedule_batch import (
    BatchState,
    BatchStateBuffers,
    Req,
    ScheduleBatch,
    StepOutput,
)
from sglang.srt.mem_cache.memory_pool import DUMMY_REQ_INDEX
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    ModelOutput,
    fill_mlp_sync_metadata,
    step_num_token_non_padded,
    target_num_token_non_padded,
)
from sglang.srt.model_executor.graph_runner import GraphRunner
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.step_buffers import StepBuffers
from sglang.srt.models.tiny_moe import TinyMoEForCausalLM
from sglang.srt.utils.phases import PhaseSpans


@dataclass(frozen=True)
class DecodeViews:
    state: BatchState
    positions: torch.Tensor  # [bs]: seq_len - 1
    table_index: torch.Tensor  # [bs]: flat index into the req->slot table
    out_cache_loc: torch.Tensor  # [bs]
    log_e: torch.Tensor  # [bs, vocab]: sampling noise
    scratch: torch.Tensor  # [bs, vocab]
    logprobs: torch.Tensor  # [bs]: the sampled tokens' (return_logprob)
    forward_batch: ForwardBatch  # DECODE over the views above


class DecodeBuffers(StepBuffers[DecodeViews]):
    """Every per-step tensor of a plain decode step."""

    def __init__(
        self, *, max_batch_size: int, vocab_size: int, model_runner: ModelRunner
    ) -> None:
        super().__init__(max_batch_size=max_batch_size)
        dev = model_runner.device
        self.state = BatchStateBuffers(
            max_batch_size=max_batch_size, vocab_size=vocab_size, device=dev
        )
        self.positions = torch.zeros(max_batch_size, dtype=torch.int64, device=dev)
        self.table_index = torch.zeros_like(self.positions)
        self.out_cache_loc = torch.zeros_like(self.positions)
        self.log_e = torch.zeros(max_batch_size, vocab_size, device=dev)
        self.scratch = torch.zeros_like(self.log_e)
        self.logprobs = torch.zeros(max_batch_size, device=dev)
        self.num_token_non_padded = torch.zeros((), dtype=torch.int32, device=dev)
        # The one position a plain step samples: out_lens + 0.
        self.slot_offsets = torch.zeros(1, 1, dtype=torch.int64, device=dev)
        self.model_runner = model_runner

    def _cut(self, bs: int) -> DecodeViews:
        state = self.state.cut(bs)
        positions, out_cache_loc = self.positions[:bs], self.out_cache_loc[:bs]
        runner = self.model_runner
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            tokens_per_req=1,
            input_ids=state.last_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=state.req_pool_indices,
            kv_lens=state.seq_lens,  # row seq_len - 1 sees keys < seq_len
            num_token_non_padded=step_num_token_non_padded(self.num_token_non_padded),
            num_token_non_padded_cpu=bs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
        )
        return DecodeViews(
            state=state,
            positions=positions,
            table_index=self.table_index[:bs],
            out_cache_loc=out_cache_loc,
            log_e=self.log_e[:bs],
            scratch=self.scratch[:bs],
            logprobs=self.logprobs[:bs],
            forward_batch=forward_batch,
        )


class TpModelWorker:
    # The spans of a decode step, in order; the model's own compute inside.
    PHASES = ("prepare", "forward", "sample", "output")
    MODEL_SPANS = ("forward",)

    def __init__(
        self,
        *,
        model: TinyMoEForCausalLM,
        model_runner: ModelRunner,
        device,
        generator: Optional[torch.Generator] = None,
        max_batch_size: Optional[int] = None,
    ) -> None:
        self.model, self.model_runner = model, model_runner
        self.device, self.generator = device, generator
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self._flat_table = self.req_to_token.view(-1)
        self.lookahead = 0  # plain decoding writes only the next position
        self.spans = PhaseSpans()
        # Filled per prefill only when EP > 1 reads it; never re-allocated.
        self._prefill_scalar = torch.zeros((), dtype=torch.int32, device=device)
        # Default: every request row of the pool (row 0 is the dummy request).
        if max_batch_size is None:
            max_batch_size = self.req_to_token.shape[0] - 1
        self.max_batch_size = max_batch_size
        self.buffers: Optional[DecodeBuffers] = None
        self.graph_runner: Optional[GraphRunner] = None

    def init_decode(
        self, *, bucket_sizes: Optional[List[int]], use_cuda_graph: bool
    ) -> None:
        """Allocate the decode step's buffers; capture its graphs on CUDA."""
        self.buffers = DecodeBuffers(
            max_batch_size=self.max_batch_size,
            vocab_size=self.model.config.vocab_size,
            model_runner=self.model_runner,
        )
        self.graph_runner = GraphRunner(
            step=self._device_step,
            bucket_sizes=bucket_sizes,
            use_cuda_graph=use_cuda_graph,
            reset=self.buffers.state.reset,
        )
        # Graphs for temperature sampling; the other parameters run eagerly.
        self.graph_runner.capture(lambda rows: [(m, NO_EXTRAS) for m in SamplingMode])

    def prefill(
        self, *, req: Req, global_num_tokens: Optional[List[int]] = None
    ) -> int:
        return self.forward_prefill(req=req, global_num_tokens=global_num_tokens)[0]

    def idle_prefill(self, *, global_num_tokens: List[int]) -> None:
        """A DP rank with no prompt where others prefill one: an idle
        forward of one dummy row (the dummy request's scratch slot), masked,
        so that its MoE joins theirs."""
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.IDLE,
            batch_size=1,
            tokens_per_req=1,
            input_ids=zero,
            positions=zero,
            out_cache_loc=zero,  # the scratch slot
            req_pool_indices=torch.full_like(zero, DUMMY_REQ_INDEX),
            kv_lens=torch.ones_like(zero),
            num_token_non_padded=target_num_token_non_padded(
                0, self._prefill_scalar, self.device
            ),
            num_token_non_padded_cpu=0,
            req_to_token_pool=self.model_runner.req_to_token_pool,
            token_to_kv_pool=self.model_runner.token_to_kv_pool,
            max_kv_len=1,
        )
        self._fill_prefill_sync(forward_batch, global_num_tokens)
        self.model_runner.forward(forward_batch)

    def _fill_prefill_sync(self, forward_batch, global_num_tokens) -> None:
        if global_num_tokens is not None:  # every rank's prompt tokens
            fill_mlp_sync_metadata(
                forward_batch,
                global_counts=global_num_tokens,
                global_counts_for_logprob=global_num_tokens,
                num_tokens_per_req=1,
                num_tokens_for_logprob_per_req=1,
                can_run_dp_cuda_graph=False,  # prefill runs eagerly
                device=self.device,
            )

    def local_verify_tier(self, batch: ScheduleBatch) -> int:
        """A plain step verifies nothing: no budget (-1), or idle (0)."""
        return 0 if batch.is_idle else -1

    def flush_cache(self) -> None:
        """Plain decoding learns nothing from its steps: nothing to forget."""

    def start_round(self) -> None:
        """Before a round of requests: plain decoding carries nothing over."""

    def forward_prefill(
        self,
        *,
        req: Req,
        capture_hidden: bool = False,
        global_num_tokens: Optional[List[int]] = None,
    ) -> tuple[int, ModelOutput, ForwardBatch]:
        """Run the prompt (eagerly); return the first output token, the model
        output and the batch (its positions and slots)."""
        n = len(req.origin_input_ids)
        positions = torch.arange(n, device=self.device)
        forward_batch = ForwardBatch.init_new(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            tokens_per_req=n,
            input_ids=torch.tensor(req.origin_input_ids, device=self.device),
            positions=positions,
            out_cache_loc=self.req_to_token[req.req_pool_idx, :n],
            req_pool_indices=torch.tensor([req.req_pool_idx], device=self.device),
            kv_lens=positions + 1,
            capture_hidden_mode=(
                CaptureHiddenMode.FULL if capture_hidden else CaptureHiddenMode.NULL
            ),
            num_token_non_padded_buffer=self._prefill_scalar,
            max_kv_len=n,
        )
        self._fill_prefill_sync(forward_batch, global_num_tokens)
        out = self.model_runner.forward(forward_batch)
        first, logprob = sample_first_token(out.logits[-1:], req, self.generator)
        if logprob is not None:
            req.output_token_logprobs.append(logprob)
        return first, out, forward_batch

    def decode_step(self, *, batch: ScheduleBatch) -> StepOutput:
        """One token per request; advances the batch's device state in place."""
        if self.buffers is None:
            raise RuntimeError("call init_decode() before decode_step()")
        bs = batch.batch_size
        if bs > self.max_batch_size:
            raise ValueError(
                f"batch of {bs} exceeds max_batch_size={self.max_batch_size}"
            )
        buffers, runner, mode = self.buffers, self.graph_runner, batch.sampling_mode
        with self.spans("prepare"):
            buffers.state.bind(batch, buffers.at(bs).state)
            rows = runner.padded_size(dp_rows(batch))
            if rows > bs:
                buffers.state.pad(bs)
            v = buffers.at(rows)
            fb = v.forward_batch
            fb.num_token_non_padded = target_num_token_non_padded(
                bs, buffers.num_token_non_padded, self.device
            )
            fb.num_token_non_padded_cpu = bs
            fb.forward_mode = ForwardMode.IDLE if batch.is_idle else ForwardMode.DECODE
            if batch.global_num_tokens is not None:
                batch.can_run_dp_cuda_graph = runner.is_graphed(rows)
                fill_mlp_sync_metadata(
                    fb,
                    global_counts=batch.global_num_tokens,
                    global_counts_for_logprob=batch.global_num_tokens_for_logprob,
                    num_tokens_per_req=1,
                    num_tokens_for_logprob_per_req=1,
                    can_run_dp_cuda_graph=batch.can_run_dp_cuda_graph,
                    device=self.device,
                )
            extras = batch.sampling_info.extras
            if mode is not SamplingMode.GREEDY:
                draw_log_exp1_(v.log_e, self.generator)
                if extras.seeded:  # seeded rows: their own draws
                    fill_seeded_log_e_(
                        v.log_e.unsqueeze(0), v.state.sampling, buffers.slot_offsets
                    )
        runner.run(
            rows=rows,
            variant=(mode, extras),
            max_kv_len=max(batch.seq_lens_cpu, default=1),
        )
        with self.spans("output"):
            tokens = _read_tokens(batch.last_ids)
            for i in range(bs):
                batch.seq_lens_cpu[i] += 1
            logprobs = None
            if extras.logprobs:
                logprobs = [[x] for x in buffers.at(bs).logprobs.tolist()]
            return StepOutput(
                output_ids=[[t] for t in tokens],
                accepted_drafts=[0] * bs,
                logprobs=logprobs,
            )

    def _device_step(
        self,
        rows: int,
        variant: Tuple[SamplingMode, SamplingExtras],
        max_kv_len: Optional[int],
    ) -> None:
        """positions and KV slots -> forward -> sample -> commit, over the
        first ``rows`` rows of the buffers (no host read: graph-safe)."""
        mode, extras = variant
        v = self.buffers.at(rows)
        state = v.state
        torch.sub(state.seq_lens, 1, out=v.positions)
        # out_cache_loc[b] = req_to_token[req_pool_indices[b], positions[b]]
        width = self.req_to_token.shape[1]
        torch.add(v.positions, state.req_pool_indices, alpha=width, out=v.table_index)
        torch.index_select(self._flat_table, 0, v.table_index, out=v.out_cache_loc)
        v.forward_batch.max_kv_len = max_kv_len
        with self.spans("forward"):
            logits = self.model_runner.forward(v.forward_batch).logits  # [rows, V]
        with self.spans("sample"):
            raw = sample_next_(
                logits,
                mode,
                sampling=state.sampling,
                neg_temperatures=state.neg_temperatures,
                log_e=v.log_e,
                scratch=v.scratch,
                out=state.last_ids,
                extras=extras,
            )
            if extras.logprobs:
                v.logprobs.copy_(token_logprobs(raw, state.last_ids))
            if extras.counted:
                state.sampling.advance_(state.last_ids.unsqueeze(1), None)
            state.seq_lens.add_(1)


def dp_rows(batch: ScheduleBatch) -> int:
    """The requests a step is shaped for: under DP attention the busiest
    rank's (every rank pads to the same rows), else the batch's own."""
    if batch.global_num_tokens is None:
        return batch.batch_size
    return max(batch.global_num_tokens)


def _read_tokens(ids: torch.Tensor) -> List[int]:
    """The step's one host read (a device tensor is copied over first)."""
    return ids.tolist()

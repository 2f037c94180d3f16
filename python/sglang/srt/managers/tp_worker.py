"""The target model's worker: prefill, and plain one-token decode steps."""

from typing import Dict, Optional, Tuple

import torch

from sglang.srt.layers.sampler import sample_tokens
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, StepOutput
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.tiny_moe import ModelOutput, TinyMoEForCausalLM


class TpModelWorker:
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
        self.lookahead = 0  # plain decoding writes only the next position
        # Filled per batch only when EP > 1 reads it; never re-allocated.
        self._num_token_non_padded = torch.zeros((), dtype=torch.int32, device=device)
        # Decode-step buffers at the largest batch (default: every request row
        # of the pool; row 0 is the dummy request).
        if max_batch_size is None:
            max_batch_size = self.req_to_token.shape[0] - 1
        self.max_batch_size = max_batch_size
        self._positions = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self._table_index = torch.zeros_like(self._positions)
        self._out_cache_loc = torch.zeros_like(self._positions)
        self._next_ids = torch.zeros_like(self._positions)
        self._flat_table = self.req_to_token.view(-1)
        # Per batch size: the four buffers cut to it, made once.
        self._views: Dict[int, Tuple[torch.Tensor, ...]] = {}

    def enable_decode_graphs(self) -> None:
        self.model_runner.add_graph_runner(
            forward_mode=ForwardMode.DECODE, tokens_per_req=1
        )

    def prefill(self, *, req: Req) -> int:
        return self.forward_prefill(req=req)[0]

    def forward_prefill(
        self, *, req: Req, capture_hidden: bool = False
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
            num_token_non_padded_buffer=self._num_token_non_padded,
        )
        out = self.model_runner.forward(forward_batch)
        temperature = req.sampling_params.temperature
        first = sample_tokens(
            logits=out.logits[-1:],
            temperatures=(
                torch.tensor([temperature], device=self.device) if temperature else None
            ),
            generator=self.generator,
        )
        return int(first.item()), out, forward_batch

    def decode_step(self, *, batch: ScheduleBatch) -> StepOutput:
        """One token per request; advances the batch's device state in place."""
        bs = batch.batch_size
        if bs > self.max_batch_size:
            raise ValueError(
                f"batch of {bs} exceeds max_batch_size={self.max_batch_size}"
            )
        views = self._views.get(bs)
        if views is None:
            views = tuple(
                t[:bs]
                for t in (
                    self._positions,
                    self._table_index,
                    self._out_cache_loc,
                    self._next_ids,
                )
            )
            self._views[bs] = views
        positions, index, out_cache_loc, next_ids = views  # [bs] each
        torch.sub(batch.seq_lens, 1, out=positions)
        # out_cache_loc[b] = req_to_token[req_pool_indices[b], positions[b]],
        # gathered from the flat table into a preallocated buffer.
        width = self.req_to_token.shape[1]
        torch.add(positions, batch.req_pool_indices, alpha=width, out=index)
        torch.index_select(self._flat_table, 0, index, out=out_cache_loc)
        forward_batch = ForwardBatch.init_new(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            tokens_per_req=1,
            input_ids=batch.last_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            kv_lens=batch.seq_lens,
            num_token_non_padded_buffer=self._num_token_non_padded,
        )
        logits = self.model_runner.forward(forward_batch).logits
        sample_tokens(
            logits=logits,
            temperatures=batch.temperatures,
            generator=self.generator,
            out=next_ids,
        )
        batch.seq_lens.add_(1)
        batch.last_ids.copy_(next_ids)
        return StepOutput(
            output_ids=[[t] for t in next_ids.tolist()], accepted_drafts=[0] * bs
        )

"""The target model's worker: prefill, and plain one-token decode steps."""

from typing import Optional

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
    ) -> None:
        self.model, self.model_runner = model, model_runner
        self.device, self.generator = device, generator
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.lookahead = 0  # plain decoding writes only the next position
        # Filled per batch only when EP > 1 reads it; never re-allocated.
        self._num_token_non_padded = torch.zeros((), dtype=torch.int32, device=device)

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
        positions = batch.seq_lens - 1
        forward_batch = ForwardBatch.init_new(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            tokens_per_req=1,
            input_ids=batch.last_ids,
            positions=positions,
            out_cache_loc=self.req_to_token[batch.req_pool_indices, positions],
            req_pool_indices=batch.req_pool_indices,
            kv_lens=batch.seq_lens,
            num_token_non_padded_buffer=self._num_token_non_padded,
        )
        logits = self.model_runner.forward(forward_batch).logits
        next_ids = sample_tokens(
            logits=logits, temperatures=batch.temperatures, generator=self.generator
        )
        batch.seq_lens.add_(1)
        batch.last_ids.copy_(next_ids)
        return StepOutput(
            output_ids=[[t] for t in next_ids.tolist()], accepted_drafts=[0] * bs
        )

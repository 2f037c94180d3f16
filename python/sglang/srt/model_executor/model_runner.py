"""Runs one model on a ForwardBatch, over that model's pools.

Prefill runs through it eagerly; a decode step's forwards run through it
inside the worker's device step, which the worker's ``GraphRunner`` captures
as a whole on CUDA.
"""

from typing import Callable

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ModelOutput

ModelForward = Callable[[ForwardBatch], ModelOutput]


class ModelRunner:
    def __init__(
        self, *, forward: ModelForward, req_to_token_pool, token_to_kv_pool, device
    ) -> None:
        self.forward_fn = forward
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.device = device

    def forward(self, forward_batch: ForwardBatch) -> ModelOutput:
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        return self.forward_fn(forward_batch)

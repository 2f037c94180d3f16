"""Runs one model on a ForwardBatch: through a padded bucket runner when one
fits the batch, eagerly otherwise (prefill, oversized batches, and every
batch when there are no buckets)."""

from typing import List, Optional, Sequence

from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.graph_runner import GraphRunner, ModelForward
from sglang.srt.models.tiny_moe import ModelOutput


class ModelRunner:
    def __init__(
        self,
        *,
        forward: ModelForward,
        req_to_token_pool,
        token_to_kv_pool,
        device,
        bucket_sizes: Optional[Sequence[int]],  # None: no buckets, no runners
        use_cuda_graph: bool,
    ) -> None:
        if bucket_sizes is None and use_cuda_graph:
            raise ValueError("CUDA graphs need bucket sizes")
        self.forward_fn = forward
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.device = device
        self.bucket_sizes = None if bucket_sizes is None else list(bucket_sizes)
        self.use_cuda_graph = use_cuda_graph
        self.graph_runners: List[GraphRunner] = []

    def add_graph_runner(
        self,
        *,
        forward_mode: ForwardMode,
        tokens_per_req: int,
        capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
    ) -> Optional[GraphRunner]:
        """A bucket runner for these batches; None (and none added) without
        buckets: the batches then run eagerly as given."""
        if self.bucket_sizes is None:
            return None
        runner = GraphRunner(
            forward=self.forward_fn,
            forward_mode=forward_mode,
            tokens_per_req=tokens_per_req,
            bucket_sizes=self.bucket_sizes,
            capture_hidden_mode=capture_hidden_mode,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            device=self.device,
            use_cuda_graph=self.use_cuda_graph,
        )
        self.graph_runners.append(runner)
        return runner

    def runs_as_given(self, forward_batch: ForwardBatch) -> bool:
        """Whether ``forward`` hands this very batch to the model (eagerly,
        unpadded), so that metadata built for it beforehand is what the
        model reads; False when a runner pads it or replays a graph."""
        for runner in self.graph_runners:
            if runner.can_run(forward_batch):
                return runner.runs_as_given(forward_batch.batch_size)
        return True

    def forward(self, forward_batch: ForwardBatch) -> ModelOutput:
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        for runner in self.graph_runners:
            if runner.can_run(forward_batch):
                return runner.run(forward_batch)
        return self.forward_fn(forward_batch)

"""Padded bucket runner: static buffers per captured batch size.

Buffers are allocated once at the largest bucket. A batch is padded up to
its bucket with dummy rows that write only the scratch KV slot and attend
only the dummy request. On CUDA each bucket is a captured CUDA graph; on
the CPU the same padded batch runs eagerly, and a batch that fills its
bucket runs as given (there is nothing to pad and no graph to feed).
"""

from typing import Callable, Dict, Sequence, Tuple

import torch

from sglang.srt.mem_cache.memory_pool import DUMMY_REQ_INDEX, SCRATCH_SLOT
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.models.tiny_moe import ModelOutput

ModelForward = Callable[[ForwardBatch], ModelOutput]


class GraphRunner:
    def __init__(
        self,
        *,
        forward: ModelForward,
        forward_mode: ForwardMode,
        tokens_per_req: int,
        bucket_sizes: Sequence[int],
        capture_hidden_mode: CaptureHiddenMode,
        req_to_token_pool,
        token_to_kv_pool,
        device,
        use_cuda_graph: bool,
    ) -> None:
        buckets = sorted(set(bucket_sizes))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"bucket sizes must be >= 1, got {list(bucket_sizes)}")
        self.forward, self.buckets = forward, buckets
        self.forward_mode, self.tokens_per_req = forward_mode, tokens_per_req
        self.capture_hidden_mode = capture_hidden_mode
        self.pools = (req_to_token_pool, token_to_kv_pool)
        self.use_cuda_graph = use_cuda_graph
        self.max_bs = buckets[-1]
        n = self.max_bs * tokens_per_req
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full(
            (n,), SCRATCH_SLOT, dtype=torch.int64, device=device
        )
        self.kv_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full(
            (self.max_bs,), DUMMY_REQ_INDEX, dtype=torch.int64, device=device
        )
        self.num_token_non_padded = torch.zeros((), dtype=torch.int32, device=device)
        # Keyed by (bucket, uses the scalar): views of the static buffers, and
        # on CUDA the captured graph with its static output.
        self._batches: Dict[Tuple[int, bool], ForwardBatch] = {}
        self._graphs: Dict[
            Tuple[int, bool], Tuple[torch.cuda.CUDAGraph, ModelOutput]
        ] = {}
        if use_cuda_graph:
            self._pool = torch.cuda.graph_pool_handle()
            for bs in reversed(buckets):
                self._capture(bs, enable_num_token_non_padded())

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.tokens_per_req == self.tokens_per_req
            and forward_batch.forward_mode == self.forward_mode
            and forward_batch.capture_hidden_mode == self.capture_hidden_mode
            and 1 <= forward_batch.batch_size <= self.max_bs
        )

    def runs_as_given(self, bs: int) -> bool:
        """Eager and nothing to pad: ``run`` hands the batch itself over."""
        return not self.use_cuda_graph and bs in self.buckets

    def _padded_batch(self, bs: int, with_scalar: bool) -> ForwardBatch:
        key = (bs, with_scalar)
        if key not in self._batches:
            self._batches[key] = self._make_padded_batch(bs, with_scalar)
        return self._batches[key]

    def _make_padded_batch(self, bs: int, with_scalar: bool) -> ForwardBatch:
        n = bs * self.tokens_per_req
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=bs,
            tokens_per_req=self.tokens_per_req,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_cache_loc=self.out_cache_loc[:n],
            req_pool_indices=self.req_pool_indices[:bs],
            kv_lens=self.kv_lens[:n],
            num_token_non_padded=self.num_token_non_padded if with_scalar else None,
            num_token_non_padded_cpu=n,
            capture_hidden_mode=self.capture_hidden_mode,
            req_to_token_pool=self.pools[0],
            token_to_kv_pool=self.pools[1],
        )

    def _capture(self, bs: int, with_scalar: bool) -> None:
        # At construction the buffers hold dummy rows, so capture writes only
        # scratch. A lazy capture from run() holds the real batch: its warm-up
        # writes the same KV values the replay then writes again.
        batch = self._padded_batch(bs, with_scalar)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels and allocator outside capture
                self.forward(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward(batch)
        self._graphs[(bs, with_scalar)] = (graph, out)

    def run(self, forward_batch: ForwardBatch) -> ModelOutput:
        """Run padded; the outputs are views of the real rows (valid until the
        next run of this runner)."""
        if not self.can_run(forward_batch):
            raise ValueError(
                f"batch (mode={forward_batch.forward_mode.name}, bs="
                f"{forward_batch.batch_size}, tokens_per_req="
                f"{forward_batch.tokens_per_req}) does not fit this runner "
                f"(mode={self.forward_mode.name}, max bs={self.max_bs}, "
                f"tokens_per_req={self.tokens_per_req})"
            )
        bs = forward_batch.batch_size
        if self.runs_as_given(bs):
            # Eager and nothing to pad: the static buffers would hold this
            # very batch, so it runs as given (five copies fewer).
            return self.forward(forward_batch)
        bucket = next(b for b in self.buckets if b >= bs)
        n, m = forward_batch.num_tokens, bucket * self.tokens_per_req
        self.input_ids[:n].copy_(forward_batch.input_ids)
        self.positions[:n].copy_(forward_batch.positions)
        self.out_cache_loc[:n].copy_(forward_batch.out_cache_loc)
        self.kv_lens[:n].copy_(forward_batch.kv_lens)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        if n < m:  # dummy rows: the dummy request, scratch slot, one visible key
            self.input_ids[n:m].zero_()
            self.positions[n:m].zero_()
            self.out_cache_loc[n:m].fill_(SCRATCH_SLOT)
            self.kv_lens[n:m].fill_(1)
            self.req_pool_indices[bs:bucket].fill_(DUMMY_REQ_INDEX)
        with_scalar = forward_batch.num_token_non_padded is not None
        if with_scalar:
            self.num_token_non_padded.copy_(forward_batch.num_token_non_padded)
        if self.use_cuda_graph:
            if (bucket, with_scalar) not in self._graphs:
                self._capture(bucket, with_scalar)
            graph, out = self._graphs[(bucket, with_scalar)]
            graph.replay()
        else:
            out = self.forward(self._padded_batch(bucket, with_scalar))
        aux = out.aux_hidden_states
        if aux is not None:
            rows = bs if self.capture_hidden_mode == CaptureHiddenMode.LAST else n
            aux = aux[:rows]
        return ModelOutput(logits=out.logits[:n], aux_hidden_states=aux)

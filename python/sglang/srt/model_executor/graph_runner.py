"""GraphRunner: a worker's whole device step, one CUDA graph per bucket.

A worker's step reads and writes only its step buffers (``StepBuffers``:
fixed addresses), so on CUDA the step at a bucket size is captured once and
a decode step is one replay: no inputs to copy, nothing returned. A batch
is padded up to its bucket with dummy rows (the dummy request: scratch KV
slot only). On the CPU the same step runs eagerly; with ``bucket_sizes``
given it runs padded, as the graph would (the tests of the padded path),
otherwise at the batch's own size.

Graphs are captured up front, for every bucket and every variant the worker
names for it (greedy, sampled, a verify budget, ...), over dummy rows: a capture's warm-up runs the
step for real, and on dummy rows that touches only scratch.
"""

from typing import Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

# step(rows, variant, max_kv_len): the worker's device step over the first
# `rows` rows of its buffers; max_kv_len None under capture (static shapes).
DeviceStep = Callable[[int, Hashable, Optional[int]], None]


class GraphRunner:
    def __init__(
        self,
        *,
        step: DeviceStep,
        bucket_sizes: Optional[Sequence[int]],  # None: no padding, no graphs
        use_cuda_graph: bool,
        reset: Callable[[], None] = lambda: None,  # dummy rows everywhere
    ) -> None:
        if bucket_sizes is None:
            if use_cuda_graph:
                raise ValueError("CUDA graphs need bucket sizes")
            buckets = []
        else:
            buckets = sorted(set(bucket_sizes))
            if not buckets or buckets[0] < 1:
                raise ValueError(f"bucket sizes must be >= 1, got {list(bucket_sizes)}")
        self.step, self.buckets = step, buckets
        self.use_cuda_graph, self.reset = use_cuda_graph, reset
        self._graphs: Dict[Tuple[int, Hashable], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_cuda_graph else None
        self.replays = 0  # graph replays so far (a decode step is one)

    def padded_size(self, bs: int) -> int:
        """Rows a step of ``bs`` requests runs: its bucket, or ``bs`` itself
        when there are no buckets or it exceeds the largest."""
        for bucket in self.buckets:
            if bucket >= bs:
                return bucket
        return bs

    def is_graphed(self, rows: int) -> bool:
        return self.use_cuda_graph and rows in self.buckets

    def capture(self, variants: Callable[[int], Sequence[Hashable]]) -> None:
        """Capture every bucket for each of its variants (CUDA only)."""
        if not self.use_cuda_graph:
            return
        for rows in reversed(self.buckets):
            for variant in variants(rows):
                self._capture(rows, variant)
        self.reset()

    def _capture(self, rows: int, variant: Hashable) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels and the allocator
                self.reset()
                self.step(rows, variant, None)
        torch.cuda.current_stream().wait_stream(stream)
        self.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.step(rows, variant, None)
        self._graphs[(rows, variant)] = graph

    def run(self, *, rows: int, variant: Hashable, max_kv_len: int) -> None:
        """One device step over ``rows`` rows: a replay when captured, else
        eagerly (keys read up to ``max_kv_len``). Under capture ``rows`` and
        ``variant`` must be ones captured (``capture``)."""
        graph = self._graphs.get((rows, variant))
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:  # not a bucket, or a variant the worker runs eagerly
            self.step(rows, variant, max_kv_len)

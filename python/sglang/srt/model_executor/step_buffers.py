"""StepBuffers: one worker's per-step device tensors, in one arena.

A worker allocates every tensor a decode step touches once, for its largest
batch (a subclass's constructor), and a step only slices and fills them.
``at(bs)`` returns the views cut to ``bs`` rows, made once per size: the one
per-batch-size view cache; the worker's parts (window, proposer, acceptance)
all read their slices from it. Because the views keep their addresses, a
CUDA graph captured over ``at(bucket)`` reads whatever a step writes there.
"""

from typing import Dict, Generic, TypeVar

V = TypeVar("V")


class StepBuffers(Generic[V]):
    def __init__(self, *, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._views: Dict[int, V] = {}

    def at(self, bs: int) -> V:
        """The views of the first ``bs`` rows (built on first use, then kept)."""
        views = self._views.get(bs)
        if views is None:
            if not 1 <= bs <= self.max_batch_size:
                raise ValueError(
                    f"batch of {bs} does not fit the step buffers (1 to "
                    f"max_batch_size={self.max_batch_size})"
                )
            views = self._views[bs] = self._cut(bs)
        return views

    def _cut(self, bs: int) -> V:
        raise NotImplementedError

"""StepBuffers: one worker's per-step device tensors, in one arena.

A worker allocates every tensor a decode step touches once, for its largest
batch (a subclass's constructor), and a step only slices and fills them.
``at(bs)`` returns the views cut to ``bs`` rows, made once per size: the one
per-batch-size view cache; the worker's parts (window, proposer, acceptance)
all read their slices from it. ``cached(key, make)`` keeps other views made
once per key in the same cache (a ragged verify batch per size and token
count). Because the views keep their addresses, a CUDA graph captured over
``at(bucket)`` reads whatever a step writes there.

``nbytes()`` is what the arena holds; built on the ``meta`` device (runners
whose device is meta) it says so before anything is allocated, which is how
``ServerArgs.static_memory_bytes`` sizes it.
"""

from typing import Any, Callable, Dict, Generic, Hashable, TypeVar

import torch

from sglang.srt.model_executor.model_runner import ModelRunner

V = TypeVar("V")


class StepBuffers(Generic[V]):
    def __init__(self, *, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._views: Dict[Hashable, Any] = {}

    def at(self, bs: int) -> V:
        """The views of the first ``bs`` rows (built on first use, then kept);
        0 rows bind an idle DP rank's empty batch."""
        views = self._views.get(bs)
        if views is None:
            if not 0 <= bs <= self.max_batch_size:
                raise ValueError(
                    f"batch of {bs} does not fit the step buffers (0 to "
                    f"max_batch_size={self.max_batch_size})"
                )
            views = self._views[bs] = self._cut(bs)
        return views

    def cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        """Views made once per ``key`` (a tuple, apart from the sizes)."""
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = make()
        return views

    def nbytes(self) -> int:
        """Bytes of the tensors the arena owns, each storage once: those its
        attributes reach, through nested buffers and dataclasses; not the
        views cut from them, nor a runner's model or pools."""
        storages: Dict[int, torch.UntypedStorage] = {}
        seen = set()

        def walk(value: Any) -> None:
            if id(value) in seen:
                return
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()  # one object per storage
                storages[id(storage)] = storage
            elif isinstance(value, (list, tuple)):
                for item in value:
                    walk(item)
            elif hasattr(value, "__dict__") and not isinstance(
                value, (type, ModelRunner, torch.nn.Module)
            ):
                for item in vars(value).values():
                    walk(item)

        seen.add(id(self._views))
        walk(self)
        return sum(s.nbytes() for s in storages.values())

    def _cut(self, bs: int) -> V:
        raise NotImplementedError

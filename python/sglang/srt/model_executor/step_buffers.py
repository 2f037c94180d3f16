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

from typing import Any, Callable, Dict, Generic, Hashable, List, Tuple, TypeVar, Union

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

    def tensors(self) -> List[Tuple[Tuple[Union[str, int], ...], torch.Tensor]]:
        """(path, tensor) for each tensor the arena's attributes reach,
        through nested buffers, dataclasses, lists and tuples (each object
        walked once; a tensor held in two places, under both paths): not
        the views cut from them, nor a runner's model or pools."""
        out: List[Tuple[Tuple[Union[str, int], ...], torch.Tensor]] = []
        seen = {id(self._views)}

        def walk(value: Any, path: Tuple[Union[str, int], ...]) -> None:
            if isinstance(value, torch.Tensor):
                out.append((path, value))
                return
            if id(value) in seen:
                return
            seen.add(id(value))
            if isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    walk(item, path + (i,))
            elif hasattr(value, "__dict__") and not isinstance(
                value, (type, ModelRunner, torch.nn.Module)
            ):
                for name, item in vars(value).items():
                    walk(item, path + (name,))

        walk(self, ())
        return out

    def nbytes(self) -> int:
        """Bytes of the tensors the arena owns (``tensors()``), each storage
        once."""
        storages = {
            id(t.untyped_storage()): t.untyped_storage() for _, t in self.tensors()
        }
        return sum(s.nbytes() for s in storages.values())

    def _cut(self, bs: int) -> V:
        raise NotImplementedError

"""Exact per-step counts of what torch dispatches, for guards and benches.

``OpCounter`` is a ``TorchDispatchMode``: inside ``with OpCounter() as c:``
every aten op is seen once, below autograd and above the backend, on CPU
and CUDA alike. Counts are exact, so tests can assert them and benches can
compare variants without timing noise.

- ``ops``: aten ops dispatched (the scalar's own included);
- ``allocs``: op outputs on new storage (not a view, not written in place);
- ``int32_scalars``: new 0-dim int32 tensors (what ``num_token_non_padded``
  is made of); ``torch.tensor(n)`` counts through ``aten.lift_fresh``;
- ``h2d_copies``: copies from host memory into a device tensor.

``count_calls`` routes chosen methods (the model forwards) through a second,
nested counter, so a step's own glue is the outer count minus the inner one.
"""

from collections import Counter
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _storage(t: torch.Tensor) -> Tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.allocs = 0
        self.int32_scalars = 0
        self.h2d_copies = 0
        self.by_op: Counter = Counter()
        # (op name, shape) of every new 0-dim int32 tensor, in order.
        self.int32_scalar_sites: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        self.by_op[func.name()] += 1
        inputs = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        ]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        seen = {_storage(t) for t in inputs if t.device.type != "meta"}
        for t in outputs:
            fresh = func in _FRESH or _storage(t) not in seen
            if not fresh:
                continue
            self.allocs += 1
            if t.dim() == 0 and t.dtype == torch.int32:
                self.int32_scalars += 1
                self.int32_scalar_sites.append(func.name())
        if func in _COPIES and any(t.device.type == "cpu" for t in inputs):
            if any(t.device.type != "cpu" for t in outputs):
                self.h2d_copies += 1
        return out

    def counts(self) -> Dict[str, int]:
        return {
            "ops": self.ops,
            "allocs": self.allocs,
            "int32_scalars": self.int32_scalars,
            "h2d_copies": self.h2d_copies,
        }


_MISSING = object()


@contextmanager
def routed(replacements: Sequence[Tuple[object, str, Callable]]) -> Iterator[None]:
    """Set ``obj.name = fn`` for each replacement, and put back on exit what
    was there: an instance attribute (e.g. another spy) as it was, else
    nothing, so the class's method shows through again. Every restore is
    tried; the first that fails is raised after the others."""
    saved = []
    try:
        for obj, name, fn in replacements:
            own = obj.__dict__.get(name, _MISSING)
            setattr(obj, name, fn)
            saved.append((obj, name, own))  # only what was set is put back
        yield
    finally:
        failed = None
        for obj, name, own in reversed(saved):
            try:
                if own is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, own)
            except Exception as e:  # keep restoring the rest
                failed = failed or e
        if failed is not None:
            raise failed


@contextmanager
def count_calls(targets: Sequence[Tuple[object, str]]) -> Iterator[OpCounter]:
    """Count every call of ``getattr(obj, name)`` for each target in one counter.

    The counter is entered only around those calls. Inside an outer
    ``OpCounter`` both count each op (a mode dispatches to the modes below
    it), so ``outer.allocs - inner.allocs`` is what happened outside them.
    The methods are restored on exit.
    """
    inner = OpCounter()
    depth = [0]  # a counted call inside another is counted once

    def counted_call(original):
        def counted(*args, **kwargs):
            if depth[0]:
                return original(*args, **kwargs)
            depth[0] += 1
            try:
                with inner:
                    return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    with routed([(obj, n, counted_call(getattr(obj, n))) for obj, n in targets]):
        yield inner

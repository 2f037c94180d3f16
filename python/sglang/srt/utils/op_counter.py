"""Exact per-step counts of what torch dispatches, for guards and benches.

``OpCounter`` is a ``TorchDispatchMode``: inside ``with OpCounter() as c:``
every aten op is seen once, below autograd and above the backend, on CPU
and CUDA alike. Counts are exact, so tests can assert them and benches can
compare variants without timing noise.

- ``ops``: aten ops dispatched (the scalar's own included);
- ``allocs``: op outputs on new storage (not a view, not written in place);
- ``int32_scalars``: new 0-dim int32 tensors (what ``num_token_non_padded``
  is made of); ``torch.tensor(n)`` counts through ``aten.lift_fresh``;
- ``h2d_copies``: copies from host memory into a device tensor;
- ``host_reads``: ops that make the host wait for device data: ``.item()``
  and ``int()`` / ``bool()`` of a tensor (``_local_scalar_dense``),
  ``nonzero``, ``bincount``, ``equal``, ``allclose``, ``masked_select``, ``unique``,
  indexing by a bool mask (``x[m]``, and ``x[m] = v`` unless ``v`` is one
  value on the CPU: a ``nonzero`` inside the kernel), ``repeat_interleave``
  without ``output_size``, and copies from a
  device to host memory; and ``.tolist()``, ``.numpy()`` and
  ``numpy.asarray()`` of a CPU tensor, which read its memory without
  dispatching an op (a device tensor's copy to the host is the op counted):
  seen one level up, by a ``TorchFunctionMode`` entered with the counter.

Per-phase counts come from ``utils.phases.PhaseRecorder``, a hook the
workers offer: no method is patched to count it.
"""

from collections import Counter
from typing import Dict, List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_aten = torch.ops.aten
_HOST_READS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.bincount.default,  # its length: the largest value + 1
    _aten.equal.default,
    _aten.allclose.default,
    _aten.is_nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
}

# Index ops whose bool (or uint8) mask indices become positions in the
# kernel, a data-dependent size: reading, and writing (but see below).
_MASK_INDEXING = {_aten.index.Tensor}
_MASK_INDEX_PUT = {
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)


def _waits_for_data(func, args, kwargs) -> bool:
    """Whether the op's output size, or its result, is read from data."""
    if func in _HOST_READS:
        return True
    if func in _MASK_INDEXING:
        return any(_is_mask(i) for i in args[1])
    if func in _MASK_INDEX_PUT:  # (self, indices, values, accumulate=False)
        self, indices, values = args[:3]
        if not any(_is_mask(i) for i in indices):
            return False
        given = [i for i in indices if i is not None]
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        # ATen writes one CPU value under one mask as a masked_fill (x[m] = 0):
        # no positions, no read.
        return not (
            not accumulate
            and values.numel() == 1
            and values.device.type == "cpu"
            and len(given) == 1
            and given[0].device == self.device
        )
    if func is _aten.repeat_interleave.Tensor:  # (repeats, *, output_size)
        return kwargs.get("output_size") is None
    return False


# Read a CPU tensor's memory from Python without an aten op.
_UNDISPATCHED_READS = {
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__array__,
}


class _UndispatchedReads(TorchFunctionMode):
    """Counts, into ``counter``, the reads of a CPU tensor's memory that
    dispatch nothing."""

    def __init__(self, counter: "OpCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _UNDISPATCHED_READS and args[0].device.type == "cpu":
            self.counter.host_reads += 1
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> Tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.allocs = 0
        self.int32_scalars = 0
        self.h2d_copies = 0
        self.host_reads = 0
        self.by_op: Counter = Counter()
        # (op name, shape) of every new 0-dim int32 tensor, in order.
        self.int32_scalar_sites: List[str] = []
        self._reads = _UndispatchedReads(self)

    def __enter__(self) -> "OpCounter":
        self._reads.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._reads.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        # The inputs' storages before the op (a storage passed as one, too,
        # as set_ takes it): one it reallocates (an out= resized, a resize_)
        # is new.
        seen = {_storage(t) for t in inputs if t.device.type != "meta"}
        seen |= {
            (str(s.device), s.data_ptr())
            for s in flat
            if isinstance(s, torch.UntypedStorage) and s.device.type != "meta"
        }
        out = func(*args, **kwargs)
        self.ops += 1
        self.by_op[func.name()] += 1
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            fresh = func in _FRESH or _storage(t) not in seen
            if not fresh:
                continue
            self.allocs += 1
            if t.dim() == 0 and t.dtype == torch.int32:
                self.int32_scalars += 1
                self.int32_scalar_sites.append(func.name())
        if _waits_for_data(func, args, kwargs):
            self.host_reads += 1
        elif func in _COPIES:
            to_device = any(t.device.type != "cpu" for t in outputs)
            if any(t.device.type == "cpu" for t in inputs) and to_device:
                self.h2d_copies += 1
            elif any(t.device.type != "cpu" for t in inputs) and not to_device:
                self.host_reads += 1
        return out

    def counts(self) -> Dict[str, int]:
        return {
            "ops": self.ops,
            "allocs": self.allocs,
            "int32_scalars": self.int32_scalars,
            "h2d_copies": self.h2d_copies,
            "host_reads": self.host_reads,
        }

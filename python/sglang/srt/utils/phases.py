"""Named spans around the phases of a decode step, for whoever observes them.

A worker wraps each phase of its step in ``spans("name")``; with no hook
set that is a shared no-op context, so the engine pays one attribute read
per phase. A bench or profiler sets ``spans.hook`` to observe the very code
that runs: no library function is patched. ``PhaseRecorder`` is such a hook:
wall time per span, and inside an ``OpCounter`` the ops, allocations and
host reads of each span.
"""

import time
from contextlib import nullcontext
from typing import Callable, ContextManager, Dict, Optional

from sglang.srt.utils.op_counter import OpCounter

_NOOP = nullcontext()

Hook = Callable[[str], ContextManager[None]]


class PhaseSpans:
    def __init__(self) -> None:
        self.hook: Optional[Hook] = None

    def __call__(self, name: str) -> ContextManager[None]:
        hook = self.hook
        return _NOOP if hook is None else hook(name)


class PhaseRecorder:
    """A ``PhaseSpans`` hook that adds up, per span name, the seconds spent
    inside it and, when ``counter`` is given (an ``OpCounter`` entered around
    the steps), the ops, allocations and host reads dispatched inside it.
    Spans may nest; each is counted on its own (a nested span's time is also
    in the span around it). ``sync`` runs at each span's ends (a CUDA
    synchronize, so that a span times its own kernels). A span costs two
    clock reads and a few additions: the step it observes stays close to
    the step unobserved (the bench shows both)."""

    def __init__(
        self,
        *,
        sync: Optional[Callable[[], None]] = None,
        counter: Optional[OpCounter] = None,
    ) -> None:
        self.sync, self.counter = sync, counter
        self._spans: Dict[str, _Span] = {}

    def __call__(self, name: str) -> "_Span":
        span = self._spans.get(name)
        if span is None:
            span = self._spans[name] = _Span(self.sync, self.counter)
        return span

    @property
    def totals(self) -> Dict[str, Dict[str, float]]:
        """Per span name: seconds, and ops, allocs and host_reads when counted."""
        return {name: span.totals() for name, span in self._spans.items()}


class _Span:
    __slots__ = ("sync", "counter", "seconds", "start", "counts", "start_counts")

    def __init__(self, sync, counter) -> None:
        self.sync, self.counter = sync, counter
        self.seconds, self.start = 0.0, 0.0
        self.counts = [0, 0, 0]  # ops, allocs, host reads
        self.start_counts = (0, 0, 0)

    def _now_counts(self):
        c = self.counter
        return (c.ops, c.allocs, c.host_reads)

    def __enter__(self) -> None:
        if self.sync is not None:
            self.sync()
        if self.counter is not None:
            self.start_counts = self._now_counts()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.sync is not None:
            self.sync()
        self.seconds += time.perf_counter() - self.start
        if self.counter is not None:
            for i, now in enumerate(self._now_counts()):
                self.counts[i] += now - self.start_counts[i]

    def totals(self) -> Dict[str, float]:
        out = {"seconds": self.seconds}
        if self.counter is not None:
            out.update(zip(("ops", "allocs", "host_reads"), self.counts))
        return out

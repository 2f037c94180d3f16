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
from typing import Callable, ContextManager, Dict, Optional, Union

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
    synchronize, so that a span times its own kernels). Without ``sync`` or
    ``counter`` a span is two clock reads and an addition (``_TimedSpan``):
    the step it observes stays close to the step unobserved (the bench
    shows both)."""

    def __init__(
        self,
        *,
        sync: Optional[Callable[[], None]] = None,
        counter: Optional[OpCounter] = None,
    ) -> None:
        self.sync, self.counter = sync, counter
        self._spans: Dict[str, Union["_Span", "_TimedSpan"]] = {}

    def __call__(self, name: str) -> Union["_Span", "_TimedSpan"]:
        try:  # a span is entered a dozen times a step: the short path first
            return self._spans[name]
        except KeyError:
            span = self._spans[name] = (
                _TimedSpan()
                if self.sync is None and self.counter is None
                else _Span(self.sync, self.counter)
            )
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


class _TimedSpan:
    """A span that only times: what a recorder without ``sync`` or
    ``counter`` hands out, so that observing a step adds the least to it."""

    __slots__ = ("seconds", "start")

    def __init__(self) -> None:
        self.seconds, self.start = 0.0, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self.start

    def totals(self) -> Dict[str, float]:
        return {"seconds": self.seconds}

"""VerifyCostTable: what a DSpark decode step costs on this machine, by batch
size and verify budget.

Measured at start-up by running the worker's own device step over dummy
requests (``measure_cost_table``: the step pipeline, not a model of it),
or read from a file a previous run saved. For each batch size in
``batch_sizes`` and each L in 0..gamma the table holds the seconds of a step
that verifies L drafts per request (budget bs * L); L = 0 is a plain
decode step (no draft forward). Other sizes and budgets are interpolated
linearly; past the largest size a step costs that size's per request.
A saved table names what it was measured for (``measured_for``: the
engine's configuration, device and threads), and is read only by an
engine of the same.
"""

import bisect
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

from sglang.srt.utils.common import as_created, is_finite


@dataclass(frozen=True)
class VerifyCostTable:
    batch_sizes: Tuple[int, ...]  # ascending
    gamma: int
    seconds: Tuple[Tuple[float, ...], ...]  # [batch size][L = 0..gamma]
    measured_for: str = ""  # a digest of what it was measured for

    def __post_init__(self) -> None:
        sizes = list(self.batch_sizes)
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be ascending and >= 1, got {sizes}")
        if len(self.seconds) != len(sizes) or any(
            len(row) != self.gamma + 1 or not all(is_finite(t) and t > 0 for t in row)
            for row in self.seconds
        ):
            raise ValueError(
                f"seconds must hold {self.gamma + 1} positive finite times per "
                f"batch size"
            )

    def cost(self, *, bs: int, budget: int) -> float:
        """Seconds of a step of ``bs`` requests verifying ``budget`` drafts in
        all (0 to bs * gamma)."""
        if not 0 <= budget <= bs * self.gamma:
            raise ValueError(f"budget {budget} is outside [0, {bs * self.gamma}]")
        per_req = budget / bs  # L, fractional

        def at(row: Sequence[float]) -> float:
            lo = min(int(per_req), self.gamma - 1)
            return row[lo] + (per_req - lo) * (row[lo + 1] - row[lo])

        sizes, rows = self.batch_sizes, self.seconds
        i = bisect.bisect_left(sizes, bs)
        if i < len(sizes) and sizes[i] == bs:
            return at(rows[i])
        if i == 0:  # below the smallest size measured: as that size
            return at(rows[0])
        if i == len(sizes):  # past the largest: its cost per request
            return at(rows[-1]) * bs / sizes[-1]
        a, b = at(rows[i - 1]), at(rows[i])
        return a + (bs - sizes[i - 1]) * (b - a) / (sizes[i] - sizes[i - 1])

    def format(self) -> str:
        """A small table in plain-step units per batch size (L = 0 is 1.0)."""
        head = "bs | " + " ".join(f"L={L:<5d}" for L in range(self.gamma + 1))
        lines = [f"DSpark verify cost, in plain steps ({head})"]
        for bs, row in zip(self.batch_sizes, self.seconds):
            unit = row[0]
            cells = " ".join(f"{t / unit:<7.2f}" for t in row)
            lines.append(f"  bs {bs:<3d} | {cells} (plain {1e3 * unit:.3f} ms)")
        return "\n".join(lines)

    def save(self, path: str) -> None:
        """Written whole or not at all: into a temporary file beside ``path``,
        then renamed over it (an engine loading it meanwhile reads the old
        table or the new one, never half of one)."""
        fd, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path) or "."
        )
        try:
            # mkstemp's 0600 would keep the table from ranks run by others.
            as_created(tmp)
            with os.fdopen(fd, "w") as f:
                json.dump(
                    {
                        "batch_sizes": list(self.batch_sizes),
                        "gamma": self.gamma,
                        "seconds": [list(r) for r in self.seconds],
                        "measured_for": self.measured_for,
                    },
                    f,
                    indent=1,
                )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    @classmethod
    def load(cls, path: str) -> "VerifyCostTable":
        try:
            with open(path) as f:
                raw = json.load(f)
            # As save writes them: ints, lists of numbers, a string (a "12"
            # read as a list, or 1.9 as an int, would load as another table).
            sizes, gamma, rows = raw["batch_sizes"], raw["gamma"], raw["seconds"]
            measured_for = raw.get("measured_for", "")
            if not (
                _is_int(gamma)
                and isinstance(sizes, list)
                and all(map(_is_int, sizes))
                and isinstance(rows, list)
                and all(isinstance(r, list) for r in rows)
                and all(_is_number(t) for r in rows for t in r)
                and isinstance(measured_for, str)
            ):
                raise ValueError("not the format save writes")
            return cls(
                batch_sizes=tuple(sizes),
                gamma=gamma,
                seconds=tuple(tuple(float(t) for t in r) for r in rows),
                measured_for=measured_for,
            )
        except (OSError, ValueError, KeyError, TypeError, OverflowError) as e:
            raise ValueError(f"cost table {path!r} is unreadable: {e}") from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# Tables measured in this process, by what they depend on (architecture,
# device, threads, graphs): engines alike measure once.
MEASURED: Dict[Hashable, VerifyCostTable] = {}


def measure_cost_table(
    *,
    run_step: Callable[[int, int], None],  # (bs, budget): one device step
    batch_sizes: Sequence[int],
    gamma: int,
    repeats: int = 5,
    sync: Callable[[], None] = lambda: None,
    measured_for: str = "",
) -> VerifyCostTable:
    """Time ``run_step`` at every batch size and per-request draft count L
    (budget bs * L): the median of ``repeats`` steps after two warm ones,
    the L values interleaved so that a load spike hits them alike."""
    seconds: List[Tuple[float, ...]] = []
    for bs in batch_sizes:
        budgets = [bs * L for L in range(gamma + 1)]
        for budget in budgets:  # warm
            run_step(bs, budget)
            run_step(bs, budget)
        times: List[List[float]] = [[] for _ in budgets]
        for _ in range(repeats):
            for i, budget in enumerate(budgets):
                sync()
                start = time.perf_counter()
                run_step(bs, budget)
                sync()
                times[i].append(time.perf_counter() - start)
        seconds.append(tuple(statistics.median(t) for t in times))
    return VerifyCostTable(
        batch_sizes=tuple(batch_sizes),
        gamma=gamma,
        seconds=tuple(seconds),
        measured_for=measured_for,
    )

"""Small checks shared by the argument and parameter validators, and the
command line tools' exit on Ctrl-C."""

import math
import numbers
import sys

# A shell's exit code for a process ended by Ctrl-C: 128 + SIGINT.
EXIT_INTERRUPTED = 130


def interrupted(prog: str, hint: str = "") -> int:
    """A command line tool stopped by Ctrl-C: one line on stderr (with what
    the user can do next), no traceback; returns the exit code."""
    print(f"{prog}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
    return EXIT_INTERRUPTED


def is_finite(value) -> bool:
    """``math.isfinite`` for any real number, False for an int past float's
    range (where ``math.isfinite`` raises ``OverflowError``), so that a
    validator refuses it with its own message."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# The most intra-op threads a run may ask torch for: far past it (100000)
# torch's thread pool crashes the process; thousands still run.
MAX_NUM_THREADS = 1024


def checked_num_threads(name: str, value) -> int:
    """``value`` as torch's intra-op thread count, or ValueError naming
    ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not 1 <= value <= MAX_NUM_THREADS:
        raise ValueError(f"{name} must be in [1, {MAX_NUM_THREADS}], got {value}")
    return int(value)

"""Small checks shared by the argument and parameter validators, and the
command line tools' exit on Ctrl-C."""

import math
import os
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


def max_num_threads() -> int:
    """The most intra-op threads a run may ask torch for: this machine's
    cores (far past them, torch's thread pool crashes the process)."""
    return os.cpu_count() or 1

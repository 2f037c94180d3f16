"""Small checks shared by the argument and parameter validators, the
command line tools' output folders, their exit on Ctrl-C, and the mode of
what they write whole then rename into place."""

import math
import numbers
import os
import sys
import threading

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


# Seeds the engine takes (``random_seed``, ``sampling_seed``): [0, 2**63).
SEED_BOUND = 2**63


def check_seed(parser, flag: str, seed: int) -> None:
    """A command line tool's seed, in the engine's range, or the parser's
    error (before any work: a bench's machine probes run first)."""
    if not 0 <= seed < SEED_BOUND:
        parser.error(f"{flag} must be in [0, 2**63), got {seed}")


def as_created(path: str) -> None:
    """Give a file or folder that ``tempfile`` made private (0600, 0700) the
    mode a plain ``open`` or ``os.makedirs`` would have: 0666 or 0777 less
    the umask. What is written beside its place and renamed in is then as
    readable as what is written in place (by other users' ranks, say)."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~_umask())


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it;
    elsewhere by setting it, meanwhile to 0o077 (private), not 0: files
    other threads make then are never more open than asked."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def check_dir(parser, flag: str, path, *, make: bool = True) -> None:
    """An output folder of a bench (``--plot-dir``, ``--profile``) or of the
    training, checked before its run: a path naming a file, or a folder that
    cannot be made or written in, is the parser's error. ``make``: made now
    (a bench's); else only checked (the training's: a run that fails leaves
    no folder it did not find)."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path} is a file; give a folder")
    if make:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            parser.error(f"{flag} {path}: cannot make it ({e.strerror})")
    found = os.path.abspath(path)  # the folder itself, or what would hold it
    while not os.path.exists(found):
        found = os.path.dirname(found)
    if not os.path.isdir(found):
        parser.error(f"{flag} {path}: cannot make it ({found} is a file)")
    if not os.access(found, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: {found} is not writable")

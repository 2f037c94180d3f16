"""The embedded pair's corpus: the Python standard library's own source files.

Bytes are tokens (vocab 256). Byte 255 never occurs in UTF-8, so it is free to
be the DSpark mask token; files that are not valid UTF-8 are skipped, which
keeps it out of the text. The files are read at run time from
``sysconfig.get_paths()["stdlib"]`` (PSF-licensed; nothing is copied into the
repo), sorted by relative path, and every 20th file is held out.

The split depends on the Python the code runs on (a different stdlib gives a
different corpus); it is fixed for one interpreter.
"""

import os
import random
import sysconfig
from dataclasses import dataclass
from typing import List, Optional, Tuple

HELD_OUT_EVERY = 20
MASK_BYTE = 255
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True)
class StdlibCorpus:
    root: str
    train_files: Tuple[str, ...]  # relative paths
    heldout_files: Tuple[str, ...]

    def read(self, split: str) -> List[bytes]:
        """The files of ``split`` ("train" or "heldout"), as bytes, in order."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        names = self.train_files if split == "train" else self.heldout_files
        out = []
        for name in names:
            with open(os.path.join(self.root, name), "rb") as f:
                out.append(f.read())
        return out


def _is_text(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def load_stdlib_corpus(root: Optional[str] = None) -> StdlibCorpus:
    """List the stdlib's ``.py`` files and split them (every 20th held out)."""
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ValueError(f"stdlib directory {root!r} does not exist")
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                names.append(os.path.relpath(path, root).replace(os.sep, "/"))
    names.sort()
    kept = []
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        if data and _is_text(data):
            kept.append(name)
    if len(kept) < HELD_OUT_EVERY:
        raise ValueError(f"only {len(kept)} usable .py files under {root!r}")
    heldout = tuple(n for i, n in enumerate(kept) if i % HELD_OUT_EVERY == 0)
    train = tuple(n for i, n in enumerate(kept) if i % HELD_OUT_EVERY != 0)
    return StdlibCorpus(root=root, train_files=train, heldout_files=heldout)


def sample_prompts(
    files: List[bytes], *, num: int, length: int, seed: int
) -> List[List[int]]:
    """``num`` prompts of ``length`` bytes, each starting at a line start of a
    file chosen by the seed; files too short for ``length`` are never chosen."""
    if num < 1 or length < 1:
        raise ValueError(f"num and length must be >= 1, got {num} and {length}")
    usable = [f for f in files if len(f) > length + 1]
    if not usable:
        raise ValueError(f"no file is longer than {length} bytes")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        data = usable[rng.randrange(len(usable))]
        start = rng.randrange(len(data) - length)
        line = data.rfind(b"\n", 0, start) + 1  # back to the line's start
        prompts.append(list(data[line : line + length]))
    return prompts

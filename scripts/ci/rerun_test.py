#!/usr/bin/env python3
"""Resolve a ``/rerun-test`` PR comment into the commands the CI bot runs.

  python3 scripts/ci/rerun_test.py "/rerun-test test_a.py spec/dspark/test_b"
  echo "/rerun-test test_a.py" | python3 scripts/ci/rerun_test.py --run

Each name is a file name (".py" optional) or a path under test/registered/.
Commands are grouped by the GitHub runner each registration runs on; ``--run``
runs the groups this machine can run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from sglang.test.ci.ci_register import (
    CPU_RUNNER,
    CIRegistration,
    RegistrationError,
    collect_registrations,
    runner_label,
)

COMMAND = "/rerun-test"
REPO_ROOT = Path(__file__).resolve().parents[2]
TAIL_LINES = 40


class ResolveError(Exception):
    """A name in the comment that does not map to one runnable test file."""


def parse_comment(text: str) -> list[str]:
    """The test names on the comment's first line, deduplicated, in order."""
    lines = text.strip().splitlines()
    words = lines[0].split() if lines else []
    if not words or words[0] != COMMAND:
        raise ValueError(f"comment must start with {COMMAND}")
    names = [w.strip(",") for w in words[1:] if w.strip(",")]
    if not names:
        raise ValueError(f"{COMMAND}: name at least one test file")
    return list(dict.fromkeys(names))


def _find(name: str, root: Path, files: list[Path]) -> Path:
    registered = root / "test" / "registered"
    filename = name.removeprefix("./")
    filename = filename if filename.endswith(".py") else filename + ".py"
    if "/" not in filename:
        matches = [p for p in files if p.name == filename]
        if not matches:
            raise ResolveError(
                f"{name}: no test file with that name under test/registered/"
            )
        if len(matches) > 1:
            listed = ", ".join(str(p) for p in matches)
            raise ResolveError(f"{name}: ambiguous, matches {listed}")
        return matches[0]
    # A path: repo-relative, test/-relative ("registered/...") or registered-relative.
    if Path(filename).is_absolute():
        candidate = Path(filename)
    elif filename.startswith("registered/"):
        candidate = root / "test" / filename
    elif filename.startswith("test/") or (root / filename).exists():
        candidate = root / filename
    else:
        candidate = registered / filename
    real = candidate.resolve()
    if not real.is_relative_to(registered.resolve()):
        raise ResolveError(f"{name}: not a path under test/registered/")
    for path in files:
        if path.resolve() == real:
            return path
    raise ResolveError(f"{name}: no test file at that path under test/registered/")


def resolve(names: list[str], root: Path) -> tuple[list[CIRegistration], list[str]]:
    """Map comment names to their enabled registrations; collect one error per bad name."""
    files = sorted((Path(root) / "test" / "registered").rglob("*.py"))
    resolved: list[CIRegistration] = []
    errors: list[str] = []
    done: set[Path] = set()
    for name in names:
        try:
            path = _find(name, Path(root), files)
            regs = collect_registrations(path)
        except ResolveError as e:
            errors.append(str(e))
            continue
        except RegistrationError as e:
            errors.append(f"{name}: {e}")
            continue
        enabled = [reg for reg in regs if reg.disabled is None]
        if not regs:
            errors.append(f"{name}: {path} is not registered for CI")
        elif not enabled:
            reasons = "; ".join(sorted({str(reg.disabled) for reg in regs}))
            errors.append(f"{name}: {path} is disabled: {reasons}")
        elif path not in done:  # two spellings of one file run it once
            done.add(path)
            resolved.extend(enabled)
    return resolved, errors


def group_by_runner(regs: list[CIRegistration], root: Path) -> dict[str, list[str]]:
    """Runner label -> test/-relative files; the CPU runner first, then by name."""
    groups: dict[str, list[str]] = {}
    for reg in regs:
        rel = Path(reg.filename).relative_to(Path(root) / "test").as_posix()
        files = groups.setdefault(runner_label(reg), [])
        if rel not in files:
            files.append(rel)
    order = sorted(groups, key=lambda label: (label != CPU_RUNNER, label))
    return {label: groups[label] for label in order}


def format_reply(groups: dict[str, list[str]]) -> str:
    """The bot's reply: per runner, a count and one command per test."""
    lines = []
    for label, files in groups.items():
        noun = "test" if len(files) == 1 else "tests"
        lines.append(f"{label} ({len(files)} {noun}):")
        lines.extend(f"  cd test/ && python3 {rel}" for rel in files)
    return "\n".join(lines)


def gpu_available() -> bool:
    try:
        import torch  # lazy: CPU-only comments never pay for the import
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_file(rel: str, test_dir: Path, timeout: float) -> tuple[bool, float, str]:
    """Run one test file from test/; returns (passed, seconds, output)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, rel],
            cwd=test_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        ok, output = proc.returncode == 0, proc.stdout
    except subprocess.TimeoutExpired:
        ok, output = False, f"timed out after {timeout:g}s"
    return ok, time.monotonic() - start, output


def run_groups(
    groups: dict[str, list[str]],
    test_dir: Path,
    *,
    gpu: bool,
    timeout: float,
    out: TextIO = sys.stdout,
) -> tuple[int, int]:
    """Run the groups this machine can run; prints like the bot, returns (passed, failed)."""
    passed = failed = 0
    for label, files in groups.items():
        if label != CPU_RUNNER and not gpu:
            print(f"{label}: skipped, no GPU on this machine", file=out, flush=True)
            continue
        print(f"{label}:", file=out, flush=True)
        group_passed = 0
        for rel in files:
            ok, seconds, output = run_file(rel, test_dir, timeout)
            mark = "✅ PASSED" if ok else "❌ FAILED"
            print(f"  {mark} {rel} ({seconds:.1f}s)", file=out)
            if not ok:
                tail = output.splitlines()[-TAIL_LINES:]
                print("\n".join("      " + line for line in tail), file=out)
            out.flush()
            group_passed += 1 if ok else 0
        group_failed = len(files) - group_passed
        print(f"{label}: {group_passed} passed, {group_failed} failed", file=out)
        passed, failed = passed + group_passed, failed + group_failed
    print(f"{passed} passed, {failed} failed", file=out, flush=True)
    return passed, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comment", nargs="*", help="the comment; stdin if absent")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repo root")
    parser.add_argument("--run", action="store_true", help="run what this machine can")
    parser.add_argument("--timeout-per-file", type=float, default=900.0)
    args = parser.parse_args(argv)
    text = " ".join(args.comment) if args.comment else sys.stdin.read()
    try:
        names = parse_comment(text)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.chdir(args.root)  # messages then name files as test/registered/...
    root = Path(".")
    resolved, errors = resolve(names, root)
    for error in errors:
        print(f"error: {error}", file=sys.stderr, flush=True)
    groups = group_by_runner(resolved, root)
    if groups:
        print(format_reply(groups), flush=True)
    status = 1 if errors else 0
    if args.run and groups:
        gpu = any(label != CPU_RUNNER for label in groups) and gpu_available()
        print(flush=True)
        _, failed = run_groups(
            groups, root / "test", gpu=gpu, timeout=args.timeout_per_file
        )
        status = 1 if failed else status
    return status


if __name__ == "__main__":
    sys.exit(main())

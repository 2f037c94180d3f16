#!/usr/bin/env python3
"""Run, list or check the test files registered for a CI suite.

From the repo root (or from test/, dropping the "test/" prefix):
  python3 test/run_suite.py --suite base-a-test-cpu          # run it
  python3 test/run_suite.py --suite base-a-test-cpu --list   # show files, est. time
  python3 test/run_suite.py --check                          # validate registrations

Each file runs in its own subprocess as ``python3 registered/<path>`` from test/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from sglang.test.ci.ci_register import (
    CIRegistration,
    RegistrationError,
    collect_registrations,
    collect_tests,
    find_test_files,
    has_main_entry,
)

REGISTERED = Path("registered")  # relative: main() runs from the test/ directory
TAIL_LINES = 40


def suite_files(regs: list[CIRegistration], suite: str) -> list[CIRegistration]:
    """The first enabled registration of each file in ``suite``, in file order."""
    by_file: dict[str, CIRegistration] = {}
    for reg in regs:
        if reg.effective_suite == suite and reg.disabled is None:
            by_file.setdefault(reg.filename, reg)
    return list(by_file.values())


def gpu_available() -> bool:
    try:
        import torch  # lazy: listing and CPU suites never pay for the import
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_file(path: str, timeout: float) -> tuple[bool, float, str]:
    """Run one test file from the cwd; returns (passed, seconds, output)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, path],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        ok, output = proc.returncode == 0, proc.stdout
    except subprocess.TimeoutExpired as e:
        # The partial output arrives as bytes even with text=True.
        raw = e.output or b""
        partial = raw if isinstance(raw, str) else raw.decode(errors="replace")
        ok, output = False, f"{partial}\ntimed out after {timeout:g}s"
    return ok, time.monotonic() - start, output


def tail(output: str, lines: int = TAIL_LINES) -> str:
    return "\n".join("    " + line for line in output.splitlines()[-lines:])


def run_suite(selected: list[CIRegistration], timeout: float) -> int:
    if any(reg.backend == "cuda" for reg in selected) and not gpu_available():
        print("note: no GPU on this machine; CUDA tests skip themselves", flush=True)
    passed = failed = 0
    for i, reg in enumerate(selected, 1):
        ok, seconds, output = run_file(reg.filename, timeout)
        status = "PASSED" if ok else "FAILED"
        print(f"[{i}/{len(selected)}] {status} {reg.filename} ({seconds:.1f}s)")
        if ok:
            passed += 1
        else:
            failed += 1
            print(tail(output))
        sys.stdout.flush()
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


def list_suite(selected: list[CIRegistration]) -> int:
    for reg in selected:
        print(f"  {reg.filename}  {reg.est_time:g}s")
    total = sum(reg.est_time for reg in selected)
    print(f"total: {len(selected)} files, {total:g}s estimated")
    return 0


def check() -> int:
    """Every test_*.py must parse, be registered and run tests when executed."""
    files = find_test_files(REGISTERED)
    problems = []
    for path in files:
        try:
            if not collect_registrations(path):
                problems.append(f"{path}: no register_cpu_ci/register_cuda_ci call")
            if not has_main_entry(path):
                problems.append(f'{path}: no `if __name__ == "__main__":` entry')
        except RegistrationError as e:
            problems.append(str(e))
    for problem in problems:
        print(problem)
    if problems:
        print(f"registration check: {len(problems)} problems in {len(files)} files")
        return 1
    print(f"registration check: {len(files)} files OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", help="the suite to run or list")
    parser.add_argument("--list", action="store_true", help="list, don't run")
    parser.add_argument("--check", action="store_true", help="validate all files")
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="the test/ directory (default: the one holding this script)",
    )
    parser.add_argument("--timeout-per-file", type=float, default=900.0)
    args = parser.parse_args(argv)
    os.chdir(args.root)  # commands and messages use paths like registered/x.py
    if args.check:
        return check()
    if not args.suite:
        parser.error("give --suite NAME or --check")
    try:
        regs = collect_tests(REGISTERED)
    except RegistrationError as e:
        print(f"error: {e} (run --check)", file=sys.stderr)
        return 2
    known = sorted({reg.effective_suite for reg in regs})
    if args.suite not in known:
        names = ", ".join(known) or "(none)"
        print(f"error: unknown suite {args.suite!r}; known: {names}", file=sys.stderr)
        return 2
    selected = suite_files(regs, args.suite)
    if args.list:
        return list_suite(selected)
    return run_suite(selected, args.timeout_per_file)


if __name__ == "__main__":
    sys.exit(main())

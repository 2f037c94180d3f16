#!/usr/bin/env python3
"""Run, list or check the test files registered for a CI suite.

From the repo root (or from test/, dropping the "test/" prefix):
  python3 test/run_suite.py --hw cpu --suite base-a-test-cpu          # run it
  python3 test/run_suite.py --hw cpu --suite base-a-test-cpu --list   # files, est. time
  python3 test/run_suite.py --hw cuda --suite base-b-test-1-gpu-large
  python3 test/run_suite.py --check                 # validate registrations

``--hw`` (cpu or cuda) and ``--suite`` are required to run or list: ``--hw``
picks the register_cpu_ci or register_cuda_ci registrations, ``--suite`` their
suite (``suite=``, or "<stage>-test-<runner_config>"). ``--check`` needs
neither: it validates that every test_*.py under registered/ parses, is
registered and has an ``if __name__ == "__main__":`` entry. A file
registered with ``nightly=True`` runs only with ``--nightly`` (which runs
the suite's other files too).

Each file runs in its own subprocess as ``python3 registered/<path>`` from test/,
with a limit of ``--timeout-per-file`` seconds. The run stops at the first
failing file (the rest are reported as not run) unless ``--continue-on-error``
is given. A file whose every test skipped itself (unittest's "OK
(skipped=N)" for all it ran: a CUDA test on a machine without a GPU) is
SKIPPED, not PASSED. A summary follows the per-file lines; the last line is
"N passed, N failed" (the skipped files are counted on the line before it,
in neither). Exit status: 0 all passed, 1 a file failed or was not
run, 2 a usage error, an unknown suite or a malformed registration, 130 a
Ctrl-C (the summary still printed, the file it stopped counted failed);
``--check``: 0 every registration is well formed, 1 not.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from sglang.srt.utils.common import EXIT_INTERRUPTED
from sglang.test.ci.ci_register import (
    CIRegistration,
    RegistrationError,
    collect_registrations,
    collect_tests,
    find_test_files,
    gpu_available,
    has_main_entry,
    run_test_file,
    timeout_seconds,
)

REGISTERED = Path("registered")  # relative: main() runs from the test/ directory
TAIL_LINES = 40
DEFAULT_TIMEOUT_S = 900.0


def suite_files(
    regs: list[CIRegistration], hw: str, suite: str, *, nightly: bool = False
) -> list[CIRegistration]:
    """The first enabled ``hw`` registration of each file in ``suite``, in file
    order; a ``nightly=True`` registration only in a nightly run, as upstream
    (which runs the others too)."""
    by_file: dict[str, CIRegistration] = {}
    for reg in regs:
        if (
            reg.backend == hw
            and reg.effective_suite == suite
            and reg.disabled is None
            and (nightly or not reg.nightly)
        ):
            by_file.setdefault(reg.filename, reg)
    return list(by_file.values())


_RAN = re.compile(r"^Ran (\d+) tests? in ", re.M)
_SKIPPED = re.compile(r"^OK \((?:.*, )?skipped=(\d+)", re.M)


def skip_counts(output: str) -> tuple[int, int]:
    """(tests run, tests skipped) by a passing unittest file's summaries."""
    ran = sum(map(int, _RAN.findall(output)))
    return ran, sum(map(int, _SKIPPED.findall(output)))


def tail(output: str, lines: int = TAIL_LINES) -> str:
    return "\n".join("    " + line for line in output.splitlines()[-lines:])


def run_suite(
    selected: list[CIRegistration],
    timeout: float,
    *,
    continue_on_error: bool,
    label: str,
) -> int:
    if any(reg.backend == "cuda" for reg in selected) and not gpu_available():
        print("note: no GPU on this machine; CUDA tests skip themselves", flush=True)
    results: list[tuple[str, str, float]] = []  # (status, file, seconds)
    interrupted = False
    for i, reg in enumerate(selected, 1):
        start = time.monotonic()
        try:
            ok, seconds, output = run_test_file([reg.filename], timeout)
        except KeyboardInterrupt:  # the file's process got the Ctrl-C too
            results.append(("FAILED", reg.filename, time.monotonic() - start))
            print(f"[{i}/{len(selected)}] INTERRUPTED {reg.filename}", flush=True)
            interrupted = True
            break
        ran, skips = skip_counts(output) if ok else (0, 0)
        # A class or module that skips adds a skip but no test run.
        status = "FAILED" if not ok else "SKIPPED" if skips >= max(ran, 1) else "PASSED"
        results.append((status, reg.filename, seconds))
        note = f", {skips} skipped, {ran} run" if skips else ""
        print(f"[{i}/{len(selected)}] {status} {reg.filename} ({seconds:.1f}s{note})")
        if not ok:
            print(tail(output))
        sys.stdout.flush()
        if not ok and not continue_on_error:
            break
    not_run = [reg.filename for reg in selected[len(results) :]]
    passed = sum(status == "PASSED" for status, _, _ in results)
    skipped = sum(status == "SKIPPED" for status, _, _ in results)
    failed = len(results) - passed - skipped
    total = sum(seconds for _, _, seconds in results)
    print(f"== summary: {label}: {len(selected)} files, {total:.1f}s ==")
    for status, filename, seconds in results:
        print(f"  {status:<8} {filename} ({seconds:.1f}s)")
    for filename in not_run:
        print(f"  {'NOT RUN':<8} {filename}")
    if not_run:
        why = (
            "interrupted (Ctrl-C)"
            if interrupted
            else "stopped at the first failure (--continue-on-error runs every file)"
        )
        print(f"{len(not_run)} not run: {why}")
    if skipped:
        print(f"{skipped} skipped: every test in the file skipped itself")
    print(f"{passed} passed, {failed} failed", flush=True)
    if interrupted:
        return EXIT_INTERRUPTED
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
                problems.append(
                    f'{path}: no `if __name__ == "__main__":` entry as its last statement'
                )
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
    parser.add_argument(
        "--hw",
        choices=("cpu", "cuda"),
        help="backend: cpu runs register_cpu_ci files, cuda register_cuda_ci files "
        "(required unless --check)",
    )
    parser.add_argument(
        "--suite", help="the suite to run or list (required unless --check)"
    )
    parser.add_argument("--list", action="store_true", help="list, don't run")
    parser.add_argument(
        "--nightly",
        action="store_true",
        help="a nightly run: also the files registered with nightly=True",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate that every file is registered and has a __main__ entry",
    )
    parser.add_argument(
        "--continue-on-error",
        action="store_true",
        help="run every file even after one fails (default: stop at the first)",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="the test/ directory (default: the one holding this script)",
    )
    parser.add_argument(
        "--timeout-per-file",
        type=timeout_seconds,
        default=None,
        help=f"seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    args = parser.parse_args(argv)
    if not args.check:
        missing = [flag for flag in ("--hw", "--suite") if not getattr(args, flag[2:])]
        if missing:
            parser.error(
                f"the following arguments are required: {', '.join(missing)} "
                "(unless --check)"
            )
    run_flags = ("--hw", "--suite", "--list", "--nightly", "--continue-on-error")
    given = [f for f in run_flags if getattr(args, f[2:].replace("-", "_"))]
    if args.timeout_per_file is not None:
        given.append("--timeout-per-file")
    if args.check and given:
        parser.error(f"--check validates every file: it takes no {', '.join(given)}")
    if args.timeout_per_file is None:
        args.timeout_per_file = DEFAULT_TIMEOUT_S
    if not args.root.is_dir():
        parser.error(f"--root {args.root}: not a directory")
    os.chdir(args.root)  # commands and messages use paths like registered/x.py
    if args.check:
        return check()
    try:
        regs = collect_tests(REGISTERED)
    except RegistrationError as e:
        print(f"error: {e} (run --check)", file=sys.stderr)
        return 2
    known = sorted({reg.effective_suite for reg in regs if reg.backend == args.hw})
    if args.suite not in known:
        names = ", ".join(known) or "(none)"
        print(
            f"error: unknown suite {args.suite!r} for --hw {args.hw}; known: {names}",
            file=sys.stderr,
        )
        return 2
    selected = suite_files(regs, args.hw, args.suite, nightly=args.nightly)
    if not selected:  # the suite's files are all disabled, or nightly
        why = "every file is disabled"
        if not args.nightly:
            why = "its files are disabled or nightly (--nightly runs those)"
        print(f"note: suite {args.suite!r} has no file to run here: {why}", flush=True)
    if args.list:
        return list_suite(selected)
    return run_suite(
        selected,
        args.timeout_per_file,
        continue_on_error=args.continue_on_error,
        label=f"suite {args.suite}, --hw {args.hw}",
    )


if __name__ == "__main__":
    sys.exit(main())

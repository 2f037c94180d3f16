#!/usr/bin/env python3
"""Resolve a ``/rerun-test`` PR comment into the commands the CI bot runs.

  python3 scripts/ci/rerun_test.py "/rerun-test test_a.py spec/dspark/test_b"
  python3 scripts/ci/rerun_test.py "/rerun-test test_a.py::TestX test_b.py::TestY.test_z"
  echo "/rerun-test test_a.py" | python3 scripts/ci/rerun_test.py --run

Each spec is a file name (".py" optional) or a path under test/registered/,
optionally followed by ``::TestClass`` or ``::TestClass.test_method`` (checked
against the file's syntax tree). Commands are grouped by the GitHub runner each
registration runs on, one per spec:
``cd test/ && python3 registered/<path>.py [TestClass[.test_method]]`` (unittest's
argv picks the class or method). ``--run`` runs the groups this machine can run:
the CPU group always, a CUDA group only with a GPU.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional, TextIO

from sglang.srt.utils.common import EXIT_INTERRUPTED
from sglang.test.ci.ci_register import (
    CPU_RUNNER,
    CIRegistration,
    RegistrationError,
    collect_registrations,
    gpu_available,
    run_test_file,
    runner_label,
    timeout_seconds,
)

COMMAND = "/rerun-test"
REPO_ROOT = Path(__file__).resolve().parents[2]
TAIL_LINES = 40


_SELECTOR = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")


class ResolveError(Exception):
    """A spec in the comment that does not map to a runnable test; the problem only."""


class Target(NamedTuple):
    """One command of the reply: a test/-relative file and its unittest selector."""

    rel: str  # e.g. "registered/spec/test_x.py"
    selector: Optional[str] = None  # "TestClass" or "TestClass.test_method"

    def argv(self) -> list[str]:
        return [self.rel] if self.selector is None else [self.rel, self.selector]

    def __str__(self) -> str:
        return " ".join(self.argv())


def parse_comment(text: str) -> list[str]:
    """The test specs on the comment's first line, deduplicated, in order."""
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
            raise ResolveError("no test file with that name under test/registered/")
        if len(matches) > 1:
            listed = ", ".join(str(p) for p in matches)
            raise ResolveError(f"ambiguous, matches {listed}")
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
        raise ResolveError("not a path under test/registered/")
    for path in files:
        if path.resolve() == real:
            return path
    raise ResolveError("no test file at that path under test/registered/")


def _split_spec(name: str) -> tuple[str, Optional[str]]:
    """Split a spec: file.py::TestClass.test_method -> (file.py, TestClass.test_method)."""
    if "::" not in name:
        return name, None
    file_part, _, selector = name.partition("::")
    if not file_part or not _SELECTOR.fullmatch(selector):
        raise ResolveError(
            "bad spec; use file.py, file.py::TestClass "
            "or file.py::TestClass.test_method"
        )
    return file_part, selector


def _check_selector(path: Path, selector: str) -> None:
    """The class (and method) must be defined in the file: a module-level class."""
    class_name, _, method = selector.partition(".")
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    classes = [
        stmt
        for stmt in tree.body
        if isinstance(stmt, ast.ClassDef) and stmt.name == class_name
    ]
    if not classes:
        raise ResolveError(f"no class {class_name} in {path}")
    if method and not any(
        isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        and stmt.name == method
        for stmt in classes[-1].body
    ):
        raise ResolveError(f"class {class_name} in {path} has no method {method}")


def resolve(
    names: list[str], root: Path
) -> tuple[list[tuple[CIRegistration, Optional[str]]], list[str]]:
    """Map comment specs to (enabled registration, selector) pairs; one error per bad spec."""
    files = sorted((Path(root) / "test" / "registered").rglob("*.py"))
    resolved: list[tuple[CIRegistration, Optional[str]]] = []
    errors: list[str] = []
    done: set[tuple[Path, Optional[str]]] = set()
    for name in names:
        try:
            file_part, selector = _split_spec(name)
            path = _find(file_part, Path(root), files)
            regs = collect_registrations(path)
            enabled = [reg for reg in regs if reg.disabled is None]
            if not regs:
                raise ResolveError(f"{path} is not registered for CI")
            if not enabled:
                reasons = "; ".join(sorted({str(reg.disabled) for reg in regs}))
                raise ResolveError(f"{path} is disabled: {reasons}")
            if selector is not None:
                _check_selector(path, selector)
        except (ResolveError, RegistrationError) as e:
            errors.append(f"{name}: {e}")
            continue
        if (path, selector) not in done:  # two spellings of one spec run it once
            done.add((path, selector))
            resolved.extend((reg, selector) for reg in enabled)
    return resolved, errors


def group_by_runner(
    resolved: list[tuple[CIRegistration, Optional[str]]], root: Path
) -> dict[str, list[Target]]:
    """Runner label -> targets to run; the CPU runner first, then by name."""
    groups: dict[str, list[Target]] = {}
    for reg, selector in resolved:
        rel = Path(reg.filename).relative_to(Path(root) / "test").as_posix()
        targets = groups.setdefault(runner_label(reg), [])
        target = Target(rel, selector)
        if target not in targets:
            targets.append(target)
    order = sorted(groups, key=lambda label: (label != CPU_RUNNER, label))
    return {label: groups[label] for label in order}


def format_reply(groups: dict[str, list[Target]]) -> str:
    """The bot's reply: per runner, a count and one command per spec."""
    lines = []
    for label, targets in groups.items():
        noun = "test" if len(targets) == 1 else "tests"
        lines.append(f"{label} ({len(targets)} {noun}):")
        lines.extend(f"  cd test/ && python3 {target}" for target in targets)
    return "\n".join(lines)


def run_groups(
    groups: dict[str, list[Target]],
    test_dir: Path,
    *,
    gpu: bool,
    timeout: float,
    out: TextIO = sys.stdout,
) -> tuple[int, int]:
    """Run the groups this machine can run; prints like the bot, returns
    (passed, failed). A Ctrl-C counts the file it stopped as failed, prints
    the last line and is raised again."""
    passed = failed = 0
    try:
        for label, targets in groups.items():
            if label != CPU_RUNNER and not gpu:
                print(f"{label}: skipped, no GPU on this machine", file=out, flush=True)
                continue
            print(f"{label}:", file=out, flush=True)
            group_passed = 0
            for target in targets:
                try:
                    ok, seconds, output = run_test_file(
                        target.argv(), timeout, cwd=test_dir
                    )
                except KeyboardInterrupt:  # the file's process got it too
                    failed += 1
                    print(f"  ⛔ INTERRUPTED {target}", file=out)
                    print(f"{label}: interrupted (Ctrl-C)", file=out)
                    raise
                mark = "✅ PASSED" if ok else "❌ FAILED"
                print(f"  {mark} {target} ({seconds:.1f}s)", file=out)
                if not ok:
                    tail = output.splitlines()[-TAIL_LINES:]
                    print("\n".join("      " + line for line in tail), file=out)
                out.flush()
                group_passed += 1 if ok else 0
                passed, failed = passed + ok, failed + (not ok)
            group_failed = len(targets) - group_passed
            print(f"{label}: {group_passed} passed, {group_failed} failed", file=out)
    finally:
        print(f"{passed} passed, {failed} failed", file=out, flush=True)
    return passed, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comment", nargs="*", help="the comment; stdin if absent")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repo root")
    parser.add_argument("--run", action="store_true", help="run what this machine can")
    parser.add_argument(
        "--timeout-per-file", type=timeout_seconds, default=900.0, help="seconds"
    )
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root}: not a directory")
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
        try:
            _, failed = run_groups(
                groups, root / "test", gpu=gpu, timeout=args.timeout_per_file
            )
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        status = 1 if failed else status
    return status


if __name__ == "__main__":
    sys.exit(main())

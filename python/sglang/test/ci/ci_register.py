"""CI registration: each test file names its CI suite with a no-op call.

A test file calls ``register_cpu_ci(...)`` or ``register_cuda_ci(...)`` at
module level, with upstream SGLang's signature::

    register_cuda_ci(est_time, suite=None, nightly=False, disabled=None,
                     *, stage=None, runner_config=None)

It names either a ``suite`` or a ``stage`` plus ``runner_config`` pair, whose
suite is "<stage>-test-<runner_config>" (e.g. "base-b-test-1-gpu-large"). The calls do nothing at run time; ``test/run_suite.py`` and
``scripts/ci/rerun_test.py`` read them back from the file's syntax tree, so
listing a suite never imports a test (or torch).
"""

from __future__ import annotations

import argparse
import ast
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn, Optional, Union

PathLike = Union[str, Path]
Fail = Callable[[str], NoReturn]

CPU_RUNNER = "ubuntu-latest"
DEFAULT_CUDA_RUNNER = "1-gpu-h100"

# CUDA runner_config, or a legacy suite name, -> GitHub runner label.
RUNNER_LABELS: dict[str, str] = {
    "1-gpu-large": "1-gpu-h100",
    "1-gpu": "1-gpu-h100",
    "2-gpu": "2-gpu-h100",
    "4-gpu": "4-gpu-h100",
    "8-gpu": "8-gpu-h200",
    "stage-b-test-large-1-gpu": "1-gpu-h100",
    "stage-b-test-small-1-gpu": "1-gpu-5090",
}

_BACKENDS = {"register_cpu_ci": "cpu", "register_cuda_ci": "cuda"}
# Upstream's positional order: est_time, suite, nightly, disabled.
_POSITIONAL = ("est_time", "suite", "nightly", "disabled")
_STR_ARGS = ("suite", "stage", "runner_config", "disabled")
_KNOWN_ARGS = ("est_time", "nightly") + _STR_ARGS


def register_cpu_ci(
    est_time: float,
    suite: Optional[str] = None,
    nightly: bool = False,
    disabled: Optional[str] = None,
    *,
    stage: Optional[str] = None,
    runner_config: Optional[str] = None,
) -> None:
    """Register this file for a CPU CI suite; a no-op read by the parser."""
    return None


def register_cuda_ci(
    est_time: float,
    suite: Optional[str] = None,
    nightly: bool = False,
    disabled: Optional[str] = None,
    *,
    stage: Optional[str] = None,
    runner_config: Optional[str] = None,
) -> None:
    """Register this file for a CUDA CI suite; a no-op read by the parser."""
    return None


class RegistrationError(ValueError):
    """A malformed registration call; the message names file, line and problem."""


@dataclass(frozen=True)
class CIRegistration:
    """One ``register_*_ci`` call found in a test file."""

    backend: str  # "cpu" | "cuda"
    filename: str  # the path as it was given to the parser
    est_time: float  # seconds
    suite: Optional[str] = None
    stage: Optional[str] = None
    runner_config: Optional[str] = None
    nightly: bool = False
    disabled: Optional[str] = None  # the reason, when disabled

    @property
    def effective_suite(self) -> str:
        """The suite run_suite matches: ``suite``, else "<stage>-test-<runner_config>".

        E.g. stage="base-b", runner_config="1-gpu-large" -> "base-b-test-1-gpu-large".
        """
        if self.suite is not None:
            return self.suite
        return f"{self.stage}-test-{self.runner_config}"


def _describe(node: ast.expr) -> str:
    # Show a wrong literal's value; other expressions by their node type.
    if isinstance(node, ast.Constant):
        return repr(node.value)
    return type(node).__name__


def _literal(name: str, node: ast.expr, fail: Fail) -> object:
    value = node.value if isinstance(node, ast.Constant) else node
    if name == "est_time":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            fail(f"est_time must be a number literal, got {_describe(node)}")
        if value <= 0:
            fail(f"est_time must be > 0, got {value}")
        return float(value)
    if name == "nightly":
        if not isinstance(value, bool):
            fail(f"nightly must be a bool literal, got {_describe(node)}")
        return value
    # Explicit None means "not given", same as leaving the argument out.
    if value is not None and not isinstance(value, str):
        fail(f"{name} must be a str literal, got {_describe(node)}")
    return value


def _parse_call(call: ast.Call, func: str, path: PathLike) -> CIRegistration:
    def fail(problem: str) -> NoReturn:
        raise RegistrationError(f"{path}:{call.lineno}: {func}: {problem}")

    if len(call.args) > len(_POSITIONAL):
        fail(
            f"takes at most {len(_POSITIONAL)} positional arguments "
            f"({', '.join(_POSITIONAL)}), got {len(call.args)}"
        )
    nodes: dict[str, ast.expr] = {}
    for name, arg in zip(_POSITIONAL, call.args):
        if isinstance(arg, ast.Starred):
            fail("*args is not allowed")
        nodes[name] = arg
    for kw in call.keywords:
        if kw.arg is None:
            fail("**kwargs is not allowed")
        if kw.arg not in _KNOWN_ARGS:
            fail(f"unknown keyword {kw.arg!r}")
        if kw.arg in nodes:
            fail(f"{kw.arg} given twice")
        nodes[kw.arg] = kw.value
    if "est_time" not in nodes:
        fail("est_time is required")
    values = {name: _literal(name, node, fail) for name, node in nodes.items()}

    has_suite = values.get("suite") is not None
    has_stage = values.get("stage") is not None
    has_runner = values.get("runner_config") is not None
    if has_suite and (has_stage or has_runner):
        fail("give suite or stage+runner_config, not both")
    if has_stage != has_runner:
        fail("stage and runner_config must be given together")
    if not has_suite and not has_stage:
        fail("needs suite or stage+runner_config")
    return CIRegistration(backend=_BACKENDS[func], filename=str(path), **values)


def _func_name(call: ast.Call) -> Optional[str]:
    # Accept both `register_cpu_ci(...)` and `ci_register.register_cpu_ci(...)`.
    func = call.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return name if name in _BACKENDS else None


def _parse_module(path: PathLike) -> ast.Module:
    text = Path(path).read_text(encoding="utf-8")
    try:
        return ast.parse(text, filename=str(path))
    except SyntaxError as e:
        raise RegistrationError(f"{path}:{e.lineno}: syntax error: {e.msg}") from e


def collect_registrations(path: PathLike) -> list[CIRegistration]:
    """Parse the module-level ``register_*_ci`` calls of one file, in order.

    Calls inside functions or classes do not count. Raises RegistrationError
    for a malformed call or a file that does not parse.
    """
    regs = []
    for stmt in _parse_module(path).body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            func = _func_name(stmt.value)
            if func is not None:
                regs.append(_parse_call(stmt.value, func, path))
    return regs


def find_test_files(root_dir: PathLike) -> list[Path]:
    """Every test_*.py below ``root_dir`` (the test/registered directory), sorted."""
    return sorted(Path(root_dir).rglob("test_*.py"))


def collect_tests(root_dir: PathLike) -> list[CIRegistration]:
    """All registrations of every test_*.py below ``root_dir`` (test/registered)."""
    return [
        reg for path in find_test_files(root_dir) for reg in collect_registrations(path)
    ]


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    has_name = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
    has_main = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
    return has_name and has_main


def has_main_entry(path: PathLike) -> bool:
    """True when the module ends in an ``if __name__ == "__main__":`` block
    that calls something. It must be the last statement: run as a script
    (``python3 registered/...py``), the module stops there, so a test class
    defined after it would never run."""
    body = _parse_module(path).body
    if not body:
        return False
    last = body[-1]
    return (
        isinstance(last, ast.If)
        and _is_main_guard(last.test)
        and any(isinstance(n, ast.Call) for s in last.body for n in ast.walk(s))
    )


def runner_label(reg: CIRegistration) -> str:
    """The GitHub runner label a registration runs on."""
    if reg.backend == "cpu":
        return CPU_RUNNER
    key = reg.runner_config if reg.runner_config is not None else reg.suite
    return RUNNER_LABELS.get(key or "", DEFAULT_CUDA_RUNNER)


# The longest --timeout-per-file: a week (past about 24.8 days the wait's
# poll() overflows).
MAX_TIMEOUT_S = 7 * 24 * 3600


def timeout_seconds(text: str) -> float:
    """An argparse type for the CI scripts' ``--timeout-per-file``: seconds
    in (0, a week] (else argparse's usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be seconds in (0, {MAX_TIMEOUT_S}], got {text!r}"
        )
    return value


def gpu_available() -> bool:
    try:
        import torch  # lazy: listing and CPU runs never pay for the import
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_test_file(
    argv: list[str], timeout: float, *, cwd: Optional[PathLike] = None
) -> tuple[bool, float, str]:
    """``python3 *argv`` (a test file, and unittest's selectors) in ``cwd``,
    the CI scripts' one way to run a file: (passed, seconds, output), the
    output of one that ran past ``timeout`` kept up to then."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=cwd,
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

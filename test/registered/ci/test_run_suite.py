"""Tests for test/run_suite.py, run as a subprocess on a fake test/ tree."""

import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=8, suite="base-a-test-cpu")

RUN_SUITE = Path(__file__).resolve().parents[2] / "run_suite.py"


def fake_test(registration: str, body: str = "print('ok')") -> str:
    return textwrap.dedent(
        f"""\
        import sys
        from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
        {registration}
        if __name__ == "__main__":
            {body}
        """
    )


def touch(name: str) -> str:
    """A test body that leaves ``name`` in its cwd (test/), proving it ran."""
    return f"open({name!r}, 'w').close()"


class TestRunSuite(CustomTestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.test_dir = Path(tmp.name)
        # fake-a (cpu) in file order: sub/test_fail.py fails, then test_pass.py.
        self.write(
            "test_pass.py", fake_test("register_cpu_ci(2, 'fake-a')", touch("ran_pass"))
        )
        self.write(
            "sub/test_fail.py",
            fake_test(
                "register_cpu_ci(est_time=3, suite='fake-a')",
                "print('boom-marker'); sys.exit(1)",
            ),
        )
        self.write(
            "test_off.py",
            fake_test("register_cpu_ci(1, 'fake-a', False, 'flaky')", "sys.exit(1)"),
        )
        self.write("test_other.py", fake_test("register_cpu_ci(4.5, 'fake-b')"))
        # CUDA registrations: one by stage+runner_config, one in a suite named
        # like a CPU one, which --hw cpu must not pick up.
        self.write(
            "test_gpu.py",
            fake_test(
                "register_cuda_ci(6, stage='base-b', runner_config='1-gpu-large')",
                touch("ran_gpu"),
            ),
        )
        self.write(
            "test_cuda_a.py",
            fake_test("register_cuda_ci(7, 'fake-a')", touch("ran_cuda_a")),
        )

    def write(self, rel: str, source: str) -> None:
        path = self.test_dir / "registered" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)

    def ran(self, marker: str) -> bool:
        return (self.test_dir / marker).exists()

    def run_suite(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(RUN_SUITE), "--root", str(self.test_dir), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def test_hw_and_suite_are_required(self) -> None:
        proc = self.run_suite("--suite", "fake-a")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("usage: run_suite.py", proc.stderr)
        self.assertIn("error: the following arguments are required: --hw", proc.stderr)
        self.assertEqual(proc.stdout, "")
        proc = self.run_suite("--hw", "cpu")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("the following arguments are required: --suite", proc.stderr)
        proc = self.run_suite("--hw", "rocm", "--suite", "fake-a")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("invalid choice: 'rocm'", proc.stderr)
        self.assertFalse(self.ran("ran_pass"))

    def test_list_shows_enabled_files_of_that_hw_and_total(self) -> None:
        proc = self.run_suite("--hw", "cpu", "--suite", "fake-a", "--list")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(
            proc.stdout.splitlines(),
            [
                "  registered/sub/test_fail.py  3s",
                "  registered/test_pass.py  2s",
                "total: 2 files, 5s estimated",
            ],
        )

    def test_nightly_files_run_only_in_a_nightly_run(self) -> None:
        self.write(
            "test_nightly.py", fake_test("register_cpu_ci(9, 'fake-a', nightly=True)")
        )
        proc = self.run_suite("--hw", "cpu", "--suite", "fake-a", "--list")
        self.assertEqual(proc.stdout.splitlines()[-1], "total: 2 files, 5s estimated")
        proc = self.run_suite("--hw", "cpu", "--suite", "fake-a", "--list", "--nightly")
        self.assertEqual(
            proc.stdout.splitlines(),
            [
                "  registered/sub/test_fail.py  3s",
                "  registered/test_nightly.py  9s",
                "  registered/test_pass.py  2s",
                "total: 3 files, 14s estimated",
            ],
        )

    def test_hw_cuda_selects_only_cuda_registrations(self) -> None:
        proc = self.run_suite("--hw", "cuda", "--suite", "fake-a", "--list")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(
            proc.stdout.splitlines(),
            ["  registered/test_cuda_a.py  7s", "total: 1 files, 7s estimated"],
        )
        proc = self.run_suite("--hw", "cuda", "--suite", "base-b-test-1-gpu-large")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        lines = proc.stdout.splitlines()
        self.assertIn("[1/1] PASSED registered/test_gpu.py", proc.stdout)
        self.assertEqual(lines[-1], "1 passed, 0 failed")
        self.assertTrue(self.ran("ran_gpu"))
        self.assertFalse(self.ran("ran_cuda_a") or self.ran("ran_pass"))

    def test_a_file_that_skipped_every_test_is_not_passed(self) -> None:
        # unittest files: one skips its only test (a CUDA test without a
        # GPU), one skips one of two (it ran something: passed).
        def unittest_file(skips: int, runs: int) -> str:
            tests = [
                f"def test_skip_{i}(self): self.skipTest('no GPU')"
                for i in range(skips)
            ]
            tests += [f"def test_run_{i}(self): pass" for i in range(runs)]
            return (
                textwrap.dedent(
                    """\
                import unittest
                from sglang.test.ci.ci_register import register_cpu_ci
                register_cpu_ci(1, 'skips')
                class T(unittest.TestCase):
                """
                )
                + "".join(f"    {t}\n" for t in tests)
                + ("if __name__ == '__main__':\n    unittest.main()\n")
            )

        self.write("test_all_skip.py", unittest_file(skips=1, runs=0))
        self.write("test_some_skip.py", unittest_file(skips=1, runs=1))
        # A module that skips before any test runs: "Ran 0 tests", 1 skip.
        self.write(
            "test_zmodule_skip.py",
            unittest_file(skips=0, runs=1).replace(
                "class T",
                "def setUpModule(): raise unittest.SkipTest('no GPU')\nclass T",
            ),
        )
        proc = self.run_suite("--hw", "cpu", "--suite", "skips")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        lines = proc.stdout.splitlines()
        self.assertRegex(
            lines[0],
            r"^\[1/3\] SKIPPED registered/test_all_skip.py \(.*s, 1 skipped, 1 run\)",
        )
        self.assertRegex(
            lines[1],
            r"^\[2/3\] PASSED registered/test_some_skip.py \(.*s, 1 skipped, 2 run\)",
        )
        self.assertRegex(
            lines[2],
            r"^\[3/3\] SKIPPED registered/test_zmodule_skip.py \(.*s, 1 skipped, 0 run",
        )
        self.assertRegex(lines[-5], r"^  SKIPPED  registered/test_all_skip.py \(")
        self.assertEqual(
            lines[-2:],
            ["2 skipped: every test in the file skipped itself", "1 passed, 0 failed"],
        )

    def test_unknown_suite_for_that_hw_lists_known_ones(self) -> None:
        proc = self.run_suite("--hw", "cpu", "--suite", "nope")
        self.assertEqual(proc.returncode, 2)
        self.assertIn(
            "error: unknown suite 'nope' for --hw cpu; known: fake-a, fake-b",
            proc.stderr,
        )
        # A CPU-only suite is unknown to --hw cuda.
        proc = self.run_suite("--hw", "cuda", "--suite", "fake-b")
        self.assertEqual(proc.returncode, 2)
        self.assertIn(
            "error: unknown suite 'fake-b' for --hw cuda; "
            "known: base-b-test-1-gpu-large, fake-a",
            proc.stderr,
        )
        self.assertEqual(proc.stdout, "")

    def test_first_failure_stops_the_run(self) -> None:
        proc = self.run_suite("--hw", "cpu", "--suite", "fake-a")
        self.assertEqual(proc.returncode, 1)
        lines = proc.stdout.splitlines()
        self.assertRegex(lines[0], r"^\[1/2\] FAILED registered/sub/test_fail.py \(")
        self.assertIn("boom-marker", proc.stdout)  # the failure's output tail
        self.assertNotIn("[2/2]", proc.stdout)
        self.assertFalse(self.ran("ran_pass"))
        start = next(i for i, line in enumerate(lines) if line.startswith("== "))
        summary = lines[start:]
        self.assertRegex(
            summary[0], r"^== summary: suite fake-a, --hw cpu: 2 files, \d+\.\ds ==$"
        )
        self.assertRegex(summary[1], r"^  FAILED   registered/sub/test_fail.py \(")
        self.assertEqual(
            summary[2:],
            [
                "  NOT RUN  registered/test_pass.py",
                "1 not run: stopped at the first failure "
                "(--continue-on-error runs every file)",
                "0 passed, 1 failed",
            ],
        )
        self.assertNotIn("test_off.py", proc.stdout)
        self.assertNotIn("test_cuda_a.py", proc.stdout)

    def test_continue_on_error_runs_every_file(self) -> None:
        proc = self.run_suite("--hw", "cpu", "--suite", "fake-a", "--continue-on-error")
        self.assertEqual(proc.returncode, 1)
        lines = proc.stdout.splitlines()
        self.assertEqual(lines[-1], "1 passed, 1 failed")
        self.assertRegex(lines[0], r"^\[1/2\] FAILED registered/sub/test_fail.py \(")
        self.assertTrue(
            any(
                line.startswith("[2/2] PASSED registered/test_pass.py")
                for line in lines
            )
        )
        self.assertTrue(self.ran("ran_pass"))
        self.assertNotIn("NOT RUN", proc.stdout)
        self.assertNotIn("not run", proc.stdout)
        self.assertTrue(
            any(
                line.startswith("  PASSED   registered/test_pass.py (")
                for line in lines
            )
        )

    def test_passing_suite_exits_zero(self) -> None:
        proc = self.run_suite("--hw", "cpu", "--suite", "fake-b")
        self.assertEqual(proc.returncode, 0, proc.stdout)
        lines = proc.stdout.splitlines()
        self.assertRegex(lines[0], r"^\[1/1\] PASSED registered/test_other.py \(")
        self.assertRegex(lines[1], r"^== summary: suite fake-b, --hw cpu: 1 files, ")
        self.assertEqual(lines[-1], "1 passed, 0 failed")

    def test_timeout_fails_the_file(self) -> None:
        self.write(
            "test_slow.py",
            fake_test("register_cpu_ci(1, 'slow')", "import time; time.sleep(30)"),
        )
        proc = self.run_suite(
            "--hw", "cpu", "--suite", "slow", "--timeout-per-file", "0.5"
        )
        self.assertEqual(proc.returncode, 1)
        self.assertIn("timed out after 0.5s", proc.stdout)
        self.assertEqual(proc.stdout.splitlines()[-1], "0 passed, 1 failed")

    def test_bad_arguments_are_usage_errors(self) -> None:
        for args in (
            ["--timeout-per-file", "nan"],  # a traceback from selectors before
            ["--timeout-per-file", "inf"],
            ["--timeout-per-file", "-1"],  # every file "timed out" before
            ["--timeout-per-file", "0"],
            ["--timeout-per-file", "1e10"],  # past poll()'s range
            ["--root", str(self.test_dir / "nonexistent")],  # the last --root
        ):
            with self.subTest(args=args):
                proc = self.run_suite("--hw", "cpu", "--suite", "fake-b", *args)
                self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
                self.assertIn("usage: run_suite.py", proc.stderr)
                self.assertNotIn("Traceback", proc.stderr)
        proc = self.run_suite("--check", "--hw", "cpu", "--suite", "nope")
        self.assertEqual(proc.returncode, 2)  # it validated everything before
        self.assertIn("--check validates every file", proc.stderr)
        proc = self.run_suite(
            "--check", "--continue-on-error", "--timeout-per-file", "5"
        )
        self.assertEqual(proc.returncode, 2)
        self.assertIn("no --continue-on-error, --timeout-per-file", proc.stderr)

    def test_a_suite_with_nothing_to_run_says_why(self) -> None:
        self.write("test_n.py", fake_test("register_cpu_ci(1, 'late', nightly=True)"))
        proc = self.run_suite("--hw", "cpu", "--suite", "late")
        self.assertEqual(proc.returncode, 0)
        self.assertIn("note: suite 'late' has no file to run here", proc.stdout)
        self.assertIn("--nightly runs those", proc.stdout)
        self.assertEqual(proc.stdout.splitlines()[-1], "0 passed, 0 failed")
        self.write("test_d.py", fake_test("register_cpu_ci(1, 'gone', False, 'x')"))
        proc = self.run_suite("--hw", "cpu", "--suite", "gone", "--nightly")
        self.assertIn("has no file to run here: every file is disabled", proc.stdout)

    def test_ctrl_c_prints_the_summary(self) -> None:
        # The file interrupts the runner as a Ctrl-C in the terminal would.
        body = "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); "
        self.write(
            "test_a_stop.py",
            fake_test("register_cpu_ci(1, 'stop')", body + "time.sleep(30)"),
        )
        self.write(
            "test_b_next.py", fake_test("register_cpu_ci(1, 'stop')", touch("b"))
        )
        proc = self.run_suite("--hw", "cpu", "--suite", "stop")
        self.assertEqual(proc.returncode, 130, proc.stdout + proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        self.assertIn("[1/2] INTERRUPTED registered/test_a_stop.py", proc.stdout)
        self.assertIn("NOT RUN  registered/test_b_next.py", proc.stdout)
        self.assertIn("1 not run: interrupted (Ctrl-C)", proc.stdout)
        self.assertEqual(proc.stdout.splitlines()[-1], "0 passed, 1 failed")
        self.assertFalse(self.ran("b"))

    def test_check_needs_no_hw_and_passes_on_a_good_tree(self) -> None:
        proc = self.run_suite("--check")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertEqual(proc.stdout.strip(), "registration check: 6 files OK")

    def test_check_reports_every_problem(self) -> None:
        self.write("test_unregistered.py", fake_test("x = 1"))
        self.write(
            "test_no_main.py",
            "from x import register_cpu_ci\nregister_cpu_ci(1, 'fake-a')\n",
        )
        self.write("test_bad.py", fake_test("register_cpu_ci(est_time=T, suite='a')"))
        proc = self.run_suite("--check")
        self.assertEqual(proc.returncode, 1)
        self.assertIn(
            "registered/test_unregistered.py: no register_cpu_ci/register_cuda_ci call",
            proc.stdout,
        )
        self.assertIn("registered/test_no_main.py: no `if __name__", proc.stdout)
        self.assertIn(
            "registered/test_bad.py:3: register_cpu_ci: "
            "est_time must be a number literal, got Name",
            proc.stdout,
        )
        self.assertIn("3 problems in 9 files", proc.stdout)

    def test_malformed_file_blocks_a_suite_run(self) -> None:
        self.write("test_bad.py", fake_test("register_cpu_ci(est_time=0, suite='a')"))
        proc = self.run_suite("--hw", "cpu", "--suite", "fake-a", "--list")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("registered/test_bad.py:3:", proc.stderr)


if __name__ == "__main__":
    unittest.main()

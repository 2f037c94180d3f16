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


class TestRunSuite(CustomTestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.test_dir = Path(tmp.name)
        self.write("test_pass.py", fake_test("register_cpu_ci(2, 'fake-a')"))
        self.write(
            "sub/test_fail.py",
            fake_test(
                "register_cpu_ci(est_time=3, suite='fake-a')",
                "print('boom-marker'); sys.exit(1)",
            ),
        )
        self.write(
            "test_off.py",
            fake_test("register_cpu_ci(1, 'fake-a', disabled='flaky')", "sys.exit(1)"),
        )
        self.write("test_other.py", fake_test("register_cpu_ci(4.5, 'fake-b')"))

    def write(self, rel: str, source: str) -> None:
        path = self.test_dir / "registered" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)

    def run_suite(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(RUN_SUITE), "--root", str(self.test_dir), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def test_list_shows_enabled_files_and_total(self) -> None:
        proc = self.run_suite("--suite", "fake-a", "--list")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(
            proc.stdout.splitlines(),
            [
                "  registered/sub/test_fail.py  3s",
                "  registered/test_pass.py  2s",
                "total: 2 files, 5s estimated",
            ],
        )

    def test_unknown_suite_lists_known_ones(self) -> None:
        proc = self.run_suite("--suite", "nope")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("unknown suite 'nope'; known: fake-a, fake-b", proc.stderr)

    def test_run_reports_each_file_and_closing_line(self) -> None:
        proc = self.run_suite("--suite", "fake-a")
        self.assertEqual(proc.returncode, 1)
        lines = proc.stdout.splitlines()
        self.assertEqual(lines[-1], "1 passed, 1 failed")
        self.assertRegex(lines[0], r"^\[1/2\] FAILED registered/sub/test_fail.py \(")
        self.assertIn("boom-marker", proc.stdout)  # the failure's output tail
        self.assertTrue(
            any(
                line.startswith("[2/2] PASSED registered/test_pass.py")
                for line in lines
            )
        )
        self.assertNotIn("test_off.py", proc.stdout)

    def test_passing_suite_exits_zero(self) -> None:
        proc = self.run_suite("--suite", "fake-b")
        self.assertEqual(proc.returncode, 0, proc.stdout)
        self.assertEqual(proc.stdout.splitlines()[-1], "1 passed, 0 failed")

    def test_timeout_fails_the_file(self) -> None:
        self.write(
            "test_slow.py",
            fake_test("register_cpu_ci(1, 'slow')", "import time; time.sleep(30)"),
        )
        proc = self.run_suite("--suite", "slow", "--timeout-per-file", "0.5")
        self.assertEqual(proc.returncode, 1)
        self.assertIn("timed out after 0.5s", proc.stdout)
        self.assertEqual(proc.stdout.splitlines()[-1], "0 passed, 1 failed")

    def test_check_passes_on_a_good_tree(self) -> None:
        proc = self.run_suite("--check")
        self.assertEqual(proc.returncode, 0, proc.stdout)
        self.assertEqual(proc.stdout.strip(), "registration check: 4 files OK")

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
        self.assertIn("3 problems in 7 files", proc.stdout)

    def test_malformed_file_blocks_a_suite_run(self) -> None:
        self.write("test_bad.py", fake_test("register_cpu_ci(est_time=0, suite='a')"))
        proc = self.run_suite("--suite", "fake-a", "--list")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("registered/test_bad.py:3:", proc.stderr)


if __name__ == "__main__":
    unittest.main()

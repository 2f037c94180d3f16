"""Tests for scripts/ci/rerun_test.py on a fake repo tree."""

import importlib.util
import io
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "ci" / "rerun_test.py"
_spec = importlib.util.spec_from_file_location("rerun_test", SCRIPT)
rerun_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rerun_test)


def fake_test(registrations: str, body: str = "print('ok')") -> str:
    return (
        "import sys\n"
        "from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci\n"
        + textwrap.dedent(registrations)
        + f"if __name__ == '__main__':\n    {body}\n"
    )


class TestRerunTest(CustomTestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.root = Path(tmp.name)
        self.registered = self.root / "test" / "registered"
        self.write("spec/dspark/test_dp.py", "register_cpu_ci(5, 'base-a-test-cpu')\n")
        self.write(
            "spec/test_both.py",
            """\
            register_cpu_ci(5, 'base-a-test-cpu')
            register_cuda_ci(30, stage='stage-b', runner_config='1-gpu-large')
            register_cuda_ci(60, stage='stage-c', runner_config='8-gpu')
            """,
        )
        self.write(
            "core/test_gpu.py", "register_cuda_ci(9, 'stage-b-test-small-1-gpu')\n"
        )
        self.write("a/test_dup.py", "register_cpu_ci(1, 'base-a-test-cpu')\n")
        self.write("b/test_dup.py", "register_cpu_ci(1, 'base-a-test-cpu')\n")
        self.write("spec/test_plain.py", "x = 1\n")
        self.write(
            "test_off.py", "register_cpu_ci(1, 'base', disabled='needs 8 GPUs')\n"
        )
        self.write("test_bad.py", "register_cpu_ci(est_time=T, suite='base')\n")
        self.write(
            "test_fail.py", "register_cpu_ci(1, 'base')\n", "sys.exit('boom-marker')"
        )
        (self.root / "test" / "test_outside.py").write_text("x = 1\n")

    def write(self, rel: str, registrations: str, body: str = "print('ok')") -> None:
        path = self.registered / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fake_test(registrations, body))

    def resolve(self, *names: str) -> tuple[list[str], list[str]]:
        regs, errors = rerun_test.resolve(list(names), self.root)
        rel = [Path(r.filename).relative_to(self.registered).as_posix() for r in regs]
        return rel, errors

    def cli(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--root", str(self.root), *args],
            input=stdin,
            capture_output=True,
            text=True,
            encoding="utf-8",
            timeout=60,
        )

    def test_parse_comment(self) -> None:
        parse = rerun_test.parse_comment
        self.assertEqual(
            parse("/rerun-test a.py b.py, a.py\nthanks!"), ["a.py", "b.py"]
        )
        with self.assertRaisesRegex(ValueError, "must start with /rerun-test"):
            parse("please /rerun-test a.py")
        with self.assertRaisesRegex(ValueError, "name at least one test file"):
            parse("/rerun-test  ")

    def test_every_spelling_resolves_to_the_file(self) -> None:
        for name in (
            "test_dp.py",
            "test_dp",
            "test/registered/spec/dspark/test_dp.py",
            "registered/spec/dspark/test_dp.py",
            "spec/dspark/test_dp.py",
            "./spec/dspark/test_dp",
        ):
            with self.subTest(name=name):
                self.assertEqual(self.resolve(name), (["spec/dspark/test_dp.py"], []))

    def test_same_file_twice_is_resolved_once(self) -> None:
        files, errors = self.resolve("test_dp.py", "spec/dspark/test_dp")
        self.assertEqual((files, errors), (["spec/dspark/test_dp.py"], []))

    def test_errors_name_each_bad_name_and_keep_the_good_ones(self) -> None:
        files, errors = self.resolve(
            "nope.py",
            "test_dup.py",
            "test_plain",
            "test_off.py",
            "test/test_outside.py",
            "../../etc/test_x.py",
            "test_bad.py",
            "test_dp.py",
        )
        self.assertEqual(files, ["spec/dspark/test_dp.py"])
        reg = self.registered
        self.assertEqual(
            errors,
            [
                "nope.py: no test file with that name under test/registered/",
                f"test_dup.py: ambiguous, matches {reg}/a/test_dup.py, "
                f"{reg}/b/test_dup.py",
                f"test_plain: {reg}/spec/test_plain.py is not registered for CI",
                f"test_off.py: {reg}/test_off.py is disabled: needs 8 GPUs",
                "test/test_outside.py: not a path under test/registered/",
                "../../etc/test_x.py: not a path under test/registered/",
                f"test_bad.py: {reg}/test_bad.py:3: register_cpu_ci: "
                "est_time must be a number literal, got Name",
            ],
        )

    def test_grouping_and_reply(self) -> None:
        regs, _ = rerun_test.resolve(["test_both", "test_gpu", "test_dp"], self.root)
        groups = rerun_test.group_by_runner(regs, self.root)
        self.assertEqual(
            rerun_test.format_reply(groups),
            "ubuntu-latest (2 tests):\n"
            "  cd test/ && python3 registered/spec/test_both.py\n"
            "  cd test/ && python3 registered/spec/dspark/test_dp.py\n"
            "1-gpu-5090 (1 test):\n"
            "  cd test/ && python3 registered/core/test_gpu.py\n"
            "1-gpu-h100 (1 test):\n"
            "  cd test/ && python3 registered/spec/test_both.py\n"
            "8-gpu-h200 (1 test):\n"
            "  cd test/ && python3 registered/spec/test_both.py",
        )

    def test_cli_prints_groups_and_fails_on_bad_names(self) -> None:
        proc = self.cli("/rerun-test test_dp.py nope.py test_off.py")
        self.assertEqual(proc.returncode, 1)
        self.assertEqual(
            proc.stdout,
            "ubuntu-latest (1 test):\n"
            "  cd test/ && python3 registered/spec/dspark/test_dp.py\n",
        )
        self.assertEqual(
            proc.stderr,
            "error: nope.py: no test file with that name under test/registered/\n"
            "error: test_off.py: test/registered/test_off.py is disabled: "
            "needs 8 GPUs\n",
        )

    def test_cli_reads_stdin_and_rejects_other_comments(self) -> None:
        proc = self.cli(stdin="/rerun-test core/test_gpu\n")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("1-gpu-5090 (1 test):", proc.stdout)
        proc = self.cli("LGTM")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("comment must start with /rerun-test", proc.stderr)

    def test_cli_run_reports_like_the_bot(self) -> None:
        proc = self.cli("/rerun-test", "test_dp.py", "test_fail.py", "--run")
        self.assertEqual(proc.returncode, 1)
        self.assertRegex(
            proc.stdout, r"✅ PASSED registered/spec/dspark/test_dp.py \(\d+\.\ds\)"
        )
        self.assertIn("❌ FAILED registered/test_fail.py", proc.stdout)
        self.assertIn("boom-marker", proc.stdout)
        self.assertIn("ubuntu-latest: 1 passed, 1 failed", proc.stdout)
        self.assertEqual(proc.stdout.splitlines()[-1], "1 passed, 1 failed")

    def test_run_groups_skips_gpu_groups_without_a_gpu(self) -> None:
        groups = {
            "ubuntu-latest": ["registered/spec/dspark/test_dp.py"],
            "1-gpu-h100": ["registered/core/test_gpu.py"],
        }
        out = io.StringIO()
        passed_failed = rerun_test.run_groups(
            groups, self.root / "test", gpu=False, timeout=60, out=out
        )
        self.assertEqual(passed_failed, (1, 0))
        lines = out.getvalue().splitlines()
        self.assertIn("1-gpu-h100: skipped, no GPU on this machine", lines)
        self.assertNotIn("test_gpu.py", out.getvalue())
        self.assertEqual(lines[-1], "1 passed, 0 failed")


if __name__ == "__main__":
    unittest.main()

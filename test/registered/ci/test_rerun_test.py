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
            register_cuda_ci(30, stage='base-b', runner_config='1-gpu-large')
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
        # Classes to select: running the whole file fails (test_broken), running
        # TestEnabledPath.test_on alone passes.
        self.write(
            "spec/dspark/test_dspark_dp_tier.py",
            """\
            import unittest
            register_cpu_ci(5, 'base-a-test-cpu')
            register_cuda_ci(10, stage='base-b', runner_config='1-gpu-large')
            class TestEnabledPath(unittest.TestCase):
                def test_on(self):
                    print('on-marker')
                def test_broken(self):
                    self.fail('broken-marker')
            class TestDisabledPath(unittest.TestCase):
                def test_off(self):
                    pass
            def helper():
                class TestNested(unittest.TestCase):
                    pass
            """,
            "unittest.main()",
        )
        self.write(
            "test_off_classes.py",
            "import unittest\n"
            "register_cpu_ci(1, 'base', disabled='broken')\n"
            "class TestA(unittest.TestCase):\n"
            "    pass\n",
        )

    def write(self, rel: str, registrations: str, body: str = "print('ok')") -> None:
        path = self.registered / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fake_test(registrations, body))

    def resolve(self, *names: str) -> tuple[list[str], list[str]]:
        """(registered-relative "file[::selector]" per registration, errors)."""
        resolved, errors = rerun_test.resolve(list(names), self.root)
        specs = []
        for reg, selector in resolved:
            rel = Path(reg.filename).relative_to(self.registered).as_posix()
            specs.append(rel if selector is None else f"{rel}::{selector}")
        return specs, errors

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
        resolved, _ = rerun_test.resolve(
            ["test_both", "test_gpu", "test_dp"], self.root
        )
        groups = rerun_test.group_by_runner(resolved, self.root)
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

    def test_cli_bad_arguments_are_usage_errors(self) -> None:
        for args in (
            ["--run", "--timeout-per-file", "nan"],  # a traceback before
            ["--run", "--timeout-per-file", "-1"],
            ["--run", "--timeout-per-file", "1e7"],  # past poll()'s range
            ["--root", str(self.root / "nonexistent")],  # the last --root
        ):
            with self.subTest(args=args):
                proc = self.cli("/rerun-test", "test_dp.py", *args)
                self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
                self.assertIn("usage: rerun_test.py", proc.stderr)
                self.assertNotIn("Traceback", proc.stderr)

    def test_cli_ctrl_c_prints_the_last_line(self) -> None:
        # The file interrupts the runner as a Ctrl-C in the terminal would.
        self.write(
            "test_stop.py",
            "register_cpu_ci(1, 'base')\n",
            "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); "
            "time.sleep(30)",
        )
        proc = self.cli("/rerun-test test_stop.py test_dp.py", "--run")
        self.assertEqual(proc.returncode, 130, proc.stdout + proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        self.assertIn("⛔ INTERRUPTED registered/test_stop.py", proc.stdout)
        self.assertIn("ubuntu-latest: interrupted (Ctrl-C)", proc.stdout)
        self.assertNotIn("PASSED", proc.stdout)  # test_dp.py did not run
        self.assertEqual(proc.stdout.splitlines()[-1], "0 passed, 1 failed")

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

    def test_class_spec_prints_runner_groups_and_command(self) -> None:
        proc = self.cli("/rerun-test test_dspark_dp_tier.py::TestEnabledPath")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        tier = "registered/spec/dspark/test_dspark_dp_tier.py"
        self.assertEqual(
            proc.stdout,
            "ubuntu-latest (1 test):\n"
            f"  cd test/ && python3 {tier} TestEnabledPath\n"
            "1-gpu-h100 (1 test):\n"
            f"  cd test/ && python3 {tier} TestEnabledPath\n",
        )
        self.assertEqual(proc.stderr, "")

    def test_method_spec_and_plain_file_in_one_comment(self) -> None:
        proc = self.cli(
            "/rerun-test spec/dspark/test_dspark_dp_tier::TestEnabledPath.test_on "
            "test_dp.py test_dspark_dp_tier.py::TestEnabledPath.test_on"
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        tier = "registered/spec/dspark/test_dspark_dp_tier.py"
        self.assertEqual(
            proc.stdout,
            "ubuntu-latest (2 tests):\n"
            f"  cd test/ && python3 {tier} TestEnabledPath.test_on\n"
            "  cd test/ && python3 registered/spec/dspark/test_dp.py\n"
            "1-gpu-h100 (1 test):\n"
            f"  cd test/ && python3 {tier} TestEnabledPath.test_on\n",
        )

    def test_spec_resolution(self) -> None:
        tier = "spec/dspark/test_dspark_dp_tier.py"
        # The file, a class and a method are three specs; one registration each.
        self.assertEqual(
            self.resolve(
                "test_dspark_dp_tier",
                f"{tier}::TestEnabledPath",
                f"{tier}::TestEnabledPath.test_on",
                "test_dspark_dp_tier.py::TestEnabledPath",
            ),
            (
                [tier, tier]
                + [f"{tier}::TestEnabledPath"] * 2
                + [f"{tier}::TestEnabledPath.test_on"] * 2,
                [],
            ),
        )

    def test_unknown_class_or_method_is_an_error(self) -> None:
        tier = "test/registered/spec/dspark/test_dspark_dp_tier.py"
        proc = self.cli(
            "/rerun-test test_dspark_dp_tier.py::TestNope "
            "test_dspark_dp_tier.py::TestNested "
            "test_dspark_dp_tier.py::TestDisabledPath.test_on "
            "test_dspark_dp_tier.py::helper "
            "test_dp.py::TestEnabledPath "
            "test_dspark_dp_tier.py::Test-Bad "
            "test_dspark_dp_tier.py::A.b.c "
            "::TestA "
            "test_off_classes.py::TestA "
            "nope.py::TestA "
            "test_dspark_dp_tier.py::TestDisabledPath"
        )
        self.assertEqual(proc.returncode, 1)
        bad = "bad spec; use file.py, file.py::TestClass or file.py::TestClass.test_method"
        self.assertEqual(
            proc.stderr.splitlines(),
            [
                f"error: test_dspark_dp_tier.py::TestNope: no class TestNope in {tier}",
                f"error: test_dspark_dp_tier.py::TestNested: "
                f"no class TestNested in {tier}",
                f"error: test_dspark_dp_tier.py::TestDisabledPath.test_on: "
                f"class TestDisabledPath in {tier} has no method test_on",
                f"error: test_dspark_dp_tier.py::helper: no class helper in {tier}",
                "error: test_dp.py::TestEnabledPath: no class TestEnabledPath in "
                "test/registered/spec/dspark/test_dp.py",
                f"error: test_dspark_dp_tier.py::Test-Bad: {bad}",
                f"error: test_dspark_dp_tier.py::A.b.c: {bad}",
                f"error: ::TestA: {bad}",
                "error: test_off_classes.py::TestA: "
                "test/registered/test_off_classes.py is disabled: broken",
                "error: nope.py::TestA: "
                "no test file with that name under test/registered/",
            ],
        )
        # The good spec is still answered.
        self.assertEqual(
            proc.stdout.splitlines()[:2],
            [
                "ubuntu-latest (1 test):",
                "  cd test/ && python3 "
                "registered/spec/dspark/test_dspark_dp_tier.py TestDisabledPath",
            ],
        )

    def test_cli_run_passes_the_selector_to_unittest(self) -> None:
        proc = self.cli(
            "/rerun-test test_dspark_dp_tier.py::TestEnabledPath.test_on "
            "test_dspark_dp_tier.py::TestEnabledPath",
            "--run",
        )
        self.assertEqual(proc.returncode, 1)
        tier = "registered/spec/dspark/test_dspark_dp_tier.py"
        # The method alone passes; the class runs both its tests (not
        # TestDisabledPath's) and fails on test_broken.
        self.assertRegex(
            proc.stdout, rf"✅ PASSED {tier} TestEnabledPath\.test_on \(\d+\.\ds\)"
        )
        self.assertRegex(proc.stdout, rf"❌ FAILED {tier} TestEnabledPath \(")
        self.assertIn("broken-marker", proc.stdout)
        self.assertIn("Ran 2 tests", proc.stdout)
        self.assertIn("ubuntu-latest: 1 passed, 1 failed", proc.stdout)

    def test_run_groups_skips_gpu_groups_without_a_gpu(self) -> None:
        groups = {
            "ubuntu-latest": [rerun_test.Target("registered/spec/dspark/test_dp.py")],
            "1-gpu-h100": [rerun_test.Target("registered/core/test_gpu.py")],
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

"""Tests for sglang.test.ci.ci_register: parsing registrations from source."""

import inspect
import re
import tempfile
import textwrap
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import (
    CIRegistration,
    RegistrationError,
    collect_registrations,
    collect_tests,
    has_main_entry,
    register_cpu_ci,
    register_cuda_ci,
    runner_label,
)
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

HEADER = "from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci\n"


class TestCIRegister(CustomTestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.root = Path(tmp.name) / "test" / "registered"

    def write(self, rel: str, source: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        return path

    def test_parses_every_field(self) -> None:
        path = self.write(
            "spec/test_fields.py",
            HEADER + "register_cpu_ci(est_time=10, suite='base-a-test-cpu')\n"
            "register_cuda_ci(est_time=30.5, stage='base-b', "
            "runner_config='1-gpu-large', nightly=True, disabled='flaky on H100')\n",
        )
        self.assertEqual(
            collect_registrations(path),
            [
                CIRegistration("cpu", str(path), 10.0, suite="base-a-test-cpu"),
                CIRegistration(
                    "cuda",
                    str(path),
                    30.5,
                    stage="base-b",
                    runner_config="1-gpu-large",
                    nightly=True,
                    disabled="flaky on H100",
                ),
            ],
        )

    def test_positional_and_attribute_calls(self) -> None:
        path = self.write(
            "test_pos.py",
            "from sglang.test.ci import ci_register\n"
            "ci_register.register_cuda_ci(7, 'stage-b-test-small-1-gpu')\n",
        )
        (reg,) = collect_registrations(path)
        self.assertEqual((reg.backend, reg.est_time), ("cuda", 7.0))
        self.assertEqual(reg.suite, "stage-b-test-small-1-gpu")

    def test_positional_nightly_and_disabled(self) -> None:
        # Upstream's order: est_time, suite, nightly, disabled.
        path = self.write(
            "test_pos4.py",
            HEADER + "register_cuda_ci(7, 'nightly-suite', True, 'flaky on H100')\n"
            "register_cpu_ci(2, None, False, None, stage='base-a', runner_config='cpu')\n",
        )
        self.assertEqual(
            collect_registrations(path),
            [
                CIRegistration(
                    "cuda",
                    str(path),
                    7.0,
                    suite="nightly-suite",
                    nightly=True,
                    disabled="flaky on H100",
                ),
                CIRegistration(
                    "cpu", str(path), 2.0, stage="base-a", runner_config="cpu"
                ),
            ],
        )

    def test_signatures_match_upstream(self) -> None:
        for func in (register_cpu_ci, register_cuda_ci):
            with self.subTest(func=func.__name__):
                params = inspect.signature(func).parameters.values()
                self.assertEqual(
                    [(p.name, p.kind.name, p.default) for p in params],
                    [
                        ("est_time", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
                        ("suite", "POSITIONAL_OR_KEYWORD", None),
                        ("nightly", "POSITIONAL_OR_KEYWORD", False),
                        ("disabled", "POSITIONAL_OR_KEYWORD", None),
                        ("stage", "KEYWORD_ONLY", None),
                        ("runner_config", "KEYWORD_ONLY", None),
                    ],
                )

    def test_effective_suite(self) -> None:
        by_suite = CIRegistration("cpu", "x.py", 1.0, suite="base-a-test-cpu")
        by_stage = CIRegistration(
            "cuda", "x.py", 1.0, stage="base-b", runner_config="1-gpu-large"
        )
        self.assertEqual(by_suite.effective_suite, "base-a-test-cpu")
        self.assertEqual(by_stage.effective_suite, "base-b-test-1-gpu-large")

    def test_only_module_level_calls_count(self) -> None:
        path = self.write(
            "test_nested.py",
            HEADER + "def helper():\n"
            "    register_cpu_ci(est_time=1, suite='inner')\n"
            "register_cpu_ci(est_time=2, suite='outer')\n",
        )
        self.assertEqual([r.suite for r in collect_registrations(path)], ["outer"])
        self.assertEqual(
            collect_registrations(self.write("test_none.py", "x = 1\n")), []
        )

    def test_malformed_registrations_name_file_and_problem(self) -> None:
        cases = {
            "register_cpu_ci(est_time=T, suite='s')": (
                "register_cpu_ci: est_time must be a number literal, got Name"
            ),
            "register_cpu_ci(est_time='5', suite='s')": (
                "est_time must be a number literal, got '5'"
            ),
            "register_cpu_ci(est_time=True, suite='s')": (
                "est_time must be a number literal, got True"
            ),
            "register_cpu_ci(est_time=0, suite='s')": "est_time must be > 0, got 0",
            "register_cpu_ci(suite='s')": "est_time is required",
            "register_cpu_ci(est_time=1)": "needs suite or stage+runner_config",
            "register_cuda_ci(1, 's', stage='b', runner_config='1-gpu')": (
                "give suite or stage+runner_config, not both"
            ),
            "register_cuda_ci(est_time=1, stage='stage-b')": (
                "stage and runner_config must be given together"
            ),
            "register_cuda_ci(est_time=1, runner_config='1-gpu')": (
                "stage and runner_config must be given together"
            ),
            "register_cpu_ci(est_time=1, suite='s', gpus=2)": "unknown keyword 'gpus'",
            "register_cpu_ci(est_time=1, suite=NAME)": (
                "suite must be a str literal, got Name"
            ),
            "register_cpu_ci(est_time=1, suite='s', nightly='yes')": (
                "nightly must be a bool literal, got 'yes'"
            ),
            "register_cpu_ci(est_time=1, suite='s', disabled=True)": (
                "disabled must be a str literal, got True"
            ),
            "register_cpu_ci(1, 's', False, None, 'x')": (
                "takes at most 4 positional arguments "
                "(est_time, suite, nightly, disabled), got 5"
            ),
            "register_cpu_ci(1, 's', 'x')": "nightly must be a bool literal, got 'x'",
            "register_cpu_ci(1, 's', False, 3)": "disabled must be a str literal, got 3",
            "register_cpu_ci(1, 's', est_time=2)": "est_time given twice",
            "register_cpu_ci(1, 's', True, nightly=False)": "nightly given twice",
            "register_cpu_ci(1, 's', False, 'x', disabled='y')": (
                "disabled given twice"
            ),
            "register_cuda_ci(1, 's', True, stage='b', runner_config='1-gpu')": (
                "give suite or stage+runner_config, not both"
            ),
            "register_cpu_ci(1, **opts)": "**kwargs is not allowed",
        }
        for call, problem in cases.items():
            with self.subTest(call=call):
                path = self.write("test_bad.py", HEADER + call + "\n")
                with self.assertRaises(RegistrationError) as ctx:
                    collect_registrations(path)
                self.assertIsInstance(ctx.exception, ValueError)
                self.assertIn(f"{path}:2: ", str(ctx.exception))
                self.assertIn(problem, str(ctx.exception))

    def test_syntax_error_names_the_file(self) -> None:
        path = self.write("test_syntax.py", "def broken(:\n")
        with self.assertRaisesRegex(
            RegistrationError, re.escape(f"{path}:1: syntax error")
        ):
            collect_registrations(path)

    def test_has_main_entry(self) -> None:
        runs = "import unittest\nif __name__ == '__main__':\n    unittest.main()\n"
        reversed_guard = "if '__main__' == __name__:\n    main()\n"
        no_call = "if __name__ == '__main__':\n    pass\n"
        nested = "def f():\n    if __name__ == '__main__':\n        main()\n"
        self.assertTrue(has_main_entry(self.write("test_a.py", runs)))
        self.assertTrue(has_main_entry(self.write("test_b.py", reversed_guard)))
        self.assertFalse(has_main_entry(self.write("test_c.py", no_call)))
        self.assertFalse(has_main_entry(self.write("test_d.py", nested)))
        self.assertFalse(has_main_entry(self.write("test_e.py", "x = 1\n")))
        # A class after the guard never runs when the file runs as a script.
        after = runs + "class TestLate(unittest.TestCase):\n    pass\n"
        self.assertFalse(has_main_entry(self.write("test_f.py", after)))

    def test_collect_tests_walks_test_files_only(self) -> None:
        self.write("test_a.py", HEADER + "register_cpu_ci(1, 'a')\n")
        self.write("sub/test_b.py", HEADER + "register_cpu_ci(2, 'b')\n")
        self.write("sub/helper.py", HEADER + "register_cpu_ci(3, 'c')\n")
        regs = collect_tests(self.root)
        # Sorted by path: "sub/..." sorts before "test_a.py".
        self.assertEqual([r.suite for r in regs], ["b", "a"])
        self.assertEqual(regs[0].filename, str(self.root / "sub" / "test_b.py"))

    def test_runner_label(self) -> None:
        def cuda(**kw: str) -> CIRegistration:
            return CIRegistration("cuda", "x.py", 1.0, **kw)

        cpu = CIRegistration("cpu", "x.py", 1.0, suite="base-a-test-cpu")
        self.assertEqual(runner_label(cpu), "ubuntu-latest")
        self.assertEqual(
            runner_label(cuda(stage="base-b", runner_config="1-gpu-large")),
            "1-gpu-h100",
        )
        self.assertEqual(
            runner_label(cuda(stage="stage-c", runner_config="8-gpu")), "8-gpu-h200"
        )
        self.assertEqual(
            runner_label(cuda(suite="stage-b-test-small-1-gpu")), "1-gpu-5090"
        )
        self.assertEqual(runner_label(cuda(suite="brand-new-suite")), "1-gpu-h100")

    def test_register_calls_are_noops_at_run_time(self) -> None:
        self.assertIsNone(register_cpu_ci(est_time=1, suite="x"))
        self.assertIsNone(
            register_cuda_ci(1, None, True, "x", stage="base-b", runner_config="1-gpu")
        )


if __name__ == "__main__":
    unittest.main()

"""Ctrl-C in the command line tools: one line on stderr saying what is left
(the rows done so far, the work dir to resume from), no traceback, exit
code 130; under torchrun the rank's process group is destroyed first."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from contextlib import redirect_stderr
from io import StringIO
from unittest import mock

from sglang import bench_dspark_step, bench_glue_cache, bench_one_batch, bench_scaling
from sglang.srt.utils.common import EXIT_INTERRUPTED
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang.train_tiny_pair import train

register_cpu_ci(est_time=20, suite="base-a-test-cpu")


class TestInterruptedInProcess(CustomTestCase):
    def test_each_tool_returns_130_with_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            cases = (
                (bench_one_batch, "run", []),
                (bench_scaling, "run", ["--quick"]),
                (bench_dspark_step, "run", []),
                (bench_glue_cache, "probe", []),
                (train, "run", ["--tiny", "--work-dir", d, "--output-dir", d]),
            )
            for module, runner, argv in cases:
                name = module.__name__.rsplit(".", 1)[-1]
                prog = "train_tiny_pair" if name == "train" else name
                with self.subTest(tool=prog):
                    err = StringIO()
                    with (
                        mock.patch.object(
                            module, runner, side_effect=KeyboardInterrupt
                        ),
                        redirect_stderr(err),
                    ):
                        try:
                            code = module.main(argv)
                        except KeyboardInterrupt:
                            self.fail("Ctrl-C left main as a traceback")
                    self.assertEqual(code, EXIT_INTERRUPTED)
                    lines = err.getvalue().splitlines()
                    self.assertEqual(len(lines), 1, lines)
                    self.assertTrue(lines[0].startswith(f"{prog}: interrupted"))
                    if module is train:  # a rerun resumes from its snapshots
                        self.assertIn(f"resumes from {d}", lines[0])

    def test_bench_one_batch_names_only_its_own_rows(self):
        # A Ctrl-C before the first row leaves nothing of this run: the line
        # names no file, not an earlier run's F.partial; after a row, it
        # names the file that holds it.
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            with open(out + ".partial", "w") as f:
                json.dump([{"batch_size": 1}], f)  # an earlier run's row

            def rows_then_interrupt(n):
                def run(args, on_row):
                    for i in range(n):
                        on_row([{"batch_size": 2}] * (i + 1))
                    raise KeyboardInterrupt

                return run

            for n, named in ((0, False), (1, True)):
                err = StringIO()
                with (
                    self.subTest(rows=n),
                    mock.patch.object(bench_one_batch, "run", rows_then_interrupt(n)),
                    redirect_stderr(err),
                ):
                    code = bench_one_batch.main(["--json", out])
                    self.assertEqual(code, EXIT_INTERRUPTED)
                    self.assertEqual(out + ".partial" in err.getvalue(), named)
            with open(out + ".partial") as f:
                self.assertEqual(json.load(f), [{"batch_size": 2}])
            # Stopped while plotting: F.partial is already F (the line named
            # the file gone before).
            err = StringIO()
            rows = [{"batch_size": 2, "greedy_output_equal": True}]
            with (
                mock.patch.object(
                    bench_one_batch, "run", lambda args, on_row: on_row(rows) or rows
                ),
                mock.patch.object(
                    bench_one_batch.bench_plots,
                    "speedup_plot",
                    side_effect=KeyboardInterrupt,
                ),
                redirect_stderr(err),
            ):
                code = bench_one_batch.main(["--json", out, "--plot-dir", d])
            self.assertEqual(code, EXIT_INTERRUPTED)
            self.assertNotIn(".partial", err.getvalue())
            self.assertIn(f"every row is in {out}", err.getvalue())
            with open(out) as f:
                self.assertEqual(json.load(f), rows)


def _sigint_when_ready(test, argv, ready, *, settle=0.0, timeout=60):
    """``python -m *argv`` with one thread; once ``ready()`` gives a true
    value (and ``settle`` seconds more), a SIGINT to that process alone.
    Asserts exit 130 without a traceback; returns (ready's value, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (value := ready(proc.pid)):
            test.assertIsNone(proc.poll(), "it ended before it was ready")
            test.assertLess(time.monotonic(), deadline)
            time.sleep(0.02)
        time.sleep(settle)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    test.assertEqual(proc.returncode, EXIT_INTERRUPTED, err)
    test.assertNotIn("Traceback", err)
    return value, err


class TestBenchOneBatchSigint(CustomTestCase):
    def test_a_real_ctrl_c_keeps_the_finished_rows(self):
        # Two rows; SIGINT once the first is written: exit 130, no
        # traceback, the first row kept in the .partial file the line names.
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.json")
            cmd = ["sglang.bench_one_batch", "--batch-size", "1"]
            cmd += ["--temperature", "0", "1"]
            cmd += ["--input-len", "8", "--repeats", "1", "--prompts", "random"]
            cmd += ["--output-len", "8", "--num-prompts", "1", "--json", out]
            # The second row long enough to be interrupted inside.
            cmd += ["--block-steps", "1"]
            _, err = _sigint_when_ready(
                self, cmd, lambda pid: os.path.exists(out + ".partial")
            )
            self.assertIn(
                f"bench_one_batch: interrupted; the rows done so far are in "
                f"{out}.partial",
                err,
            )
            self.assertFalse(os.path.exists(out))  # not named as a whole run
            with open(out + ".partial") as f:
                self.assertEqual([r["temperature"] for r in json.load(f)], [0.0])


def _rank_pids(pid: int):
    """The pids of ``pid``'s rank processes (its ``mp.spawn`` children)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    ranks = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    ranks.append(child)
        except FileNotFoundError:
            pass
    return ranks


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


class TestBenchDsparkStepSigint(CustomTestCase):
    @unittest.skipUnless(
        os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
        "needs Linux's /proc/PID/task/PID/children to find the ranks",
    )
    def test_a_ctrl_c_to_the_launcher_alone_ends_its_ranks(self):
        # `kill -INT` of the launcher only: before, its ranks ran to the end
        # of their (here minutes of) work, the launcher waiting on them.
        cmd = ["sglang.bench_dspark_step", "--ep-size", "2"]
        cmd += ["--concurrency", "8", "--steps-per-capture", "100000"]
        ranks, err = _sigint_when_ready(
            self,
            cmd,
            lambda pid: (r := _rank_pids(pid)) and len(r) >= 2 and r,
            settle=2,  # the ranks at work
            timeout=30,
        )
        self.assertIn("bench_dspark_step: interrupted", err)
        self.assertFalse([pid for pid in ranks if _running(pid)])


if __name__ == "__main__":
    unittest.main()

"""The main job runs end to end and reports real figures."""

import contextlib
import io
import json
import os
import tempfile
import unittest

from sglang import bench_one_batch
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


class TestBenchOneBatch(CustomTestCase):
    def test_figures_and_json(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bench.json")
            out = io.StringIO()
            with (
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                rc = bench_one_batch.main(
                    ["--batch-size", "1", "3", "--input-len", "8", "--output-len", "9"]
                    + ["--repeats", "2", "--json", path]
                )
            with open(path) as f:
                rows = json.load(f)
        self.assertEqual(rc, 0)
        self.assertEqual([r["batch_size"] for r in rows], [1, 3])
        for r in rows:
            self.assertTrue(r["greedy_output_equal"])
            self.assertEqual(r["gamma"], 5)
            self.assertGreater(r["plain_tokens_per_s"], 0)
            self.assertGreater(r["dspark_tokens_per_s"], 0)
            self.assertAlmostEqual(
                r["speedup"], r["dspark_tokens_per_s"] / r["plain_tokens_per_s"]
            )
            self.assertEqual(r["repeats"], 2)
            for name in ("plain", "dspark"):
                lo, hi = r[f"{name}_tokens_per_s_range"]
                self.assertLessEqual(lo, r[f"{name}_tokens_per_s"])
                self.assertLessEqual(r[f"{name}_tokens_per_s"], hi)
            self.assertGreaterEqual(r["accept_length"], 1.0)
            self.assertLessEqual(r["accept_length"], 6.0)
        text = out.getvalue()
        self.assertIn("bs=1 ", text)
        self.assertIn("greedy equal: True", text)
        self.assertIn(f"wrote {path}", text)

    def test_sampling_reports_no_equality(self):
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            rc = bench_one_batch.main(
                ["--batch-size", "2", "--input-len", "4", "--output-len", "6"]
                + ["--temperature", "0.7"]
            )
        self.assertEqual(rc, 0)

    def test_bad_arguments(self):
        for argv in (
            ["--output-len", "1"],
            ["--batch-size", "0"],
            ["--input-len", "0"],
            ["--repeats", "0"],
        ):
            with self.subTest(argv=argv):
                with contextlib.redirect_stderr(io.StringIO()):
                    with self.assertRaises(SystemExit) as ctx:
                        bench_one_batch.main(argv)
                self.assertEqual(ctx.exception.code, 2)


if __name__ == "__main__":
    unittest.main()

"""bench_dspark_step: the seed's before / after / fixed measurement, tiny sizes."""

import argparse
import contextlib
import copy
import io
import json
import os
import tempfile
import unittest
from unittest import mock

import torch

from sglang import bench_dspark_step
from sglang.srt.utils.common import MAX_NUM_THREADS
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=15, suite="base-a-test-cpu")
register_cuda_ci(est_time=30, stage="base-b", runner_config="1-gpu-large")

TINY = [
    "--input-len", "8", "--output-len", "24", "--steps-per-capture", "4",
    "--repeats", "6", "--count-steps", "2",
]  # fmt: skip


def _main(argv, stderr=None):
    stdout, stderr = io.StringIO(), stderr or io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = bench_dspark_step.main(argv)
    return rc, stdout.getvalue()


class TestBenchDSparkStep(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.tmp = tempfile.TemporaryDirectory()
        cls.json_path = os.path.join(cls.tmp.name, "out.json")
        cls.profile_dir = os.path.join(cls.tmp.name, "traces")
        cls.plot_dir = os.path.join(cls.tmp.name, "plots")
        argv = TINY + ["--concurrency", "1", "3", "--json", cls.json_path]
        argv += ["--plot-dir", cls.plot_dir]
        cls.rc, cls.stdout = _main(argv + ["--profile", cls.profile_dir])
        with open(cls.json_path) as f:
            cls.result = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()
        super().tearDownClass()

    def test_table_for_each_concurrency(self):
        self.assertEqual(self.rc, 0)
        rows = self.result["rows"]
        self.assertEqual([r["concurrency"] for r in rows], [1, 3])
        for r in rows:
            ms = r["ms_per_step"]
            self.assertEqual(sorted(ms), ["after", "before", "fixed"])
            self.assertTrue(all(v > 0 for v in ms.values()))
            for name in ms:  # the table's means are the blocks' means
                self.assertEqual(len(r["block_ms_per_step"][name]), 6)
            self.assertAlmostEqual(
                r["reduction_vs_after_pct"],
                100 * (ms["after"] - ms["fixed"]) / ms["after"],
            )
            ratio = r["after_over_fixed"]
            # 6 blocks: the sign-test interval is [min, max], coverage 1 - 2/64.
            self.assertEqual(
                ratio["ci95"], [min(ratio["ratios"]), max(ratio["ratios"])]
            )
            self.assertAlmostEqual(ratio["coverage"], 1 - 2 / 64)
            lo, hi = ratio["ci95"]
            self.assertEqual(ratio["resolvable"], not lo <= 1 <= hi)
            self.assertEqual(r["timed_steps_per_block"], 4)
            cost = r["scalar_cost_us"]  # the helper timed alone
            self.assertTrue(cost["after"] > 0 and cost["fixed"] > 0)
            self.assertTrue(r["greedy_output_equal"])
            line = f"| {r['concurrency']} | {ms['before']:.3f} ms |"
            self.assertIn(line, self.stdout)
        self.assertIn("| C | before | after | fixed | reduction vs after", self.stdout)

    def test_verdict_weighs_the_a_a_control(self):
        # At EP 1 before and fixed run the same code: an after/fixed CI that
        # excludes 1 by no more than their ratio's distance from 1 proves
        # nothing about the scalar.
        args = argparse.Namespace(
            repeats=6, steps_per_capture=4, ep_size=1, input_len=8, output_len=24
        )

        def ratio(lo, hi):
            return dict(
                median=(lo + hi) / 2, ci95=[lo, hi], resolvable=not lo <= 1 <= hi
            )

        cases = (
            ((1.01, 1.02), (0.99, 1.01), "resolved above the noise"),
            ((1.01, 1.02), (0.98, 0.99), "NOT attributable to the scalar"),
            ((1.03, 1.04), (0.98, 0.99), "resolved above the noise"),
            ((0.97, 0.99), (1.01, 1.03), "NOT attributable to the scalar"),
            ((0.99, 1.02), (0.98, 0.99), "NOT resolvable above the noise"),
        )
        for after, control, expected in cases:
            with self.subTest(after=after, control=control):
                result = copy.deepcopy(self.result)
                for r in result["rows"]:
                    r["after_over_fixed"] = ratio(*after)
                    r["before_over_fixed"] = ratio(*control)
                text = bench_dspark_step.format_report(result, args)
                self.assertEqual(text.count(expected), 2)  # C = 1 and 3
                if expected.startswith("NOT attributable"):
                    self.assertNotIn("resolved above the noise", text)

    def test_counts_show_the_scalar_only_in_after(self):
        # The regressed helper is torch.tensor(n).to(device): on the CPU the
        # .to() is a no-op (one host scalar per step); on CUDA it adds the
        # device copy, a second int32 scalar and one host-to-device copy.
        on_cuda = torch.cuda.is_available()  # the bench's default device
        per_step = 2 if on_cuda else 1
        steps = 2  # --count-steps
        scalar_ops = {"aten::lift_fresh": steps}
        if on_cuda:
            scalar_ops["aten::_to_copy"] = steps
        for r in self.result["rows"]:
            counts = r["counts"]
            self.assertEqual(counts["fixed"]["int32_scalars"], 0)
            self.assertEqual(counts["before"]["int32_scalars"], 0)
            self.assertEqual(counts["after"]["int32_scalars"], per_step)
            self.assertEqual(counts["fixed"]["h2d_copies"], 0)
            self.assertEqual(counts["after"]["h2d_copies"], per_step - 1)
            self.assertEqual(
                sorted(counts["after"]["int32_scalar_sites"]),
                sorted(name for name, n in scalar_ops.items() for _ in range(n)),
            )
            self.assertEqual(counts["fixed"]["glue_allocs"], 0)
            self.assertEqual(counts["after"]["glue_allocs"], per_step)
            self.assertEqual(
                counts["after"]["allocs"], counts["fixed"]["allocs"] + per_step
            )
            self.assertTrue(r["before_equals_fixed"])
            self.assertEqual(r["after_minus_fixed"], scalar_ops)
            self.assertTrue(r["after_is_fixed_plus_scalar"])
        self.assertIn("before == fixed op for op: yes", self.stdout)

    def test_one_trace_per_variant(self):
        names = sorted(os.listdir(self.profile_dir))
        expected = sorted(
            f"dspark_step_c{c}_{v}.json"
            for c in (1, 3)
            for v in bench_dspark_step.VARIANTS
        )
        self.assertEqual(names, expected)
        with open(os.path.join(self.profile_dir, names[0])) as f:
            self.assertGreater(len(json.load(f)["traceEvents"]), 100)

    def test_step_times_plot(self):
        with open(os.path.join(self.plot_dir, "step_times.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_json_folder_checked_before_running(self):
        for bad in (
            ["--json", "/nonexistent-dir/x.json"],
            ["--json", "/proc/x.json"],  # a folder that takes no new file
            ["--profile", __file__],  # a file, not a folder
            ["--ep-timeout", "-1"],
            ["--profile-steps", "0"],
            ["--num-threads", str(MAX_NUM_THREADS + 1)],  # far past: a crash
            ["--seed", str(2**63)],
            ["--moe-a2a-backend", "none"],  # read under DP attention only
            # DP attention times no step: nothing to trace.
            ["--ep-size", "2", "--enable-dp-attention", "--profile", "/tmp"],
        ):
            with self.subTest(argv=bad):
                with mock.patch.object(bench_dspark_step, "run") as run:
                    with self.assertRaises(SystemExit) as cm:
                        _main(TINY + bad)
                self.assertEqual(cm.exception.code, 2)
                run.assert_not_called()

    def test_no_steady_steps_is_an_error(self):
        # Every request ends at its first decode step: someone joins every
        # step, so no step is steady; the bench says so instead of spinning.
        argv = TINY[:2] + ["--output-len", "2", "--steps-per-capture", "2"]
        argv += ["--concurrency", "1"]
        for ranks in (["--ep-size", "1"], ["--ep-size", "2"]):  # a rank's, too
            with self.subTest(argv=ranks):
                stderr = io.StringIO()
                rc, _ = _main(argv + ranks, stderr=stderr)
                self.assertEqual(rc, 2)
                self.assertIn("error:", stderr.getvalue())
                self.assertIn("steady", stderr.getvalue())

    def test_six_repeats_run_every_order(self):
        orders = bench_dspark_step.ORDERS
        self.assertEqual(len(set(orders)), 6)
        for name in bench_dspark_step.VARIANTS:  # first, second, third twice each
            self.assertEqual(sorted(o.index(name) for o in orders), [0, 0, 1, 1, 2, 2])

    def test_unknown_variant(self):
        with self.assertRaisesRegex(ValueError, "'later'"):
            bench_dspark_step.with_proposer(None, "later")


class TestBenchDSparkStepEP2(CustomTestCase):
    def test_ep2_ranks(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ep.json")
            argv = TINY + ["--concurrency", "3", "--ep-size", "2", "--json", path]
            rc, stdout = _main(argv)
            with open(path) as f:
                ranks = json.load(f)["ranks"]
        self.assertEqual(rc, 0)
        self.assertIn("EP 2 (rank 0)", stdout)
        for rank in range(2):
            self.assertIn(f"Per decode step, rank {rank}, C=3", stdout)
        self.assertEqual(len(ranks), 2)
        for rows in ranks:
            self.assertTrue(rows[0]["greedy_output_equal"])
            counts = rows[0]["counts"]
            # The shipped enabled path fills buffers: no scalar created per
            # step; the regressed helper builds the proposer's every step.
            self.assertEqual(counts["fixed"]["int32_scalars"], 0)
            self.assertEqual(counts["fixed"]["glue_allocs"], 0)
            self.assertEqual(counts["after"]["int32_scalars"], 1)
            # `before` sends no scalar, so padded rows are not masked: the
            # op counts differ from fixed's at EP 2, unlike at EP 1.
            self.assertFalse(rows[0]["before_equals_fixed"])


class TestBenchDSparkStepDpAttention(CustomTestCase):
    """``--enable-dp-attention``: what the MoE dispatch sends per decode step.
    C=3 over 2 ranks gives them 3 and 2 requests: the second pads one."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "dp.json")
            argv = ["--input-len", "8", "--count-steps", "2", "--concurrency", "3"]
            argv += ["--ep-size", "2", "--enable-dp-attention", "--json", path]
            cls.rc, cls.stdout = _main(argv + ["--plot-dir", tmp])
            with open(path) as f:
                cls.ranks = json.load(f)["ranks"]
            with open(os.path.join(tmp, "dp_bytes.png"), "rb") as f:
                cls.png = f.read(8)

    def test_fixed_sends_no_padded_row_and_exactly_the_real_copies(self):
        self.assertEqual(self.rc, 0)
        self.assertIn("fixed sends no padded row: yes", self.stdout)
        for rank, rows in enumerate(self.ranks):
            fixed = rows[0]["variants"]["fixed"]
            self.assertEqual(fixed["requests"], 3 - rank)
            for fwd, m in fixed["per_step"].items():
                with self.subTest(rank=rank, forward=fwd):
                    self.assertEqual(m["padded_rows_sent"], 0)
                    self.assertGreater(m["real_row_copies"], 0)
                    self.assertEqual(
                        m["hidden_bytes"], m["real_row_copies"] * fixed["row_bytes"]
                    )

    def test_bytes_plot(self):
        self.assertEqual(self.png, b"\x89PNG\r\n\x1a\n")

    def test_before_sends_the_padded_draft_rows(self):
        # Rank 1 pads one request to rank 0's rows: without the draft
        # block's scalar its gamma padded rows go out unmasked.
        light = self.ranks[1][0]["variants"]
        before, fixed = light["before"]["per_step"], light["fixed"]["per_step"]
        self.assertGreater(before["draft"]["padded_rows_sent"], 0)
        self.assertGreater(
            before["draft"]["hidden_bytes"], fixed["draft"]["hidden_bytes"]
        )
        # The verify batch carries its scalar in every variant.
        self.assertEqual(before["verify"], fixed["verify"])
        self.assertTrue(self.ranks[0][0]["greedy_output_equal"])

    def test_needs_ranks(self):
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit) as ctx:
                bench_dspark_step.main(["--enable-dp-attention"])
        self.assertEqual(ctx.exception.code, 2)

    def test_device_names_are_the_engines(self):
        # cpu:0 is the CPU, where the gloo ranks run (it was refused as not
        # "cpu"); a name torch does not take is the parser's error.
        argv = ["--device", "cpu:0", "--ep-size", "2"]
        with mock.patch.object(bench_dspark_step, "run", side_effect=ValueError) as run:
            with contextlib.redirect_stderr(io.StringIO()):
                self.assertEqual(bench_dspark_step.main(argv), 2)  # run's error
        self.assertEqual(run.call_args.args[0].device, "cpu")
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit) as ctx:
                bench_dspark_step.main(["--device", "tpu"])
        self.assertEqual(ctx.exception.code, 2)


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class TestBenchDSparkStepCUDA(CustomTestCase):
    def test_cuda_graphs_table_and_counts(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "cuda.json")
            argv = TINY + ["--concurrency", "1", "--device", "cuda", "--json", path]
            rc, stdout = _main(argv)
            with open(path) as f:
                row = json.load(f)["rows"][0]
        self.assertEqual(rc, 0)
        self.assertIn("CUDA graphs", stdout)
        self.assertTrue(row["cuda_graph"])
        counts = row["counts"]
        # On a device the regressed scalar is a host tensor plus its copy.
        self.assertEqual(counts["after"]["int32_scalars"], 2)
        self.assertEqual(counts["after"]["h2d_copies"], 1)
        self.assertEqual(counts["fixed"]["int32_scalars"], 0)
        self.assertEqual(counts["fixed"]["h2d_copies"], 0)
        self.assertTrue(row["before_equals_fixed"])
        self.assertTrue(row["after_is_fixed_plus_scalar"])
        self.assertTrue(row["greedy_output_equal"])


if __name__ == "__main__":
    unittest.main()

"""The main job runs end to end, in lockstep, and reports real figures."""

import contextlib
import io
import json
import math
import os
import statistics
import tempfile
import unittest
from unittest import mock

from sglang import Engine, bench_one_batch
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, record_decode_batch_sizes

register_cpu_ci(est_time=12, suite="base-a-test-cpu")


def _main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = bench_one_batch.main(argv)
    return rc, out.getvalue()


class TestBenchOneBatch(CustomTestCase):
    def test_figures_and_json(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bench.json")
            rc, text = _main(
                ["--batch-size", "1", "3", "--input-len", "8", "--output-len", "9"]
                + ["--count-ops", "--json", path]
                + ["--temperature", "0", "--model-path", "random-tiny-moe"]
            )
            with open(path) as f:
                rows = json.load(f)
        self.assertEqual(rc, 0)
        self.assertEqual([r["batch_size"] for r in rows], [1, 3])
        for r in rows:
            # The defaults: 16 prompts per request slot, 2 rounds.
            self.assertEqual(r["num_prompts"], 16 * r["batch_size"])
            self.assertTrue(r["greedy_output_equal"])
            self.assertEqual(r["gamma"], 5)
            self.assertEqual(r["repeats"], 2)
            for name in ("plain", "dspark"):
                self.assertGreater(r[f"{name}_tokens_per_s"], 0)
                self.assertGreater(r[f"{name}_mean_step_ms"], 0)
                # Counted ops: a decode step runs the model (at least the
                # embedding, attention and experts of every layer).
                self.assertGreater(r[f"{name}_ops_per_step"], 20)
                self.assertGreater(r[f"{name}_allocs_per_step"], 0)
                self.assertLess(r[f"{name}_allocs_per_step"], r[f"{name}_ops_per_step"])
            # Plain decoding: 16 waves of the batch, 8 decode steps each, per
            # round (the first token is prefill's); DSpark needs at most as many.
            self.assertEqual(r["plain_decode_steps"], 2 * 16 * 8)
            self.assertLessEqual(r["dspark_decode_steps"], r["plain_decode_steps"])
            # Blocks of 16 steps: a pair per turn in which both engines decoded.
            self.assertEqual(r["block_steps"], 16)
            self.assertGreaterEqual(r["step_pairs"], 3)
            self.assertLessEqual(r["step_pairs"], r["dspark_decode_steps"])
            lo, hi = r["step_cost_ratio_ci95"]
            self.assertLess(lo, r["step_cost_ratio"])
            self.assertLess(r["step_cost_ratio"], hi)
            # DSpark also runs the draft and verifies gamma + 1 rows.
            self.assertGreater(r["dspark_ops_per_step"], r["plain_ops_per_step"])
            # Speedup: tokens per step (exact counts) over the paired cost.
            tokens = r["num_prompts"] * r["repeats"] * 8  # decode tokens per engine
            gain = (tokens / r["dspark_decode_steps"]) / (
                tokens / r["plain_decode_steps"]
            )
            self.assertAlmostEqual(r["tokens_per_step_ratio"], gain)
            self.assertAlmostEqual(r["speedup"], gain / r["step_cost_mean_ratio"])
            s_lo, s_hi = r["speedup_ci95"]
            self.assertGreater(s_lo, 0)
            self.assertLess(s_lo, r["speedup"])
            self.assertLess(r["speedup"], s_hi)
            self.assertAlmostEqual(
                r["tokens_per_s_ratio"],
                r["dspark_tokens_per_s"] / r["plain_tokens_per_s"],
            )
            self.assertGreaterEqual(r["accept_length"], 1.0)
            self.assertLessEqual(r["accept_length"], 6.0)
        self.assertIn("bs=1 ", text)
        self.assertIn("step cost dspark/plain", text)
        self.assertIn("aten ops", text)
        self.assertIn("greedy equal: True", text)
        self.assertIn(f"wrote {path}", text)

    def test_op_counts_with_the_trained_pair(self):
        # The shipped pair's draft accepts long runs, so a short request can
        # finish in its first decode step: the op-count pass gives its own
        # requests room for every counted step. Op counts do not depend on
        # the weights (same architecture): they equal the random pair's.
        rows = {}
        for model in ([], ["--model-path", "random-tiny-moe"]):
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "bench.json")
                rc, _ = _main(
                    ["--batch-size", "3", "--input-len", "8", "--output-len", "4"]
                    + ["--repeats", "1", "--temperature", "0", "--count-ops"]
                    + ["--prompts", "random", "--json", path]
                    + model
                )
                with open(path) as f:
                    (rows[bool(model)],) = json.load(f)
            self.assertEqual(rc, 0)
        trained, random_pair = rows[False], rows[True]
        self.assertTrue(trained["greedy_output_equal"])
        self.assertGreater(trained["accept_length"], random_pair["accept_length"])
        for key in (
            "plain_ops_per_step",
            "plain_allocs_per_step",
            "dspark_ops_per_step",
            "dspark_allocs_per_step",
        ):
            with self.subTest(key=key):
                self.assertIsNotNone(trained[key])
                self.assertEqual(trained[key], random_pair[key])
        self.assertGreater(
            trained["dspark_ops_per_step"], trained["plain_ops_per_step"]
        )

    def test_block_steps(self):
        # One round: DSpark decodes in turns of up to K steps while plain
        # (more steps) still runs, so it makes ceil(steps / K) pairs; K = 1
        # alternates single steps.
        for k in (1, 4):
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "bench.json")
                rc, _ = _main(
                    ["--batch-size", "2", "--input-len", "4", "--output-len", "12"]
                    + ["--repeats", "1", "--temperature", "0", "--block-steps"]
                    + [str(k), "--json", path]
                )
                with open(path) as f:
                    (row,) = json.load(f)
            self.assertEqual(rc, 0)
            with self.subTest(block_steps=k):
                self.assertEqual(row["block_steps"], k)
                self.assertTrue(row["greedy_output_equal"])
                steps = row["dspark_decode_steps"]
                self.assertGreater(steps, k)
                self.assertEqual(row["step_pairs"], -(-steps // k))

    def test_batch_size_caps_running_requests(self):
        # 5 prompts, 2 decoding at once: plain runs waves of 2, 2 and 1; DSpark
        # admits a prompt whenever one finishes. --num-prompts equal to the
        # batch size is one static batch.
        sizes, real = {}, bench_one_batch.Engine
        with contextlib.ExitStack() as stack:

            def make(**kwargs):
                engine = real(**kwargs)
                name = "dspark" if kwargs["speculative_algorithm"] else "plain"
                sizes[name] = stack.enter_context(record_decode_batch_sizes(engine))
                return engine

            with mock.patch.object(bench_one_batch, "Engine", make):
                for num in (5, 2):
                    with tempfile.TemporaryDirectory() as d:
                        path = os.path.join(d, "bench.json")
                        rc, _ = _main(
                            ["--batch-size", "2", "--num-prompts", str(num)]
                            + ["--input-len", "4", "--output-len", "6"]
                            + ["--repeats", "1", "--temperature", "0"]
                            + ["--json", path]
                        )
                        with open(path) as f:
                            (row,) = json.load(f)
                    self.assertEqual(rc, 0)
                    self.assertEqual(row["num_prompts"], num)
                    self.assertTrue(row["greedy_output_equal"])
                    warmup = [2] * 3  # 4 tokens: prefill's, then 3 decode steps
                    waves = [[2] * 5, [2] * 5, [1] * 5] if num == 5 else [[2] * 5]
                    self.assertEqual(sizes["plain"], warmup + sum(waves, []))
                    self.assertEqual(row["plain_decode_steps"], 5 * len(waves))
                    # Requests per step: the timed decode batches, the last
                    # ones recorded (the warm-up's come first).
                    for name in ("plain", "dspark"):
                        timed = sizes[name][-row[f"{name}_decode_steps"] :]
                        self.assertAlmostEqual(
                            row[f"{name}_rows_per_step"], sum(timed) / len(timed)
                        )
                    self.assertEqual(max(sizes["dspark"]), 2)
                    # Every prompt's 5 decoded tokens came from these steps.
                    self.assertLessEqual(len(sizes["dspark"]) - 3, 5 * len(waves))
                    sizes["plain"].clear()
                    sizes["dspark"].clear()

    def test_sampling_reports_no_equality(self):
        rc, text = _main(
            ["--batch-size", "2", "--input-len", "4", "--output-len", "6"]
            + ["--temperature", "0.7", "--repeats", "1"]
        )
        self.assertEqual(rc, 0)
        self.assertIn("greedy equal: n/a (sampling)", text)
        self.assertNotIn("aten ops", text)  # only with --count-ops

    def test_a_row_draws_the_same_whatever_ran_before(self):
        # A sampled row alone, and after another row and --count-ops passes
        # (which draw from the engines' generators): the same draws, so the
        # same accepted drafts and step counts.
        rows = {}
        with tempfile.TemporaryDirectory() as d:
            for name, extra in (
                ("alone", ["--batch-size", "2"]),
                ("after", ["--batch-size", "1", "2", "--count-ops"]),
            ):
                path = os.path.join(d, f"{name}.json")
                rc, _ = _main(
                    ["--input-len", "4", "--output-len", "12", "--repeats", "1"]
                    + ["--temperature", "0.7", "--json", path]
                    + extra
                )
                self.assertEqual(rc, 0)
                with open(path) as f:
                    rows[name] = json.load(f)[-1]
        for key in ("accept_length", "dspark_decode_steps", "plain_decode_steps"):
            self.assertEqual(rows["alone"][key], rows["after"][key], key)

    def test_phases(self):
        # Every phase ran and took time; DSpark's phases and the rest add up
        # to its step, in units of plain's step; the timers are gone after.
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bench.json")
            rc, text = _main(
                ["--batch-size", "2", "--input-len", "4", "--output-len", "10"]
                + ["--temperature", "0", "1", "--repeats", "1", "--phases"]
                + ["--json", path]
            )
            with open(path) as f:
                rows = json.load(f)
        self.assertEqual(rc, 0)
        self.assertEqual(text.count("phases, in plain steps: plain forward"), 2)
        expected = {
            "plain": ["forward", "rest", "step"],
            "dspark": [
                "verify forward",
                "draft forward",
                "proposer",
                "acceptance",
                "context write",
                "rest",
                "step",
            ],
        }
        for row in rows:
            phases = row["phases_plain_steps"]
            for name, labels in expected.items():
                with self.subTest(temperature=row["temperature"], engine=name):
                    self.assertEqual(list(phases[name]), labels)
                    for label in labels[:-2]:
                        self.assertGreater(phases[name][label], 0, label)
                    parts = sum(phases[name][k] for k in labels[:-1])
                    self.assertAlmostEqual(parts, phases[name]["step"], places=9)
            self.assertAlmostEqual(phases["plain"]["step"], 1.0, places=9)
            # The DSpark step runs two forwards: more than one plain step.
            self.assertGreater(phases["dspark"]["step"], 1.0)
            # The bound: this run's tokens-per-step gain over the two
            # forwards' cost, above the speedup (the rest of the step costs).
            forwards = phases["dspark"]["verify forward"]
            forwards += phases["dspark"]["draft forward"]
            self.assertAlmostEqual(
                row["speedup_forwards_only"],
                row["tokens_per_step_ratio"] / forwards,
                places=12,
            )
            self.assertGreater(
                row["speedup_forwards_only"],
                row["tokens_per_step_ratio"] / phases["dspark"]["step"],
            )
        self.assertEqual(text.count("speedup if only the forwards cost time"), 2)

    def test_phase_timers_are_removed(self):
        # After a phase round (also one that raises) the workers' methods are
        # the classes' again and the worker module's verify functions its own.
        from sglang.srt.speculative.dspark_components import (
            dspark_verify,
            dspark_worker_v2,
        )

        engines = {
            "plain": Engine(random_seed=0, max_running_requests=2),
            "dspark": Engine(
                speculative_algorithm="DSPARK", random_seed=0, max_running_requests=2
            ),
        }
        prompts = [[3, 1, 4, 1], [5, 9, 2]]
        params = {"max_new_tokens": 8, "temperature": 1.0}
        phases = bench_one_batch._phase_round(engines, prompts, params, 4)
        self.assertGreater(phases["dspark"]["verify forward"], 0)
        with mock.patch.object(
            bench_one_batch, "_lockstep_round", side_effect=KeyboardInterrupt
        ):
            with self.assertRaises(KeyboardInterrupt):
                bench_one_batch._phase_round(engines, prompts, params, 4)
        for engine in engines.values():
            worker = engine.worker
            objs = [worker, getattr(worker, "model_runner", None)]
            if hasattr(worker, "proposer"):
                objs += [
                    worker.proposer,
                    worker.draft_runner,
                    worker.draft_model,
                    worker.target_worker.model_runner,
                ]
            for obj in filter(None, objs):
                for name in ("decode_step", "forward", "propose", "write_context"):
                    self.assertNotIn(name, vars(obj), (type(obj).__name__, name))
        for name in ("verify", "rejection_verify_into"):
            self.assertIs(getattr(dspark_worker_v2, name), getattr(dspark_verify, name))

    def test_bad_arguments(self):
        for argv in (
            ["--output-len", "1"],
            ["--batch-size", "0"],
            ["--input-len", "0"],
            ["--repeats", "0"],
            ["--block-steps", "0"],
            ["--batch-size", "1", "8", "--num-prompts", "4"],
        ):
            with self.subTest(argv=argv):
                with contextlib.redirect_stderr(io.StringIO()):
                    with self.assertRaises(SystemExit) as ctx:
                        bench_one_batch.main(argv)
                self.assertEqual(ctx.exception.code, 2)

    def test_json_path_checked_before_the_run(self):
        with tempfile.TemporaryDirectory() as d:
            missing = os.path.join(d, "no-such-folder", "bench.json")
            for path, says in ((missing, "does not exist"), (d, "is a folder")):
                with self.subTest(path=path):
                    err = io.StringIO()
                    with (
                        mock.patch.object(bench_one_batch, "run") as run,
                        contextlib.redirect_stderr(err),
                        self.assertRaises(SystemExit) as ctx,
                    ):
                        bench_one_batch.main(["--json", path])
                    self.assertEqual(ctx.exception.code, 2)
                    self.assertIn(says, err.getvalue())
                    run.assert_not_called()


class TestPairedRatio(CustomTestCase):
    def test_t_quantile(self):
        # Student's t 97.5% points from the tables.
        for df, t in ((2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (120, 1.980)):
            with self.subTest(df=df):
                self.assertAlmostEqual(
                    bench_one_batch._t_quantile_975(df), t, delta=0.04
                )

    def test_interval_on_log_ratios(self):
        pairs = [(1.0, 2.0), (2.0, 4.4), (1.5, 2.7), (3.0, 6.6), (1.0, 1.9)]
        ratio, lo, hi = bench_one_batch.paired_ratio(pairs)
        logs = [math.log(b / a) for a, b in pairs]
        self.assertAlmostEqual(ratio, math.exp(statistics.fmean(logs)))
        half = 2.776 * statistics.stdev(logs) / math.sqrt(5)  # t(0.975, df=4)
        self.assertAlmostEqual(lo, ratio * math.exp(-half), places=2)
        self.assertAlmostEqual(hi, ratio * math.exp(half), places=2)
        # Scaling one engine's times scales the ratio and its interval.
        scaled = bench_one_batch.paired_ratio([(a, 3 * b) for a, b in pairs])
        for x, y in zip(scaled, (ratio, lo, hi)):
            self.assertAlmostEqual(x, 3 * y)

    def test_mean_ratio_and_its_interval(self):
        pairs = [(1.0, 2.0), (2.0, 4.4), (1.5, 2.7), (3.0, 6.6), (1.0, 1.9)]
        ratio, lo, hi = bench_one_batch.paired_mean_ratio(pairs)
        self.assertAlmostEqual(ratio, 17.6 / 8.5)  # sum(b) / sum(a)
        res = [b - ratio * a for a, b in pairs]
        se = math.sqrt(sum(r * r for r in res) / 4 / 5) / 1.7  # mean(a) = 1.7
        self.assertAlmostEqual(hi - ratio, 2.776 * se, places=2)
        self.assertAlmostEqual(ratio - lo, hi - ratio)
        # A long DSpark step weighs by its time, not by its log ratio.
        skew = [(1.0, 2.0)] * 9 + [(1.0, 20.0)]
        self.assertAlmostEqual(bench_one_batch.paired_mean_ratio(skew)[0], 3.8)
        self.assertLess(bench_one_batch.paired_ratio(skew)[0], 2.6)
        same = bench_one_batch.paired_mean_ratio([(1.0, 1.5), (2.0, 3.0), (4.0, 6.0)])
        for x in same:
            self.assertAlmostEqual(x, 1.5)
        self.assertEqual(
            bench_one_batch.paired_mean_ratio([(1.0, 2.0), (1.0, 3.0)]),
            (2.5, None, None),
        )

    def test_constant_ratio_and_too_few_pairs(self):
        same = bench_one_batch.paired_ratio([(1.0, 1.5), (2.0, 3.0), (4.0, 6.0)])
        for x in same:  # no spread: a zero-width interval
            self.assertAlmostEqual(x, 1.5)
        ratio, lo, hi = bench_one_batch.paired_ratio([(1.0, 2.0), (1.0, 3.0)])
        self.assertAlmostEqual(ratio, math.sqrt(6))
        self.assertEqual((lo, hi), (None, None))


if __name__ == "__main__":
    unittest.main()

"""The main job runs end to end, in lockstep, and reports real figures."""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import torch

from sglang import Engine, bench_one_batch
from sglang.srt.distributed.parallel_state import (
    get_open_port,
    init_distributed_environment,
)
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import (
    CustomTestCase,
    record_decode_batch_sizes,
    spawn_ranks,
)

register_cpu_ci(est_time=25, suite="base-a-test-cpu")


def _main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = bench_one_batch.main(argv)
    return rc, out.getvalue()


def _main_json(argv):
    """``_main`` with ``--json`` to a temporary file: rc, text, the rows."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.json")
        rc, text = _main(argv + ["--json", path])
        with open(path) as f:
            return rc, text, json.load(f)


def _bench_rank_with_own_block_steps(rank, world, port, out_dir) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(rank=rank, world_size=world, port=port, timeout_s=30)
    argv = ["--enable-dp-attention", "--dp-size", str(world), "--batch-size", "1"]
    argv += ["--temperature", "0", "--output-len", "4", "--input-len", "8"]
    argv += ["--num-prompts", "2", "--repeats", "1", "--dist-timeout", "20"]
    argv += ["--speculative-verify-budget", "off", "--block-steps", str(2 + rank)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = bench_one_batch.main(argv)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"code": code, "stderr": err.getvalue()}, f)


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
            # A DSpark step does more than a plain one, even one that drafts
            # nothing (auto may plan budget 0 here: it stashes the context);
            # that a drafting step runs the draft, test_phases checks.
            self.assertGreater(r["dspark_ops_per_step"], r["plain_ops_per_step"])
            # Speedup: tokens per step over the paired cost, both over the
            # turns both engines decoded (one's tail, once the other is done,
            # is unpaired).
            tokens = r["num_prompts"] * r["repeats"] * 8  # decode tokens per engine
            per_step = {}
            for name in ("plain", "dspark"):
                paired = r[f"{name}_paired_decode_tokens"]
                steps = r[f"{name}_paired_decode_steps"]
                self.assertLessEqual(paired, tokens)
                self.assertGreater(paired, tokens / 2)
                self.assertLessEqual(steps, r[f"{name}_decode_steps"])
                per_step[name] = paired / steps
            gain = per_step["dspark"] / per_step["plain"]
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
            # The line's per-engine figures are the paired turns': their
            # tokens/s ratio is the speedup, their step-time ratio the cost.
            paired = {n: r[f"{n}_paired_tokens_per_s"] for n in ("plain", "dspark")}
            self.assertAlmostEqual(paired["dspark"] / paired["plain"], r["speedup"])
            self.assertAlmostEqual(
                r["dspark_paired_mean_step_ms"] / r["plain_paired_mean_step_ms"],
                r["step_cost_mean_ratio"],
            )
            self.assertIn(
                f"plain {paired['plain']:7.1f} tok/s "
                f"{r['plain_paired_mean_step_ms']:.3f} ms/step",
                text,
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
        # the weights (same architecture): they equal the random pair's,
        # with every draft verified (a planner's budgets follow the draft).
        rows = {}
        for model in ([], ["--model-path", "random-tiny-moe"]):
            rc, _, rows[bool(model)] = _main_json(
                ["--batch-size", "3", "--input-len", "8", "--output-len", "4"]
                + ["--repeats", "1", "--temperature", "0", "1", "--count-ops"]
                + ["--prompts", "random", "--speculative-verify-budget", "off"]
                + model
            )
            self.assertEqual(rc, 0)
        (trained, trained_t1), (random_pair, random_t1) = rows[False], rows[True]
        self.assertTrue(trained["greedy_output_equal"])
        self.assertGreater(trained["accept_length"], random_pair["accept_length"])
        for key in (
            "plain_ops_per_step",
            "plain_allocs_per_step",
            "dspark_ops_per_step",
            "dspark_allocs_per_step",
            "dspark_glue_ops_per_step",
        ):
            for a, b in ((trained, random_pair), (trained_t1, random_t1)):
                with self.subTest(key=key, temperature=a["temperature"]):
                    self.assertIsNotNone(a[key])
                    self.assertEqual(a[key], b[key])
        self.assertGreater(
            trained["dspark_ops_per_step"], trained["plain_ops_per_step"]
        )
        # The glue's ops, a guard: greedy, the window (3) and its verify
        # inputs (2), the block's inputs (4), the Markov head's 5 slots (3
        # each, and 2 views of the logits), the drafts into the verify ids,
        # the greedy rule (6 with its views) and the sequence lengths (2);
        # sampled, the head reads the noisy logits' slots (a view fewer),
        # and the draws (5), the noise on the logits (2), q (4) and
        # rejection sampling (17 with its views, for the greedy rule's 6).
        self.assertLessEqual(trained["dspark_glue_ops_per_step"], 35)
        self.assertLessEqual(trained_t1["dspark_glue_ops_per_step"], 56)

    def test_block_steps(self):
        # One round: DSpark decodes in turns of up to K steps while plain
        # (more steps) still runs, so it makes ceil(steps / K) pairs; K = 1
        # alternates single steps.
        for k in (1, 4):
            rc, _, (row,) = _main_json(
                ["--batch-size", "2", "--input-len", "4", "--output-len", "12"]
                + ["--repeats", "1", "--temperature", "0", "--block-steps", str(k)]
            )
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
                    rc, _, (row,) = _main_json(
                        ["--batch-size", "2", "--num-prompts", str(num)]
                        + ["--input-len", "4", "--output-len", "6"]
                        + ["--repeats", "1", "--temperature", "0"]
                    )
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

    def test_top_p(self):
        rc, text, (row,) = _main_json(
            ["--batch-size", "2", "--input-len", "4", "--output-len", "6"]
            + ["--temperature", "1", "--repeats", "1", "--top-p", "0.9"]
            + ["--speculative-verify-budget", "off"]  # every step drafts
        )
        self.assertEqual(rc, 0)
        self.assertIn("T=1 top_p=0.9 bs=2", text)
        self.assertEqual(row["sampling_params"], {"top_p": 0.9})
        self.assertGreater(row["speedup"], 0)
        self.assertGreater(row["accept_length"], 1)

    def test_a_row_draws_the_same_whatever_ran_before(self):
        # A sampled row alone, and after another row and --count-ops passes
        # (which draw from the engines' generators): the same draws, so the
        # same accepted drafts and step counts (every draft verified: a
        # planner's budgets follow the steps timed before).
        rows = {}
        for name, extra in (
            ("alone", ["--batch-size", "2"]),
            ("after", ["--batch-size", "1", "2", "--count-ops"]),
        ):
            rc, _, all_rows = _main_json(
                ["--input-len", "4", "--output-len", "12", "--repeats", "1"]
                + ["--temperature", "0.7", "--speculative-verify-budget", "off"]
                + extra
            )
            self.assertEqual(rc, 0)
            rows[name] = all_rows[-1]
        for key in ("accept_length", "dspark_decode_steps", "plain_decode_steps"):
            self.assertEqual(rows["alone"][key], rows["after"][key], key)

    def test_phases(self):
        # Every phase ran and took time, inside the step as timed on its own
        # by the scheduler (an independent total, outside the worker); the
        # model's own compute is inside the phases. In units of plain's step.
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bench.json")
            rc, text = _main(
                ["--batch-size", "2", "--input-len", "4", "--output-len", "10"]
                + ["--temperature", "0", "1", "--repeats", "1", "--phases"]
                + ["--speculative-verify-budget", "off"]  # every step drafts
                + ["--json", path, "--plot-dir", os.path.join(d, "plots")]
            )
            with open(path) as f:
                rows = json.load(f)
            for name in ("speedup.png", "phases.png"):  # the plots, PNGs
                with open(os.path.join(d, "plots", name), "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertEqual(rc, 0)
        self.assertEqual(text.count("dspark phases, in plain steps: draft"), 2)
        workers = {"plain": TpModelWorker, "dspark": DSparkWorkerV2}
        for row in rows:
            phases = row["phases_plain_steps"]
            for name, worker in workers.items():
                with self.subTest(temperature=row["temperature"], engine=name):
                    spans = phases[name]
                    self.assertEqual(
                        set(spans),
                        {"step"} | set(worker.PHASES) | set(worker.MODEL_SPANS),
                    )
                    for label in worker.PHASES + worker.MODEL_SPANS:
                        self.assertGreater(spans[label], 0, label)
                    # Nested in the step (that they cover it all is counted
                    # exactly, op for op, in test_dspark_step_pipeline).
                    total = sum(spans[k] for k in worker.PHASES)
                    self.assertLessEqual(total, spans["step"])
            self.assertAlmostEqual(phases["plain"]["step"], 1.0, places=9)
            dspark = phases["dspark"]
            self.assertLess(dspark["draft forward"], dspark["draft"])
            self.assertLess(dspark["verify forward"], dspark["verify"] + 1e-12)
            self.assertLess(dspark["context write"], dspark["commit"])
            model = sum(dspark[k] for k in DSparkWorkerV2.MODEL_SPANS)
            self.assertAlmostEqual(row["dspark_model_share"], model / dspark["step"])
            self.assertLess(row["dspark_model_share"], 1.0)
            # The bound: this run's tokens-per-step gain over the two
            # forwards' cost, above the speedup (the rest of the step costs).
            forwards = dspark["verify forward"] + dspark["draft forward"]
            self.assertAlmostEqual(
                row["speedup_forwards_only"],
                row["tokens_per_step_ratio"] / forwards,
                places=12,
            )
            self.assertGreater(
                row["speedup_forwards_only"],
                row["tokens_per_step_ratio"] / dspark["step"],
            )
        self.assertEqual(text.count("speedup if only the forwards cost time"), 2)

    def test_phase_hooks_are_removed(self):
        # After a phase round (also one that raises) no worker is observed.
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
        for engine in engines.values():
            self.assertIsNone(engine.worker.spans.hook)
        with mock.patch.object(
            bench_one_batch, "_lockstep_round", side_effect=KeyboardInterrupt
        ):
            with self.assertRaises(KeyboardInterrupt):
                bench_one_batch._phase_round(engines, prompts, params, 4)
        for engine in engines.values():
            self.assertIsNone(engine.worker.spans.hook)

    def test_host_reads_counted_before_the_output(self):
        rc, _, rows = _main_json(
            ["--batch-size", "2", "--input-len", "4", "--output-len", "8"]
            + ["--temperature", "0", "1", "--repeats", "1", "--count-ops"]
            + ["--speculative-verify-budget", "off"]  # every step drafts
        )
        self.assertEqual(rc, 0)
        for row in rows:
            self.assertEqual(row["dspark_host_reads_per_step"], 0)
            self.assertEqual(row["plain_host_reads_per_step"], 0)
            # The glue (the step outside the model's spans) allocates
            # nothing: the step buffers hold every tensor it writes.
            for name in ("plain", "dspark"):
                with self.subTest(temperature=row["temperature"], engine=name):
                    self.assertEqual(row[f"{name}_glue_allocs_per_step"], 0)
                    self.assertGreater(row[f"{name}_glue_ops_per_step"], 0)
                    self.assertLess(
                        row[f"{name}_glue_ops_per_step"], row[f"{name}_ops_per_step"]
                    )
            # The draft's proposing and acceptance are glue: DSpark has more.
            self.assertGreater(
                row["dspark_glue_ops_per_step"], row["plain_glue_ops_per_step"] + 20
            )

    def test_bad_arguments(self):
        for argv in (
            ["--output-len", "1"],
            ["--batch-size", "0"],
            ["--input-len", "0"],
            ["--repeats", "0"],
            ["--block-steps", "0"],
            ["--batch-size", "1", "8", "--num-prompts", "4"],
            ["--enable-dp-attention"],  # one process: no ranks
            ["--enable-dp-attention", "--dp-size", "2", "--count-ops"],
            ["--moe-a2a-backend", "all_to_all"],  # without DP attention
            ["--top-p", "0"],
            ["--top-k", "0"],
            ["--temperature", "0", "-1"],  # every temperature, before any row
            ["--json", ""],
            ["--json", "/proc/bench.json"],  # a folder that takes no new file
            ["--plot-dir", __file__],  # a file, not a folder
            ["--seed", "-1"],
            ["--device", "tpu"],  # not a device name, as ServerArgs says
        ):
            with self.subTest(argv=argv):
                with contextlib.redirect_stderr(io.StringIO()):
                    with self.assertRaises(SystemExit) as ctx:
                        bench_one_batch.main(argv)
                self.assertEqual(ctx.exception.code, 2)

    def test_device_names_are_the_engines(self):
        # cpu:0 is the CPU (ServerArgs' rule): --phases runs there, where a
        # comparison with "cpu" took it for CUDA and asked for
        # --disable-cuda-graph.
        argv = ["--device", "cpu:0", "--phases", "--batch-size", "1"]
        argv += ["--temperature", "0", "--input-len", "4", "--output-len", "3"]
        argv += ["--num-prompts", "1", "--repeats", "1"]
        with contextlib.redirect_stdout(io.StringIO()):
            rc, _, rows = _main_json(argv)
        self.assertEqual(rc, 0)
        self.assertEqual(rows[0]["device"], "cpu")
        self.assertIn("dspark_model_share", rows[0])

    def test_an_engine_refusal_is_an_error_not_a_traceback(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = bench_one_batch.main(["--model-path", "no-such-model"])
        self.assertEqual(rc, 2)
        self.assertIn("bench_one_batch: error: unknown model path", err.getvalue())
        # A prompt past the context, refused before the prompts are built:
        # 10**9 random ids took minutes to build before.
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            with mock.patch.object(bench_one_batch, "make_prompts") as make:
                rc = bench_one_batch.main(
                    ["--prompts", "random", "--input-len", str(10**9)]
                )
        self.assertEqual(rc, 2)
        self.assertRegex(
            err.getvalue(), "error: prompt of 1000000000 tokens .* exceeds"
        )
        make.assert_not_called()

    def test_the_json_keeps_the_rows_before_a_failing_one(self):
        # The JSON is written after every row, to F.partial: a failure later
        # loses none, and leaves no F that passes for a whole run.
        real_format, calls = bench_one_batch._format, []

        def format_then_fail(row, engines):
            calls.append(row)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real_format(row, engines)

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bench.json")
            argv = ["--batch-size", "1", "2", "--input-len", "4", "--output-len"]
            argv += ["3", "--temperature", "0", "--repeats", "1", "--json", path]
            argv += ["--model-path", "random-tiny-moe"]
            err = io.StringIO()
            with (
                mock.patch.object(bench_one_batch, "_format", format_then_fail),
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(err),
            ):
                code = bench_one_batch.main(argv)
            self.assertEqual(code, 130)  # Ctrl-C: the rows so far named
            self.assertEqual(  # after the progress bars (\r-ended): one line
                err.getvalue().splitlines()[-1],
                f"bench_one_batch: interrupted; the rows done so far are in "
                f"{path}.partial",
            )
            self.assertNotIn("Traceback", err.getvalue())
            self.assertFalse(os.path.exists(path))
            with open(path + ".partial") as f:
                rows = json.load(f)
            self.assertEqual(os.listdir(d), ["bench.json.partial"])
        self.assertEqual([r["batch_size"] for r in rows], [1])

    def test_torchrun_with_dp_attention(self):
        # As a user launches it: two ranks, each its own share of the prompts.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-port", str(get_open_port()), "-m", "sglang.bench_one_batch"]
        cmd += ["--enable-dp-attention", "--moe-a2a-backend", "all_to_all"]
        cmd += ["--batch-size", "2", "--temperature", "0", "--output-len", "8"]
        cmd += ["--input-len", "8", "--num-prompts", "3", "--repeats", "1"]
        cmd += ["--speculative-verify-budget", "off"]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "dp.json")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            run = subprocess.run(
                cmd + ["--json", path], capture_output=True, text=True, env=env
            )
            self.assertEqual(run.returncode, 0, run.stderr[-3000:])
            with open(path) as f:
                (row,) = json.load(f)
        self.assertEqual(run.stdout.count("T=0 bs=2"), 1)  # rank 0 prints
        self.assertIn("greedy equal: True", run.stdout)
        self.assertEqual(row["dp_size"], 2)
        self.assertEqual(row["moe_a2a_backend"], "all_to_all")
        self.assertTrue(row["greedy_output_equal"])
        # Rank 0 decoded its 3 prompts, 2 at a time: 7 decode steps (the
        # first of 8 tokens is the prefill's) for the first two, 7 for the third.
        self.assertEqual(row["plain_decode_steps"], 7 * 2)

    def test_ranks_given_different_arguments_stop_at_once(self):
        # The ranks step in lockstep: one rank's other --block-steps used to
        # hang both until the collectives' timeout. Both refuse the run.
        for rank in spawn_ranks(_bench_rank_with_own_block_steps, world_size=2):
            self.assertEqual(rank["code"], 2)
            self.assertIn("disagree on the bench's arguments", rank["stderr"])

    def test_plot_dir_needs_matplotlib_before_the_run(self):
        err = io.StringIO()
        missing = ImportError("--plot-dir needs matplotlib: pip install")
        with (
            mock.patch.object(bench_one_batch, "run") as run,
            mock.patch.object(
                bench_one_batch.bench_plots, "require_matplotlib", side_effect=missing
            ),
            contextlib.redirect_stderr(err),
            self.assertRaises(SystemExit),
        ):
            bench_one_batch.main(["--plot-dir", "/tmp/x"])
        self.assertIn("needs matplotlib", err.getvalue())
        run.assert_not_called()

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


if __name__ == "__main__":
    unittest.main()

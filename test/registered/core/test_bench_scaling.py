"""bench_scaling: the byte and FLOP model, the router hooks, and real runs."""

import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import unittest
from unittest import mock

import torch

from sglang import bench_plots
from sglang import bench_scaling as bs
from sglang.srt.managers.scheduler import DRAFT_HEALTH_LOGGER
from sglang.srt.models.registry import DEFAULT_MODEL_PATH
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

# A dense model small enough to work out by hand: hidden 8, 2 layers of 2
# heads (head_dim 4), one expert of 16 (a dense FFN), vocab 32, float32.
TINY = {
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 16,
    "vocab_size": 32,
    "torch_dtype": "float32",
    "dspark_target_layer_ids": [0],
    "dspark_block_size": 2,
}
MOE_S = os.path.join(bs.CONFIG_DIR, "family-moe-s.json")


def _main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = bs.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def _write(folder: str, name: str, cfg) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return path


class TestCostModel(CustomTestCase):
    def test_plain_step_by_hand(self):
        spec = bs.spec_from_config(TINY, name="tiny", file="tiny.json")
        cost = bs.step_cost(spec, engine="plain", bs=1, seq_len=10, kernels="fused")
        c = bs.total(cost)
        # Per layer: qkv 8 x 24 + o 8 x 8 + two norms of 8 = 272 weights; the
        # router's 8 and the expert's 3 x 8 x 16 = 384; then the embedding
        # row, the final norm and the 32 x 8 LM head (8 + 8 + 256): 4 bytes each.
        self.assertEqual(c.weights, 4 * (2 * (272 + 8 + 384) + 272))
        # K and V of 10 positions, 2 heads x 4, per layer.
        self.assertEqual(c.kv_read, 4 * 2 * 10 * 16)
        # Per layer 2 x 256 projection + 4 x 10 keys x 8 attention, 2 x 8
        # router, 2 x 384 expert; the head 2 x 8 x 32.
        self.assertEqual(c.flops, 2 * (512 + 320 + 16 + 768) + 512)
        # Per layer: norms, o_proj (3 x 8), qkv 24, rotated q, k 16, attention
        # out 8, the KV write 16; logits and probabilities 8, the expert's
        # rows 2 x 8 + 3 x 16 and its output 8. Head: embedding, norm, logits.
        self.assertEqual(c.activations, 4 * (2 * (88 + 2 + 64 + 8) + 48))
        self.assertEqual(c.bytes, c.weights + c.kv_read + 2 * c.activations)

    def test_the_slice_kernels_cost_more(self):
        # The slice's dense MoE path reads every expert at few rows, and its
        # attention gathers K/V into a copy: never less traffic than fused.
        spec = bs.load_spec(DEFAULT_MODEL_PATH)
        for engine in bs.ENGINES:
            fused, sliced = (
                bs.total(bs.step_cost(spec, engine=engine, bs=1, seq_len=64, kernels=k))
                for k in ("fused", "slice")
            )
            self.assertGreater(sliced.bytes, fused.bytes)
        one_row = bs.step_cost(spec, engine="plain", bs=1, seq_len=64, kernels="slice")
        experts = spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size
        router = spec.num_experts * spec.hidden_size
        self.assertEqual(
            one_row["forward"]["ffn"].weights, 4 * spec.num_layers * (experts + router)
        )

    def test_verify_reads_more_than_plain_at_bs_1(self):
        paths = [DEFAULT_MODEL_PATH] + bs.shipped_configs()
        for spec in map(bs.load_spec, paths):
            # The slice's kernels where it runs the config (with 128 experts
            # its dense path would read them all for one plain row).
            runs = bs.why_not_buildable(spec) is None
            for kernels in ("slice", "fused") if runs else ("fused",):
                with self.subTest(config=spec.name, kernels=kernels):
                    step = {
                        e: bs.step_cost(
                            spec, engine=e, bs=1, seq_len=256, kernels=kernels
                        )
                        for e in bs.ENGINES
                    }
                    verify = bs.total(step["dspark"], ["verify"])
                    self.assertGreater(verify.bytes, bs.total(step["plain"]).bytes)
                    self.assertGreater(verify.flops, bs.total(step["plain"]).flops)

    def test_expected_experts_match_monte_carlo(self):
        gen = torch.Generator().manual_seed(0)
        for experts, top_k, rows in ((8, 2, 1), (8, 2, 6), (8, 2, 20), (128, 8, 6)):
            # Uniform routing: each row's top-k of random scores.
            picks = torch.rand(4000, rows, experts, generator=gen).topk(top_k).indices
            hit = torch.zeros(4000, experts).scatter_(1, picks.flatten(1), 1.0)
            sampled = hit.sum(1).mean().item()
            expected = bs.expected_experts_hit(
                num_experts=experts, top_k=top_k, rows=rows
            )
            with self.subTest(experts=experts, top_k=top_k, rows=rows):
                self.assertAlmostEqual(sampled, expected, delta=0.02 * expected)

    def test_moe_verify_turns_compute_bound_before_plain(self):
        # Given GPU-like figures, a verify has gamma + 1 rows per request, so
        # its FFN leaves the memory-bound regime at a smaller batch.
        machine = bs.Machine(
            bandwidth_gbs=4800,
            peak_tflops=989,
            op_overhead_us=2,
            scalar_us=10,
            source="given",
        )
        spec = bs.load_spec(os.path.join(bs.CONFIG_DIR, "qwen3-30b-a3b.json"))
        plain, verify = (
            bs.ffn_compute_bound_from(spec, engine=e, machine=machine, kernels="fused")
            for e in bs.ENGINES
        )
        self.assertIsNotNone(verify)
        self.assertLess(verify, plain)
        rows = verify * (spec.draft.gamma + 1)
        self.assertLessEqual(abs(rows - plain), spec.draft.gamma + 1)


class TestConfigs(CustomTestCase):
    def test_shipped_configs(self):
        specs = {s.name: s for s in map(bs.load_spec, bs.shipped_configs())}
        for size in ("s", "m", "l"):
            dense, moe = specs[f"family-dense-{size}"], specs[f"family-moe-{size}"]
            self.assertIsNone(bs.why_not_buildable(dense))
            self.assertIsNone(bs.why_not_buildable(moe))
            self.assertEqual((dense.num_experts, dense.top_k), (1, 1))
            self.assertEqual((moe.num_experts, moe.top_k), (8, 2))
        self.assertIn("GQA", bs.why_not_buildable(specs["qwen3-30b-a3b"]))
        reason = bs.why_not_buildable(specs["deepseek-v3"])
        for part in ("first_k_dense_replace=3", "MLA", "shared experts", "bfloat16"):
            self.assertIn(part, reason)
        self.assertEqual(bs.load_spec(DEFAULT_MODEL_PATH).name, "embedded")

    def test_bad_configs_name_the_file_and_field(self):
        cases = (
            ({k: v for k, v in TINY.items() if k != "hidden_size"}, "'hidden_size'"),
            (dict(TINY, num_hidden_layers="two"), "'num_hidden_layers'"),
            (dict(TINY, num_experts=4, num_experts_per_tok=8), "num_experts_per_tok"),
            (dict(TINY, torch_dtype="float64"), "'torch_dtype'"),
            (dict(TINY, dspark_target_layer_ids=[1]), "dspark_target_layer_ids"),
            (dict(TINY, num_key_value_heads=3), "num_key_value_heads"),
            ("{not json", "not valid JSON"),
            ([1, 2], "JSON object"),
        )
        with tempfile.TemporaryDirectory() as d:
            for i, (cfg, says) in enumerate(cases):
                path = _write(d, f"bad{i}.json", cfg if isinstance(cfg, str) else cfg)
                with self.subTest(says=says):
                    rc, _, err = _main(["--config", path, "--quick"])
                    self.assertEqual(rc, 2)
                    self.assertIn(path, err)
                    self.assertIn(says, err)

    def test_bad_arguments(self):
        with tempfile.TemporaryDirectory() as d:
            missing = os.path.join(d, "no-such-folder", "out.json")
            for argv, says in (
                (["--turns", "2"], "--turns"),
                (["--batch-size", "0"], "--batch-size"),
                (["--bandwidth-gbs", "4800"], "go together"),
                (
                    ["--bandwidth-gbs", "nan", "--peak-tflops", "1"]
                    + ["--op-overhead-us", "1"],
                    "finite and > 0",
                ),
                (["--max-measure-mb", "nan"], "--max-measure-mb"),
                # Past 2**64 an overflow from torch, after the machine probes.
                (["--seed", str(10**23)], "--seed must be in [0, 2**63)"),
                (["--json", missing], "does not exist"),
                (["--config", os.path.join(d, "none.json")], "no such config"),
                (["--config", MOE_S, MOE_S], "a second config"),
                (["--config", DEFAULT_MODEL_PATH], "always included"),
            ):
                with self.subTest(argv=argv):
                    rc, _, err = _main(argv)
                    self.assertEqual(rc, 2)
                    self.assertIn(says, err)

    def test_plot_dir_needs_matplotlib(self):
        with mock.patch.dict(sys.modules, {"matplotlib": None}):
            rc, _, err = _main(["--quick", "--plot-dir", tempfile.gettempdir()])
        self.assertEqual(rc, 2)
        self.assertIn("needs matplotlib", err)


class TestSliceRuns(CustomTestCase):
    def test_stand_in_counts_the_same_ops(self):
        # Op counts do not depend on the widths: the embedded pair's exact
        # counts equal its width-8 stand-in's.
        spec = bs.load_spec(DEFAULT_MODEL_PATH)
        real = bs.EnginePair(
            model_path=DEFAULT_MODEL_PATH,
            max_bs=3,
            context_length=128,
            max_total_tokens=3 * 128,
            seed=0,
        )
        with tempfile.TemporaryDirectory() as d:
            small = bs._stand_in_pair(spec, d, max_bs=3, seed=0)
            self.assertEqual(small.engines["plain"].worker.model.config.hidden_size, 8)
            self.assertEqual(
                bs.count_ops(real, [1, 3], seed=0), bs.count_ops(small, [1, 3], seed=0)
            )

    def test_random_drafts_raise_no_warning(self):
        # The bench's drafts are random weights on purpose: the engines'
        # "draft almost never accepted" advice is not for its user. 8 x 33
        # request-steps fill the scheduler's health window.
        spec = bs.load_spec(DEFAULT_MODEL_PATH)
        with tempfile.TemporaryDirectory() as d:
            pair = bs._stand_in_pair(spec, d, max_bs=8, seed=0)
            with self.assertLogs("sglang.srt.managers", "WARNING") as logs:
                bs.time_steps(pair, bs=8, steps=32, seed=0)
            self.assertIn("almost never accepted", "".join(logs.output))
            pair.engines["dspark"].flush_cache()  # it warns once an engine
            with (
                self.assertNoLogs("sglang.srt.managers", "WARNING"),
                bs._random_drafts_expected(),
            ):
                bs.time_steps(pair, bs=8, steps=32, seed=0)
        self.assertEqual(logging.getLogger(DRAFT_HEALTH_LOGGER).level, logging.NOTSET)

    def test_measured_experts_on_the_embedded_pair(self):
        need = bs.kv_need(context=16, steps=3 * 2 + 4, gamma=5)
        pair = bs.EnginePair(
            model_path=DEFAULT_MODEL_PATH,
            max_bs=2,
            context_length=need,
            max_total_tokens=2 * need,
            seed=0,
        )
        point = bs.measure_point(pair, bs=2, context=16, turns=3, block_steps=2, seed=0)
        spec, hits = bs.load_spec(DEFAULT_MODEL_PATH), point["hits"]
        g, d = spec.draft.gamma, spec.draft
        # At least one row's top-k, at most every expert or every row's pick.
        for part, rows, experts, top_k in (
            ("forward", 2, spec.num_experts, spec.top_k),
            ("verify", 2 * (g + 1), spec.num_experts, spec.top_k),
            ("draft", 2 * g, d.num_experts, d.top_k),
        ):
            with self.subTest(part=part):
                self.assertGreaterEqual(hits[part], top_k)
                self.assertLessEqual(hits[part], min(experts, rows * top_k))
        # The trained pair's verify rows hit fewer experts than uniform routing.
        uniform = bs.expected_experts_hit(
            num_experts=spec.num_experts, top_k=spec.top_k, rows=2 * (g + 1)
        )
        self.assertLess(hits["verify"], uniform)
        for name, engine in pair.engines.items():
            for model in bs._router_parts(name, engine).values():
                for layer in model.layers:
                    self.assertFalse(layer.mlp.gate._forward_hooks)
        for name in bs.ENGINES:
            blocks = point["blocks"][name]
            self.assertEqual(len(blocks), 3)
            for seconds, seq in blocks:
                self.assertGreater(seconds, 0)
                self.assertGreater(seq, 16)
        self.assertGreaterEqual(point["accept_length"], 1.0)
        self.assertLessEqual(point["accept_length"], g + 1)


class TestRun(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.dir = tempfile.TemporaryDirectory()
        # An MoE config the slice cannot build (GQA, bfloat16): projection only.
        with open(MOE_S) as f:
            gqa = dict(json.load(f), num_key_value_heads=2, torch_dtype="bfloat16")
        gqa_path = _write(cls.dir.name, "moe-gqa.json", gqa)
        cls.path = os.path.join(cls.dir.name, "out.json")
        cls.rc, cls.text, _ = _main(
            ["--config", MOE_S, gqa_path, "--batch-size", "1", "2"]
            + ["--context", "8", "--turns", "3", "--block-steps", "1"]
            + ["--json", cls.path]
        )
        with open(cls.path) as f:
            cls.result = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()
        super().tearDownClass()

    def test_json_rows(self):
        self.assertEqual(self.rc, 0)
        rows = self.result["rows"]
        names = [c["name"] for c in self.result["configs"]]
        # The embedded pair first, then by weight bytes (bfloat16 halves them).
        self.assertEqual(names, ["embedded", "moe-gqa", "family-moe-s"])
        self.assertEqual(len(rows), 3 * 2 * 2)  # configs x batch sizes x engines
        for r in rows:
            with self.subTest(
                config=r["config"], engine=r["engine"], bs=r["batch_size"]
            ):
                b = r["bytes"]
                self.assertGreater(b["weights"], 0)
                self.assertGreater(b["kv_read"], 0)
                self.assertAlmostEqual(
                    b["total"],
                    b["weights"] + b["kv_read"] + 2 * b["activations_written"],
                )
                self.assertGreater(r["flops"], 0)
                self.assertGreater(r["ops"], 100)
                self.assertGreater(r["projected_ms"], 0)
                if r["config"] == "moe-gqa":
                    self.assertIsNone(r["measured_ms"])
                    self.assertIsNone(r["ratio"])
                    self.assertIn("GQA", r["not_measured"])
                    self.assertEqual(r["kernels"], "fused")
                    continue
                self.assertEqual(r["kernels"], "slice")
                self.assertGreater(r["measured_ms"], 0)
                # A ratio of means over the same blocks.
                self.assertAlmostEqual(
                    r["ratio"], r["projected_ms"] / r["measured_ms"], places=9
                )
                lo, hi = r["ratio_ci95"]
                self.assertLess(lo, r["ratio"])
                self.assertLess(r["ratio"], hi)
                for hit in r["experts_hit"].values():
                    self.assertIsNotNone(hit["measured"])
        by = {(r["config"], r["engine"], r["batch_size"]): r for r in rows}
        for name in names:
            plain, spec = by[(name, "plain", 1)], by[(name, "dspark", 1)]
            self.assertGreater(
                spec["parts"]["verify"]["bytes"], plain["bytes"]["total"]
            )
            self.assertGreater(spec["scalar_pct_projected"], 0)
            self.assertIsNone(plain["scalar_pct_projected"])
        m = self.result["machine"]
        for key in ("bandwidth_gbs", "peak_tflops", "op_overhead_us", "scalar_us"):
            self.assertGreater(m[key], 0)
        self.assertEqual(m["source"], "measured here")
        self.assertIn("proj/meas", self.text)
        self.assertIn("DSpark speedup over plain", self.text)

    def test_speedup_by_accepted_length(self):
        entries = self.result["speedup"]
        self.assertEqual(len(entries), 3 * 2)
        for s in entries:
            taus = sorted(s["projected"], key=int)
            self.assertEqual(taus, [str(t) for t in range(1, 7)])  # gamma 5
            self.assertLess(s["projected"]["1"], 1.0)  # no accepted draft: a loss
            if s["config"] != "moe-gqa":
                self.assertGreaterEqual(s["measured_accept_length"], 1.0)
                self.assertGreater(s["measured"], 0)

    def test_plots(self):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("matplotlib is not installed (pip install -e '.[plot]')")
        with tempfile.TemporaryDirectory() as d:
            paths = bench_plots.scaling_plots(self.result, d)
            self.assertEqual(len(paths), 3)
            for path in paths:
                with open(path, "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_given_hardware_is_projection_only(self):
        rc, text, _ = _main(
            ["--config", MOE_S, "--batch-size", "1", "--context", "64"]
            + ["--bandwidth-gbs", "4800", "--peak-tflops", "989"]
            + ["--op-overhead-us", "2", "--json", self.path + ".gpu"]
        )
        self.assertEqual(rc, 0)
        with open(self.path + ".gpu") as f:
            result = json.load(f)
        self.assertEqual(result["machine"]["scalar_us"], bs.GPU_SCALAR_US)
        for r in result["rows"]:
            self.assertIsNone(r["measured_ms"])
            self.assertEqual(r["kernels"], "fused")
        self.assertIn("given", text)


if __name__ == "__main__":
    unittest.main()

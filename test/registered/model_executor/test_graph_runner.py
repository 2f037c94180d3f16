"""GraphRunner pads a batch to its bucket with dummy rows that touch only the
scratch KV slot; ModelRunner uses it when the batch fits, eagerly otherwise.
Runs the real tiny MoE target over real KV pools with prefilled requests."""

import unittest
from typing import List, Sequence
from unittest import mock

import torch

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.mem_cache.memory_pool import (
    DUMMY_REQ_INDEX,
    SCRATCH_SLOT,
    KVPool,
    ReqToTokenPool,
    TokenSlotAllocator,
)
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.graph_runner import GraphRunner
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.registry import load_target
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase, expert_groups

register_cpu_ci(est_time=8, suite="base-a-test-cpu")
register_cuda_ci(est_time=20, stage="base-b", runner_config="1-gpu-large")

BUCKETS = [1, 2, 4, 8]
NUM_REQS = 10  # enough for a batch past the largest bucket
WINDOW = 3  # verify rows per request in these tests
EXTRA = WINDOW + 1  # slots per request past its prompt
CAPTURED_LAYERS = (0, 2)
TOL = dict(rtol=1e-5, atol=1e-5)


class _World:
    """The tiny target, its pools, and NUM_REQS prefilled requests."""

    def __init__(self, device):
        self.device = device
        self.model = load_target("random-tiny-moe", seed=0, device=device)
        self.model.set_layers_to_capture(CAPTURED_LAYERS)
        cfg = self.model.config
        self.prompt_lens = [4 + i for i in range(NUM_REQS)]
        total = sum(self.prompt_lens) + NUM_REQS * EXTRA
        self.req_pool = ReqToTokenPool(
            max_reqs=NUM_REQS, max_context_len=32, device=device
        )
        self.kv_pool = KVPool(
            num_layers=cfg.num_layers,
            num_slots=total,
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            dtype=torch.float32,
            device=device,
        )
        slots = TokenSlotAllocator(total)
        gen = torch.Generator().manual_seed(1)
        self.rows: List[int] = []
        for n in self.prompt_lens:
            row = self.req_pool.alloc()
            self.req_pool.req_to_token[row, : n + EXTRA] = torch.tensor(
                slots.alloc(n + EXTRA)
            )
            self.rows.append(row)
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
            self._prefill(row, prompt.to(device))
        self.vocab = cfg.vocab_size

    def _prefill(self, row: int, prompt: torch.Tensor) -> None:
        n = prompt.shape[0]
        positions = torch.arange(n, device=self.device)
        self.model(
            self._batch(
                ForwardMode.EXTEND,
                [row],
                n,
                prompt,
                positions,
                capture=CaptureHiddenMode.NULL,
            )
        )

    def _batch(self, mode, rows, q, input_ids, positions, *, capture, scalar=None):
        # positions: [bs * q] request-major; causal inside the rows of a request
        req_rows = torch.tensor(rows, device=self.device)
        out_cache_loc = self.req_pool.req_to_token[
            req_rows.repeat_interleave(q), positions
        ]
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            tokens_per_req=q,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_rows,
            kv_lens=positions + 1,
            num_token_non_padded=scalar,
            num_token_non_padded_cpu=len(rows) * q,
            capture_hidden_mode=capture,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
        )

    def step_batch(
        self,
        reqs: Sequence[int],
        q: int,
        *,
        seed: int = 0,
        scalar=None,
        capture=CaptureHiddenMode.NULL,
    ) -> ForwardBatch:
        """DECODE (q == 1) or TARGET_VERIFY rows right after each prompt."""
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.vocab, (len(reqs) * q,), generator=gen)
        start = torch.tensor([self.prompt_lens[i] for i in reqs])
        positions = (start.unsqueeze(1) + torch.arange(q)).view(-1)
        mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
        return self._batch(
            mode,
            [self.rows[i] for i in reqs],
            q,
            ids.to(self.device),
            positions.to(self.device),
            capture=capture,
            scalar=scalar,
        )

    def runner(self, q, *, capture=CaptureHiddenMode.NULL, use_cuda_graph=False):
        return GraphRunner(
            forward=self.model.forward,
            forward_mode=ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY,
            tokens_per_req=q,
            bucket_sizes=BUCKETS,
            capture_hidden_mode=capture,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            device=self.device,
            use_cuda_graph=use_cuda_graph,
        )

    def model_runner(self, *, bucket_sizes=BUCKETS, use_cuda_graph=False):
        return ModelRunner(
            forward=self.model.forward,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            device=self.device,
            bucket_sizes=bucket_sizes,
            use_cuda_graph=use_cuda_graph,
        )

    def kv(self):
        return self.kv_pool.k.clone(), self.kv_pool.v.clone()

    def restore(self, kv) -> None:
        self.kv_pool.k.copy_(kv[0])
        self.kv_pool.v.copy_(kv[1])


def _clone(out):
    aux = None if out.aux_hidden_states is None else out.aux_hidden_states.clone()
    return out.logits.clone(), aux


def _count_expert_pairs(fn):
    """Run fn(); return its result and the (row, expert) pairs that reached
    an expert: each local expert's rows in grouped calls (not the zero
    expert's) plus nonzero routing weights of dense forwards (a zero weight
    adds exactly 0)."""
    pairs, grouped, routing = [], EPMoE._experts_grouped, EPMoE._routing_weights

    def spy_grouped(module, xs, offs):
        pairs.append(sum(x.shape[0] for _, x in expert_groups(xs, offs)))
        return grouped(module, xs, offs)

    def spy_routing(module, topk, *, masked):
        weights = routing(module, topk, masked=masked)
        pairs.append(int((weights != 0).sum()))
        return weights

    with (
        mock.patch.object(EPMoE, "_experts_grouped", spy_grouped),
        mock.patch.object(EPMoE, "_routing_weights", spy_routing),
    ):
        result = fn()
    return result, sum(pairs)


class _RunnerChecks:
    """Checks shared by the eager-padding (CPU) and CUDA-graph runners."""

    device = "cpu"
    use_cuda_graph = False
    tol = TOL

    def setUp(self):
        super().setUp()
        self.world = _World(self.device)

    def _runner(self, q, capture=CaptureHiddenMode.NULL):
        return self.world.runner(q, capture=capture, use_cuda_graph=self.use_cuda_graph)

    def _padded_vs_eager(self, runner, batch):
        """Padded run, then eager run from the same KV; returns both states."""
        w = self.world
        before = w.kv()
        padded = _clone(runner.run(batch))
        after_padded = w.kv()
        w.restore(before)
        eager = _clone(w.model(batch))
        after_eager = w.kv()
        return before, padded, after_padded, eager, after_eager

    def _check_case(self, q, capture):
        w = self.world
        runner = self._runner(q, capture)
        batch = w.step_batch([0, 3, 5], q, capture=capture)
        # A sentinel in scratch, so the dummy row's write there shows, and in
        # the rows' own slots (written before they are read), so their writes
        # show even where an earlier case wrote the same values.
        w.kv_pool.k[:, SCRATCH_SLOT] = 7.0
        w.kv_pool.v[:, SCRATCH_SLOT] = 7.0
        w.kv_pool.k[:, batch.out_cache_loc] = -7.0
        w.kv_pool.v[:, batch.out_cache_loc] = -7.0
        before, padded, after_padded, eager, after_eager = self._padded_vs_eager(
            runner, batch
        )
        # (a) real rows: the padded bucket gives the eager logits.
        self.assertEqual(tuple(padded[0].shape), (3 * q, w.vocab))
        torch.testing.assert_close(padded[0], eager[0], **self.tol)
        self.assertTrue(torch.equal(padded[0].argmax(-1), eager[0].argmax(-1)))
        if capture != CaptureHiddenMode.NULL:
            rows = 3 if capture == CaptureHiddenMode.LAST else 3 * q
            width = len(CAPTURED_LAYERS) * w.model.config.hidden_size
            self.assertEqual(tuple(padded[1].shape), (rows, width))
            torch.testing.assert_close(padded[1], eager[1], **self.tol)
        # (b) dummy rows write only the scratch slot.
        live = torch.ones(before[0].shape[1], dtype=torch.bool, device=w.device)
        live[SCRATCH_SLOT] = False
        live[batch.out_cache_loc] = False
        for name, b, p, e in zip("kv", before, after_padded, after_eager):
            with self.subTest(pool=name):
                self.assertTrue(torch.equal(p[:, live], b[:, live]))
                self.assertTrue(torch.equal(e[:, live], b[:, live]))
                loc = batch.out_cache_loc
                torch.testing.assert_close(p[:, loc], e[:, loc], **self.tol)
                # The real rows did write their slots; the dummy row wrote scratch.
                self.assertFalse(torch.equal(p[:, loc], b[:, loc]))
                self.assertFalse(torch.equal(p[:, SCRATCH_SLOT], b[:, SCRATCH_SLOT]))
                self.assertTrue(torch.equal(e[:, SCRATCH_SLOT], b[:, SCRATCH_SLOT]))

    def test_decode_padded_matches_eager(self):
        self._check_case(1, CaptureHiddenMode.NULL)

    def test_verify_padded_matches_eager(self):
        self._check_case(WINDOW, CaptureHiddenMode.NULL)

    def test_verify_hidden_capture_full_and_last(self):
        for capture in (CaptureHiddenMode.FULL, CaptureHiddenMode.LAST):
            with self.subTest(capture=capture.name):
                self._check_case(WINDOW, capture)

    def test_scalar_reaches_the_static_buffer(self):
        w = self.world
        for q in (1, WINDOW):
            with self.subTest(tokens_per_req=q):
                runner = self._runner(q)
                kv = w.kv()
                base = _clone(runner.run(w.step_batch([1, 2, 4], q)))
                w.restore(kv)
                address = runner.num_token_non_padded.data_ptr()
                scalar = torch.tensor(3 * q, dtype=torch.int32, device=w.device)
                out = _clone(runner.run(w.step_batch([1, 2, 4], q, scalar=scalar)))
                self.assertEqual(runner.num_token_non_padded.item(), 3 * q)
                self.assertEqual(runner.num_token_non_padded.data_ptr(), address)
                self.assertIn((4, True), runner._batches)
                self.assertIs(
                    runner._batches[(4, True)].num_token_non_padded,
                    runner.num_token_non_padded,
                )
                self.assertIsNone(runner._batches[(4, False)].num_token_non_padded)
                torch.testing.assert_close(out[0], base[0], **self.tol)
                self.assertTrue(torch.equal(out[0].argmax(-1), base[0].argmax(-1)))
                # A new value lands in the same buffer (5 requests pad to 8).
                w.restore(kv)
                runner.run(
                    w.step_batch(
                        [0, 1, 2, 3, 4],
                        q,
                        scalar=torch.tensor(5 * q, dtype=torch.int32, device=w.device),
                    )
                )
                self.assertEqual(runner.num_token_non_padded.item(), 5 * q)
                self.assertEqual(runner.num_token_non_padded.data_ptr(), address)

    def test_bucket_selection(self):
        w = self.world
        runner = self._runner(1)
        kv = w.kv()
        seen = set(runner._batches)
        for bs, bucket in ((1, 1), (2, 2), (3, 4), (5, 8), (4, 4), (8, 8)):
            with self.subTest(bs=bs):
                batch = w.step_batch(list(range(bs)), 1, seed=bs)
                w.restore(kv)
                with mock.patch.object(
                    runner, "forward", wraps=runner.forward
                ) as forward:
                    logits = runner.run(batch).logits.clone()
                self.assertEqual(tuple(logits.shape), (bs, w.vocab))
                if self.use_cuda_graph or bs != bucket:
                    # Padded into the bucket's static batch (or its graph).
                    self.assertIn((bucket, False), runner._batches)
                    self.assertEqual(
                        runner._batches[(bucket, False)].batch_size, bucket
                    )
                    seen.add((bucket, False))
                else:
                    # Eager with nothing to pad: the batch runs as given.
                    forward.assert_called_once_with(batch)
                self.assertEqual(set(runner._batches), seen)
                w.restore(kv)
                torch.testing.assert_close(logits, w.model(batch).logits, **self.tol)

    def test_oversized_batch(self):
        w = self.world
        runner = self._runner(1)
        batch = w.step_batch(list(range(9)), 1)
        self.assertFalse(runner.can_run(batch))
        with self.assertRaisesRegex(ValueError, r"bs=9.*max bs=8"):
            runner.run(batch)

    def test_can_run_checks_shape_and_mode(self):
        w = self.world
        decode = self._runner(1)
        self.assertTrue(decode.can_run(w.step_batch([0, 1], 1)))
        self.assertFalse(decode.can_run(w.step_batch([0, 1], WINDOW)))
        self.assertFalse(
            decode.can_run(w.step_batch([0, 1], 1, capture=CaptureHiddenMode.FULL))
        )
        with self.assertRaisesRegex(ValueError, "tokens_per_req=3"):
            decode.run(w.step_batch([0], WINDOW))

    def test_model_runner_picks_runner_or_eager(self):
        w = self.world
        model_runner = w.model_runner(use_cuda_graph=self.use_cuda_graph)
        runner = model_runner.add_graph_runner(
            forward_mode=ForwardMode.DECODE, tokens_per_req=1
        )
        self.assertEqual(model_runner.graph_runners, [runner])
        kv = w.kv()
        cases = (
            ([0, 1, 2], 1, 1),  # fits: padded to 4
            (list(range(9)), 1, 0),  # past the largest bucket: eager
            ([0, 1], WINDOW, 0),  # no verify runner: eager
        )
        for reqs, q, runs in cases:
            with self.subTest(bs=len(reqs), tokens_per_req=q):
                batch = w.step_batch(reqs, q)
                batch.req_to_token_pool = batch.token_to_kv_pool = None
                w.restore(kv)
                with mock.patch.object(runner, "run", wraps=runner.run) as run:
                    out = _clone(model_runner.forward(batch))
                self.assertEqual(run.call_count, runs)
                self.assertIs(batch.token_to_kv_pool, w.kv_pool)
                self.assertEqual(tuple(out[0].shape), (len(reqs) * q, w.vocab))
                w.restore(kv)
                torch.testing.assert_close(out[0], w.model(batch).logits, **self.tol)


class TestGraphRunnerCPU(_RunnerChecks, CustomTestCase):
    def test_runs_as_given(self):
        # Whether ModelRunner hands this very batch to the model: eagerly an
        # exact bucket fit or no fitting runner; never a padded batch, and
        # never under CUDA graphs (a replay reads the static buffers).
        w = self.world
        model_runner = w.model_runner()
        runner = model_runner.add_graph_runner(
            forward_mode=ForwardMode.DECODE, tokens_per_req=1
        )
        cases = (
            ([0, 1], 1, True),  # fills bucket 2
            ([0, 1, 2], 1, False),  # padded to 4
            (list(range(9)), 1, True),  # past the largest bucket: eager
            ([0, 1, 2], WINDOW, True),  # no runner for it: eager
        )
        for graphs in (False, True):
            runner.use_cuda_graph = graphs  # the flag alone: nothing runs
            for reqs, q, eager in cases:
                with self.subTest(graphs=graphs, bs=len(reqs), tokens_per_req=q):
                    fits = q == 1 and len(reqs) <= 8
                    expected = eager and not (graphs and fits)
                    batch = w.step_batch(reqs, q)
                    self.assertEqual(model_runner.runs_as_given(batch), expected)

    def test_no_buckets_runs_every_batch_as_given(self):
        # The CPU default (ServerArgs leaves cuda_graph_bs None without
        # graphs): no runner, so a bs-3 batch reaches the model as 3 requests.
        w = self.world
        model_runner = w.model_runner(bucket_sizes=None)
        self.assertIsNone(
            model_runner.add_graph_runner(
                forward_mode=ForwardMode.DECODE, tokens_per_req=1
            )
        )
        self.assertEqual(model_runner.graph_runners, [])
        seen = []
        model_runner.forward_fn = lambda fb: seen.append(fb.batch_size) or "out"
        batch = w.step_batch([0, 1, 2], 1)
        self.assertEqual(model_runner.forward(batch), "out")
        self.assertEqual(seen, [3])
        with self.assertRaisesRegex(ValueError, "CUDA graphs need bucket sizes"):
            w.model_runner(bucket_sizes=None, use_cuda_graph=True)

    def test_bad_buckets(self):
        for buckets in ([], [0, 2], [-1]):
            with self.subTest(buckets=buckets):
                with self.assertRaisesRegex(ValueError, "bucket sizes"):
                    GraphRunner(
                        forward=self.world.model.forward,
                        forward_mode=ForwardMode.DECODE,
                        tokens_per_req=1,
                        bucket_sizes=buckets,
                        capture_hidden_mode=CaptureHiddenMode.NULL,
                        req_to_token_pool=self.world.req_pool,
                        token_to_kv_pool=self.world.kv_pool,
                        device="cpu",
                        use_cuda_graph=False,
                    )

    def test_static_buffers_sized_by_largest_bucket(self):
        runner = self._runner(WINDOW)
        self.assertEqual(runner.max_bs, 8)
        self.assertEqual(runner.input_ids.shape[0], 8 * WINDOW)
        self.assertEqual(runner.req_pool_indices.shape[0], 8)
        self.assertEqual(runner._batches, {})  # no CUDA graphs: built on demand
        runner.run(self.world.step_batch([0, 1, 2], WINDOW))
        # After a bs=3 run the padding rows point at the dummy request.
        self.assertEqual(runner.req_pool_indices[3:4].tolist(), [DUMMY_REQ_INDEX])
        self.assertEqual(
            runner.out_cache_loc[3 * WINDOW : 4 * WINDOW].tolist(),
            [SCRATCH_SLOT] * WINDOW,
        )

    def test_scalar_masks_padding_in_the_moe(self):
        # The scalar from the batch reaches the MoE: dummy rows reach no expert.
        w = self.world
        layers, top_k = w.model.config.num_layers, w.model.config.top_k
        for q in (1, WINDOW):
            with self.subTest(tokens_per_req=q):
                runner = self._runner(q)
                scalar = torch.tensor(3 * q, dtype=torch.int32)
                _, plain = _count_expert_pairs(
                    lambda: runner.run(w.step_batch([0, 1, 2], q))
                )
                _, masked = _count_expert_pairs(
                    lambda: runner.run(w.step_batch([0, 1, 2], q, scalar=scalar))
                )
                self.assertEqual(plain, layers * top_k * 4 * q)
                self.assertEqual(masked, layers * top_k * 3 * q)


@unittest.skipUnless(torch.cuda.is_available(), "CUDA graphs need a CUDA device")
class TestGraphRunnerCUDA(_RunnerChecks, CustomTestCase):
    device = "cuda"
    use_cuda_graph = True
    tol = dict(rtol=1e-4, atol=1e-4)

    def test_graphs_captured_up_front(self):
        runner = self._runner(1)
        self.assertEqual(set(runner._graphs), {(b, False) for b in BUCKETS})

    def test_replay_reads_new_inputs(self):
        w = self.world
        runner = self._runner(WINDOW)
        kv = w.kv()
        for seed in (1, 2, 3):
            batch = w.step_batch([2, 6], WINDOW, seed=seed)
            w.restore(kv)
            logits = runner.run(batch).logits.clone()
            w.restore(kv)
            torch.testing.assert_close(logits, w.model(batch).logits, **self.tol)


if __name__ == "__main__":
    unittest.main()

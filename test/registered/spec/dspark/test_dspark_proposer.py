"""DraftBlockProposer: block layout, shapes, num_token_non_padded at its call
site, the Markov head (tabulated for small vocabularies, low-rank above), and
each slot's processed logits (min_new_tokens by its output position,
penalties counting the drafts before it).

The proposer is driven as the worker drives it in a step's draft phase:
prepare (bind, pad, scalars, noise), the window, then propose."""

import unittest
from unittest import mock

import torch

from sglang import Engine
from sglang.srt.managers.schedule_batch import Req, SamplingParams, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models import dspark
from sglang.srt.models.registry import load_draft, load_target
from sglang.srt.runtime_context import get_parallel
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")
register_cuda_ci(est_time=20, stage="base-b", runner_config="1-gpu-large")

PREDICATE = (
    "sglang.srt.speculative.dspark_components.dspark_draft.enable_num_token_non_padded"
)


class TestDraftBlockProposer(CustomTestCase):
    device = "cpu"

    def setUp(self):
        super().setUp()
        # bs=3 pads to the 4 bucket, so padded rows exist in every draft run.
        self.engine = Engine(
            speculative_algorithm="DSPARK",
            device=self.device,
            random_seed=0,
            max_running_requests=8,
            cuda_graph_bs=[1, 2, 4, 8],
            speculative_verify_budget="off",
        )
        self.worker = self.engine.worker
        self.proposer = self.worker.proposer
        self.gamma = self.engine.dspark_config.gamma
        self.mask_id = self.engine.dspark_config.mask_token_id
        self.seen = []  # the draft ForwardBatches the proposer built
        runner = self.proposer.draft_model_runner
        original = runner.forward

        self.base_logits = []  # what the draft forward returned

        def spy(forward_batch):
            self.seen.append(forward_batch)
            out = original(forward_batch)
            self.base_logits.append(out.logits.clone())
            return out

        runner.forward = spy

    def _propose(self, batch, seed=None):
        """The draft phase of a step: (the views it ran on, the proposal)."""
        worker, mode = self.worker, batch.sampling_mode
        if seed is not None:
            worker.generator.manual_seed(seed)
        rows, _ = worker._prepare(batch, mode)
        views = worker.buffers.at(rows)
        worker._fill_window(views, max(batch.seq_lens_cpu) + self.gamma, plain=False)
        return views, self.proposer.propose(views=views, mode=mode)

    def test_block_layout_and_shapes(self):
        batch = self._make_batch()
        views, proposal = self._propose(batch)
        window = views.window
        bs, gamma = batch.batch_size, self.gamma
        rows = views.state.seq_lens.shape[0]  # padded to the bucket
        self.assertEqual(rows, 4)
        self.assertEqual(proposal.draft_tokens.shape, (rows, gamma))
        self.assertEqual(proposal.block_ids.shape, (rows, gamma))
        anchors = proposal.block_ids[:bs, 0].tolist()
        self.assertEqual(anchors, batch.last_ids.tolist())
        self.assertTrue(bool((proposal.block_ids[:, 1:] == self.mask_id).all()))
        self.assertIsNone(proposal.draft_probs)  # all greedy
        # The drafts are the verify batch's, written in place.
        self.assertEqual(proposal.draft_tokens.data_ptr(), views.drafts.data_ptr())
        fb = self.seen[-1]
        self.assertEqual(fb.forward_mode, ForwardMode.DRAFT_EXTEND_V2)
        self.assertEqual(fb.tokens_per_req, gamma)
        seq = batch.seq_lens.tolist()
        for b in range(bs):
            rows = slice(b * gamma, (b + 1) * gamma)
            self.assertEqual(
                fb.positions[rows].tolist(), list(range(seq[b] - 1, seq[b] - 1 + gamma))
            )
            # Non-causal: every block row sees the context and the whole block.
            self.assertEqual(fb.kv_lens[rows].tolist(), [seq[b] - 1 + gamma] * gamma)
            self.assertEqual(
                fb.out_cache_loc[rows].tolist(),
                window.out_cache_loc[b, :gamma].tolist(),
            )
        self.assertTrue(bool((proposal.draft_tokens >= 0).all()))
        self.assertTrue(bool((proposal.draft_tokens < self.engine.vocab_size).all()))

    def test_sampling_keeps_corrected_logits(self):
        batch = self._make_batch(temperatures=(0.0, 0.7, 1.0))
        views, proposal = self._propose(batch)
        logits = views.corrected.transpose(0, 1)[:3]  # [bs, gamma, V]
        self.assertEqual(logits.shape, (3, self.gamma, self.engine.vocab_size))
        # Greedy row: each draft token is the argmax of its corrected logits.
        self.assertEqual(
            proposal.draft_tokens[0].tolist(), logits[0].argmax(-1).tolist()
        )
        # Corrected = the draft forward's logits + W2(W1[previous token]),
        # the previous token being the anchor for slot 0.
        draft = self.engine.worker.draft_model
        base = self.base_logits[-1].view(4, self.gamma, -1)
        prev = torch.cat(
            [batch.last_ids.unsqueeze(1), proposal.draft_tokens[:3, :-1]], 1
        )
        for b in range(3):
            expected = base[b] + draft.markov_correction(prev[b])
            torch.testing.assert_close(logits[b], expected, rtol=1e-5, atol=1e-5)
        self.assertGreater(float(draft.markov_correction(prev[0]).abs().max()), 0.1)

    def test_sampled_draft_tokens_follow_q(self):
        # q = softmax(corrected logits / T) for sampled rows; the Gumbel-max
        # draws follow it (slot 0's q depends on the context only, so it is
        # the same in every draw; 5 sigma of a frequency over N draws).
        n = 2000
        for temps in ((0.0, 0.7, 1.0), (1.3, 0.7, 1.0)):
            batch = self._make_batch(temperatures=temps)
            counts = torch.zeros(3, self.engine.vocab_size, dtype=torch.float64)
            for seed in range(n):
                views, proposal = self._propose(batch, seed=seed)
                first = proposal.draft_tokens[:3, 0].cpu()
                counts[torch.arange(3), first] += 1
            q = proposal.draft_probs[0, :3].double().cpu()  # slot 0: [bs, V]
            # Some sampled row is a real draw, not a near-certain token.
            sampled = [b for b, t in enumerate(temps) if t > 0]
            self.assertLess(min(q[b].max().item() for b in sampled), 0.9)
            for b, t in enumerate(temps):
                with self.subTest(temperatures=temps, row=b):
                    logits = views.corrected[:, b].double().cpu()  # [gamma, V]
                    if t == 0:
                        self.assertEqual(counts[b].max().item(), n)  # argmax
                        continue
                    want = torch.softmax(logits / t, dim=-1)
                    torch.testing.assert_close(
                        proposal.draft_probs[:, b].double().cpu(),
                        want,
                        rtol=1e-4,
                        atol=1e-6,
                    )
                    tol = 5 * 0.5 / n**0.5
                    self.assertLess((counts[b] / n - q[b]).abs().max().item(), tol)

    def test_scalar_none_on_ep1_int32_on_ep_gt1_tokens_identical(self):
        batch = self._make_batch()
        bs = batch.batch_size
        _, off = self._propose(batch)
        tokens_off = off.draft_tokens[:bs].clone()  # the real rows
        self.assertIsNone(self.seen[-1].num_token_non_padded)
        self.assertEqual(self.seen[-1].num_token_non_padded_cpu, bs * self.gamma)

        # EP size 2 set explicitly: the predicate turns on at the call site
        # (the buffers bound at EP 1 stay; the scalar is set per step).
        with get_parallel().override(moe_ep_size=2, moe_ep_rank=0):
            _, on = self._propose(batch)
        scalar = self.seen[-1].num_token_non_padded
        self.assertEqual(scalar.dtype, torch.int32)
        self.assertEqual(scalar.device.type, torch.device(self.device).type)
        self.assertEqual(int(scalar), bs * self.gamma)
        self.assertEqual(self.seen[-1].num_token_non_padded_cpu, bs * self.gamma)
        # The scalar masks only padded rows: real rows' arithmetic is unchanged.
        self.assertEqual(on.draft_tokens[:bs].tolist(), tokens_off.tolist())

        with mock.patch(PREDICATE, return_value=True):
            _, patched = self._propose(batch)
        self.assertEqual(int(self.seen[-1].num_token_non_padded), bs * self.gamma)
        self.assertEqual(patched.draft_tokens[:bs].tolist(), tokens_off.tolist())

    def test_markov_table_is_the_low_rank_head(self):
        draft = self.worker.draft_model
        vocab = self.engine.vocab_size
        self.assertLessEqual(vocab, dspark.MARKOV_TABLE_MAX_VOCAB)
        table = draft.markov_table()
        self.assertEqual(tuple(table.shape), (vocab, vocab))
        self.assertIs(draft.markov_table(), table)  # made once, not per call
        ids = torch.arange(vocab, device=table.device)
        with torch.no_grad():
            low_rank = draft.markov_w2(draft.markov_w1(ids))  # [V, V]
        torch.testing.assert_close(table, low_rank, rtol=1e-5, atol=1e-6)
        self.assertGreater(float(table.abs().max()), 0.1)
        prev = torch.tensor([[3, 7], [7, 250]], device=table.device)
        self.assertTrue(torch.equal(draft.markov_correction(prev), table[prev]))
        # New weights (a copy_ into the same storage) make a new table.
        with torch.no_grad():
            draft.markov_w2.weight.mul_(2)
        torch.testing.assert_close(draft.markov_table(), 2 * table)

    def test_markov_table_follows_a_dtype_round_trip(self):
        # .to() and back gives the head's weights new storage (rounded
        # through bfloat16), possibly at the old address: a new table.
        target = load_target("random-tiny-moe", seed=5, device="cpu")
        draft = load_draft("random-tiny-moe", target=target, seed=5, device="cpu")
        ids = torch.arange(draft.markov_w1.weight.shape[0])
        for _ in range(6):
            draft.markov_table()  # made from the current weights
            for head in (draft.markov_w1, draft.markov_w2):
                head.to(torch.bfloat16).to(torch.float32)
            with torch.no_grad():
                low_rank = draft.markov_w2(draft.markov_w1(ids))
            torch.testing.assert_close(draft.markov_table(), low_rank)

    def test_large_vocab_keeps_the_low_rank_path(self):
        batch = self._make_batch(temperatures=(0.0, 0.7, 0.0))
        views, tabulated = self._propose(batch, seed=3)
        tokens = tabulated.draft_tokens[:3].clone()
        logits = views.corrected.transpose(0, 1)[:3].clone()
        draft = self.worker.draft_model
        prev = torch.cat([batch.last_ids.unsqueeze(1), tokens[:, :-1]], 1)
        with mock.patch.object(dspark, "MARKOV_TABLE_MAX_VOCAB", 255):
            self.assertIsNone(draft.markov_table())
            with torch.no_grad():
                expected = draft.markov_w2(draft.markov_w1(prev))
            self.assertTrue(torch.equal(draft.markov_correction(prev), expected))
            views, low_rank = self._propose(batch, seed=3)
        # The same head, rounded differently: the same draft tokens.
        self.assertEqual(low_rank.draft_tokens[:3].tolist(), tokens.tolist())
        low_rank_logits = views.corrected.transpose(0, 1)[:3]
        torch.testing.assert_close(low_rank_logits, logits, rtol=1e-5, atol=1e-5)
        base = self.base_logits[-1].view(4, self.gamma, -1)[:3]
        torch.testing.assert_close(
            low_rank_logits, base + expected, rtol=1e-6, atol=1e-6
        )

    def test_min_new_tokens_masks_each_slot_by_its_output_position(self):
        # Slot k drafts output position out_lens + k: the stop ids are -inf
        # in its processed logits while that position is below the request's
        # min_new_tokens, and open from it on, slot by slot.
        stops = [7, 11]
        views, reqs = self._propose_processed(
            [
                SamplingParams(
                    max_new_tokens=20,
                    min_new_tokens=m,
                    stop_token_ids=stops,
                    ignore_eos=True,
                )
                for m in (2, 4, 0)
            ]
        )
        out_lens = views.state.sampling.out_lens[:3].tolist()
        self.assertEqual(out_lens, [1, 1, 1])  # the prefill's token
        masked = views.corrected[:, :3, stops].isneginf()  # [gamma, bs, stops]
        for k in range(self.gamma):
            for b, req in enumerate(reqs):
                early = out_lens[b] + k < req.sampling_params.min_new_tokens
                with self.subTest(slot=k, request=b):
                    self.assertEqual(masked[k, b].tolist(), [early] * len(stops))
        self.assertTrue(bool(masked.any()) and not bool(masked.all()))

    def test_penalties_count_the_drafts_before_each_slot(self):
        # A frequency penalty at slot k counts the committed output and the
        # block's own drafts d_1..d_k before it: the processed logits are the
        # corrected ones less f times those counts.
        f = 2.0
        views, reqs = self._propose_processed(
            [SamplingParams(max_new_tokens=20, frequency_penalty=f)] * 3
        )
        draft, bs, g = self.engine.worker.draft_model, 3, self.gamma
        base = self.base_logits[-1].view(4, g, -1)[:bs]
        drafts = views.drafts[:bs]
        prev = torch.cat([views.state.last_ids[:bs, None], drafts[:, :-1]], 1)
        counts = views.state.sampling.counts[:bs].clone()  # the output so far
        self.assertEqual(counts.sum(1).tolist(), [1.0] * bs)
        for k in range(g):
            raw = base[:, k] + draft.markov_correction(prev[:, k])
            expected = raw - (f * counts + 0.0 * (counts > 0))
            with self.subTest(slot=k):
                torch.testing.assert_close(
                    views.corrected[k, :bs], expected, rtol=0, atol=1e-5
                )
            ones = torch.ones(bs, 1, device=counts.device)
            counts.scatter_add_(1, drafts[:, k : k + 1], ones)
        self.assertGreater(int(counts.sum()), bs * 2)  # the drafts were counted

    def _propose_processed(self, params):
        """The draft phase of a step for requests with these sampling
        parameters (processed: penalties, min_new_tokens)."""
        reqs = [
            Req(rid=i, origin_input_ids=[5 + i, 9, 17 + 3 * i], sampling_params=p)
            for i, p in enumerate(params)
        ]
        sched = self.engine.scheduler
        for r in reqs:
            sched.add_request(r)
        sched._admit()
        batch = ScheduleBatch.from_reqs(reqs, self.engine.worker.device)
        extras = batch.sampling_info.extras
        self.assertTrue(extras.processed)
        worker, mode = self.worker, batch.sampling_mode
        rows, _ = worker._prepare(batch, mode)
        views = worker.buffers.at(rows)
        worker._fill_window(views, max(batch.seq_lens_cpu) + self.gamma, plain=False)
        self.proposer.propose(views=views, mode=mode, extras=extras)
        return views, reqs

    def test_batch_over_capacity_is_an_error(self):
        reqs = self._make_batch().reqs
        big = ScheduleBatch.from_reqs(reqs * 3, self.worker.device)  # 9 > 8
        with self.assertRaisesRegex(ValueError, "max_batch_size=8"):
            self.worker.decode_step(batch=big)

    def _make_batch(self, temperatures=(0.0, 0.0, 0.0)) -> ScheduleBatch:
        sched = self.engine.scheduler
        reqs = [
            Req(
                rid=i,
                origin_input_ids=[5 + i, 9, 17 + 3 * i, 2, 40][: 2 + i],
                sampling_params=SamplingParams(max_new_tokens=20, temperature=t),
            )
            for i, t in enumerate(temperatures)
        ]
        for r in reqs:
            sched.add_request(r)
        sched._admit()  # allocates KV and prefills: the draft context is written
        self.assertEqual(len(sched.waiting), 0)
        return ScheduleBatch.from_reqs(reqs, self.engine.worker.device)


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class TestDraftBlockProposerCUDA(TestDraftBlockProposer):
    device = "cuda"


if __name__ == "__main__":
    unittest.main()

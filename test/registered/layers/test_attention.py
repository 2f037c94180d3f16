"""Slot attention reads keys only up to the batch's longest kv_len, from
metadata built once per forward (slots, mask, rotary tables) and shared by
every layer; it equals attention over the table's full width."""

import unittest
from unittest import mock

import torch
import torch.nn.functional as F

from sglang import Engine
from sglang.srt.layers.attention import AttentionMetadata, kv_read_bound, slot_attention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.mem_cache.memory_pool import DUMMY_REQ_INDEX, KVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.models.dspark import DSparkDraftConfig, DSparkDraftModel
from sglang.srt.models.registry import init_random_weights
from sglang.srt.models.tiny_moe import (
    TinyMoEConfig,
    TinyMoEForCausalLM,
    init_attention_metadata,
)
from sglang.srt.utils.op_counter import OpCounter
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=3, suite="base-a-test-cpu")

CONFIG = TinyMoEConfig()
WIDTH = 48  # request->slot table width (the context length)
HEADS, DIM = CONFIG.num_heads, CONFIG.head_dim


class _Pools:
    """Three requests with scattered slots and random K/V in every slot."""

    def __init__(self, num_layers: int = CONFIG.num_layers):
        gen = torch.Generator().manual_seed(0)
        self.req_pool = ReqToTokenPool(max_reqs=3, max_context_len=WIDTH, device="cpu")
        slots = 3 * WIDTH
        self.kv_pool = KVPool(
            num_layers=num_layers,
            num_slots=slots,
            num_heads=HEADS,
            head_dim=DIM,
            dtype=torch.float32,
            device="cpu",
        )
        self.kv_pool.k.copy_(torch.randn(self.kv_pool.k.shape, generator=gen))
        self.kv_pool.v.copy_(torch.randn(self.kv_pool.v.shape, generator=gen))
        order = torch.randperm(slots, generator=gen) + 1
        for row in (1, 2, 3):
            self.req_pool.req_to_token[row] = order[(row - 1) * WIDTH : row * WIDTH]

    def batch(self, rows, starts, q_len, *, non_causal=False, vocab=CONFIG.vocab_size):
        """q_len rows per request from each start position (request-major)."""
        req = torch.tensor(rows)
        positions = (torch.tensor(starts).unsqueeze(1) + torch.arange(q_len)).view(-1)
        kv_lens = positions + 1
        if non_causal:  # a whole block sees the block's last position
            kv_lens = kv_lens.view(len(rows), q_len)[:, -1:].expand(-1, q_len)
        table = self.req_pool.req_to_token
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY if q_len > 1 else ForwardMode.DECODE,
            batch_size=len(rows),
            tokens_per_req=q_len,
            input_ids=torch.randint(0, vocab - 1, (len(rows) * q_len,)),
            positions=positions,
            out_cache_loc=table[req.repeat_interleave(q_len), positions],
            req_pool_indices=req,
            kv_lens=kv_lens.reshape(-1),
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
        )


def _full_width_attention(q, layer, fb: ForwardBatch) -> torch.Tensor:
    """Every request's whole table row, masked: what attention read before."""
    bs, q_len = fb.batch_size, fb.tokens_per_req
    slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices]  # [bs, WIDTH]
    k = fb.token_to_kv_pool.k[layer][slots]
    v = fb.token_to_kv_pool.v[layer][slots]
    mask = torch.arange(WIDTH).view(1, 1, -1) < fb.kv_lens.view(bs, q_len, 1)
    out = F.scaled_dot_product_attention(
        q.view(bs, q_len, HEADS, DIM).transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),
    )
    return out.transpose(1, 2).reshape(bs * q_len, HEADS * DIM)


def _target_and_draft():
    """The random tiny target (capturing layers 1 and 2) and its draft."""
    target = TinyMoEForCausalLM(CONFIG)
    init_random_weights(target, seed=0)
    target.set_layers_to_capture((1, 2))
    draft = DSparkDraftModel(DSparkDraftConfig(), target)
    init_random_weights(draft, seed=1)
    return target, draft


class TestBoundedReads(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.pools = _Pools()
        self.rope = RotaryEmbedding(DIM, CONFIG.max_position)

    def _metadata(self, fb):
        return init_attention_metadata(fb, rotary=self.rope, dtype=torch.float32)

    def test_metadata(self):
        fb = self.pools.batch([2, 1, 3], [5, 17, 9], 4)
        md = self._metadata(fb)
        self.assertEqual(md.kv_bound, 21)  # the longest kv_len: 17 + 4
        table = self.pools.req_pool.req_to_token
        self.assertTrue(torch.equal(md.kv_slots, table[[2, 1, 3], :21].reshape(-1)))
        self.assertEqual(tuple(md.attn_mask.shape), (3, 1, 4, 21))
        seen = torch.arange(21).view(1, 1, 1, -1) < fb.kv_lens.view(3, 1, 4, 1)
        self.assertTrue(bool((md.attn_mask[seen] == 0).all()))
        self.assertTrue(bool((md.attn_mask[~seen] == float("-inf")).all()))
        cos, sin = self.rope.cos_sin(fb.positions)
        self.assertTrue(torch.equal(md.cos, cos) and torch.equal(md.sin, sin))

    def test_equals_full_width_attention(self):
        gen = torch.Generator().manual_seed(5)
        cases = {
            "decode": self.pools.batch([1, 3], [30, 2], 1),
            "verify": self.pools.batch([3, 2, 1], [0, 40, 11], 6),
            "draft block": self.pools.batch([2, 3], [7, 19], 5, non_causal=True),
            # A padded bucket: the dummy request sees one key (scratch).
            "padding": self.pools.batch([1, DUMMY_REQ_INDEX], [12, 0], 1),
        }
        cases["padding"].kv_lens[1] = 1
        for name, fb in cases.items():
            with self.subTest(name):
                q = torch.randn(fb.num_tokens, HEADS, DIM, generator=gen)
                md = self._metadata(fb)
                self.assertLess(md.kv_bound, WIDTH)
                for layer in (0, 3):
                    out = slot_attention(
                        q=q,
                        k_cache=fb.token_to_kv_pool.k[layer],
                        v_cache=fb.token_to_kv_pool.v[layer],
                        metadata=md,
                    )
                    ref = _full_width_attention(q, layer, fb)
                    # The kernel's reduction lanes depend on the key count:
                    # equal up to rounding, not bitwise.
                    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    def test_read_bound(self):
        kv_lens = torch.tensor([3, 30, 7])

        def bound(**kw):
            args = dict(max_kv_len=None, kv_lens=kv_lens, width=48, capturing=False)
            with OpCounter() as c:
                value = kv_read_bound(**{**args, **kw})
            return value, c.host_reads

        self.assertEqual(bound(), (30, 1))  # read from the device
        self.assertEqual(bound(width=20), (20, 1))
        # Given by the host, or under CUDA-graph capture: no device read.
        self.assertEqual(bound(max_kv_len=30), (30, 0))
        self.assertEqual(bound(max_kv_len=30, width=20), (20, 0))
        self.assertEqual(bound(capturing=True), (48, 0))

    def test_host_bound_gives_the_same_metadata(self):
        fb = self.pools.batch([2, 1, 3], [5, 17, 9], 4)
        read = self._metadata(fb)
        fb.max_kv_len = 21
        with OpCounter() as c:
            given = self._metadata(fb)
        self.assertEqual(c.host_reads, 0)
        self.assertEqual(given.kv_bound, read.kv_bound)
        self.assertTrue(torch.equal(given.attn_mask, read.attn_mask))


class TestMetadataOncePerForward(CustomTestCase):
    """Target and draft build the metadata once per forward; the layers
    only read it."""

    def _count(self, fn):
        with (
            mock.patch.object(
                AttentionMetadata, "init_new", wraps=AttentionMetadata.init_new
            ) as init_new,
            mock.patch.object(
                RotaryEmbedding,
                "cos_sin",
                autospec=True,
                side_effect=RotaryEmbedding.cos_sin,
            ) as cos_sin,
            OpCounter() as ops,
        ):
            fn()
        return init_new.call_count, cos_sin.call_count, ops.by_op

    def test_target_and_draft(self):
        target, draft = _target_and_draft()
        pools, draft_pools = _Pools(), _Pools(num_layers=1)
        verify = pools.batch([1, 2], [20, 33], 6)
        verify.capture_hidden_mode = CaptureHiddenMode.FULL
        block = draft_pools.batch([1, 2], [20, 33], 5, non_causal=True)
        layers = CONFIG.num_layers
        out = {}

        def run_target():
            out["target"] = target(verify)

        for name, fn, n_layers in (
            ("target", run_target, layers),
            ("draft", lambda: draft(block), 1),
        ):
            with self.subTest(name):
                init_new, cos_sin, by_op = self._count(fn)
                self.assertEqual((init_new, cos_sin), (1, 1))
                self.assertEqual(by_op["aten::arange"], 1)
                self.assertEqual(by_op["aten::masked_fill_.Scalar"], 1)
                self.assertNotIn("aten::where.self", by_op)  # no per-layer mask
                attention = "aten::_scaled_dot_product_flash_attention_for_cpu"
                self.assertEqual(by_op[attention], n_layers)
        # Committing context to the draft: one table for its layers.
        ctx = draft_pools.batch([1, 2], [20, 33], 6)
        _, cos_sin, _ = self._count(
            lambda: draft.write_context(
                aux_hidden_states=out["target"].aux_hidden_states,
                positions=ctx.positions,
                out_cache_loc=ctx.out_cache_loc,
                kv_pool=ctx.token_to_kv_pool,
            )
        )
        self.assertEqual(cos_sin, 1)


class TestSharedStepMetadata(CustomTestCase):
    """A DSpark step builds the verify's metadata once: the target's forward
    and the context write read it as given, and the draft block derives its
    own from it (the verify's slots and mask row gamma - 1, up to its own
    bound), bitwise the same results as metadata built per forward."""

    def test_block_and_context_write_read_the_verify_metadata(self):
        target, draft = _target_and_draft()
        self.assertIs(draft.rotary_emb, target.rotary_emb)
        pools, draft_pools = _Pools(), _Pools(num_layers=1)
        # As in the engine, both KV pools share one request -> slot table.
        draft_pools.req_pool = pools.req_pool
        # Block bounds 11 to 47 (SDPA's sums group differently by key count).
        for starts in ([2, 6], [20, 33], [0, 10], [9, 26], [3, 42]):
            with self.subTest(starts=starts):
                self._check_shared(target, draft, pools, draft_pools, starts)

    def _check_shared(self, target, draft, pools, draft_pools, starts):
        verify = pools.batch([1, 2], starts, 6)
        verify.capture_hidden_mode = CaptureHiddenMode.FULL
        block = draft_pools.batch([1, 2], starts, 5, non_causal=True)
        shared = target.init_forward_metadata(verify)
        own_block = draft.init_forward_metadata(block)
        with mock.patch.object(
            AttentionMetadata, "init_new", side_effect=AssertionError
        ):
            derived = draft.init_forward_metadata(block, verify_metadata=shared)
        # The block's own keys, mask and bound, read from the verify's.
        self.assertEqual(derived.kv_bound, shared.kv_bound - 1)
        self.assertEqual(derived.kv_bound, own_block.kv_bound)
        self.assertTrue(torch.equal(derived.kv_slots, own_block.kv_slots))
        mask = derived.attn_mask.expand(own_block.attn_mask.shape)
        self.assertTrue(torch.equal(mask, own_block.attn_mask))
        self.assertTrue(torch.equal(derived.cos, own_block.cos))
        self.assertTrue(torch.equal(derived.sin, own_block.sin))
        # Forwards with the shared metadata give bitwise what they give
        # without it.
        ref = target(verify)
        verify.attn_metadata = shared
        out = target(verify)
        self.assertTrue(torch.equal(out.logits, ref.logits))
        self.assertTrue(torch.equal(out.aux_hidden_states, ref.aux_hidden_states))
        ref_block = draft(block).logits
        block.attn_metadata = derived
        self.assertTrue(torch.equal(draft(block).logits, ref_block))
        # The context write takes the verify rows' rotary tables as given.
        ctx = draft_pools.batch([1, 2], starts, 6)
        written = {}
        for name, metadata in (("own", None), ("shared", shared)):
            with mock.patch.object(
                RotaryEmbedding,
                "cos_sin",
                autospec=True,
                side_effect=RotaryEmbedding.cos_sin,
            ) as cos_sin:
                draft.write_context(
                    aux_hidden_states=out.aux_hidden_states,
                    positions=ctx.positions,
                    out_cache_loc=ctx.out_cache_loc,
                    kv_pool=ctx.token_to_kv_pool,
                    metadata=metadata,
                )
            self.assertEqual(cos_sin.call_count, 0 if metadata else 1)
            slots = ctx.out_cache_loc
            written[name] = (
                draft_pools.kv_pool.k[:, slots].clone(),
                draft_pools.kv_pool.v[:, slots].clone(),
            )
        for own, shared_kv in zip(written["own"], written["shared"]):
            self.assertTrue(torch.equal(own, shared_kv))

    def test_verify_metadata_of_another_shape_is_refused(self):
        target = TinyMoEForCausalLM(CONFIG)
        draft = DSparkDraftModel(DSparkDraftConfig(), target)
        pools = _Pools()
        block = pools.batch([1, 2], [4, 9], 5, non_causal=True)
        for rows, q_len in (([1], 6), ([1, 2], 5), ([1, 2, 3], 6)):
            with self.subTest(requests=len(rows), q_len=q_len):
                other = target.init_forward_metadata(
                    pools.batch(rows, [4, 9, 2][: len(rows)], q_len)
                )
                with self.assertRaisesRegex(ValueError, "does not fit a block"):
                    draft.init_forward_metadata(block, verify_metadata=other)

    def test_engine_builds_it_once_per_step_padded_or_not(self):
        # Three requests: unpadded by default on the CPU, padded to a bucket
        # of 4 when buckets are asked for; one metadata per step either way
        # (the step runs padded as a whole), and the same tokens.
        prompts = [[7, 3, 9, 1], [4, 4, 8], [12, 50, 2, 77, 5]]
        outputs, builds = {}, {}
        for name, buckets in (("unpadded", None), ("padded", [1, 2, 4])):
            engine = Engine(
                speculative_algorithm="DSPARK",
                device="cpu",
                random_seed=0,
                max_running_requests=4,
                cuda_graph_bs=buckets,
            )
            sched = engine.scheduler
            params = SamplingParams(max_new_tokens=20)
            reqs = [
                Req(rid=i, origin_input_ids=ids, sampling_params=params)
                for i, ids in enumerate(prompts)
            ]
            for req in reqs:
                sched.add_request(req)
            sched.step()  # admission: prefills and a first decode step
            with mock.patch.object(
                AttentionMetadata, "init_new", wraps=AttentionMetadata.init_new
            ) as init_new:
                sched.step()
            builds[name] = init_new.call_count
            while sched.has_work():
                sched.step()
            outputs[name] = [req.output_ids for req in reqs]
        self.assertEqual(builds, {"unpadded": 1, "padded": 1})
        self.assertEqual(outputs["unpadded"], outputs["padded"])


if __name__ == "__main__":
    unittest.main()

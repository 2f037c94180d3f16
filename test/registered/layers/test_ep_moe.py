"""EPMoE's grouped path: rows sorted by expert once, each hit expert run on
its rows only, bitwise equal to a straightforward loop over experts; masked
rows and other ranks' experts never computed; one host read per layer."""

import unittest
from unittest import mock

import torch
import torch.nn.functional as F

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.layers.moe.topk import TopKOutput, select_experts
from sglang.srt.models.registry import init_random_weights
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.op_counter import OpCounter
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=4, suite="base-a-test-cpu")

HIDDEN, INTER = 32, 48


def _moe(num_experts: int, top_k: int, seed: int = 0) -> EPMoE:
    moe = EPMoE(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_experts=num_experts,
        top_k=top_k,
    )
    init_random_weights(moe, seed=seed)
    return moe


def _inputs(moe: EPMoE, rows: int, n=None, seed: int = 1):
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    scalar = None if n is None else torch.tensor(n, dtype=torch.int32)
    with torch.no_grad():
        topk = select_experts(
            router_logits=moe.gate(x), top_k=moe.top_k, num_token_non_padded=scalar
        )
    return x, scalar, topk


def _reference(moe: EPMoE, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
    """The straightforward loop: every local expert, its rows found by a
    nonzero, computed with F.linear and added in expert order."""
    local_ids = topk.topk_ids - moe.first_local
    out = torch.zeros_like(x)
    for e in range(moe.num_local):
        hit = local_ids == e  # [T, top_k]
        weight = (topk.topk_weights * hit).sum(dim=-1)  # [T]
        rows = hit.any(dim=-1).nonzero().squeeze(1)
        if rows.numel():
            gate, up = F.linear(x.index_select(0, rows), moe.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, moe.w2[e])
            out.index_add_(0, rows, weight[rows].unsqueeze(1) * y)
    return out


def _expert_rows(moe: EPMoE, fn):
    """Run fn; return its result and the row count of every _expert call."""
    calls = []
    real = moe._expert

    def spy(e, x):
        calls.append((e, x.shape[0]))
        return real(e, x)

    with mock.patch.object(moe, "_expert", spy):
        out = fn()
    return out, calls


class TestGroupedExperts(CustomTestCase):
    def test_bitwise_equal_to_the_expert_loop(self):
        # top_k 3 makes the per-row summation order matter, not only the rows.
        for num_experts, top_k in ((8, 2), (8, 1), (8, 3), (4, 2)):
            moe = _moe(num_experts, top_k)
            for rows in (1, 5, 6, 48, 97):
                for n in (None, 0, rows // 2, rows):
                    with self.subTest(E=num_experts, top_k=top_k, rows=rows, n=n):
                        x, scalar, topk = _inputs(moe, rows, n, seed=rows)
                        with torch.no_grad():
                            out = moe(x, scalar)
                            ref = _reference(moe, x, topk)
                        self.assertTrue(torch.equal(out, ref))
                        if n is not None:
                            self.assertTrue(bool((out[n:] == 0).all()))

    def test_only_hit_experts_run_on_their_rows(self):
        moe = _moe(8, 2)
        x, _, topk = _inputs(moe, 6)
        with torch.no_grad():
            _, calls = _expert_rows(moe, lambda: moe(x))
        ids = topk.topk_ids.view(-1)
        expected = [(e, int((ids == e).sum())) for e in range(8) if (ids == e).any()]
        self.assertEqual(calls, expected)  # ascending experts, hit ones only

    def test_masked_rows_reach_no_expert(self):
        moe = _moe(8, 2)
        for n in (0, 3, 7):
            with self.subTest(n=n):
                x, scalar, _ = _inputs(moe, 7, n)
                with torch.no_grad():
                    out, calls = _expert_rows(moe, lambda: moe(x, scalar))
                self.assertEqual(sum(r for _, r in calls), n * moe.top_k)
                self.assertTrue(bool((out[n:] == 0).all()))

    def test_one_host_read_and_no_per_expert_scan(self):
        moe = _moe(8, 2)
        x, scalar, topk = _inputs(moe, 6, 4)
        hit = int(topk.topk_ids[:4].unique().numel())
        with torch.no_grad(), OpCounter() as c:
            moe(x, scalar)
        # The group ends' .tolist() is the one host read.
        self.assertEqual(c.by_op["aten::searchsorted.Tensor"], 1)
        self.assertEqual(c.by_op["aten::sort.stable"], 1)
        for op in (
            "aten::nonzero",
            "aten::bincount",
            "aten::_local_scalar_dense",
            "aten::eq.Scalar",
        ):
            self.assertNotIn(op, c.by_op)
        # The router's matmul, then two per hit expert: nothing for the others.
        self.assertEqual(c.by_op["aten::mm"], 1 + 2 * hit)

    def test_static_path_matches_on_real_rows(self):
        # The path CUDA-graph capture takes (static shapes), run eagerly here.
        moe = _moe(8, 2)
        x, scalar, topk = _inputs(moe, 9, 5)
        with torch.no_grad():
            static = moe._forward_static(x, topk)
            grouped = moe(x, scalar)
        torch.testing.assert_close(static, grouped, rtol=1e-5, atol=1e-5)
        self.assertTrue(bool((static[5:] == 0).all()))

    def test_weight_views_follow_the_parameters(self):
        moe = _moe(4, 2)
        x, _, topk = _inputs(moe, 5)
        with torch.no_grad():
            before = moe(x)
            moe.w13.data = moe.w13.data * 2  # new storage: new views
            after = moe(x)
            self.assertTrue(torch.equal(after, _reference(moe, x, topk)))
        self.assertFalse(torch.equal(before, after))


class TestExpertParallelSplit(CustomTestCase):
    """Two EP ranks in one process (the all-reduce replaced by a recorder):
    each computes only its experts' pairs, and their sum is the whole."""

    def _rank(self, full: EPMoE, rank: int) -> EPMoE:
        group = object()  # a stand-in: the collective is patched out below
        with get_parallel().override(
            moe_ep_size=2, moe_ep_rank=rank, moe_ep_group=group
        ):
            moe = EPMoE(
                hidden_size=HIDDEN, intermediate_size=INTER, num_experts=8, top_k=2
            )
        moe.load_full_experts(full.w13, full.w2)
        with torch.no_grad():
            moe.gate.weight.copy_(full.gate.weight)
        return moe

    def test_ranks_sum_to_one_process(self):
        full = _moe(8, 2)
        ranks = [self._rank(full, r) for r in (0, 1)]
        for n in (None, 4):
            with self.subTest(n=n):
                x, scalar, topk = _inputs(full, 9, n)
                with torch.no_grad():
                    whole = full(x, scalar)
                    with mock.patch("torch.distributed.all_reduce") as all_reduce:
                        parts = [
                            _expert_rows(m, lambda m=m: m(x, scalar)) for m in ranks
                        ]
                self.assertEqual(all_reduce.call_count, 2)
                # top_k 2: each row is c_a + c_b on one process, 0 + c_a and
                # 0 + c_b on the ranks: the sum is bitwise the same.
                self.assertTrue(torch.equal(parts[0][0] + parts[1][0], whole))
                real = topk.topk_ids[: 9 if n is None else n].view(-1)
                for r, (_, calls) in enumerate(parts):
                    mine = int(((real >= 4 * r) & (real < 4 * r + 4)).sum())
                    self.assertEqual(sum(rows for _, rows in calls), mine)
                    self.assertTrue(all(0 <= e < 4 for e, _ in calls))


if __name__ == "__main__":
    unittest.main()

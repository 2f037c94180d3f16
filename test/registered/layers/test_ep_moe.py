"""EPMoE's two paths. Dense (few rows, and always on CUDA): every local
expert on every row in two matmuls, a constant op count, no host read,
equal to a loop over experts up to rounding, padded rows exactly 0.
Grouped (more rows, eager CPU): rows sorted by expert once, each hit expert
run on its rows only, bitwise equal to the loop; padded rows and other
ranks' experts never computed (one host read per layer to cut them off,
only with a mask or on EP > 1)."""

import unittest
from unittest import mock

import torch
import torch.nn.functional as F

from sglang.srt.layers.moe.ep_moe import DENSE_MAX_ROW_EXPERTS, EPMoE
from sglang.srt.layers.moe.topk import TopKOutput, select_experts
from sglang.srt.models.registry import init_random_weights
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.op_counter import OpCounter
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, expert_groups

register_cpu_ci(est_time=4, suite="base-a-test-cpu")

HIDDEN, INTER = 32, 48
# The dense path's rounding against the loop's (float32, outputs ~1).
DENSE_TOL = dict(rtol=1e-5, atol=1e-5)


def _moe(num_experts: int, top_k: int, seed: int = 0, *, dense: bool) -> EPMoE:
    moe = EPMoE(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_experts=num_experts,
        top_k=top_k,
    )
    init_random_weights(moe, seed=seed)
    moe.dense_max_row_experts = 10**9 if dense else -1  # -1: even 0 rows grouped
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


def _expert_pairs(moe: EPMoE, fn):
    """Run fn; return its result and the (row, local expert) pairs that reach
    an expert: each expert's rows in every grouped call, plus nonzero routing
    weights of every dense forward (a zero-weight pair adds exactly 0)."""
    pairs = {"grouped": [], "dense": 0}
    grouped, routing = moe._experts_grouped, moe._routing_weights

    def spy_grouped(xs, offs):
        pairs["grouped"] += [(e, x.shape[0]) for e, x in expert_groups(xs, offs)]
        return grouped(xs, offs)

    def spy_routing(topk, *, masked):
        weights = routing(topk, masked=masked)
        pairs["dense"] += int((weights != 0).sum())
        return weights

    with (
        mock.patch.object(moe, "_experts_grouped", spy_grouped),
        mock.patch.object(moe, "_routing_weights", spy_routing),
    ):
        out = fn()
    return out, pairs


class TestDenseExperts(CustomTestCase):
    def test_equal_to_the_expert_loop(self):
        for num_experts, top_k in ((8, 2), (8, 1), (8, 3), (4, 2), (4, 4)):
            moe = _moe(num_experts, top_k, dense=True)
            for rows in (0, 1, 5, 6, 48, 97):
                for n in (None, 0, rows // 2, rows):
                    with self.subTest(E=num_experts, top_k=top_k, rows=rows, n=n):
                        x, scalar, topk = _inputs(moe, rows, n, seed=rows)
                        with torch.no_grad():
                            out, pairs = _expert_pairs(moe, lambda: moe(x, scalar))
                            ref = _reference(moe, x, topk)
                        torch.testing.assert_close(out, ref, **DENSE_TOL)
                        self.assertEqual(pairs["grouped"], [])  # the dense path ran
                        real = rows if n is None else n
                        self.assertEqual(pairs["dense"], real * top_k)
                        # Padded rows: weight 0 for every expert, output exactly 0.
                        self.assertTrue(bool((out[real:] == 0).all()))

    def test_constant_op_count_and_no_host_read(self):
        moe = _moe(8, 2, dense=True)
        with torch.no_grad():
            moe(_inputs(moe, 1)[0])  # the derived weight layouts, made once
        counts = {}
        for rows, n in ((1, None), (6, None), (48, None), (6, 4), (48, 40)):
            x, scalar, _ = _inputs(moe, rows, n)
            with torch.no_grad(), OpCounter() as c:
                moe(x, scalar)
            counts.setdefault(n is None, set()).add(c.ops)
            for op in (
                "aten::_local_scalar_dense",
                "aten::sort.stable",
                "aten::searchsorted.Tensor",
                "aten::nonzero",
            ):
                self.assertNotIn(op, c.by_op)
            # The router's matmul, then one for every gate and up, one for
            # every down: nothing per expert.
            self.assertEqual(c.by_op["aten::mm"], 3)
            if n is None:
                # New tensors: the router's logits, softmax and top-k (2),
                # the weights' sum, the [T, E] routing weights, the two
                # matmuls. The renormalization, the activation and its
                # weighting are written in place.
                self.assertEqual(c.allocs, 8, c.by_op)
        # The same ops for 1 row or 48, masked or not (masking adds its own).
        self.assertEqual([len(v) for v in counts.values()], [1, 1], counts)

    def test_derived_weights_follow_the_parameters(self):
        moe = _moe(4, 2, dense=True)
        x, _, topk = _inputs(moe, 5)
        with torch.no_grad():
            before = moe(x)
            moe.w13.data = moe.w13.data * 2  # new storage
            after = moe(x)
            torch.testing.assert_close(after, _reference(moe, x, topk), **DENSE_TOL)
            moe.w2.mul_(3)  # same storage, new version
            torch.testing.assert_close(moe(x), 3 * after, **DENSE_TOL)
        self.assertFalse(torch.equal(before, after))


class TestPathChoice(CustomTestCase):
    def test_rows_times_local_experts_picks_the_path(self):
        moe = EPMoE(hidden_size=HIDDEN, intermediate_size=INTER, num_experts=8, top_k=2)
        init_random_weights(moe, seed=0)
        self.assertEqual(moe.dense_max_row_experts, DENSE_MAX_ROW_EXPERTS)
        limit = DENSE_MAX_ROW_EXPERTS // moe.num_local
        for rows, dense in ((1, True), (limit, True), (limit + 1, False)):
            with self.subTest(rows=rows):
                x, _, _ = _inputs(moe, rows)
                with torch.no_grad():
                    _, pairs = _expert_pairs(moe, lambda: moe(x))
                self.assertEqual(pairs["dense"] > 0, dense)
                self.assertEqual(bool(pairs["grouped"]), not dense)


class TestGroupedExperts(CustomTestCase):
    def test_bitwise_equal_to_the_expert_loop(self):
        # top_k 3 makes the per-row summation order matter, not only the rows.
        for num_experts, top_k in ((8, 2), (8, 1), (8, 3), (4, 2), (4, 4)):
            moe = _moe(num_experts, top_k, dense=False)
            for rows in (0, 1, 5, 6, 48, 97):
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
        moe = _moe(8, 2, dense=False)
        x, _, topk = _inputs(moe, 6)
        with torch.no_grad():
            _, pairs = _expert_pairs(moe, lambda: moe(x))
        ids = topk.topk_ids.view(-1)
        expected = [(e, int((ids == e).sum())) for e in range(8) if (ids == e).any()]
        self.assertEqual(pairs["grouped"], expected)  # ascending, hit ones only

    def test_masked_rows_reach_no_expert(self):
        moe = _moe(8, 2, dense=False)
        for n in (0, 3, 7):
            with self.subTest(n=n):
                x, scalar, _ = _inputs(moe, 7, n)
                with torch.no_grad():
                    out, pairs = _expert_pairs(moe, lambda: moe(x, scalar))
                self.assertEqual(sum(r for _, r in pairs["grouped"]), n * moe.top_k)
                self.assertTrue(bool((out[n:] == 0).all()))

    def test_no_per_expert_scan_and_a_host_read_only_to_cut_masked_pairs(self):
        # Unmasked on EP 1 every pair is routed: no host read. Masked, the
        # padded rows' pairs sort last and one read of where cuts them off:
        # the grouped matmuls multiply the real rows' pairs only.
        moe = _moe(8, 2, dense=False)
        with torch.no_grad():
            moe(_inputs(moe, 1)[0])  # the derived weight layouts, made once
        for n, reads in ((None, 0), (4, 1), (0, 1)):
            with self.subTest(n=n):
                x, scalar, _ = _inputs(moe, 6, n)
                computed, grouped = [], moe._experts_grouped

                def spy(xs, offs):
                    computed.append((xs.shape[0], offs))  # read after counting
                    return grouped(xs, offs)

                with (
                    torch.no_grad(),
                    mock.patch.object(moe, "_experts_grouped", spy),
                    OpCounter() as c,
                ):
                    out = moe(x, scalar)
                self.assertEqual(c.by_op["aten::searchsorted.Tensor"], 1)
                self.assertEqual(c.by_op["aten::sort.stable"], 1)
                self.assertEqual(c.by_op["aten::_local_scalar_dense"], reads)
                for op in ("aten::nonzero", "aten::bincount", "aten::eq.Scalar"):
                    self.assertNotIn(op, c.by_op)
                real = 6 if n is None else n
                if real == 0:  # nothing routed: no expert runs, the output is 0
                    self.assertEqual(computed, [])
                    self.assertNotIn("aten::_grouped_mm", c.by_op)
                    self.assertTrue(torch.equal(out, torch.zeros_like(x)))
                    continue
                # The router's matmul, then one grouped matmul per projection
                # for all experts, whatever the routing.
                self.assertEqual(c.by_op["aten::mm"], 1)
                self.assertEqual(c.by_op["aten::_grouped_mm"], 2)
                if n is None:
                    # The router's 5 (as dense), the sort (2), the groups'
                    # ends, the rows' and their weights' gathers, the two
                    # grouped matmuls, the output. The pair -> row division
                    # and the activation are written in place.
                    self.assertEqual(c.allocs, 13, c.by_op)
                ((num_rows, offs),) = computed
                self.assertEqual((num_rows, int(offs[-1])), (2 * real, 2 * real))
                self.assertTrue(torch.equal(out[real:], torch.zeros_like(x[real:])))

    def test_weight_views_follow_the_parameters(self):
        moe = _moe(4, 2, dense=False)
        x, _, topk = _inputs(moe, 5)
        with torch.no_grad():
            before = moe(x)
            moe.w13.data = moe.w13.data * 2  # new storage: new views
            after = moe(x)
            self.assertTrue(torch.equal(after, _reference(moe, x, topk)))
        self.assertFalse(torch.equal(before, after))

    def test_both_paths_are_differentiable(self):
        # The in-place activation is for inference: with autograd on, both
        # paths keep the gates the backward needs, and their gradients (the
        # input's, the router's and the experts' weights') are the expert
        # loop's; the weights' too after an update (the layouts follow).
        for dense in (True, False):
            with self.subTest(dense=dense):
                moe = _moe(8, 2, dense=dense)
                x = _inputs(moe, 9)[0].requires_grad_(True)
                wrt = [x, moe.gate.weight, moe.w13, moe.w2]
                for update in range(2):
                    grads = torch.autograd.grad(moe(x).square().sum(), wrt)
                    topk = select_experts(router_logits=moe.gate(x), top_k=2)
                    ref = _reference(moe, x, topk)
                    refs = torch.autograd.grad(ref.square().sum(), wrt)
                    for got, want in zip(grads, refs):
                        torch.testing.assert_close(got, want, **DENSE_TOL)
                    with torch.no_grad():  # an optimizer's step, in place
                        moe.w13.sub_(0.01 * grads[2])
                        moe.w2.sub_(0.01 * grads[3])

    def test_sizes_the_grouped_matmul_refuses_run_dense(self):
        # torch._grouped_mm on the CPU needs 16-byte row strides: an
        # intermediate size of 30 floats (120 bytes) takes the dense path
        # at any row count, and gives the loop's result.
        moe = EPMoE(hidden_size=HIDDEN, intermediate_size=30, num_experts=8, top_k=2)
        init_random_weights(moe, seed=0)
        moe.dense_max_row_experts = -1  # the grouped path wherever it can run
        x, _, topk = _inputs(moe, 48)
        with torch.no_grad():
            out = moe(x)
            ref = _reference(moe, x, topk)
        self.assertFalse(moe._grouped_ok)
        torch.testing.assert_close(out, ref, **DENSE_TOL)

    def test_both_paths_agree(self):
        for rows, n in ((6, None), (9, 5), (48, 40)):
            with self.subTest(rows=rows, n=n):
                dense, grouped = _moe(8, 2, dense=True), _moe(8, 2, dense=False)
                x, scalar, _ = _inputs(dense, rows, n)
                with torch.no_grad():
                    a, b = dense(x, scalar), grouped(x, scalar)
                torch.testing.assert_close(a, b, **DENSE_TOL)
                if n is not None:
                    self.assertTrue(bool((a[n:] == 0).all() and (b[n:] == 0).all()))


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
        moe.dense_max_row_experts = full.dense_max_row_experts
        with torch.no_grad():
            moe.gate.weight.copy_(full.gate.weight)
        return moe

    def test_ranks_sum_to_one_process(self):
        for dense in (True, False):
            full = _moe(8, 2, dense=dense)
            ranks = [self._rank(full, r) for r in (0, 1)]
            for n in (None, 4):
                with self.subTest(dense=dense, n=n):
                    x, scalar, topk = _inputs(full, 9, n)
                    with torch.no_grad():
                        whole = full(x, scalar)
                        with mock.patch("torch.distributed.all_reduce") as all_reduce:
                            parts = [
                                _expert_pairs(m, lambda m=m: m(x, scalar))
                                for m in ranks
                            ]
                    self.assertEqual(all_reduce.call_count, 2)
                    total = parts[0][0] + parts[1][0]
                    if dense:  # each rank's down matmul sums its own experts
                        torch.testing.assert_close(total, whole, **DENSE_TOL)
                    else:
                        # top_k 2: each row is c_a + c_b on one process, 0 + c_a
                        # and 0 + c_b on the ranks: the sum is bitwise the same.
                        self.assertTrue(torch.equal(total, whole))
                    if n is not None:
                        self.assertTrue(bool((total[n:] == 0).all()))
                    real = topk.topk_ids[: 9 if n is None else n].view(-1)
                    for r, (_, pairs) in enumerate(parts):
                        mine = int(((real >= 4 * r) & (real < 4 * r + 4)).sum())
                        grouped = sum(rows for _, rows in pairs["grouped"])
                        self.assertEqual(pairs["dense"] if dense else grouped, mine)
                        self.assertEqual(grouped + pairs["dense"], mine)
                        self.assertTrue(all(0 <= e < 4 for e, _ in pairs["grouped"]))


if __name__ == "__main__":
    unittest.main()

"""MoE routing: select_experts masks rows >= num_token_non_padded, and EPMoE
gives those rows weight 0 for every expert (dense path) or computes them
with no expert (grouped path); either way their output is exactly 0
(single process, EP size 1)."""

import unittest
from unittest import mock

import torch
import torch.nn.functional as F

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.layers.moe.token_dispatcher import _pack, _unpack
from sglang.srt.layers.moe.topk import TopKOutput, select_experts
from sglang.srt.models.registry import init_random_weights
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase, expert_groups

register_cpu_ci(est_time=3, suite="base-a-test-cpu")
register_cuda_ci(est_time=10, stage="base-b", runner_config="1-gpu-large")

T, E, TOP_K, HIDDEN, INTER = 7, 6, 2, 16, 24


def _scalar(n: int, device="cpu") -> torch.Tensor:
    return torch.tensor(n, dtype=torch.int32, device=device)


def _router_logits(device="cpu", dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(T, E, generator=gen).to(device=device, dtype=dtype)


def _reference_topk(logits: torch.Tensor):
    # Our own routing: sort the softmax, keep top_k, renormalize.
    probs = torch.softmax(logits.double(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept = sorted_probs[:, :TOP_K]
    return order[:, :TOP_K], kept / kept.sum(dim=-1, keepdim=True)


class TestSelectExperts(CustomTestCase):
    def _check_unmasked(self, out: TopKOutput, logits: torch.Tensor):
        ids, weights = _reference_topk(logits.cpu())
        self.assertEqual(out.topk_ids.dtype, torch.int64)
        self.assertEqual(tuple(out.topk_ids.shape), (T, TOP_K))
        self.assertTrue(torch.equal(out.topk_ids.cpu(), ids))
        torch.testing.assert_close(
            out.topk_weights.cpu().double(), weights, rtol=1e-6, atol=1e-6
        )
        sums = out.topk_weights.float().sum(dim=-1).cpu()
        torch.testing.assert_close(sums, torch.ones(T), rtol=0, atol=1e-6)

    def test_none_masks_nothing(self):
        logits = _router_logits()
        out = select_experts(router_logits=logits, top_k=TOP_K)
        self._check_unmasked(out, logits)
        self.assertTrue(bool(((out.topk_ids >= 0) & (out.topk_ids < E)).all()))
        # top_k distinct experts per row
        self.assertTrue(bool((out.topk_ids[:, 0] != out.topk_ids[:, 1]).all()))

    def _check_masked(self, device):
        logits = _router_logits(device)
        full = select_experts(router_logits=logits, top_k=TOP_K)
        for n in range(T + 1):
            with self.subTest(n=n):
                out = select_experts(
                    router_logits=logits,
                    top_k=TOP_K,
                    num_token_non_padded=_scalar(n, device),
                )
                self.assertEqual(out.topk_ids.device, logits.device)
                self.assertTrue(torch.equal(out.topk_ids[:n], full.topk_ids[:n]))
                self.assertTrue(
                    torch.equal(out.topk_weights[:n], full.topk_weights[:n])
                )
                self.assertTrue(bool((out.topk_ids[n:] == -1).all()))
                self.assertTrue(bool((out.topk_weights[n:] == 0).all()))
                self.assertEqual(int((out.topk_ids == -1).sum()), (T - n) * TOP_K)

    def test_scalar_masks_rows_from_n(self):
        self._check_masked("cpu")

    def test_zero_masks_all_and_t_masks_none(self):
        logits = _router_logits()
        full = select_experts(router_logits=logits, top_k=TOP_K)
        none_left = select_experts(
            router_logits=logits, top_k=TOP_K, num_token_non_padded=_scalar(0)
        )
        self.assertTrue(bool((none_left.topk_ids == -1).all()))
        self.assertEqual(none_left.topk_weights.abs().sum().item(), 0.0)
        all_left = select_experts(
            router_logits=logits, top_k=TOP_K, num_token_non_padded=_scalar(T)
        )
        self.assertTrue(torch.equal(all_left.topk_ids, full.topk_ids))
        self.assertTrue(torch.equal(all_left.topk_weights, full.topk_weights))

    def test_weights_keep_the_logits_dtype(self):
        logits = _router_logits(dtype=torch.bfloat16)
        out = select_experts(
            router_logits=logits, top_k=TOP_K, num_token_non_padded=_scalar(3)
        )
        self.assertEqual(out.topk_weights.dtype, torch.bfloat16)
        # Routing is computed in fp32, so the ids match the fp32 reference.
        ids, _ = _reference_topk(logits.float())
        self.assertTrue(torch.equal(out.topk_ids[:3], ids[:3]))

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_scalar_masks_rows_from_n_cuda(self):
        self._check_masked("cuda")
        logits = _router_logits("cuda")
        self._check_unmasked(select_experts(router_logits=logits, top_k=TOP_K), logits)


class _ExpertSpy:
    """Records what reaches an expert: the input rows of each expert in every
    grouped EPMoE._experts_grouped call, and every dense forward's routing
    weights."""

    def __init__(self):
        self.calls = []  # (expert id, rows [r, H])
        self.routing = []  # [T, E_local] weights of each dense forward
        self._grouped, self._routing = EPMoE._experts_grouped, EPMoE._routing_weights

    def experts_grouped(self, module, xs, offs):
        self.calls += [(e, x.detach().clone()) for e, x in expert_groups(xs, offs)]
        return self._grouped(module, xs, offs)

    def routing_weights(self, module, topk, *, masked):
        weights = self._routing(module, topk, masked=masked)
        self.routing.append(weights.clone())
        return weights

    def pairs(self) -> int:
        """(row, expert) pairs that reach an expert with a nonzero weight."""
        grouped = sum(x.shape[0] for _, x in self.calls)
        return grouped + sum(int((w != 0).sum()) for w in self.routing)


def _make_moe(device="cpu") -> EPMoE:
    moe = EPMoE(hidden_size=HIDDEN, intermediate_size=INTER, num_experts=E, top_k=TOP_K)
    init_random_weights(moe, seed=0)
    return moe.to(device)


def _reference_moe(moe: EPMoE, x: torch.Tensor) -> torch.Tensor:
    # Dense: every expert on every row, weighted by the renormalized top-k.
    ids, weights = _reference_topk(F.linear(x, moe.gate.weight))
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for e in range(E):
        gate, up = F.linear(xd, moe.w13[e].double()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, moe.w2[e].double())
        w = (weights * (ids == e)).sum(dim=-1, keepdim=True)
        out += w * y
    return out


class TestEPMoE(CustomTestCase):
    """Each check runs on both paths: dense (the default at these 7 rows)
    and grouped (forced by a zero threshold)."""

    def setUp(self):
        super().setUp()
        self.moe = _make_moe()
        self.x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(9))

    def _forward(self, n=None, *, dense: bool):
        self.moe.dense_max_row_experts = 10**9 if dense else 0
        spy = _ExpertSpy()

        # Plain functions, so they bind as methods like the real ones.
        def experts_grouped(module, xs, offs):
            return spy.experts_grouped(module, xs, offs)

        def routing_weights(module, topk, *, masked):
            return spy.routing_weights(module, topk, masked=masked)

        with (
            mock.patch.object(EPMoE, "_experts_grouped", experts_grouped),
            mock.patch.object(EPMoE, "_routing_weights", routing_weights),
            torch.no_grad(),
        ):
            out = self.moe(self.x, None if n is None else _scalar(n))
        # The path asked for is the one that ran.
        self.assertEqual(len(spy.routing), int(dense))
        if dense:
            self.assertEqual(spy.calls, [])
        return out, spy

    def test_single_process_holds_every_expert(self):
        self.assertEqual((self.moe.ep_size, self.moe.num_local), (1, E))
        self.assertEqual(self.moe.first_local, 0)

    def test_unmasked_output_matches_dense_reference(self):
        for dense in (True, False):
            with self.subTest(dense=dense):
                out, spy = self._forward(dense=dense)
                torch.testing.assert_close(
                    out.double(),
                    _reference_moe(self.moe, self.x),
                    rtol=1e-5,
                    atol=1e-5,
                )
                # Every row reaches exactly top_k experts.
                self.assertEqual(spy.pairs(), T * TOP_K)

    def test_masked_rows_are_zero_and_real_rows_unchanged(self):
        for dense in (True, False):
            full, _ = self._forward(dense=dense)
            for n in (0, 1, 4, T):
                with self.subTest(dense=dense, n=n):
                    out, spy = self._forward(n, dense=dense)
                    torch.testing.assert_close(out[:n], full[:n], rtol=1e-6, atol=1e-6)
                    self.assertTrue(bool((out[n:] == 0).all()))
                    self.assertEqual(spy.pairs(), n * TOP_K)

    def test_masked_rows_reach_no_expert(self):
        n = 3
        # Dense: padded rows have weight 0 for every expert, real rows top_k.
        _, spy = self._forward(n, dense=True)
        (weights,) = spy.routing
        self.assertEqual((weights[n:] != 0).sum().item(), 0)
        self.assertEqual((weights[:n] != 0).sum(dim=1).tolist(), [TOP_K] * n)
        # Grouped: padded rows are never an expert's input.
        _, spy = self._forward(n, dense=False)
        self.assertGreater(len(spy.calls), 0)
        seen = torch.cat([x for _, x in spy.calls])
        # Each row an expert computed is one of the real rows, never padding.
        match = (seen.unsqueeze(1) == self.x.unsqueeze(0)).all(dim=-1)  # [r, T]
        self.assertTrue(bool(match[:, :n].any(dim=1).all()))
        self.assertFalse(bool(match[:, n:].any()))
        # ... and each real row reached exactly top_k experts.
        self.assertEqual(match[:, :n].sum(dim=0).tolist(), [TOP_K] * n)

    def test_a_dtype_round_trip_remakes_the_dense_weights(self):
        # .to() and back gives the weights new storage (rounded through
        # bfloat16), possibly at the old address: the dense path's copies
        # follow every time, as the grouped path's views do.
        for _ in range(6):
            self._forward(dense=True)  # made from the current weights
            self.moe.to(torch.bfloat16).to(torch.float32)
            dense, _ = self._forward(dense=True)
            grouped, _ = self._forward(dense=False)
            torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-5)

    def test_bad_top_k(self):
        for top_k in (0, E + 1):
            with self.subTest(top_k=top_k):
                with self.assertRaisesRegex(ValueError, "top_k"):
                    EPMoE(
                        hidden_size=HIDDEN,
                        intermediate_size=INTER,
                        num_experts=E,
                        top_k=top_k,
                    )

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_cuda_runs_dense_and_matches_the_cpu(self):
        moe, x = _make_moe("cuda"), self.x.cuda()
        moe.dense_max_row_experts = 0  # ignored on CUDA: always dense
        n = _scalar(4, "cuda")
        with (
            mock.patch.object(EPMoE, "_experts_grouped", side_effect=AssertionError),
            torch.no_grad(),
        ):
            full = moe(x)
            masked = moe(x, n)
        torch.testing.assert_close(masked[:4], full[:4], rtol=1e-5, atol=1e-5)
        self.assertTrue(bool((masked[4:] == 0).all()))
        torch.testing.assert_close(
            full.double().cpu(),
            _reference_moe(moe.cpu(), self.x),
            rtol=1e-4,
            atol=1e-4,
        )


class TestDispatchPacking(CustomTestCase):
    def test_expert_ids_round_trip_exactly_or_are_refused(self):
        # The dispatch sends ids in the hidden dtype: bfloat16 holds every
        # int up to 256, so 256 experts round-trip and 257 are refused.
        ids = torch.tensor([[255, 0], [-1, 254], [128, 129]])
        topk = TopKOutput(topk_weights=torch.rand(3, 2), topk_ids=ids)
        x = torch.randn(3, 8, dtype=torch.bfloat16)
        _, back = _unpack(_pack(x, topk, 256), 8, 2, torch.float32)
        self.assertTrue(torch.equal(back.topk_ids, ids))
        with self.assertRaisesRegex(ValueError, "257 experts: .*up to 256"):
            _pack(x, topk, 257)
        _pack(x.float(), topk, 257)  # float32: exact up to 2**24


if __name__ == "__main__":
    unittest.main()

"""MoE FFN whose experts are split over the EP group.

Every rank holds ``num_experts / ep_size`` experts and sees the same rows;
it computes its experts' share and one all-reduce over the EP group sums
the shares. Eagerly, (row, expert) pairs are sorted by expert once and each
hit expert runs on its rows only; rows whose expert id is -1 are computed by
no expert. Under CUDA-graph capture shapes must be static, so every local
expert runs on every row and -1 rows get weight 0 (their output is still
exactly 0).
The all-reduce always carries the whole [T, H] tensor.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.moe.topk import TopKOutput, select_experts
from sglang.srt.runtime_context import get_parallel


class EPMoE(nn.Module):
    def __init__(
        self, *, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int
    ) -> None:
        super().__init__()
        parallel = get_parallel()
        self.ep_size, self.ep_rank = parallel.moe_ep_size, parallel.moe_ep_rank
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by moe_ep_size={self.ep_size}"
            )
        if self.ep_size > 1 and parallel.moe_ep_group is None:
            raise ValueError(
                f"moe_ep_size={self.ep_size} needs an initialized EP group"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.ep_group = parallel.moe_ep_group
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local = num_experts // self.ep_size
        self.first_local = self.ep_rank * self.num_local
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        # Only this rank's experts: gate+up fused [E_local, 2 * I, H], down [E_local, H, I].
        self.w13 = nn.Parameter(
            torch.empty(self.num_local, 2 * intermediate_size, hidden_size)
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_local, hidden_size, intermediate_size)
        )
        # 1..E_local: searched in the sorted expert ids, the ends of the groups.
        self.register_buffer(
            "_expert_ends", torch.arange(1, self.num_local + 1), persistent=False
        )
        self._weight_views_key: Optional[Tuple[int, int]] = None
        self._weight_views: Tuple[Tuple[torch.Tensor, ...], ...] = ()

    def load_full_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Take this rank's slice of the full expert weights (every rank has all)."""
        local = slice(self.first_local, self.first_local + self.num_local)
        with torch.no_grad():
            self.w13.copy_(w13[local])
            self.w2.copy_(w2[local])

    def _expert_weights(self) -> Tuple[Tuple[torch.Tensor, ...], ...]:
        """Per-expert transposed views ([H, 2I] and [I, H]): F.linear's
        operands without its per-call select and transpose. Made once per
        weight storage; a .to() or a reassigned .data makes new ones."""
        key = (self.w13.data_ptr(), self.w2.data_ptr())
        if self._weight_views_key != key:
            self._weight_views = tuple(
                tuple(w.detach().transpose(1, 2).unbind(0)) for w in (self.w13, self.w2)
            )
            self._weight_views_key = key
        return self._weight_views

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, H] -> [rows, H]; F.linear's arithmetic (mm with W.t()).
        w13_t, w2_t = self._expert_weights()
        gate, up = torch.mm(x, w13_t[e]).chunk(2, dim=-1)
        return torch.mm(F.silu(gate).mul_(up), w2_t[e])

    def forward(self, x: torch.Tensor, num_token_non_padded=None) -> torch.Tensor:
        # x: [T, H]
        topk = select_experts(
            router_logits=self.gate(x),
            top_k=self.top_k,
            num_token_non_padded=num_token_non_padded,
        )
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self._forward_static(x, topk)
        else:
            masked = num_token_non_padded is not None
            out = self._forward_grouped(x, topk, masked=masked)
        if self.ep_size > 1:
            dist.all_reduce(out, group=self.ep_group)
        return out

    def _forward_grouped(
        self, x: torch.Tensor, topk: TopKOutput, *, masked: bool
    ) -> torch.Tensor:
        """Rows sorted by expert once; each hit expert runs on its own rows.

        A stable sort keeps each expert's rows in ascending order, so each
        expert computes the same rows in the same order as a loop over
        experts would, and index_add_ adds each row's shares in ascending
        expert order: the same arithmetic. One host read (the group ends); -1
        ids and other ranks' experts sort past the local ones, uncomputed.
        """
        num_rows, top_k = topk.topk_ids.shape
        ids = topk.topk_ids.view(-1)  # [T * top_k], flat index = row * top_k + j
        local = ids - self.first_local if self.first_local else ids
        if self.ep_size > 1 or masked:
            # Not this rank's (or -1, masked): a sentinel past every local expert.
            routed = (local >= 0) & (local < self.num_local)
            local = torch.where(routed, local, self.num_local)
        sorted_ids, order = torch.sort(local, stable=True)  # [T * top_k] each
        # ends[e]: where expert e's pairs end in the sorted order (searchsorted,
        # not bincount: CUDA's bincount reads the max back, a second sync).
        ends = torch.searchsorted(sorted_ids, self._expert_ends).tolist()
        num_routed = ends[-1]
        out = torch.zeros_like(x)
        if num_routed == 0:
            return out
        if num_routed < order.shape[0]:
            order = order[:num_routed]
        rows = order // top_k  # [R], expert-major, ascending rows per expert
        sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
        xs = x.index_select(0, rows).split(sizes)
        ys = [self._expert(e, xe) for e, xe in enumerate(xs) if xe.shape[0]]
        y = torch.cat(ys) if len(ys) > 1 else ys[0]  # [R, H]
        y *= topk.topk_weights.view(-1).index_select(0, order).unsqueeze(1)
        return out.index_add_(0, rows, y)

    def _forward_static(self, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Graph capture needs static shapes: every local expert on every row,
        weight 0 where not routed (so -1 rows come out exactly 0)."""
        local_ids = topk.topk_ids - self.first_local  # -1 stays out of range
        out = torch.zeros_like(x)
        for e in range(self.num_local):
            weight = (topk.topk_weights * (local_ids == e)).sum(dim=-1)  # [T]
            out += weight.unsqueeze(1) * self._expert(e, x)
        return out

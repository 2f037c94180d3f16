"""MoE FFN whose experts are split over the EP group.

Every rank holds ``num_experts / ep_size`` experts and sees the same rows;
it computes its experts' share and one all-reduce over the EP group sums
the shares. Eagerly, rows whose expert id is -1 are computed by no expert;
under CUDA-graph capture shapes must be static, so every local expert runs
on every row and -1 rows get weight 0 (their output is still exactly 0).
The all-reduce always carries the whole [T, H] tensor.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.moe.topk import select_experts
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

    def load_full_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Take this rank's slice of the full expert weights (every rank has all)."""
        local = slice(self.first_local, self.first_local + self.num_local)
        with torch.no_grad():
            self.w13.copy_(w13[local])
            self.w2.copy_(w2[local])

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[e])

    def forward(self, x: torch.Tensor, num_token_non_padded=None) -> torch.Tensor:
        # x: [T, H]
        topk = select_experts(
            router_logits=self.gate(x),
            top_k=self.top_k,
            num_token_non_padded=num_token_non_padded,
        )
        local_ids = topk.topk_ids - self.first_local  # -1 stays out of range
        out = torch.zeros_like(x)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        for e in range(self.num_local):
            hit = local_ids == e  # [T, top_k]
            weight = (topk.topk_weights * hit).sum(dim=-1)  # [T]
            if capturing:
                # A graph needs static shapes: every row, weight 0 where not routed.
                out += weight.unsqueeze(1) * self._expert(e, x)
                continue
            rows = hit.any(dim=-1).nonzero().squeeze(1)
            if rows.numel():
                y = self._expert(e, x.index_select(0, rows))
                out.index_add_(0, rows, weight[rows].unsqueeze(1) * y)
        if self.ep_size > 1:
            dist.all_reduce(out, group=self.ep_group)
        return out

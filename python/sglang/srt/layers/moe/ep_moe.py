"""MoE FFN whose experts are split over the EP group.

Every rank holds ``num_experts / ep_size`` experts. The rows reach them
through a dispatcher (``token_dispatcher``): without DP attention every rank
sees the same rows and one all-reduce over the EP group sums the shares;
with it each rank brings its own rows, gathered from every rank or sent
all-to-all only where their experts live. Two ways to compute a rank's
share of the rows it gets, the same function:

- dense (``T * E_local <= dense_max_row_experts``, always on CUDA, so also
  under CUDA-graph capture, and under ``torch.compile``): every local expert on every row in two matmuls
  over all local experts at once, each expert's share scaled by the row's
  routing weight for it (0 where not routed). A constant op count and no
  host read: on these tiny shapes a step costs what it dispatches more than
  what it multiplies. Padded rows (expert id -1) are computed and multiplied
  by 0, so their output is exactly 0;
- grouped (eager CPU, more rows): (row, expert) pairs sorted by expert once,
  then one grouped matmul per projection (``torch._grouped_mm``: each
  expert's weights on its own rows only), bitwise equal to a loop over
  experts in float32 (in a narrower dtype the one scatter-add rounds each
  row's sum once, where a loop rounds after every expert); sizes whose rows
  are not 16-byte multiples, which the grouped matmul refuses, run dense.
  Padded rows and other ranks' pairs sort last and are never
  computed: one host read of how many pairs are this rank's, made only
  when there can be others (EP > 1 or masked rows); their output is
  exactly 0. Past the threshold the dense path's E_local / top_k times
  more multiply-adds cost more than the grouped path's extra ops (sort,
  gather, scatter-add).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.moe.token_dispatcher import make_dispatcher
from sglang.srt.layers.moe.topk import TopKOutput, select_experts
from sglang.srt.runtime_context import get_parallel

# Dense up to this many rows * local experts (20 rows over 8 experts, 40
# over 4): past it the dense path's E_local / top_k times more multiply-adds
# cost more than the grouped path's extra ops on one CPU thread (the
# crossover is measured in docs/benchmarks.md).
DENSE_MAX_ROW_EXPERTS = 160


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
        self.intermediate_size = intermediate_size
        self.num_local = num_experts // self.ep_size
        # None on one rank; its stats count what this layer sends.
        self.dispatcher = make_dispatcher(
            group=self.ep_group,
            ep_size=self.ep_size,
            ep_rank=self.ep_rank,
            num_local=self.num_local,
            enable_dp_attention=parallel.enable_dp_attention,
            a2a_backend=parallel.moe_a2a_backend,
        )
        self.first_local = self.ep_rank * self.num_local
        self.dense_max_row_experts = DENSE_MAX_ROW_EXPERTS
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        # Only this rank's experts: gate+up fused [E_local, 2 * I, H], down [E_local, H, I].
        self.w13 = nn.Parameter(
            torch.empty(self.num_local, 2 * intermediate_size, hidden_size)
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_local, hidden_size, intermediate_size)
        )
        # 1..E_local: searched in the sorted expert ids, the ends of the
        # local experts' groups (unrouted pairs sort after the last).
        self.register_buffer(
            "_expert_ends", torch.arange(1, self.num_local + 1), persistent=False
        )
        # Layouts derived from w13/w2, remade when a weight changes.
        self._derived_key: Optional[Tuple[int, ...]] = None
        self._derived_from: Tuple[torch.UntypedStorage, ...] = ()
        self._grouped_experts: Tuple[torch.Tensor, ...] = ()
        self._all_experts: Tuple[torch.Tensor, ...] = ()
        # torch._grouped_mm on the CPU needs every row stride (H, I, 2I
        # elements) a multiple of 16 bytes; other sizes take the dense path.
        self._grouped_ok = True

    def load_full_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Take this rank's slice of the full expert weights (every rank has all)."""
        local = slice(self.first_local, self.first_local + self.num_local)
        with torch.no_grad():
            self.w13.copy_(w13[local])
            self.w2.copy_(w2[local])

    def _derived_weights(self) -> None:
        """Remake the layouts below when a weight's storage (a .to(), a new
        .data) or its version (a copy_, a load) changed since the last call.
        The storages they were made from are held, so that a new one cannot
        take their address unseen. (An in-place write through ``.data``
        bypasses the version: update weights with ``copy_``, as loaders do.)"""
        w13, w2 = self.w13, self.w2
        key = (w13.data_ptr(), w13._version, w2.data_ptr(), w2._version)
        if self._derived_key == key:
            return
        self._derived_from = (w13.untyped_storage(), w2.untyped_storage())
        self._grouped_experts, self._all_experts = self._layouts(
            w13.detach(), w2.detach()
        )
        row_sizes = (w13.shape[-1], self.intermediate_size)
        self._grouped_ok = all(n * w13.element_size() % 16 == 0 for n in row_sizes)
        self._derived_key = key

    def _layouts(self, w13: torch.Tensor, w2: torch.Tensor):
        """The weights as each path multiplies them. Grouped: [E_local, H,
        2I] and [E_local, I, H], transposed views, multiplied as F.linear
        multiplies (x @ W.t(): bitwise its results). Dense: all local experts
        side by side, copied: w13 as [H, 2 * E_local * I] (every gate, then
        every up: each half of the product is one contiguous block per row),
        w2 as [E_local * I, H]."""
        inter, hidden = self.intermediate_size, w13.shape[-1]
        gates_ups = torch.cat(
            (w13[:, :inter].reshape(-1, hidden), w13[:, inter:].reshape(-1, hidden))
        )
        return (w13.transpose(1, 2), w2.transpose(1, 2)), (
            gates_ups.t(),
            w2.transpose(1, 2).reshape(-1, hidden).contiguous(),
        )

    def dense_layout_nbytes(self) -> int:
        """The bytes ``_layouts`` copies (the dense path's weights; the
        grouped ones are views), held beside the weights once made."""
        return self.w13.nbytes + self.w2.nbytes

    def _weights(self, dense: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """The path's weights: the cached layouts (made without autograd),
        or, when the experts' weights train, made from them this forward so
        that their gradients reach them."""
        if torch.is_grad_enabled() and (
            self.w13.requires_grad or self.w2.requires_grad
        ):
            grouped, all_experts = self._layouts(self.w13, self.w2)
        else:
            grouped, all_experts = self._grouped_experts, self._all_experts
        return all_experts if dense else grouped

    def forward(
        self, x: torch.Tensor, num_token_non_padded=None, forward_batch=None
    ) -> torch.Tensor:
        """x: [T, H]. ``forward_batch`` (the forward's, for its DP counts and
        mode) is needed under DP attention only."""
        topk = select_experts(
            router_logits=self.gate(x),
            top_k=self.top_k,
            num_token_non_padded=num_token_non_padded,
        )
        masked = num_token_non_padded is not None
        if not torch.compiler.is_compiling():  # compiled code reads them as made
            self._derived_weights()
        if self.dispatcher is None:
            return self._experts(x, topk, masked=masked)
        rows, routed, handle = self.dispatcher.dispatch(x, topk, forward_batch)
        out = self._experts(rows, routed, masked=masked or self.dispatcher.masked_rows)
        return self.dispatcher.combine(out, handle, forward_batch)

    def _experts(
        self, x: torch.Tensor, topk: TopKOutput, *, masked: bool
    ) -> torch.Tensor:
        """This rank's experts' share of every row of ``x``."""
        # CUDA and torch.compile: always dense (static shapes for capture, no
        # host read; the grouped matmul has no CPU compile support).
        if (
            x.is_cuda
            or torch.compiler.is_compiling()
            or not self._grouped_ok
            or x.shape[0] * self.num_local <= self.dense_max_row_experts
        ):
            return self._forward_dense(x, topk, masked=masked)
        return self._forward_grouped(x, topk, masked=masked)

    def _routing_weights(self, topk: TopKOutput, *, masked: bool) -> torch.Tensor:
        """[T, E_local]: each row's weight for each local expert; 0 for the
        experts it is not routed to, other ranks' experts, and every expert
        of a padded row."""
        ids = topk.topk_ids  # [T, top_k]
        if masked:  # a -1 row's weights are 0: any in-range column takes them
            ids = ids.clamp_min(0)
        weights = torch.zeros(
            ids.shape[0],
            self.num_experts,
            dtype=topk.topk_weights.dtype,
            device=ids.device,
        ).scatter_(
            1, ids, topk.topk_weights
        )  # [T, E]
        if self.ep_size > 1:
            weights = weights[:, self.first_local : self.first_local + self.num_local]
        return weights

    def _forward_dense(
        self, x: torch.Tensor, topk: TopKOutput, *, masked: bool
    ) -> torch.Tensor:
        """Every local expert on every row: one matmul for all gates and ups,
        one for all downs. Each expert's activations are scaled by the row's
        weight before the down projection: that projection is linear, so the
        result is the routed experts' weighted sum (rounded differently from
        the grouped path, not a different function)."""
        num_rows, width = x.shape[0], self.num_local * self.intermediate_size
        w13, w2 = self._weights(dense=True)
        weights = self._routing_weights(topk, masked=masked)  # [T, E_local]
        h = torch.mm(x, w13)  # [T, 2 * E_local * I]: gates, then ups
        # In h's gate half: [T, E_local * I], a strided view (mm reads it as
        # is); out of place where autograd needs the gates for the backward.
        act = F.silu(h[:, :width], inplace=not h.requires_grad).mul_(h[:, width:])
        act.view(num_rows, self.num_local, self.intermediate_size).mul_(
            weights.unsqueeze(-1)
        )
        return torch.mm(act, w2)  # [T, H]

    def _experts_grouped(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """xs: [R, H], grouped by expert; offs: [E_local] int32, each
        group's end (the last is R). Local expert e multiplies rows
        offs[e - 1]:offs[e], F.linear's arithmetic per group."""
        w13, w2 = self._weights(dense=False)
        inter = self.intermediate_size
        h = torch._grouped_mm(xs, w13, offs=offs)  # [R, 2I]: gates, then ups
        # In h's gates (out of place where autograd needs them), as dense.
        act = F.silu(h[:, :inter], inplace=not h.requires_grad).mul_(h[:, inter:])
        return torch._grouped_mm(act, w2, offs=offs)

    def _forward_grouped(
        self, x: torch.Tensor, topk: TopKOutput, *, masked: bool
    ) -> torch.Tensor:
        """Pairs sorted by expert once; one grouped matmul per projection.

        A stable sort keeps each expert's rows in ascending order, so each
        expert multiplies the same rows in the same order as a loop over
        experts would, and index_add_ adds each row's shares in ascending
        expert order: the same arithmetic. -1 ids (masked) and other ranks'
        experts sort after the local ones and are cut off unread (one host
        read of where, only when there can be any): their rows' output is
        exactly 0, and at EP size n a rank multiplies its own ~1 / n of the
        pairs only.
        """
        top_k = topk.topk_ids.shape[1]
        ids = topk.topk_ids.view(-1)  # [T * top_k], flat index = row * top_k + j
        local = ids - self.first_local if self.first_local else ids
        unrouted = self.ep_size > 1 or masked  # pairs no local expert takes
        if unrouted:
            # Not this rank's (or -1, masked): sorted past the local ones.
            routed = (local >= 0) & (local < self.num_local)
            local = torch.where(routed, local, self.num_local)
        sorted_ids, order = torch.sort(local, stable=True)  # [T * top_k] each
        # offs[e]: where expert e's pairs end in the sorted order, on the device.
        offs = torch.searchsorted(sorted_ids, self._expert_ends, out_int32=True)
        if unrouted:  # cut them off: one host read (this path is eager only)
            num_routed = int(offs[-1])
            if num_routed == 0:
                return torch.zeros_like(x)
            order = order[:num_routed]
        weights = topk.topk_weights.view(-1).index_select(0, order)
        # Pair -> row (expert-major, ascending rows per expert), in order's
        # own storage, read above and not again; unless autograd keeps order
        # for the weights' backward.
        if weights.requires_grad:
            rows = order // top_k
        else:
            rows = order.floor_divide_(top_k)
        y = self._experts_grouped(x.index_select(0, rows), offs)  # [T * top_k, H]
        y *= weights.unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, rows, y)

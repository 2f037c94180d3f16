"""How MoE rows reach the ranks that own their experts, and come back.

One interface, three dispatchers (upstream keeps one per backend under
``layers/moe/token_dispatcher/``); ``dispatch`` returns the rows this rank's
experts compute, with their routing, and ``combine`` turns this rank's
shares of them into its own rows' output:

- ``AllReduceDispatcher``: expert parallelism without DP attention. Every
  rank holds the same rows; it computes its experts' share of each, and one
  all-reduce of the whole ``[T, H]`` output sums the shares.
- ``DpGatherDispatcher`` (``moe_a2a_backend="none"`` under DP attention):
  each rank has its own rows. They are gathered from every rank, each
  rank's padded to the longest, every rank computes its experts' share of
  all of them, an all-reduce sums the shares, and each rank keeps its own
  rows. Padded rows travel (masked, they reach no expert).
- ``AllToAllDispatcher`` (``moe_a2a_backend="all_to_all"``): each row goes
  only to the ranks that own one of its experts (``all_to_all_single`` with
  per-rank splits), comes back as that rank's share, and the shares are
  summed at home. Rows at or past ``num_token_non_padded`` have expert id
  -1 (``select_experts``): they are never sent. Eager only: the splits are
  read on the host.

Every dispatcher counts what this rank sends to the other ranks, per
forward mode (``DispatchStats``): row copies, padded rows among them, and
bytes of hidden states, of routing (expert ids and weights) and of the
combine; a rank's own share never leaves it and is not counted. Counted in
eager forwards (a CUDA graph replays without Python; a compiled forward
skips the count).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sglang.srt.layers.moe.topk import TopKOutput


@dataclass
class DispatchStats:
    """What this rank handed to the MoE's collectives, summed over calls."""

    calls: int = 0
    rows: int = 0  # rows the forwards brought to the MoE
    real_rows: int = 0  # of those, before num_token_non_padded
    # Row copies sent to other ranks (a row to two other ranks: 2); for an
    # all-reduce, the rows of the reduced tensor.
    sent_rows: int = 0
    padded_rows_sent: int = 0  # of those, copies of rows past the real ones
    hidden_bytes: int = 0  # hidden states sent out (dispatch)
    routing_bytes: int = 0  # expert ids and weights sent with them
    # Shares sent back to other ranks, or the whole tensor all-reduced (its
    # bytes on the wire depend on the all-reduce's algorithm).
    combine_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.hidden_bytes + self.routing_bytes + self.combine_bytes


def _pack(x: torch.Tensor, topk: TopKOutput, num_experts: int) -> torch.Tensor:
    """[T, H + 2k]: each row's hidden state, expert weights and expert ids
    (small ints: exact in the hidden dtype), sent as one message."""
    exact = round(2 / torch.finfo(x.dtype).eps)  # every int up to it is exact
    if num_experts > exact:
        raise ValueError(
            f"{num_experts} experts: their ids are not exact in {x.dtype} (up "
            f"to {exact}), which the MoE dispatch packs them in"
        )
    ids = topk.topk_ids.to(x.dtype)
    return torch.cat((x, topk.topk_weights.to(x.dtype), ids), dim=1)


def _unpack(
    packed: torch.Tensor, hidden: int, top_k: int, weight_dtype
) -> Tuple[torch.Tensor, TopKOutput]:
    x = packed[:, :hidden].contiguous()
    weights = packed[:, hidden : hidden + top_k].to(weight_dtype).contiguous()
    ids = packed[:, hidden + top_k :].to(torch.int64)
    return x, TopKOutput(topk_weights=weights, topk_ids=ids)


class _Dispatcher:
    def __init__(self, *, group, ep_size: int, ep_rank: int, num_local: int):
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank
        self.num_local = num_local
        # Keyed by the forward mode's name ("" when no batch is given).
        self.stats: Dict[str, DispatchStats] = {}

    def _count(
        self, forward_batch, *, rows: int, sent_rows: int, padded: int, **nbytes
    ) -> None:
        if torch.compiler.is_compiling():
            return
        mode = "" if forward_batch is None else forward_batch.forward_mode.name
        s = self.stats.setdefault(mode, DispatchStats())
        s.calls += 1
        s.rows += rows
        s.real_rows += _real_rows(forward_batch, rows)
        s.sent_rows += sent_rows
        s.padded_rows_sent += padded
        for name, n in nbytes.items():
            setattr(s, name, getattr(s, name) + n)


def _real_rows(forward_batch, rows: int) -> int:
    """The forward's real rows, as the host knows them (all without a batch)."""
    if forward_batch is None:
        return rows
    return min(rows, forward_batch.num_token_non_padded_cpu)


class AllReduceDispatcher(_Dispatcher):
    """Replicated rows: compute every row, all-reduce the shares."""

    masked_rows = False  # the rows are the forward's own: masked as it says

    def dispatch(self, x, topk, forward_batch):
        return x, topk, None

    def combine(self, out: torch.Tensor, handle, forward_batch) -> torch.Tensor:
        rows, row_bytes = out.shape[0], out.shape[1] * out.element_size()
        self._count(
            forward_batch,
            rows=rows,
            sent_rows=rows,
            padded=rows - _real_rows(forward_batch, rows),
            combine_bytes=rows * row_bytes,
        )
        dist.all_reduce(out, group=self.group)
        return out


class DpGatherDispatcher(_Dispatcher):
    """Every rank's rows, each rank's padded to the longest, on every rank."""

    masked_rows = True  # gather padding: expert id -1 on every rank

    def dispatch(self, x, topk, forward_batch):
        if forward_batch is None or forward_batch.global_num_tokens_cpu is None:
            raise ValueError(
                "DP attention's MoE gather needs the forward's global_num_tokens_cpu"
            )
        rows = x.shape[0]
        # The same on every rank: decode steps run the same padded rows
        # everywhere, a prefill's longest prompt covers every rank's rows.
        longest = max([rows] + list(forward_batch.global_num_tokens_cpu))
        packed = _pack(x, topk, self.num_local * self.ep_size)
        if longest > rows:
            pad = packed.new_zeros(longest - rows, packed.shape[1])
            pad[:, -topk.topk_ids.shape[1] :] = -1  # no expert
            packed = torch.cat((packed, pad))
        parts = [torch.empty_like(packed) for _ in range(self.ep_size)]
        dist.all_gather(parts, packed, group=self.group)
        hidden, top_k = x.shape[1], topk.topk_ids.shape[1]
        gathered_x, gathered_topk = _unpack(
            torch.cat(parts), hidden, top_k, topk.topk_weights.dtype
        )
        peers = self.ep_size - 1  # each gets this rank's padded rows
        self._count(
            forward_batch,
            rows=rows,
            sent_rows=longest * peers,
            padded=(longest - _real_rows(forward_batch, rows)) * peers,
            hidden_bytes=longest * peers * hidden * x.element_size(),
            routing_bytes=longest * peers * 2 * top_k * x.element_size(),
            combine_bytes=self.ep_size * longest * hidden * x.element_size(),
        )
        return gathered_x, gathered_topk, (rows, longest)

    def combine(self, out: torch.Tensor, handle, forward_batch) -> torch.Tensor:
        rows, longest = handle
        dist.all_reduce(out, group=self.group)
        start = self.ep_rank * longest
        return out[start : start + rows]


class AllToAllDispatcher(_Dispatcher):
    """Each real row to the ranks owning its experts; shares summed at home."""

    masked_rows = False  # only routed rows arrive

    def dispatch(self, x, topk, forward_batch):
        ids = topk.topk_ids  # [T, k]; -1: a padded row, routed nowhere
        owner = torch.where(ids >= 0, ids // self.num_local, -1)
        ranks = torch.arange(self.ep_size, device=ids.device)
        to_rank = (owner.unsqueeze(-1) == ranks).any(dim=1)  # [T, ep]
        # (rank, row) pairs, rank-major, rows ascending within a rank.
        dest, row = to_rank.t().nonzero(as_tuple=True)
        send_counts = to_rank.sum(dim=0)  # [ep]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits: List[int] = send_counts.tolist()
        recv_splits: List[int] = recv_counts.tolist()
        packed = _pack(x, topk, self.num_local * self.ep_size).index_select(0, row)
        received = packed.new_empty(sum(recv_splits), packed.shape[1])
        dist.all_to_all_single(
            received, packed, recv_splits, send_splits, group=self.group
        )
        hidden, top_k = x.shape[1], topk.topk_ids.shape[1]
        rows, me = x.shape[0], self.ep_rank
        remote = dest != me  # this rank's own share stays here
        sent = sum(send_splits) - send_splits[me]
        size = x.element_size()
        self._count(
            forward_batch,
            rows=rows,
            sent_rows=sent,
            padded=int((remote & (row >= _real_rows(forward_batch, rows))).sum()),
            hidden_bytes=sent * hidden * size,
            routing_bytes=sent * 2 * top_k * size,
            combine_bytes=(sum(recv_splits) - recv_splits[me]) * hidden * size,
        )
        recv_x, recv_topk = _unpack(received, hidden, top_k, topk.topk_weights.dtype)
        return recv_x, recv_topk, (row, send_splits, recv_splits, rows)

    def combine(self, out: torch.Tensor, handle, forward_batch) -> torch.Tensor:
        row, send_splits, recv_splits, rows = handle
        back = out.new_empty(sum(send_splits), out.shape[1])
        dist.all_to_all_single(back, out, send_splits, recv_splits, group=self.group)
        # A row sent to two ranks gets both shares, in rank order.
        return out.new_zeros(rows, out.shape[1]).index_add_(0, row, back)


def make_dispatcher(
    *,
    group,
    ep_size: int,
    ep_rank: int,
    num_local: int,
    enable_dp_attention: bool,
    a2a_backend: str,
) -> Optional[_Dispatcher]:
    """The dispatcher of this parallel layout; None on one rank."""
    if ep_size == 1:
        return None
    if not enable_dp_attention:
        cls = AllReduceDispatcher
    elif a2a_backend == "all_to_all":
        cls = AllToAllDispatcher
    else:
        cls = DpGatherDispatcher
    return cls(group=group, ep_size=ep_size, ep_rank=ep_rank, num_local=num_local)

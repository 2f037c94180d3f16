"""VerifyWindow: the gamma + 1 positions and KV slots of one decode step.

Computed once per step, before the proposer runs: the draft block uses the
first gamma entries, the target's verify batch all gamma + 1.
"""

from dataclasses import dataclass
from typing import Dict, Tuple

import torch


@dataclass(frozen=True)
class VerifyWindow:
    """Views of the planner's buffers: valid until the next ``plan``."""

    positions: torch.Tensor  # [bs, gamma + 1]: seq_len - 1 .. seq_len - 1 + gamma
    out_cache_loc: torch.Tensor  # [bs, gamma + 1]


class VerifyWindowPlanner:
    """Fills preallocated [max_bs, gamma + 1] buffers with ``out=`` ops."""

    def __init__(
        self, *, req_to_token: torch.Tensor, gamma: int, max_batch_size: int, device
    ) -> None:
        self.req_to_token = req_to_token  # [max_reqs + 1, context_len] int64
        self._flat_table = req_to_token.view(-1)
        shape = (max_batch_size, gamma + 1)
        self._offsets = torch.arange(gamma + 1, device=device) - 1
        self._positions = torch.zeros(shape, dtype=torch.int64, device=device)
        self._table_index = torch.zeros(shape, dtype=torch.int64, device=device)
        self._slots = torch.zeros(shape, dtype=torch.int64, device=device)
        # Per batch size: the buffers cut to it, made once (no per-step views).
        self._views: Dict[int, Tuple[torch.Tensor, ...]] = {}

    def _cut(self, bs: int) -> Tuple[torch.Tensor, ...]:
        views = self._views.get(bs)
        if views is None:
            index, slots = self._table_index[:bs], self._slots[:bs]
            views = (self._positions[:bs], index, index.view(-1), slots, slots.view(-1))
            self._views[bs] = views
        return views

    def plan(
        self,
        *,
        seq_lens: torch.Tensor,  # [bs] int64
        req_pool_indices: torch.Tensor,  # [bs] int64
    ) -> VerifyWindow:
        bs = seq_lens.shape[0]
        positions, index, flat_index, slots, flat_slots = self._cut(bs)
        torch.add(
            seq_lens.unsqueeze(1), self._offsets, out=positions
        )  # [bs, gamma + 1]
        # slots[b, j] = req_to_token[req_pool_indices[b], positions[b, j]],
        # gathered from the flat table into a preallocated buffer.
        width = self.req_to_token.shape[1]
        torch.add(positions, req_pool_indices.unsqueeze(1), alpha=width, out=index)
        torch.index_select(self._flat_table, 0, flat_index, out=flat_slots)
        return VerifyWindow(positions=positions, out_cache_loc=slots)

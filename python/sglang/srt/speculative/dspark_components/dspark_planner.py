"""VerifyWindow: the gamma + 1 positions and KV slots of one decode step.

Computed once per step, before the proposer runs: the draft block uses the
first gamma entries, the target's verify batch all gamma + 1.
"""

from dataclasses import dataclass

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
        shape = (max_batch_size, gamma + 1)
        self._offsets = torch.arange(gamma + 1, device=device) - 1
        self._positions = torch.zeros(shape, dtype=torch.int64, device=device)
        self._table_index = torch.zeros(shape, dtype=torch.int64, device=device)
        self._slots = torch.zeros(shape, dtype=torch.int64, device=device)

    def plan(
        self,
        *,
        seq_lens: torch.Tensor,  # [bs] int64
        req_pool_indices: torch.Tensor,  # [bs] int64
    ) -> VerifyWindow:
        bs = seq_lens.shape[0]
        positions = self._positions[:bs]  # [bs, gamma + 1]
        torch.add(seq_lens.unsqueeze(1), self._offsets, out=positions)
        # slots[b, j] = req_to_token[req_pool_indices[b], positions[b, j]],
        # gathered from the flat table into a preallocated buffer.
        index = self._table_index[:bs]
        width = self.req_to_token.shape[1]
        torch.add(positions, req_pool_indices.unsqueeze(1), alpha=width, out=index)
        slots = self._slots[:bs]
        torch.index_select(
            self.req_to_token.view(-1), 0, index.view(-1), out=slots.view(-1)
        )
        return VerifyWindow(positions=positions, out_cache_loc=slots)

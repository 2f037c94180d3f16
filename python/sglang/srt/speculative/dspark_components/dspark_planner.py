"""VerifyWindow: the gamma + 1 positions and KV slots of one decode step.

Filled once per step, first: the draft block uses the first gamma entries,
the target's verify batch all gamma + 1.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyWindow:
    """Views of the step buffers: valid until the next step fills them."""

    positions: torch.Tensor  # [bs, gamma + 1]: seq_len - 1 .. seq_len - 1 + gamma
    out_cache_loc: torch.Tensor  # [bs, gamma + 1]


class VerifyWindowPlanner:
    """Fills a step's window with ``out=`` ops (three kernels, no host read)."""

    def __init__(self, *, req_to_token: torch.Tensor, gamma: int, device) -> None:
        self.req_to_token = req_to_token  # [max_reqs + 1, context_len] int64
        self._flat_table = req_to_token.view(-1)
        self._offsets = torch.arange(gamma + 1, device=device) - 1  # [gamma + 1]

    def plan(
        self,
        *,
        seq_lens: torch.Tensor,  # [bs, 1] int64
        req_pool_indices: torch.Tensor,  # [bs, 1] int64
        window: VerifyWindow,  # filled in place
        table_index: torch.Tensor,  # [bs, gamma + 1] scratch
        flat_table_index: torch.Tensor,  # [bs * (gamma + 1)]: its flat view
        flat_slots: torch.Tensor,  # [bs * (gamma + 1)]: window.out_cache_loc's
    ) -> VerifyWindow:
        """Columns in and flat views given, so that a step reshapes nothing."""
        positions = window.positions
        torch.add(seq_lens, self._offsets, out=positions)  # [bs, gamma + 1]
        # slots[b, j] = req_to_token[req_pool_indices[b], positions[b, j]],
        # gathered from the flat table.
        width = self.req_to_token.shape[1]
        torch.add(positions, req_pool_indices, alpha=width, out=table_index)
        torch.index_select(self._flat_table, 0, flat_table_index, out=flat_slots)
        return window

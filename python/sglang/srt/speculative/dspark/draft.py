"""DSpark draft: one forward pass proposes a block of gamma tokens."""

import numbers
from typing import Optional

import torch
from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded


def _make_num_token_non_padded(
    num_tokens: int, device: torch.device | str
) -> Optional[torch.Tensor]:
    """The int32 device scalar the EP MoE router reads, or None when unread.

    Building it is a host-to-device copy every decode step; on EP size 1
    nothing reads it, so nothing is made.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
        raise ValueError(
            f"num_tokens must be an int, got {type(num_tokens).__name__} "
            f"{num_tokens!r}"
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not enable_num_token_non_padded():
        return None
    return torch.tensor(int(num_tokens), dtype=torch.int32).to(
        device, non_blocking=True
    )

"""Expert selection; the one reader of ``num_token_non_padded``."""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TopKOutput:
    topk_weights: torch.Tensor  # [T, top_k] float
    topk_ids: torch.Tensor  # [T, top_k] int64; -1 means "no expert"


def select_experts(
    *,
    router_logits: torch.Tensor,  # [T, num_experts]
    top_k: int,
    num_token_non_padded: Optional[torch.Tensor] = None,  # [] int32
) -> TopKOutput:
    """Softmax top-k routing, renormalized over the chosen experts.

    Rows at or past ``num_token_non_padded`` are padding: their expert ids
    become -1 so that no expert computes them and EP never sends them.
    ``None`` masks nothing.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    topk_weights.div_(topk_weights.sum(dim=-1, keepdim=True))  # topk's own output
    if num_token_non_padded is not None:
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
        padded = (rows >= num_token_non_padded).unsqueeze(1)  # [T, 1]
        topk_ids = topk_ids.masked_fill(padded, -1)
        topk_weights = topk_weights.masked_fill(padded, 0.0)
    return TopKOutput(
        topk_weights=topk_weights.to(router_logits.dtype), topk_ids=topk_ids
    )

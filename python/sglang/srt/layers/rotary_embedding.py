"""Rotary positions (neox layout).

A model holds one ``RotaryEmbedding``; each forward gathers the rows' cos/sin
once (``cos_sin``) and every layer applies them with ``apply_rotary_``, in
place.
"""

from typing import Tuple

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables built once, laid out so that one rotation is
    ``x * cos + swap_halves(x) * sin`` over the whole head (see apply_rotary)."""

    def __init__(self, head_dim: int, max_position: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()  # [max_position, head_dim // 2] each
        # [max_position, 1, head_dim]: (cos, cos) and (-sin, sin), so the first
        # half gets x1*cos - x2*sin and the second x2*cos + x1*sin; the 1
        # broadcasts over heads, so a gather is all a forward needs.
        full_cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        full_sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1)
        self.register_buffer("cos", full_cos, persistent=False)
        self.register_buffer("sin", full_sin, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32  # [T]
    ) -> Tuple[torch.Tensor, torch.Tensor]:  # [T, 1, head_dim] each
        """The rows' tables, gathered once per forward for every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, heads, head_dim], left as it is (a copy rotates)
        return apply_rotary_(x.clone(), *self.cos_sin(positions, x.dtype))


def apply_rotary_(
    x: torch.Tensor,  # [T, heads, head_dim], rotated in place
    cos: torch.Tensor,  # [T, 1, head_dim]: (cos, cos), x's dtype
    sin: torch.Tensor,  # [T, 1, head_dim]: (-sin, sin)
) -> torch.Tensor:  # x
    """Neox rotation in four kernels, written into ``x`` (a layer's own
    projection, a strided view of it as often as not: upstream's kernels
    rotate q and k in place too). The same products and sums as
    ``cat(x1*cos - x2*sin, x2*cos + x1*sin)``: a - b == a + (-b) exactly.
    One copy, the swapped halves, where an out-of-place rotation makes two."""
    if cos.dtype != x.dtype:  # in place would round the product to x's dtype
        raise ValueError(f"rotary tables are {cos.dtype}, x is {x.dtype}")
    half = x.shape[-1] // 2
    # (x2, x1), a copy. On the CPU one roll (fewer ops than unflatten, flip
    # and flatten); on CUDA the flip, one kernel over the strided q/k view,
    # where roll would first copy it to contiguous memory.
    if x.is_cuda:
        swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    else:
        swapped = x.roll(half, -1)
    return x.mul_(cos).add_(swapped.mul_(sin))

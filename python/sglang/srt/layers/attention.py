"""Attention over a slot-indexed KV cache, with static shapes (graph-safe).

Each row writes its K/V at its KV slot first, then attends every key
position ``< kv_lens[row]`` of its request. ``kv_lens = position + 1`` is
causal; giving a whole block the same ``kv_lens`` makes it non-causal.

What every layer of one forward shares is built once, in
``AttentionMetadata``: the KV slots to gather, the mask and the rows'
rotary tables; by the model at the top of its forward, or by a caller,
ahead, to share it further (a DSpark step builds the verify's once and the
draft block and the context write read it). Keys are read only up to
``kv_bound``: the batch's longest ``kv_lens``, given by the caller from
host-side sequence lengths (no device read), or the table's full width
under CUDA-graph capture, whose shapes are static.

A ragged batch (a verify where each request checks its own number of
drafts) runs only some places of its [bs, q_len] grid: ``query_index``
says which. The mask covers the whole grid; the rows' queries are placed
into it for the attention (places not run see key 0, their output unread)
and read back out: the projections and experts run on the rows only.

This layer takes plain tensors: it knows nothing of the batch types above it.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from sglang.srt.layers.rotary_embedding import RotaryEmbedding


def kv_read_bound(
    *,
    max_kv_len: Optional[int],
    kv_lens: torch.Tensor,
    width: int,
    capturing: bool,
) -> int:
    """Key positions a forward reads per request: ``width`` (the request->slot
    table's) under capture; else the longest of ``kv_lens``, from the host's
    ``max_kv_len`` when given, or read from the device (one host sync)."""
    if capturing:
        return width
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max())
    return min(max_kv_len, width)


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per forward (or once per DSpark step), read by every layer."""

    batch_size: int
    q_len: int  # query rows per request
    kv_bound: int  # key positions read per request
    kv_slots: torch.Tensor  # [bs * kv_bound] int64, request-major KV slots
    # [bs, 1, q_len, kv_bound] float: 0 seen, -inf not; [bs, 1, 1, kv_bound]
    # when every row of a request sees the same keys (a draft block).
    attn_mask: torch.Tensor
    cos: torch.Tensor  # [T, 1, head_dim], the rows' rotary tables
    sin: torch.Tensor  # [T, 1, head_dim]
    # A ragged batch's rows' places in the grid, and the grid of queries
    # they are placed into; None when every place is a row.
    query_index: Optional[torch.Tensor] = None  # [T]
    query_grid: Optional[torch.Tensor] = None  # [bs * q_len, heads, head_dim]

    @classmethod
    def init_new(
        cls,
        *,
        req_to_token: torch.Tensor,  # [max_reqs + 1, width] int64
        req_pool_indices: torch.Tensor,  # [bs]
        positions: torch.Tensor,  # [T]
        kv_lens: torch.Tensor,  # [bs * q_len]: every place of the grid
        q_len: int,
        kv_bound: int,
        rotary: RotaryEmbedding,
        dtype,
        query_index: Optional[torch.Tensor] = None,  # [T]; None: T = bs * q_len
        query_shape: Optional[tuple] = None,  # (heads, head_dim), with query_index
    ) -> "AttentionMetadata":
        bs = req_pool_indices.shape[0]
        slots = req_to_token[:, :kv_bound][req_pool_indices]  # [bs, kv_bound]
        key_pos = torch.arange(kv_bound, device=slots.device)
        hidden = key_pos >= kv_lens.view(bs, 1, q_len, 1)
        # The float mask SDPA would build from a bool one, built once here.
        mask = torch.zeros(hidden.shape, dtype=dtype, device=slots.device)
        cos, sin = rotary.cos_sin(positions, dtype)
        grid = None
        if query_index is not None:
            grid = torch.zeros(
                (bs * q_len,) + tuple(query_shape), dtype=dtype, device=slots.device
            )
        return cls(
            batch_size=bs,
            q_len=q_len,
            kv_bound=kv_bound,
            kv_slots=slots.view(-1),
            attn_mask=mask.masked_fill_(hidden, float("-inf")),
            cos=cos,
            sin=sin,
            query_index=query_index,
            query_grid=grid,
        )


def slot_attention(
    *,
    q: torch.Tensor,  # [T, heads, dim]
    k_cache: torch.Tensor,  # [num_slots + 1, heads, dim]: this layer's keys
    v_cache: torch.Tensor,  # [num_slots + 1, heads, dim]
    metadata: AttentionMetadata,
) -> torch.Tensor:  # [T, heads * dim]
    bs, q_len = metadata.batch_size, metadata.q_len
    heads, dim = q.shape[1], q.shape[2]
    shape = (bs, metadata.kv_bound, heads, dim)
    k = k_cache.index_select(0, metadata.kv_slots).view(shape)
    v = v_cache.index_select(0, metadata.kv_slots).view(shape)
    ragged = metadata.query_index is not None
    if ragged:  # the rows' queries into their places (the others: any value)
        q = metadata.query_grid.index_copy_(0, metadata.query_index, q)
    out = F.scaled_dot_product_attention(
        q.view(bs, q_len, heads, dim).transpose(1, 2),  # [bs, heads, q_len, dim]
        k.transpose(1, 2),  # [bs, heads, L, dim]
        v.transpose(1, 2),
        attn_mask=metadata.attn_mask,  # [bs, 1, q_len, L]
    )
    out = out.transpose(1, 2).reshape(bs * q_len, heads * dim)
    return out.index_select(0, metadata.query_index) if ragged else out

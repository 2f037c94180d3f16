"""Attention over a slot-indexed KV cache, with static shapes (graph-safe).

Each row writes its K/V at ``out_cache_loc`` first, then attends every key
position ``< kv_lens[row]`` of its request. ``kv_lens = position + 1`` is
causal; giving a whole block the same ``kv_lens`` makes it non-causal.

What every layer of one forward shares is built once, at the top of the
model's forward, in ``AttentionMetadata``: the KV slots to gather, the mask
and the rows' rotary tables; or by the caller, ahead, to share it further
(``ForwardBatch.attn_metadata``: a DSpark step builds the verify's once and
the draft block and the context write read it; the block reads the
verify's slots and mask up to its own bound, one key less). Keys are read
only up to ``kv_bound``: eagerly the batch's longest ``kv_lens`` (one host read per forward), under
CUDA-graph capture the table's full width, because a graph's shapes are
static and a per-replay bound would need a device read, a sync, on every
step (on a GPU the extra gather is cheap next to the launch it would stall).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def kv_read_bound(*, kv_lens: torch.Tensor, width: int, capturing: bool) -> int:
    """Key positions a forward reads per request: the longest of ``kv_lens``
    (one host read), or ``width`` (the request->slot table's) under capture."""
    if capturing:
        return width
    return min(int(kv_lens.max()), width)


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per forward by the model (or ahead, by a caller that shares
    it: ``ForwardBatch.attn_metadata``), read by every layer."""

    kv_bound: int  # key positions read per request
    kv_slots: torch.Tensor  # [bs * kv_bound] int64, request-major KV slots
    # [bs, 1, q_len, kv_bound] float: 0 seen, -inf not; [bs, 1, 1, kv_bound]
    # when every row of a request sees the same keys (a draft block).
    attn_mask: torch.Tensor
    cos: torch.Tensor  # [T, 1, head_dim], the rows' rotary tables
    sin: torch.Tensor  # [T, 1, head_dim]

    @classmethod
    def init_new(
        cls, *, forward_batch: ForwardBatch, rotary: RotaryEmbedding, dtype
    ) -> "AttentionMetadata":
        bs, q_len = forward_batch.batch_size, forward_batch.tokens_per_req
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        kv_lens = forward_batch.kv_lens  # [T]
        bound = kv_read_bound(
            kv_lens=kv_lens,
            width=req_to_token.shape[1],
            capturing=kv_lens.is_cuda and torch.cuda.is_current_stream_capturing(),
        )
        slots = req_to_token[:, :bound][forward_batch.req_pool_indices]  # [bs, L]
        key_pos = torch.arange(bound, device=slots.device)
        hidden = key_pos >= kv_lens.view(bs, 1, q_len, 1)
        # The float mask SDPA would build from a bool one, built once here.
        mask = torch.zeros(hidden.shape, dtype=dtype, device=slots.device)
        cos, sin = rotary.cos_sin(forward_batch.positions, dtype)
        return cls(
            kv_bound=bound,
            kv_slots=slots.view(-1),
            attn_mask=mask.masked_fill_(hidden, float("-inf")),
            cos=cos,
            sin=sin,
        )


def slot_attention(
    *,
    q: torch.Tensor,  # [T, heads, dim]
    layer: int,
    forward_batch: ForwardBatch,
    metadata: AttentionMetadata,
) -> torch.Tensor:  # [T, heads * dim]
    bs, q_len = forward_batch.batch_size, forward_batch.tokens_per_req
    heads, dim = q.shape[1], q.shape[2]
    kv_pool = forward_batch.token_to_kv_pool
    shape = (bs, metadata.kv_bound, heads, dim)
    k = kv_pool.k[layer].index_select(0, metadata.kv_slots).view(shape)
    v = kv_pool.v[layer].index_select(0, metadata.kv_slots).view(shape)
    out = F.scaled_dot_product_attention(
        q.view(bs, q_len, heads, dim).transpose(1, 2),  # [bs, heads, q_len, dim]
        k.transpose(1, 2),  # [bs, heads, L, dim]
        v.transpose(1, 2),
        attn_mask=metadata.attn_mask,  # [bs, 1, q_len, L]
    )
    return out.transpose(1, 2).reshape(bs * q_len, heads * dim)

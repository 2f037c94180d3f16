"""Attention over a slot-indexed KV cache, with static shapes (graph-safe).

Each row writes its K/V at ``out_cache_loc`` first, then attends every key
position ``< kv_lens[row]`` of its request. ``kv_lens = position + 1`` is
causal; giving a whole block the same ``kv_lens`` makes it non-causal.
"""

import torch
import torch.nn.functional as F

from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def slot_attention(
    *,
    q: torch.Tensor,  # [T, heads, dim]
    layer: int,
    forward_batch: ForwardBatch,
) -> torch.Tensor:  # [T, heads * dim]
    bs, q_len = forward_batch.batch_size, forward_batch.tokens_per_req
    heads, dim = q.shape[1], q.shape[2]
    kv_pool = forward_batch.token_to_kv_pool
    req_to_token = forward_batch.req_to_token_pool.req_to_token
    slots = req_to_token[forward_batch.req_pool_indices]  # [bs, L]
    k = kv_pool.k[layer][slots]  # [bs, L, heads, dim]
    v = kv_pool.v[layer][slots]
    key_pos = torch.arange(slots.shape[1], device=q.device)
    mask = key_pos.view(1, 1, -1) < forward_batch.kv_lens.view(bs, q_len, 1)
    out = F.scaled_dot_product_attention(
        q.view(bs, q_len, heads, dim).transpose(1, 2),  # [bs, heads, q_len, dim]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),  # [bs, 1, q_len, L]
    )
    return out.transpose(1, 2).reshape(bs * q_len, heads * dim)

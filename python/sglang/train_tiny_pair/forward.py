"""Differentiable forwards of the embedded target and DSpark draft.

The inference forwards (``TinyMoEForCausalLM.forward``,
``DSparkDraftModel.forward``) run without autograd over a slot-indexed KV
cache. Training needs gradients over whole sequences, so these functions
recompute the same arithmetic from the same modules' parameters:

- ``target_forward``: causal LM over ``[B, T]`` byte ids, returning logits
  and the hidden states of the draft's target layers, concatenated;
- ``draft_block_logits``: the DSpark block for every anchor position at
  once, as inference feeds it: context = those hidden states, ``fc`` +
  RMSNorm, written only as keys/values at positions ``< anchor``; the block
  ``[anchor, mask, ...]`` at positions ``anchor .. anchor + gamma - 1``
  attends the context and its whole block (non-causal); slot k's logits get
  the Markov correction of the token at ``anchor + k`` (teacher forced).

``test/registered/core/test_trained_pair.py`` checks both against the engine.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.models.dspark import DSparkDraftModel
from sglang.srt.models.tiny_moe import TinyMoEAttention, TinyMoEForCausalLM

ROPE_BASE = 10000.0


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox-layout rotary; x: [B, T, heads, dim], positions: [T]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (
        ROPE_BASE ** (torch.arange(0, dim, 2, device=x.device).float() / dim)
    )
    freqs = torch.outer(positions.float(), inv_freq)  # [T, dim // 2]
    cos, sin = freqs.cos()[:, None].to(x.dtype), freqs.sin()[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def moe(mlp: EPMoE, x: torch.Tensor) -> torch.Tensor:
    """Top-k MoE on [N, hidden] rows; every expert local (EP size 1)."""
    if mlp.num_local != mlp.num_experts:
        raise ValueError("training runs on EP size 1")
    probs = torch.softmax(F.linear(x, mlp.gate.weight).float(), dim=-1)
    weights, ids = torch.topk(probs, mlp.top_k, dim=-1)  # [N, top_k]
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(mlp.num_experts):
        hit = ids == e
        rows = hit.any(dim=-1).nonzero().squeeze(1)
        if rows.numel():
            gate, up = F.linear(x.index_select(0, rows), mlp.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, mlp.w2[e])
            w = (weights * hit).sum(dim=-1).index_select(0, rows)
            out = out.index_add(0, rows, w.unsqueeze(1) * y)
    return out


def _heads(attn: TinyMoEAttention, x: torch.Tensor) -> torch.Tensor:
    return x.view(*x.shape[:-1], attn.num_heads, attn.head_dim)


def _qkv(attn: TinyMoEAttention, h, positions):
    # h: [B, T, hidden] -> q, k, v: [B, heads, T, dim], rotary on q and k
    q, k, v = (_heads(attn, t) for t in F.linear(h, attn.qkv_proj.weight).chunk(3, -1))
    return (
        rope(q, positions).transpose(1, 2),
        rope(k, positions).transpose(1, 2),
        v.transpose(1, 2),
    )


def _mlp_residual(layer, x: torch.Tensor) -> torch.Tensor:
    h = rms_norm(layer.post_attention_layernorm, x)
    return x + moe(layer.mlp, h.reshape(-1, h.shape[-1])).view_as(x)


def target_forward(
    model: TinyMoEForCausalLM,
    ids: torch.Tensor,  # [B, T] int64
    *,
    capture: Sequence[int] = (),
    start: int = 0,
    cache: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logits [B, T, vocab] and the ``capture`` layers' outputs [B, T, n * hidden].

    With ``cache`` (per layer K, V: [B, heads, max_len, dim], no autograd),
    ``ids`` sit at positions ``start ..``: a prompt at 0, or one token later.
    """
    B, T = ids.shape
    if cache is not None and start > 0 and T != 1:
        raise ValueError("a cached forward past the prompt takes one token per row")
    positions = torch.arange(start, start + T, device=ids.device)
    x = F.embedding(ids, model.embed_tokens.weight)  # [B, T, hidden]
    captured = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = _qkv(attn, rms_norm(layer.input_layernorm, x), positions)
        if cache is not None:
            ck, cv = cache[i]
            ck[:, :, start : start + T], cv[:, :, start : start + T] = k, v
            k, v = ck[:, :, : start + T], cv[:, :, : start + T]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0)
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, -1), attn.o_proj.weight)
        x = _mlp_residual(layer, x)
        if i in capture:
            captured.append(x)
    logits = F.linear(rms_norm(model.norm, x), model.lm_head.weight)
    return logits, torch.cat(captured, dim=-1) if captured else None


def draft_block_logits(
    draft: DSparkDraftModel,
    *,
    aux_hidden: torch.Tensor,  # [B, T, n * hidden]: target_forward's capture
    ids: torch.Tensor,  # [B, T]: the sequence, teacher forced
    anchors: torch.Tensor,  # [A] int64, each <= T - gamma, shared by all rows
    gamma: int,
) -> torch.Tensor:  # [B, A, gamma, vocab]: Markov-corrected logits
    """Slot k of the block at anchor p predicts the token at p + k + 1."""
    B, T = ids.shape
    A = anchors.shape[0]
    if A and int(anchors.max()) > T - gamma:
        raise ValueError(f"anchors must be <= T - gamma = {T - gamma}")
    context = rms_norm(draft.context_norm, F.linear(aux_hidden, draft.fc.weight))
    block_pos = (anchors.unsqueeze(1) + torch.arange(gamma, device=ids.device)).view(
        -1
    )  # [A * gamma]
    block_ids = torch.full((B, A, gamma), draft.config.mask_token_id, device=ids.device)
    block_ids[:, :, 0] = ids[:, anchors]
    x = F.embedding(block_ids.view(B, -1), draft.embed_tokens.weight)
    # Row of anchor p sees context keys j < p and its own block's keys.
    owner = torch.arange(A, device=ids.device).repeat_interleave(gamma)  # [A * gamma]
    mask = torch.cat(
        (
            torch.arange(T, device=ids.device).unsqueeze(0)
            < anchors[owner].unsqueeze(1),
            owner.unsqueeze(1) == owner.unsqueeze(0),
        ),
        dim=1,
    )  # [A * gamma, T + A * gamma]
    hidden = context.shape[-1]
    for layer in draft.layers:
        attn = layer.self_attn
        # The context becomes K/V only: no input norm, no MLP (write_kv).
        ck, cv = F.linear(context, attn.qkv_proj.weight[hidden:]).chunk(2, -1)
        ck = rope(_heads(attn, ck), torch.arange(T, device=ids.device)).transpose(1, 2)
        cv = _heads(attn, cv).transpose(1, 2)
        q, k, v = _qkv(attn, rms_norm(layer.input_layernorm, x), block_pos)
        a = F.scaled_dot_product_attention(
            q, torch.cat((ck, k), dim=2), torch.cat((cv, v), dim=2), attn_mask=mask
        )
        x = x + F.linear(
            a.transpose(1, 2).reshape(B, A * gamma, -1), attn.o_proj.weight
        )
        x = _mlp_residual(layer, x)
    base = F.linear(rms_norm(draft.norm, x), draft.lm_head.weight)
    prev = ids[:, block_pos]  # [B, A * gamma]: token at p + k, the anchor for k = 0
    correction = F.linear(
        F.embedding(prev, draft.markov_w1.weight), draft.markov_w2.weight
    )
    return (base + correction).view(B, A, gamma, -1)

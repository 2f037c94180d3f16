"""Target model: a tiny decoder with an MoE FFN that can return the hidden
states of chosen layers (the DSpark draft's context)."""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.attention import AttentionMetadata, kv_read_bound, slot_attention
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, apply_rotary_
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ModelOutput,
)


@dataclass(frozen=True)
class TinyMoEConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 96
    max_position: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def init_attention_metadata(
    forward_batch: ForwardBatch,
    *,
    rotary: RotaryEmbedding,
    dtype,
    query_shape: Optional[tuple] = None,  # (heads, head_dim): a ragged batch's
) -> AttentionMetadata:
    """The attention metadata of a batch: keys up to its host-known longest
    kv_len (the table's width under CUDA-graph capture)."""
    req_to_token = forward_batch.req_to_token_pool.req_to_token
    kv_lens = forward_batch.kv_lens
    return AttentionMetadata.init_new(
        req_to_token=req_to_token,
        req_pool_indices=forward_batch.req_pool_indices,
        positions=forward_batch.positions,
        kv_lens=kv_lens,
        q_len=forward_batch.tokens_per_req,
        kv_bound=kv_read_bound(
            max_kv_len=forward_batch.max_kv_len,
            kv_lens=kv_lens,
            width=req_to_token.shape[1],
            capturing=kv_lens.is_cuda and torch.cuda.is_current_stream_capturing(),
        ),
        rotary=rotary,
        dtype=dtype,
        query_index=forward_batch.query_index,
        query_shape=query_shape,
    )


class TinyMoEAttention(nn.Module):
    def __init__(self, config: TinyMoEConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        h = config.hidden_size
        self.qkv_proj = nn.Linear(h, 3 * h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def write_kv(
        self,
        *,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim], the rows' rotary tables
        sin: torch.Tensor,
        kv_pool,
        out_cache_loc: torch.Tensor,  # [T]
    ) -> None:
        """K/V of ``hidden`` into this layer's cache at ``out_cache_loc``:
        the projection's K and V rows only (no query is asked of them)."""
        heads = self.num_heads
        kv_weight = self.qkv_proj.weight[heads * self.head_dim :]  # [2 * H, H]
        kv = F.linear(hidden, kv_weight).view(-1, 2 * heads, self.head_dim)
        k = apply_rotary_(kv[:, :heads], cos, sin)
        kv_pool.write(self.layer_id, out_cache_loc, k, kv[:, heads:])

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        forward_batch: ForwardBatch,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        heads = self.num_heads
        qkv = self.qkv_proj(hidden).view(-1, 3 * heads, self.head_dim)
        # q and k rotated together: one set of kernels for both.
        qk = apply_rotary_(qkv[:, : 2 * heads], metadata.cos, metadata.sin)
        forward_batch.token_to_kv_pool.write(
            self.layer_id,
            forward_batch.out_cache_loc,
            qk[:, heads:],
            qkv[:, 2 * heads :],
        )
        kv_pool = forward_batch.token_to_kv_pool
        out = slot_attention(
            q=qk[:, :heads],
            k_cache=kv_pool.k[self.layer_id],
            v_cache=kv_pool.v[self.layer_id],
            metadata=metadata,
        )
        return self.o_proj(out)


class TinyMoEDecoderLayer(nn.Module):
    def __init__(
        self, config: TinyMoEConfig, layer_id: int, *, num_experts: int, top_k: int
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = TinyMoEAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = EPMoE(
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            num_experts=num_experts,
            top_k=top_k,
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        forward_batch: ForwardBatch,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), forward_batch, metadata)
        hidden = attn.add_(hidden)  # a fresh tensor: the residual adds in place
        moe_out = self.mlp(
            self.post_attention_layernorm(hidden),
            forward_batch.num_token_non_padded,
            forward_batch=forward_batch,
        )
        return moe_out.add_(hidden)


class TinyMoEForCausalLM(nn.Module):
    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TinyMoEDecoderLayer(
                config, i, num_experts=config.num_experts, top_k=config.top_k
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layers_to_capture: Tuple[int, ...] = ()
        # One table for every layer: each forward gathers its rows' cos/sin once.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position)

    def set_layers_to_capture(self, layer_ids: Sequence[int]) -> None:
        """Layers whose outputs are returned, concatenated, when asked to capture."""
        ids = tuple(layer_ids)
        if any(not 0 <= i < self.config.num_layers for i in ids):
            raise ValueError(
                f"layer ids {ids} out of range for {self.config.num_layers} layers"
            )
        self.layers_to_capture = ids

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> AttentionMetadata:
        """What every layer of a forward over this batch shares."""
        c = self.config
        return init_attention_metadata(
            forward_batch,
            rotary=self.rotary_emb,
            dtype=self.embed_tokens.weight.dtype,
            query_shape=(c.num_heads, c.head_dim),
        )

    @torch.no_grad()
    def forward(self, forward_batch: ForwardBatch) -> ModelOutput:
        hidden = self.embed_tokens(forward_batch.input_ids)  # [T, H]
        metadata = forward_batch.attn_metadata
        if metadata is None:
            metadata = self.init_forward_metadata(forward_batch)
        captured = []
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, forward_batch, metadata)
            if i in self.layers_to_capture:
                captured.append(hidden)
        logits = self.lm_head(self.norm(hidden))
        aux = None
        mode = forward_batch.capture_hidden_mode
        if mode.need_capture():
            if not captured:
                raise ValueError("hidden capture asked for, but no layers are set")
            aux = torch.cat(captured, dim=-1)
            if mode == CaptureHiddenMode.LAST:
                q = forward_batch.tokens_per_req
                aux = aux.view(forward_batch.batch_size, q, -1)[:, -1]
        return ModelOutput(logits=logits, aux_hidden_states=aux)

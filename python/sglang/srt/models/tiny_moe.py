"""Target model: a tiny decoder with an MoE FFN that can return the hidden
states of chosen layers (the DSpark draft's context)."""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from sglang.srt.layers.attention import slot_attention
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch


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


@dataclass(frozen=True)
class ModelOutput:
    logits: torch.Tensor  # [T, vocab]
    aux_hidden_states: Optional[torch.Tensor] = None  # [T, n_layers * hidden]


class TinyMoEAttention(nn.Module):
    def __init__(self, config: TinyMoEConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        h = config.hidden_size
        self.qkv_proj = nn.Linear(h, 3 * h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position)

    def write_kv(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> None:
        """K/V of ``hidden`` into this layer's cache at ``out_cache_loc``."""
        h = hidden.shape[-1]
        k, v = self.qkv_proj(hidden)[:, h:].split(h, dim=-1)
        self._write(positions, k, v, forward_batch)

    def _write(self, positions, k, v, forward_batch: ForwardBatch) -> None:
        k = self.rotary(positions, k.view(-1, self.num_heads, self.head_dim))
        v = v.view(-1, self.num_heads, self.head_dim)
        forward_batch.token_to_kv_pool.write(
            self.layer_id, forward_batch.out_cache_loc, k, v
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        self._write(positions, k, v, forward_batch)
        q = self.rotary(positions, q.view(-1, self.num_heads, self.head_dim))
        out = slot_attention(q=q, layer=self.layer_id, forward_batch=forward_batch)
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

    def forward(self, positions, hidden, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            positions, self.input_layernorm(hidden), forward_batch
        )
        moe_out = self.mlp(
            self.post_attention_layernorm(hidden), forward_batch.num_token_non_padded
        )
        return hidden + moe_out


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

    def set_layers_to_capture(self, layer_ids: Sequence[int]) -> None:
        """Layers whose outputs are returned, concatenated, when asked to capture."""
        ids = tuple(layer_ids)
        if any(not 0 <= i < self.config.num_layers for i in ids):
            raise ValueError(
                f"layer ids {ids} out of range for {self.config.num_layers} layers"
            )
        self.layers_to_capture = ids

    @torch.no_grad()
    def forward(self, forward_batch: ForwardBatch) -> ModelOutput:
        positions = forward_batch.positions
        hidden = self.embed_tokens(forward_batch.input_ids)  # [T, H]
        captured = []
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, forward_batch)
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

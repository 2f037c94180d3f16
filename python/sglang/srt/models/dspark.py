"""DSpark draft model: one forward over ``[anchor, mask, ...]`` blocks.

Context (hidden states of chosen target layers) is projected by ``fc``,
RMS-normed and written only as keys/values into the draft's KV cache, at the
target tokens' slots; it never runs through the draft's MLP. Block queries
attend the committed context plus their whole block (non-causal). The
embedding and LM head are the target's own modules, shared.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.attention import AttentionMetadata
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ModelOutput
from sglang.srt.models.tiny_moe import (
    TinyMoEConfig,
    TinyMoEDecoderLayer,
    TinyMoEForCausalLM,
    init_attention_metadata,
)

# Up to this vocabulary the Markov head's correction after every token is
# tabulated once, a [V, V] table (256 KB at V = 256, 4 MB at 1024), so a
# block slot costs one row gather instead of a gather and a [rank, V]
# matmul. A real 128k vocabulary keeps the low-rank path (its table would
# be 64 GB).
MARKOV_TABLE_MAX_VOCAB = 1024


@dataclass(frozen=True)
class DSparkDraftConfig:
    num_layers: int = 1
    num_experts: int = 4
    top_k: int = 2
    target_layer_ids: Tuple[int, ...] = (1, 2)
    markov_rank: int = 16
    block_size: int = 5  # gamma the draft was trained with
    mask_token_id: int = 255


class DSparkDraftModel(nn.Module):
    def __init__(self, config: DSparkDraftConfig, target: TinyMoEForCausalLM) -> None:
        super().__init__()
        self.config = config
        tcfg: TinyMoEConfig = target.config
        # Shared, not copied: the draft reads the target's own modules.
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head
        h = tcfg.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.context_norm = RMSNorm(h)
        self.layers = nn.ModuleList(
            TinyMoEDecoderLayer(
                tcfg, i, num_experts=config.num_experts, top_k=config.top_k
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(h)
        # Low-rank Markov head: correction(x_prev) = W2(W1[x_prev]).
        self.markov_w1 = nn.Embedding(tcfg.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, tcfg.vocab_size, bias=False)
        # The target's table, shared: the same positions rotate the same way,
        # so the verify's gathered rows serve the context write.
        self.rotary_emb: RotaryEmbedding = target.rotary_emb
        self._markov_table_key: Optional[Tuple[int, ...]] = None
        self._markov_table: Optional[torch.Tensor] = None
        self._markov_table_from: Tuple[torch.UntypedStorage, ...] = ()

    @torch.no_grad()
    def write_context(
        self,
        *,
        aux_hidden_states: torch.Tensor,  # [T, n_layers * hidden]
        positions: torch.Tensor,  # [T]: the positions of those rows
        out_cache_loc: torch.Tensor,  # [T]: their KV slots
        kv_pool,  # the draft's KV pool
        metadata: Optional[AttentionMetadata] = None,  # the same rows', shared
    ) -> None:
        """The target's hidden states of these rows become the draft's context
        K/V at their slots (the rotary tables of ``metadata`` when given)."""
        context = self.context_norm(self.fc(aux_hidden_states))  # [T, hidden]
        if metadata is None:
            cos, sin = self.rotary_emb.cos_sin(positions, context.dtype)
        else:
            cos, sin = metadata.cos, metadata.sin
        for layer in self.layers:
            layer.self_attn.write_kv(
                hidden=context,
                cos=cos,
                sin=sin,
                kv_pool=kv_pool,
                out_cache_loc=out_cache_loc,
            )

    def init_forward_metadata(
        self,
        forward_batch: ForwardBatch,
        *,
        verify_metadata: Optional[AttentionMetadata] = None,
    ) -> AttentionMetadata:
        """What the layers of a forward over this block batch share.

        ``verify_metadata``: the same step's verify metadata (rows ``[bonus,
        d_1..d_gamma]`` of the same requests, causal; the block is their
        first gamma positions). Every block row sees the context and the
        whole block: what verify row ``gamma - 1`` sees, one key less than
        the verify's last row. So the block reads the verify's slots and
        mask row ``gamma - 1`` up to the verify's bound minus one, its own
        bound: the same keys, mask and bound as metadata built for the
        block, bitwise the same attention. Its own rotary tables are
        gathered.
        """
        if verify_metadata is None:
            return init_attention_metadata(
                forward_batch,
                rotary=self.rotary_emb,
                dtype=self.embed_tokens.weight.dtype,
            )
        bs, q_len = forward_batch.batch_size, forward_batch.tokens_per_req
        mask = verify_metadata.attn_mask  # [bs, 1, q_len + 1, verify bound]
        if mask.shape[0] != bs or mask.shape[2] != q_len + 1:
            raise ValueError(
                f"verify metadata for {mask.shape[0]} requests x {mask.shape[2]} "
                f"rows does not fit a block of {bs} x {q_len} (needs "
                f"{bs} x {q_len + 1})"
            )
        bound = verify_metadata.kv_bound - 1
        cos, sin = self.rotary_emb.cos_sin(forward_batch.positions, mask.dtype)
        return AttentionMetadata(
            batch_size=bs,
            q_len=q_len,
            kv_bound=bound,
            # [bs, verify bound] -> its first `bound` columns: a copy (at bs 1
            # a view, read only).
            kv_slots=verify_metadata.kv_slots.view(bs, -1)[:, :bound].reshape(-1),
            attn_mask=mask[:, :, q_len - 1 : q_len, :bound],
            cos=cos,
            sin=sin,
        )

    @torch.no_grad()
    def forward(self, forward_batch: ForwardBatch) -> ModelOutput:
        hidden = self.embed_tokens(forward_batch.input_ids)  # [T, hidden]
        metadata = forward_batch.attn_metadata
        if metadata is None:
            metadata = self.init_forward_metadata(forward_batch)
        for layer in self.layers:
            hidden = layer(hidden, forward_batch, metadata)
        return ModelOutput(logits=self.lm_head(self.norm(hidden)))

    def markov_table(self) -> Optional[torch.Tensor]:
        """[V, V]: row v is the correction after token v, W2(W1[v]); None
        above ``MARKOV_TABLE_MAX_VOCAB``. Made once per weight version (a
        load, a copy_ or a .to() makes a new one; an in-place write through
        ``.data`` bypasses the version and is not seen)."""
        if torch.compiler.is_compiling():  # compiled code reads it as made
            return self._markov_table
        # Read every decode step: the weights straight from their modules'
        # tables, what ``self.markov_w1.weight`` resolves to without
        # nn.Module's attribute fallback (about 1 us a lookup).
        w1 = self._modules["markov_w1"]._parameters["weight"]
        w2 = self._modules["markov_w2"]._parameters["weight"]
        if w1.shape[0] > MARKOV_TABLE_MAX_VOCAB:
            return None
        key = (w1.data_ptr(), w1._version, w2.data_ptr(), w2._version)
        if self._markov_table_key != key:
            with torch.no_grad():
                self._markov_table = self.markov_w2(w1)  # [V, V]
            self._markov_table_key = key
            # Held: a new storage cannot take their address unseen.
            self._markov_table_from = (w1.untyped_storage(), w2.untyped_storage())
        return self._markov_table

    @torch.no_grad()
    def markov_correction(self, prev_ids: torch.Tensor) -> torch.Tensor:
        # prev_ids: [...] -> [..., vocab]; the table's rows when there is one.
        table = self.markov_table()
        if table is not None:
            return table[prev_ids]
        return self.markov_w2(self.markov_w1(prev_ids))

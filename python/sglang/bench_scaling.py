"""From the embedded pair to real models: bytes and FLOPs per decode step, a
roofline, projected against measured.

    python -m sglang.bench_scaling --quick --json out.json --plot-dir plots
    python -m sglang.bench_scaling --config path/to/config.json \\
        --bandwidth-gbs 4800 --peak-tflops 989 --op-overhead-us 2

Models: the embedded pair (``checkpoints/tiny-moe-dspark``) and upstream-style
``config.json`` files (``--config``, several allowed; a model directory means
its config.json; default: the files in ``bench_configs/``, a dense and an MoE
model of the embedded family at three sizes and two real models). A config
the slice can build (MHA, no dense first layers, no shared experts, float32,
small enough) runs here with seeded random weights written to a temporary
checkpoint; the rest is projection only, and each row says why.

Per decode step, plain (one target forward over bs rows) and DSpark (a draft
forward over bs x gamma rows, a verify forward over bs x (gamma + 1) rows and
the context write): weight bytes read (an MoE layer reads the experts its rows
hit: E (1 - (1 - k / E)^rows) under uniform routing, the measured count where
the slice ran, seen by forward hooks on the router gates), KV bytes read,
activation bytes written, and FLOPs. ``--kernels slice`` (the default when
measuring here) models the code that runs here: the dense MoE path multiplies
every expert while rows x experts <= DENSE_MAX_ROW_EXPERTS, and attention
gathers keys and values into a copy; ``fused`` models an engine with routed
MoE kernels and paged attention (the default for given hardware).

Roofline: each forward's attention, FFN and head parts take
max(bytes / bandwidth, FLOPs / peak) (they run one after another), plus the
step's aten ops (counted exactly by OpCounter on the model's structure at
width 8) x the per-op overhead. Here the bandwidth is a memcpy, the peak an
fp32 matmul and the per-op overhead an empty-op microbench: decode steps of
the embedded pair's structure at width 8 (its tensors hold almost nothing),
over their op count. For a GPU give all three as flags; nothing is measured.

Measured: for the configs that run here, plain and DSpark decode steps in
lockstep blocks (``--block-steps`` steps of one engine, then of the other,
the order alternating), timed by the scheduler (``Scheduler.record_step_times``), at
each batch size and context (prompts of that many random tokens); each block
is projected at the contexts it ran, and projected / measured is a ratio of
means with its 95% interval (``bench_stats.mean_ratio``). Also printed: the
DSpark speedup as a function of accepted length (tokens per verify step) and
batch size, the batch size from which the MoE FFN stops being memory-bound,
and the seed's ``num_token_non_padded`` scalar (one
``torch.tensor(n, dtype=torch.int32).to(device)`` per DSpark step) as a share
of the step: measured here on the CPU, ``--scalar-us`` for a GPU.
"""

import argparse
import contextlib
import gc
import itertools
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, astuple, dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from sglang import bench_plots
from sglang.bench_dspark_step import scalar_cost_us
from sglang.bench_stats import mean_ratio
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.layers.moe.ep_moe import DENSE_MAX_ROW_EXPERTS
from sglang.srt.managers.schedule_batch import Req, SamplingParams, kv_slots_needed
from sglang.srt.managers.scheduler import DRAFT_HEALTH_LOGGER
from sglang.srt.model_loader.loader import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    read_json,
    save_checkpoint,
)
from sglang.srt.models.dspark import (
    MARKOV_TABLE_MAX_VOCAB,
    DSparkDraftConfig,
    DSparkDraftModel,
)
from sglang.srt.models.registry import DEFAULT_MODEL_PATH, init_random_weights
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM
from sglang.srt.utils.common import check_seed, interrupted, is_finite
from sglang.srt.utils.op_counter import OpCounter

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_configs")
ENGINES = ("plain", "dspark")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
SLICE_ARCH = "TinyMoEForCausalLM"  # its config.json dtype is storage; it runs float32
DRAFT_DEFAULTS = DSparkDraftConfig()
# A GPU's scalar cost when none is given: a pageable 4-byte host-to-device
# copy and an allocation, without the pipeline stall it can cause (docs/).
GPU_SCALAR_US = 10.0
# Per-op overhead and op counts come from a model's structure at this width,
# over at most this many decode steps.
STAND_IN_HIDDEN, STAND_IN_HEADS, STAND_IN_STEPS = 8, 2, 34
QUICK = dict(
    batch_size=[1, 8, 32],
    context=[64, 512],
    turns=6,
    block_steps=4,
    max_measure_mb=100.0,
    max_prefill_tokens=8192,
)
FULL = dict(
    batch_size=[1, 4, 16, 64],
    context=[64, 512, 2048],
    turns=5,
    block_steps=6,
    max_measure_mb=1024.0,
    max_prefill_tokens=32768,
)
# Steady decode steps a measured point runs besides its timed blocks: a
# warm-up, and the steps the router hooks see.
WARM_STEPS, HOOKED_STEPS = 2, 2
_rids = itertools.count()


# ---- Model specs: an upstream config.json, read once ----------------------


@dataclass(frozen=True)
class DraftSpec:
    num_layers: int
    num_experts: int
    top_k: int
    target_layer_ids: Tuple[int, ...]
    markov_rank: int
    gamma: int


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # the config file
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int  # 1 (top_k 1): a dense FFN of moe_intermediate_size
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # the first dense layers' FFN
    first_dense_layers: int
    shared_intermediate_size: int  # every shared expert together; 0: none
    kv_lora_rank: int  # > 0: MLA, one latent (+ its rope key) per token
    q_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dtype: str
    max_position: Optional[int]
    draft: DraftSpec

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def weight_bytes(self) -> int:
        """The target's weights (every expert), in its dtype."""
        h, i_moe = self.hidden_size, self.moe_intermediate_size
        attn = _attention_params(self)
        moe = (
            self.num_experts * (3 * h * i_moe + h)
            + 3 * h * self.shared_intermediate_size
        )
        dense = 3 * h * self.intermediate_size
        layers = (
            self.first_dense_layers * dense
            + (self.num_layers - self.first_dense_layers) * moe
        )
        return (self.num_layers * attn + layers + 2 * self.vocab_size * h) * (
            self.dtype_bytes
        )


_MISSING = object()


def _field(
    cfg: dict, names: Sequence[str], file: str, *, default=_MISSING, minimum: int = 1
):
    """The first of ``names`` present in ``cfg``: an int >= minimum."""
    for name in names:
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"{file}: field {name!r} must be an int >= {minimum}, got {value!r}"
            )
        return value
    if default is _MISSING:
        also = f" (or {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""
        raise ValueError(f"{file}: field {names[0]!r}{also} is missing")
    return default


def spec_from_config(cfg: dict, *, name: str, file: str) -> ModelSpec:
    """A model spec from upstream-style config.json fields (Llama, Qwen3,
    Qwen3-MoE, Mixtral, DeepSeek-V3 and the slice's own names), or ValueError
    naming the file and the field."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(cfg).__name__}")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # a multimodal wrapper: its language model
    hidden = _field(cfg, ("hidden_size",), file)
    layers = _field(cfg, ("num_hidden_layers", "num_layers"), file)
    heads = _field(cfg, ("num_attention_heads", "num_heads"), file)
    kv_heads = _field(cfg, ("num_key_value_heads",), file, default=heads)
    if heads % kv_heads:
        raise ValueError(
            f"{file}: field 'num_key_value_heads' ({kv_heads}) must divide "
            f"num_attention_heads ({heads})"
        )
    head_dim = _field(cfg, ("head_dim",), file, default=None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"{file}: field 'hidden_size' ({hidden}) is not divisible by "
                f"num_attention_heads ({heads}); give 'head_dim'"
            )
        head_dim = hidden // heads
    names = ("num_experts", "n_routed_experts", "num_local_experts")
    experts = _field(cfg, names, file, default=0, minimum=0)
    moe_inter = _field(cfg, ("moe_intermediate_size",), file, default=None)
    inter = _field(cfg, ("intermediate_size",), file, default=None)
    if experts <= 1:  # dense: one expert of the dense size, always chosen
        ffn = _field(cfg, ("intermediate_size", "moe_intermediate_size"), file)
        experts, top_k, moe_inter, inter = 1, 1, ffn, ffn
    else:
        top_k = _field(cfg, ("num_experts_per_tok", "top_k"), file)
        if top_k > experts:
            raise ValueError(
                f"{file}: field 'num_experts_per_tok' ({top_k}) exceeds the "
                f"{experts} experts"
            )
        moe_inter = _field(cfg, ("moe_intermediate_size", "intermediate_size"), file)
        inter = moe_inter if inter is None else inter
    first_dense = _field(cfg, ("first_k_dense_replace",), file, default=0, minimum=0)
    if first_dense > layers:
        raise ValueError(
            f"{file}: field 'first_k_dense_replace' ({first_dense}) exceeds "
            f"num_hidden_layers ({layers})"
        )
    shared = _field(
        cfg, ("shared_expert_intermediate_size",), file, default=0, minimum=0
    )
    if not shared:
        shared = moe_inter * _field(
            cfg, ("n_shared_experts",), file, default=0, minimum=0
        )
    kv_lora = _field(cfg, ("kv_lora_rank",), file, default=0, minimum=0)
    mla = dict(q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0)
    if kv_lora:
        mla = dict(
            q_lora_rank=_field(cfg, ("q_lora_rank",), file, default=0, minimum=0),
            **{k: _field(cfg, (k,), file) for k in list(mla)[1:]},
        )
    if cfg.get("architectures") == [SLICE_ARCH]:
        dtype = "float32"
    else:
        key = "torch_dtype" if "torch_dtype" in cfg else "dtype"
        dtype = cfg.get(key, "float32")
        if dtype not in DTYPE_BYTES:
            raise ValueError(
                f"{file}: field {key!r} must be one of {sorted(DTYPE_BYTES)}, "
                f"got {dtype!r}"
            )
    return ModelSpec(
        name=name,
        source=file,
        vocab_size=_field(cfg, ("vocab_size",), file, minimum=2),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=moe_inter,
        intermediate_size=inter,
        first_dense_layers=first_dense,
        shared_intermediate_size=shared,
        kv_lora_rank=kv_lora,
        **mla,
        dtype=dtype,
        max_position=_field(
            cfg, ("max_position_embeddings", "max_position"), file, default=None
        ),
        draft=_draft_spec(cfg, file, layers=layers, experts=experts, top_k=top_k),
    )


def _draft_spec(
    cfg: dict, file: str, *, layers: int, experts: int, top_k: int
) -> DraftSpec:
    """The DSpark draft a config bundles (upstream's ``dspark_*`` fields), or
    one layer of the target's own experts with the slice's defaults."""
    d_experts = _field(cfg, ("dspark_num_experts",), file, default=experts)
    d_top_k = _field(cfg, ("dspark_top_k",), file, default=min(top_k, d_experts))
    if d_top_k > d_experts:
        raise ValueError(
            f"{file}: field 'dspark_top_k' ({d_top_k}) exceeds dspark_num_experts "
            f"({d_experts})"
        )
    ids = cfg.get("dspark_target_layer_ids", list(DRAFT_DEFAULTS.target_layer_ids))
    ok = (
        isinstance(ids, list)
        and ids
        and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        and all(b > a for a, b in zip(ids, ids[1:]))
        and 0 <= ids[0]
        and ids[-1] < layers - 1
    )
    if not ok:
        raise ValueError(
            f"{file}: field 'dspark_target_layer_ids' must be strictly increasing "
            f"ints in [0, {layers - 1}) (never the last of {layers} layers), got "
            f"{ids!r}" + ("" if "dspark_target_layer_ids" in cfg else " (the default)")
        )
    return DraftSpec(
        num_layers=_field(
            cfg, ("dspark_num_layers",), file, default=DRAFT_DEFAULTS.num_layers
        ),
        num_experts=d_experts,
        top_k=d_top_k,
        target_layer_ids=tuple(ids),
        markov_rank=_field(
            cfg, ("dspark_markov_rank",), file, default=DRAFT_DEFAULTS.markov_rank
        ),
        gamma=_field(
            cfg, ("dspark_block_size",), file, default=DRAFT_DEFAULTS.block_size
        ),
    )


def load_spec(path: str) -> ModelSpec:
    """A config file, or a model directory's config.json; named by the file
    (a config.json by its directory)."""
    file = os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"{file}: no such config file")
    cfg = read_json(file)
    stem = os.path.splitext(os.path.basename(file))[0]
    name = os.path.basename(os.path.dirname(os.path.abspath(file)))
    if os.path.abspath(os.path.dirname(file)) == os.path.abspath(DEFAULT_MODEL_PATH):
        name = "embedded"
    return spec_from_config(cfg, name=name if stem == "config" else stem, file=file)


def shipped_configs() -> List[str]:
    return sorted(
        os.path.join(CONFIG_DIR, f)
        for f in os.listdir(CONFIG_DIR)
        if f.endswith(".json")
    )


def slice_checkpoint(spec: ModelSpec) -> Optional[str]:
    """The slice's checkpoint directory a config.json belongs to (its weights
    next to it), else None: the bench draws random weights."""
    if os.path.basename(spec.source) != CONFIG_NAME:
        return None
    folder = os.path.dirname(os.path.abspath(spec.source))
    return folder if os.path.isfile(os.path.join(folder, WEIGHTS_NAME)) else None


def why_not_buildable(spec: ModelSpec) -> Optional[str]:
    """Why the slice cannot run this architecture (None: it can)."""
    reasons = []
    if spec.first_dense_layers:
        reasons.append(
            f"first_k_dense_replace={spec.first_dense_layers} (the slice's layers "
            "are all MoE)"
        )
    if spec.shared_intermediate_size:
        reasons.append("shared experts (the slice has none)")
    if spec.kv_lora_rank:
        reasons.append(f"MLA KV (kv_lora_rank={spec.kv_lora_rank})")
    elif spec.num_kv_heads != spec.num_heads:
        reasons.append(
            f"GQA KV ({spec.num_kv_heads} KV heads for {spec.num_heads} query heads)"
        )
    if spec.head_dim * spec.num_heads != spec.hidden_size or spec.head_dim % 2:
        reasons.append(
            f"head_dim {spec.head_dim} (the slice needs hidden_size / heads, even)"
        )
    if spec.dtype != "float32":
        reasons.append(f"{spec.dtype} (the slice runs float32)")
    return "; ".join(reasons) or None


def build_checkpoint(
    spec: ModelSpec, path: str, *, seed: int, max_position: int
) -> None:
    """A checkpoint of ``spec`` with seeded random weights, bundling its draft."""
    # The slice's config fields, under the same names in the spec.
    fields = {f: getattr(spec, f) for f in TinyMoEConfig.__dataclass_fields__}
    config = TinyMoEConfig(**dict(fields, max_position=max_position))
    d = spec.draft
    draft_config = DSparkDraftConfig(
        num_layers=d.num_layers,
        num_experts=d.num_experts,
        top_k=d.top_k,
        target_layer_ids=d.target_layer_ids,
        markov_rank=d.markov_rank,
        block_size=d.gamma,
        mask_token_id=spec.vocab_size - 1,
    )
    target = TinyMoEForCausalLM(config)
    init_random_weights(target, seed)
    draft = DSparkDraftModel(draft_config, target)
    # Also redraws the shared embedding and LM head: random either way.
    init_random_weights(draft, seed + 1)
    save_checkpoint(path, target=target, draft=draft)


def stand_in(spec: ModelSpec) -> ModelSpec:
    """``spec``'s structure as the slice runs it (layers, experts, top-k, the
    draft, the Markov head's path) with tensors that hold almost nothing: its
    op count is ``spec``'s, its step time is overhead."""
    table = spec.vocab_size <= MARKOV_TABLE_MAX_VOCAB  # the head's path
    small_vocab = 32 if table else MARKOV_TABLE_MAX_VOCAB + 1
    return replace(
        spec,
        name=f"{spec.name} (stand-in)",
        vocab_size=small_vocab,
        hidden_size=STAND_IN_HIDDEN,
        num_heads=STAND_IN_HEADS,
        num_kv_heads=STAND_IN_HEADS,
        head_dim=STAND_IN_HIDDEN // STAND_IN_HEADS,
        moe_intermediate_size=4,
        intermediate_size=4,
        first_dense_layers=0,
        shared_intermediate_size=0,
        kv_lora_rank=0,
        dtype="float32",
        # Room for the stand-in's runs, verify windows included.
        max_position=max(
            1024, kv_need(context=4, steps=STAND_IN_STEPS, gamma=spec.draft.gamma)
        ),
    )


# ---- Bytes and FLOPs per decode step ---------------------------------------


@dataclass(frozen=True)
class Cost:
    weights: float = 0.0  # weight bytes read
    kv_read: float = 0.0  # KV-cache bytes read
    activations: float = 0.0  # bytes written: outputs, KV writes, gathered copies
    flops: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, n: float) -> "Cost":
        return Cost(*(a * n for a in astuple(self)))

    @property
    def bytes(self) -> float:
        """Traffic: every activation written is read back once, by the next op."""
        return self.weights + self.kv_read + 2 * self.activations


# A step: part ("forward"; "draft", "verify", "context write") -> component
# ("attention", "ffn", "head", "context") -> its cost.
StepCost = Dict[str, Dict[str, Cost]]


def expected_experts_hit(*, num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts ``rows`` rows reach under uniform routing: a row
    misses a given expert with probability 1 - top_k / num_experts."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def _attention_params(spec: ModelSpec) -> int:
    h, nh = spec.hidden_size, spec.num_heads
    if spec.kv_lora_rank:
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        q = spec.q_lora_rank * (h + nh * qk) if spec.q_lora_rank else h * nh * qk
        kv_up = spec.kv_lora_rank * nh * (spec.qk_nope_head_dim + spec.v_head_dim)
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        return q + h * latent + kv_up + nh * spec.v_head_dim * h
    qkv = h * (nh + 2 * spec.num_kv_heads) * spec.head_dim
    return qkv + nh * spec.head_dim * h


def _kv_per_token(spec: ModelSpec) -> int:
    """KV-cache elements per token and layer."""
    if spec.kv_lora_rank:
        return spec.kv_lora_rank + spec.qk_rope_head_dim
    return 2 * spec.num_kv_heads * spec.head_dim


def _attention(
    spec: ModelSpec, *, bs: int, q_len: int, kv_bound: int, kernels: str
) -> Cost:
    """One layer's norms, projections and attention over ``kv_bound`` keys."""
    b, h, nh, rows = spec.dtype_bytes, spec.hidden_size, spec.num_heads, bs * q_len
    params, kv_token = _attention_params(spec), _kv_per_token(spec)
    if spec.kv_lora_rank:  # absorbed MLA: scores over latent + rope, values latent
        out = nh * spec.v_head_dim
        proj = nh * (spec.qk_nope_head_dim + spec.qk_rope_head_dim) + kv_token
        attn_flops = 2 * rows * kv_bound * nh * (2 * spec.kv_lora_rank + kv_token)
    else:
        out = nh * spec.head_dim
        # q, k, v; then q and k rotated (in place, past one copy)
        proj = (2 * nh + 3 * spec.num_kv_heads) * spec.head_dim
        attn_flops = 4 * rows * kv_bound * out
    kv_read = bs * kv_bound * kv_token * b
    # two norms, the projections, attention out, o_proj, the KV write
    written = rows * (3 * h + proj + out + kv_token) * b
    if kernels == "slice":  # keys and values gathered into a copy, then
        # attended; the heads' output transposed back into a copy
        written += kv_read + rows * out * b
    return Cost(
        weights=(params + 2 * h) * b,
        kv_read=kv_read,
        activations=written,
        flops=2 * rows * params + attn_flops,
    )


def _metadata(
    spec: ModelSpec, *, bs: int, q_len: int, kv_bound: int, mask: bool
) -> Cost:
    """What a forward builds once for every layer (the slice's kernels): the
    rows' rotary tables, the KV slots to gather and (but for the draft block,
    which reads the verify's) the mask."""
    rows = bs * q_len
    written = 2 * rows * spec.head_dim * spec.dtype_bytes + bs * kv_bound * 8
    if mask:  # a bool mask, then the float one
        written += bs * q_len * kv_bound * (1 + spec.dtype_bytes)
    return Cost(activations=written)


def _moe(spec: ModelSpec, *, rows, experts, top_k, hit, kernels) -> Cost:
    """One MoE layer's router and experts (plus any shared experts)."""
    b, h, inter = spec.dtype_bytes, spec.hidden_size, spec.moe_intermediate_size
    expert = 3 * h * inter  # gate and up [2I, H], down [H, I]
    router = Cost(
        weights=experts * h * b,
        activations=rows * experts * (b + 4),  # logits, float32 probabilities
        flops=2 * rows * experts * h,
    )
    if kernels == "slice" and rows * experts <= DENSE_MAX_ROW_EXPERTS:
        # Every expert on every row: [T, 2EI] -> [T, EI], and the row weights.
        pairs, touched = rows * experts, experts
        written = rows * experts * (3 * inter + 1) * b + rows * h * b
    else:  # each row's experts only: gathered rows, [R, 2I] -> [R, I] -> [R, H]
        pairs = rows * top_k
        touched = expected_experts_hit(num_experts=experts, top_k=top_k, rows=rows)
        touched = touched if hit is None else hit
        written = pairs * (2 * h + 3 * inter) * b + rows * h * b
    shared = spec.shared_intermediate_size
    return router + Cost(
        weights=(touched * expert + 3 * h * shared) * b,
        activations=written + rows * (3 * shared + h) * b * (shared > 0),
        flops=2 * pairs * expert + 2 * rows * 3 * h * shared,
    )


def _dense_ffn(spec: ModelSpec, *, rows: int) -> Cost:
    b, h, inter = spec.dtype_bytes, spec.hidden_size, spec.intermediate_size
    return Cost(
        weights=3 * h * inter * b,
        activations=rows * (3 * inter + h) * b,
        flops=2 * rows * 3 * h * inter,
    )


def _head(spec: ModelSpec, *, rows: int) -> Cost:
    """The embedding rows, the final norm and the LM head."""
    b, h, v = spec.dtype_bytes, spec.hidden_size, spec.vocab_size
    return Cost(
        weights=(rows * h + h + v * h) * b,
        activations=rows * (2 * h + v) * b,
        flops=2 * rows * h * v,
    )


def _markov(spec: ModelSpec, *, bs: int) -> Cost:
    """The draft's Markov head over its block, slot by slot: a row of the
    tabulated [V, V] correction (small vocabularies) or W2(W1[x])."""
    b, v, g, r = (
        spec.dtype_bytes,
        spec.vocab_size,
        spec.draft.gamma,
        spec.draft.markov_rank,
    )
    rows = bs * g
    if v <= MARKOV_TABLE_MAX_VOCAB:
        return Cost(weights=rows * v * b, activations=2 * rows * v * b)
    return Cost(
        weights=(g * r * v + rows * r) * b,
        activations=rows * (r + 2 * v) * b,
        flops=2 * rows * r * v,
    )


def forward_cost(
    spec: ModelSpec,
    *,
    part: str,  # "forward" (plain), "verify" or "draft"
    bs: int,
    q_len: int,
    kv_bound: int,
    kernels: str,
    hit: Optional[float] = None,  # distinct experts per MoE layer; None: uniform
) -> Dict[str, Cost]:
    rows, draft = bs * q_len, part == "draft"
    layers = spec.draft.num_layers if draft else spec.num_layers
    experts, top_k = (
        (spec.draft.num_experts, spec.draft.top_k)
        if draft
        else (spec.num_experts, spec.top_k)
    )
    dense = 0 if draft else spec.first_dense_layers
    attention = _attention(spec, bs=bs, q_len=q_len, kv_bound=kv_bound, kernels=kernels)
    moe = _moe(spec, rows=rows, experts=experts, top_k=top_k, hit=hit, kernels=kernels)
    out = {
        "attention": attention * layers,
        "ffn": _dense_ffn(spec, rows=rows) * dense + moe * (layers - dense),
        "head": _head(spec, rows=rows),
    }
    if kernels == "slice":
        out["attention"] += _metadata(
            spec, bs=bs, q_len=q_len, kv_bound=kv_bound, mask=not draft
        )
    if draft:
        out["head"] += _markov(spec, bs=bs)
    elif part == "verify":  # the captured layers, concatenated for the draft
        n = len(spec.draft.target_layer_ids)
        out["head"] += Cost(activations=rows * n * spec.hidden_size * spec.dtype_bytes)
    return out


def _context_write(spec: ModelSpec, *, rows: int) -> Cost:
    """The verified rows' target hidden states -> fc -> norm -> each draft
    layer's K/V (the slice's write_kv projects k and v only, and rotates k
    with one copy)."""
    b, h = spec.dtype_bytes, spec.hidden_size
    fc = len(spec.draft.target_layer_ids) * h * h
    if spec.kv_lora_rank:
        kv_params = h * _kv_per_token(spec)
        kv_out = 2 * _kv_per_token(spec)
    else:
        kv_params = h * 2 * spec.num_kv_heads * spec.head_dim
        kv_out = (
            kv_params // h + spec.num_kv_heads * spec.head_dim + _kv_per_token(spec)
        )
    layers = spec.draft.num_layers
    return Cost(
        weights=(fc + h + layers * kv_params) * b,
        activations=rows * (2 * h + layers * kv_out) * b,
        flops=2 * rows * (fc + layers * kv_params),
    )


def step_cost(
    spec: ModelSpec,
    *,
    engine: str,
    bs: int,
    seq_len: int,  # the batch's longest sequence, the pending token included
    kernels: str,
    hits: Optional[Dict[str, float]] = None,  # part -> distinct experts per layer
) -> StepCost:
    g, hits = spec.draft.gamma, hits or {}
    # (part, rows per request, keys read): verify rows [bonus, d_1..d_gamma]
    # see up to seq_len + gamma keys, the draft block one fewer.
    if engine == "plain":
        forwards = [("forward", 1, seq_len)]
    else:
        forwards = [("draft", g, seq_len + g - 1), ("verify", g + 1, seq_len + g)]
    cost = {
        part: forward_cost(
            spec,
            part=part,
            bs=bs,
            q_len=q_len,
            kv_bound=keys,
            kernels=kernels,
            hit=hits.get(part),
        )
        for part, q_len, keys in forwards
    }
    if engine == "dspark":
        cost["context write"] = {"context": _context_write(spec, rows=bs * (g + 1))}
    return cost


def total(cost: StepCost, parts: Optional[Sequence[str]] = None) -> Cost:
    out = Cost()
    for part, components in cost.items():
        if parts is None or part in parts:
            for c in components.values():
                out += c
    return out


# ---- The roofline and this machine's figures --------------------------------


@dataclass(frozen=True)
class Machine:
    bandwidth_gbs: float
    peak_tflops: float
    op_overhead_us: float
    scalar_us: float  # one num_token_non_padded scalar, per DSpark step
    source: str  # "measured here" or "given"

    def memory_s(self, c: Cost) -> float:
        return c.bytes / (self.bandwidth_gbs * 1e9)

    def compute_s(self, c: Cost) -> float:
        return c.flops / (self.peak_tflops * 1e12)


def roofline_ms(cost: StepCost, *, ops: float, machine: Machine) -> float:
    """sum over components of max(bytes / bandwidth, FLOPs / peak), plus ops
    x the per-op overhead."""
    work = sum(
        max(machine.memory_s(c), machine.compute_s(c))
        for components in cost.values()
        for c in components.values()
    )
    return 1e3 * (work + ops * machine.op_overhead_us * 1e-6)


def bound_by(cost: StepCost, *, ops: float, machine: Machine) -> str:
    """What the projected step spends most on."""
    c = total(cost)
    terms = {
        "memory": machine.memory_s(c),
        "compute": machine.compute_s(c),
        "overhead": ops * machine.op_overhead_us * 1e-6,
    }
    return max(terms, key=terms.get)


def ffn_compute_bound_from(
    spec: ModelSpec, *, engine: str, machine: Machine, kernels: str, limit=8192
) -> Optional[int]:
    """The batch size from which the MoE FFN of the plain forward or of the
    verify forward takes longer to compute than to read, up to ``limit``
    (None: memory-bound throughout)."""
    q_len = 1 if engine == "plain" else spec.draft.gamma + 1
    first = None
    for bs in range(limit, 0, -1):
        c = _moe(
            spec,
            rows=bs * q_len,
            experts=spec.num_experts,
            top_k=spec.top_k,
            hit=None,
            kernels=kernels,
        )
        if machine.compute_s(c) < machine.memory_s(c):
            return first
        first = bs
    return first


def _best_seconds(fn, *, calls: int, rounds: int = 5) -> float:
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """A memcpy well past the caches; it reads and writes ``nbytes`` each."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), calls=2) / 1e9


def measure_peak_tflops(n: int = 1024) -> float:
    """A float32 matmul, [n, n] @ [n, n]."""
    a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    torch.mm(a, b, out=out)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=out), calls=2) / 1e12


def measure_aten_op_us() -> float:
    """A bare aten op on one element: the dispatch floor, for reference."""
    x = torch.zeros(1)
    return 1e6 * _best_seconds(lambda: torch.add(x, x, out=x), calls=5000)


# ---- Running the slice -------------------------------------------------------


def new_tokens(*, steps: int, gamma: int) -> int:
    """max_new_tokens with room for ``steps`` decode steps after ``running``'s
    first, each committing up to gamma + 1 tokens, and one to spare."""
    return (steps + 2) * (gamma + 1) + 1


def kv_need(*, context: int, steps: int, gamma: int) -> int:
    """KV positions a request of ``context`` prompt tokens may touch over
    ``steps`` steps: the scheduler's reservation, verify window included."""
    return kv_slots_needed(
        prompt_len=context,
        max_new_tokens=new_tokens(steps=steps, gamma=gamma),
        lookahead=gamma,
    )


class EnginePair:
    """The plain and the DSpark engine of one checkpoint."""

    def __init__(
        self,
        *,
        model_path: str,
        max_bs: int,
        context_length: int,
        max_total_tokens: int,
        seed: int,
    ) -> None:
        common = dict(
            model_path=model_path,
            device="cpu",
            random_seed=seed,
            max_running_requests=max_bs,
            max_total_tokens=max_total_tokens,
            context_length=context_length,
        )
        self.engines = {
            "plain": Engine(speculative_algorithm=None, **common),
            # Every draft verified: the step the cost model describes (a
            # planned budget would make low-confidence steps plain ones).
            "dspark": Engine(
                speculative_algorithm="DSPARK",
                speculative_verify_budget="off",
                **common,
            ),
        }
        self.gamma = self.engines["dspark"].dspark_config.gamma
        self.vocab_size = self.engines["plain"].vocab_size

    def prompts(self, *, bs: int, length: int, seed: int) -> List[List[int]]:
        rng = random.Random(seed * 1000 + bs * 7 + length)
        # Below the last id: the draft's mask token.
        return [
            [rng.randrange(self.vocab_size - 1) for _ in range(length)]
            for _ in range(bs)
        ]

    def new_tokens(self, steps: int) -> int:
        return new_tokens(steps=steps, gamma=self.gamma)


@contextlib.contextmanager
def running(engine: Engine, prompts, *, max_new_tokens: int) -> Iterator[List[Req]]:
    """``prompts`` admitted, prefilled and decoding (one step taken) on
    ``engine``, all at once; aborted on exit."""
    sched = engine.scheduler
    sched.max_running_requests = len(prompts)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    reqs = [
        Req(rid=next(_rids), origin_input_ids=list(p), sampling_params=params)
        for p in prompts
    ]
    try:
        for req in reqs:
            sched.add_request(req)
        steady_step(engine, len(reqs))  # admission, prefills, a decode step
        yield reqs
    finally:
        sched.abort_requests(reqs)


def steady_step(engine: Engine, bs: int) -> None:
    """One scheduler step that every one of the ``bs`` requests ran through."""
    sched = engine.scheduler
    sched.step()
    if len(sched.running) != bs or sched.waiting:
        raise RuntimeError(
            f"{len(sched.running)} of {bs} requests running after a step: one "
            "finished (max_new_tokens too small) or was not admitted"
        )


def count_ops(
    pair: EnginePair, batch_sizes: Sequence[int], *, seed: int
) -> Dict[str, Dict[int, int]]:
    """Exact aten ops of one steady decode step, per engine and batch size."""
    out: Dict[str, Dict[int, int]] = {name: {} for name in ENGINES}
    for bs in batch_sizes:
        prompts = pair.prompts(bs=bs, length=4, seed=seed)
        for name, engine in pair.engines.items():
            with running(engine, prompts, max_new_tokens=pair.new_tokens(3)):
                steady_step(engine, bs)  # warm
                with OpCounter() as counter:
                    steady_step(engine, bs)
            out[name][bs] = counter.ops
    return out


def time_steps(pair: EnginePair, *, bs: int, steps: int, seed: int) -> Dict[str, float]:
    """Median seconds of ``steps`` steady decode steps of each engine at
    ``bs`` on 4-token prompts."""
    prompts = pair.prompts(bs=bs, length=4, seed=seed)
    out = {}
    for name, engine in pair.engines.items():
        with running(engine, prompts, max_new_tokens=pair.new_tokens(steps + 2)):
            with engine.scheduler.record_step_times() as times:
                for _ in range(steps):
                    steady_step(engine, bs)
            out[name] = statistics.median(times)
    return out


@contextlib.contextmanager
def experts_hit(parts: Dict[str, torch.nn.Module]) -> Iterator[Dict[str, List[int]]]:
    """Distinct experts each router call picks (top-k of its gate's logits),
    per model part, through forward hooks on the gates."""
    hits: Dict[str, List[int]] = {part: [] for part in parts}
    handles = []

    def hook(part: str, top_k: int):
        def record(module, args, logits):  # logits: [T, num_experts]
            hits[part].append(logits.topk(top_k, dim=-1).indices.unique().numel())

        return record

    for part, model in parts.items():
        for layer in model.layers:
            moe = layer.mlp
            handles.append(moe.gate.register_forward_hook(hook(part, moe.top_k)))
    try:
        yield hits
    finally:
        for handle in handles:
            handle.remove()


def _router_parts(name: str, engine: Engine) -> Dict[str, torch.nn.Module]:
    worker = engine.worker
    if name == "plain":
        return {"forward": worker.model}
    return {"verify": worker.target_worker.model, "draft": worker.draft_model}


def measure_point(
    pair: EnginePair, *, bs: int, context: int, turns: int, block_steps: int, seed: int
) -> Dict:
    """Lockstep blocks of steady decode steps of both engines at ``bs``
    requests with ``context``-token prompts: per engine the blocks' (mean
    step seconds, mean longest sequence), the distinct experts per router
    call (two more steps, hooked), and DSpark's accepted length."""
    steps = WARM_STEPS + turns * block_steps + HOOKED_STEPS
    prompts = pair.prompts(bs=bs, length=context, seed=seed)
    new = pair.new_tokens(steps)
    blocks: Dict[str, List[Tuple[float, float]]] = {name: [] for name in ENGINES}
    hits: Dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        reqs = {
            name: stack.enter_context(running(e, prompts, max_new_tokens=new))
            for name, e in pair.engines.items()
        }
        for name, engine in pair.engines.items():
            for _ in range(WARM_STEPS):
                steady_step(engine, bs)
        order = list(ENGINES)
        for _ in range(turns):
            for name in order:
                engine, seqs = pair.engines[name], []
                with engine.scheduler.record_step_times() as times:
                    for _ in range(block_steps):
                        seqs.append(max(r.seq_len for r in reqs[name]))
                        steady_step(engine, bs)
                blocks[name].append((statistics.fmean(times), statistics.fmean(seqs)))
            order.reverse()  # neither engine always runs right after the other
        for name, engine in pair.engines.items():
            with experts_hit(_router_parts(name, engine)) as seen:
                for _ in range(HOOKED_STEPS):
                    steady_step(engine, bs)
            # A router no step called (no such part ran) has no count.
            hits.update(
                {p: statistics.fmean(n) if n else None for p, n in seen.items()}
            )
        verify = sum(r.spec_verify_ct for r in reqs["dspark"])
        accepted = sum(r.spec_accepted_drafts for r in reqs["dspark"])
    return {"blocks": blocks, "hits": hits, "accept_length": 1 + accepted / verify}


# ---- The bench ---------------------------------------------------------------


@dataclass
class ConfigPlan:
    spec: ModelSpec
    not_buildable: Optional[str]  # why the slice cannot build it; None: it can
    kernels: str  # what the projection models: "slice" or "fused"
    measured_points: List[Tuple[int, int]]  # (bs, context) measured here
    skipped: Dict[Tuple[int, int], str]  # why a point is projection only


def plan_config(spec: ModelSpec, args: argparse.Namespace, measure: bool) -> ConfigPlan:
    """Which points of the grid run here, and what the projection models: the
    slice's own kernels where it can run the config here, else fused ones."""
    reason = why_not_buildable(spec)
    points, skipped = [], {}
    weights_mb = spec.weight_bytes() / 2**20
    for bs, ctx in itertools.product(args.batch_size, args.context):
        need = _point_kv_need(args, context=ctx, gamma=spec.draft.gamma)
        if not measure:
            why = "given hardware: projection only"
        elif reason:
            why = f"projection only: {reason}"
        elif weights_mb > args.max_measure_mb:
            why = (
                f"not measured: weights {weights_mb:.0f} MiB > --max-measure-mb "
                f"{args.max_measure_mb:g}"
            )
        elif spec.max_position is not None and need > spec.max_position:
            why = (
                f"not measured: context {ctx} + decode {need - ctx} > "
                f"max_position {spec.max_position}"
            )
        elif bs * ctx > args.max_prefill_tokens:
            why = f"not measured: {bs} x {ctx} prompt tokens > --max-prefill-tokens"
        else:
            points.append((bs, ctx))
            continue
        skipped[(bs, ctx)] = why
    kernels = args.kernels or ("slice" if measure and reason is None else "fused")
    return ConfigPlan(
        spec=spec,
        not_buildable=reason,
        kernels=kernels,
        measured_points=points,
        skipped=skipped,
    )


def _point_kv_need(args: argparse.Namespace, *, context: int, gamma: int) -> int:
    steps = WARM_STEPS + args.turns * args.block_steps + HOOKED_STEPS
    return kv_need(context=context, steps=steps, gamma=gamma)


def _stand_in_pair(
    spec: ModelSpec, workdir: str, *, max_bs: int, seed: int
) -> EnginePair:
    """Engines of ``spec``'s stand-in, for op counts and the empty-op
    microbench (4-token prompts, up to STAND_IN_STEPS steps)."""
    path = tempfile.mkdtemp(dir=workdir)
    small = stand_in(spec)
    build_checkpoint(small, path, seed=seed, max_position=small.max_position)
    need = kv_need(context=4, steps=STAND_IN_STEPS, gamma=spec.draft.gamma)
    return EnginePair(
        model_path=path,
        max_bs=max_bs,
        context_length=need,
        max_total_tokens=max_bs * need,
        seed=seed,
    )


def measure_machine(
    embedded: ModelSpec, workdir: str, *, max_bs: int, seed: int
) -> Tuple[Machine, Dict]:
    """This machine's figures, and the empty-op microbench at bs 1 and at
    ``max_bs`` (the per-op overhead the roofline uses is bs 1's)."""
    pair = _stand_in_pair(embedded, workdir, max_bs=max_bs, seed=seed)
    per_op = {}
    for bs in sorted({1, max_bs}):
        ops = count_ops(pair, [bs], seed=seed)
        seconds = time_steps(pair, bs=bs, steps=STAND_IN_STEPS - 2, seed=seed)
        per_op[bs] = 1e6 * sum(seconds.values()) / sum(ops[n][bs] for n in ENGINES)
    cost = scalar_cost_us("cpu")
    machine = Machine(
        bandwidth_gbs=measure_bandwidth_gbs(),
        peak_tflops=measure_peak_tflops(),
        op_overhead_us=per_op[1],
        scalar_us=max(cost["after"] - cost["fixed"], 0.0),
        source="measured here",
    )
    extra = {"op_overhead_us_by_bs": per_op, "aten_op_us": measure_aten_op_us()}
    return machine, extra


def _row(
    plan: ConfigPlan,
    *,
    engine: str,
    bs: int,
    context: int,
    ops: int,
    machine: Machine,
    point: Optional[Dict] = None,  # measure_point's figures, where measured
) -> Dict:
    """One (config, engine, batch size, context) row: bytes, FLOPs, ops and
    the projected step; with ``point``, also what it measured, the step
    projected at the contexts its blocks ran and the experts they hit."""
    spec, kernels, gamma = plan.spec, plan.kernels, plan.spec.draft.gamma

    def project(seq_len: int, hits=None) -> StepCost:
        return step_cost(
            spec, engine=engine, bs=bs, seq_len=seq_len, kernels=kernels, hits=hits
        )

    blocks = None if point is None else point["blocks"][engine]
    hits = None if point is None else point["hits"]
    seq = context if blocks is None else round(statistics.fmean(s for _, s in blocks))
    cost = project(seq, hits)
    c = total(cost)
    row = {
        "config": spec.name,
        "engine": engine,
        "batch_size": bs,
        "context": context,
        "bytes": {
            "weights": c.weights,
            "kv_read": c.kv_read,
            "activations_written": c.activations,
            "activations_read": c.activations,  # each read back once
            "total": c.bytes,
        },
        "flops": c.flops,
        "ops": ops,
        "parts": {
            part: {
                "bytes": total(cost, [part]).bytes,
                "flops": total(cost, [part]).flops,
            }
            for part in cost
        },
        "projected_ms": roofline_ms(cost, ops=ops, machine=machine),
        "bound": bound_by(cost, ops=ops, machine=machine),
        "kernels": kernels,
        "measured_ms": None,
        "ratio": None,
        "ratio_ci95": None,
        "scalar_pct_projected": None,
        "scalar_pct_measured": None,
    }
    if engine == "plain":
        routers = {"forward": (bs, spec.num_experts, spec.top_k)}
    else:
        routers = {
            "draft": (bs * gamma, spec.draft.num_experts, spec.draft.top_k),
            "verify": (bs * (gamma + 1), spec.num_experts, spec.top_k),
        }
    row["experts_hit"] = {
        part: {
            "rows": n,
            "uniform": expected_experts_hit(num_experts=e, top_k=k, rows=n),
            "measured": None if hits is None else hits[part],
        }
        for part, (n, e, k) in routers.items()
    }
    if blocks is None:
        row["not_measured"] = plan.skipped[(bs, context)]
    else:
        # Each block projected at the contexts it ran: projected / measured
        # as a ratio of means, with its interval.
        projected = [
            roofline_ms(project(round(s), hits), ops=ops, machine=machine)
            for _, s in blocks
        ]
        measured = [1e3 * seconds for seconds, _ in blocks]
        ratio, lo, hi = mean_ratio(list(zip(measured, projected)))
        row.update(
            projected_ms=statistics.fmean(projected),
            measured_ms=statistics.fmean(measured),
            ratio=ratio,
            ratio_ci95=None if lo is None else [lo, hi],
            measured_context=statistics.fmean(s for _, s in blocks),
        )
    if engine == "dspark":
        scalar_ms = 1e-3 * machine.scalar_us
        row["scalar_pct_projected"] = 100 * scalar_ms / row["projected_ms"]
        if blocks is not None:
            row["scalar_pct_measured"] = 100 * scalar_ms / row["measured_ms"]
            row["accept_length"] = point["accept_length"]
    return row


def _given_or_measured_machine(
    args: argparse.Namespace, embedded: ModelSpec, workdir: str
) -> Tuple[Machine, Dict]:
    if args.bandwidth_gbs is None:
        machine, extra = measure_machine(
            embedded, workdir, max_bs=max(args.batch_size), seed=args.seed
        )
    else:
        machine, extra = (
            Machine(
                bandwidth_gbs=args.bandwidth_gbs,
                peak_tflops=args.peak_tflops,
                op_overhead_us=args.op_overhead_us,
                scalar_us=GPU_SCALAR_US,
                source="given",
            ),
            {},
        )
    if args.scalar_us is not None:
        machine = replace(machine, scalar_us=args.scalar_us)
    return machine, extra


def _measure_config(
    plan: ConfigPlan, args: argparse.Namespace, workdir: str, bar: tqdm
) -> Dict:
    """Every measured point of one config: (name, bs, context) -> its figures."""
    spec, g = plan.spec, plan.spec.draft.gamma
    # Room for the largest point's requests, KV for the point that needs most.
    need = {
        (bs, ctx): _point_kv_need(args, context=ctx, gamma=g)
        for bs, ctx in plan.measured_points
    }
    context_length = max(need.values())
    model_path = slice_checkpoint(spec)
    if model_path is None:
        model_path = tempfile.mkdtemp(dir=workdir)
        bar.set_postfix_str(f"weights {spec.name}")
        max_position = spec.max_position or context_length
        build_checkpoint(spec, model_path, seed=args.seed, max_position=max_position)
    try:
        pair = EnginePair(
            model_path=model_path,
            max_bs=max(bs for bs, _ in plan.measured_points),
            context_length=context_length,
            max_total_tokens=max(bs * n for (bs, _), n in need.items()),
            seed=args.seed,
        )
    except ValueError as e:  # ServerArgs: the KV pools do not fit here now
        for point in plan.measured_points:
            plan.skipped[point] = f"not measured: {e}"
        plan.measured_points = []
        return {}
    points = {}
    for bs, ctx in plan.measured_points:
        bar.set_postfix_str(f"{spec.name} bs={bs} ctx={ctx}")
        points[(spec.name, bs, ctx)] = measure_point(
            pair,
            bs=bs,
            context=ctx,
            turns=args.turns,
            block_steps=args.block_steps,
            seed=args.seed,
        )
        bar.update(1)
    return points


@contextlib.contextmanager
def _random_drafts_expected() -> Iterator[None]:
    """The engines' draft-health warning off: the stand-ins' and the
    configs' drafts are random weights, never accepted by design (the
    embedded pair's trained draft is accepted; it would not warn)."""
    health = logging.getLogger(DRAFT_HEALTH_LOGGER)
    level = health.level
    health.setLevel(logging.ERROR)
    try:
        yield
    finally:
        health.setLevel(level)


def run(args: argparse.Namespace) -> Dict:
    specs = [load_spec(DEFAULT_MODEL_PATH)] + [load_spec(p) for p in args.config]
    measure = args.bandwidth_gbs is None
    plans = [plan_config(s, args, measure=measure) for s in specs]
    plans.sort(key=lambda p: (p.spec.name != "embedded", p.spec.weight_bytes()))
    work = 1 + len(plans) + sum(len(p.measured_points) for p in plans)
    ops: Dict[str, Dict[str, Dict[int, int]]] = {}
    points: Dict[Tuple[str, int, int], Dict] = {}
    with (
        tqdm(total=work, desc="bench_scaling", unit="task", file=sys.stderr) as bar,
        tempfile.TemporaryDirectory(prefix="bench_scaling_") as workdir,
        _random_drafts_expected(),
    ):
        bar.set_postfix_str("machine")
        machine, extra = _given_or_measured_machine(args, plans[0].spec, workdir)
        bar.update(1)
        for plan in plans:  # op counts: the structure at width 8
            bar.set_postfix_str(f"ops {plan.spec.name}")
            pair = _stand_in_pair(
                plan.spec, workdir, max_bs=max(args.batch_size), seed=args.seed
            )
            ops[plan.spec.name] = count_ops(pair, args.batch_size, seed=args.seed)
            bar.update(1)
        for plan in plans:
            if plan.measured_points:
                points.update(_measure_config(plan, args, workdir, bar))
                gc.collect()  # this config's engines go before the next's come
    rows = [
        _row(
            plan,
            engine=engine,
            bs=bs,
            context=ctx,
            ops=ops[plan.spec.name][engine][bs],
            machine=machine,
            point=points.get((plan.spec.name, bs, ctx)),
        )
        for plan in plans
        for bs, ctx, engine in itertools.product(args.batch_size, args.context, ENGINES)
    ]
    return {
        "machine": dict(asdict(machine), **extra),
        "configs": [_config_summary(p, machine=machine) for p in plans],
        "rows": rows,
        "speedup": _speedups(rows, plans),
        "args": vars(args),
    }


def _config_summary(plan: ConfigPlan, *, machine: Machine) -> Dict:
    spec = plan.spec
    return {
        "name": spec.name,
        "source": spec.source,
        "spec": asdict(spec),
        "weight_bytes": spec.weight_bytes(),
        "buildable": plan.not_buildable is None,
        "not_buildable_because": plan.not_buildable,
        "kernels": plan.kernels,
        "measured_points": [list(p) for p in plan.measured_points],
        # Why other points are not measured (a config the slice cannot build:
        # its not_buildable_because).
        "not_measured_because": sorted(
            set(plan.skipped.values()) if plan.not_buildable is None else ()
        ),
        "ffn_compute_bound_from_bs": {
            engine: ffn_compute_bound_from(
                spec, engine=engine, machine=machine, kernels=plan.kernels
            )
            for engine in ENGINES
        },
    }


def _speedups(rows: List[Dict], plans: List[ConfigPlan]) -> List[Dict]:
    """DSpark's decode speedup over plain, tau x plain step / DSpark step, for
    every accepted length tau (tokens per verify step) from 1 to gamma + 1."""
    gamma = {p.spec.name: p.spec.draft.gamma for p in plans}
    dspark = {
        (r["config"], r["batch_size"], r["context"]): r
        for r in rows
        if r["engine"] == "dspark"
    }
    out = []
    for plain in (r for r in rows if r["engine"] == "plain"):
        name = plain["config"]
        spec = dspark[(name, plain["batch_size"], plain["context"])]
        step_ratio = spec["projected_ms"] / plain["projected_ms"]
        entry = {
            "config": name,
            "batch_size": plain["batch_size"],
            "context": plain["context"],
            "break_even_accept_length": step_ratio,
            # tau (a JSON key: a string) -> speedup
            "projected": {str(t): t / step_ratio for t in range(1, gamma[name] + 2)},
        }
        if spec["measured_ms"] is not None:
            tau = spec["accept_length"]
            entry.update(
                measured_accept_length=tau,
                measured=tau * plain["measured_ms"] / spec["measured_ms"],
                projected_at_measured=tau / step_ratio,
            )
        out.append(entry)
    return out


# ---- Report ------------------------------------------------------------------


def _mb(x: float) -> str:
    return f"{x / 2**20:.3g}"


def _table(header: Sequence[str], rows: List[Sequence]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def _configs_table(result: Dict) -> List[str]:
    def bs(b: Optional[int]) -> str:
        return "never (<= 8192)" if b is None else str(b)

    rows = []
    for c in result["configs"]:
        bound = c["ffn_compute_bound_from_bs"]
        runs = "yes" if c["buildable"] else f"no: {c['not_buildable_because']}"
        n = len(c["measured_points"])
        skipped = "; ".join(c["not_measured_because"])
        measured = f"{n}" + (f" (others {skipped})" if skipped else "")
        rows.append(
            [c["name"], _mb(c["weight_bytes"]), runs, c["kernels"], measured]
            + [bs(bound["plain"]), bs(bound["dspark"])]
        )
    header = ["config", "weights MiB", "runs in the slice", "kernels modelled"]
    header += ["points measured", "FFN compute-bound from bs: plain", "verify"]
    return _table(header, rows)


def _rows_table(result: Dict) -> List[str]:
    rows = []
    for r in result["rows"]:
        b, ratio, measured, scalar = r["bytes"], "-", "-", "-"
        if r["measured_ms"] is not None:
            measured, ci = f"{r['measured_ms']:.3f}", r["ratio_ci95"]
            ratio = f"{r['ratio']:.2f}"
            ratio += "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"
        if r["scalar_pct_projected"] is not None:
            scalar = f"{r['scalar_pct_projected']:.2g}"
            if r["scalar_pct_measured"] is not None:
                scalar += f" / {r['scalar_pct_measured']:.2g}"
        rows.append(
            [r["config"], r["engine"], r["batch_size"], r["context"]]
            + [_mb(b["weights"]), _mb(b["kv_read"]), _mb(b["activations_written"])]
            + [f"{r['flops'] / 1e9:.3g}", r["ops"], f"{r['projected_ms']:.3f}"]
            + [measured, ratio, r["bound"], scalar]
        )
    header = ["config", "engine", "bs", "ctx", "weights MiB", "KV read MiB"]
    header += ["act. written MiB", "GFLOP", "ops", "projected ms", "measured ms"]
    header += ["proj/meas [95% CI]", "bound", "scalar % (proj / meas)"]
    return _table(header, rows)


def _speedup_table(result: Dict) -> List[str]:
    """At the largest context, and wherever a point was measured (the JSON
    has every context)."""
    longest = max(s["context"] for s in result["speedup"])
    taus = max(len(s["projected"]) for s in result["speedup"])
    rows = []
    for s in result["speedup"]:
        if s["context"] != longest and "measured" not in s:
            continue
        cells = [
            f"{s['projected'].get(str(t), math.nan):.2f}" for t in range(1, taus + 1)
        ]
        measured = "-"
        if "measured" in s:
            measured = (
                f"tau {s['measured_accept_length']:.2f}: "
                f"{s['projected_at_measured']:.2f} / {s['measured']:.2f}"
            )
        rows.append(
            [s["config"], s["batch_size"], s["context"]]
            + [f"{s['break_even_accept_length']:.2f}"]
            + cells
            + [measured]
        )
    header = ["config", "bs", "ctx", "break-even tau"]
    header += [f"tau={t}" for t in range(1, taus + 1)] + ["projected / measured"]
    return [
        "DSpark speedup over plain, projected, by accepted length tau (tokens "
        f"per verify step): context {longest}, and every measured point:",
        "",
    ] + _table(header, rows)


def _experts_table(result: Dict) -> List[str]:
    moe = {c["name"] for c in result["configs"] if c["spec"]["num_experts"] > 1}
    rows = [
        [r["config"], r["batch_size"], r["context"], part, h["rows"]]
        + [
            f"{h['uniform']:.2f}",
            "-" if h["measured"] is None else f"{h['measured']:.2f}",
        ]
        for r in result["rows"]
        if r["measured_ms"] is not None and r["config"] in moe
        for part, h in r["experts_hit"].items()
    ]
    if not rows:
        return []
    header = ["config", "bs", "ctx", "router", "rows", "uniform", "measured"]
    return [
        "",
        "Distinct experts per MoE layer: uniform routing, and measured at the gates:",
        "",
    ] + _table(header, rows)


def format_report(result: Dict) -> str:
    m = result["machine"]
    lines = [
        f"machine ({m['source']}): bandwidth {m['bandwidth_gbs']:.1f} GB/s, peak "
        f"{1e3 * m['peak_tflops']:.0f} GFLOP/s, per-op overhead "
        f"{m['op_overhead_us']:.2f} us, num_token_non_padded scalar "
        f"{m['scalar_us']:.2f} us per DSpark step"
    ]
    if "op_overhead_us_by_bs" in m:
        per_bs = ", ".join(
            f"{us:.2f} us at bs {bs}" for bs, us in m["op_overhead_us_by_bs"].items()
        )
        lines.append(
            f"empty-op microbench: {per_bs}; a bare aten op {m['aten_op_us']:.2f} us"
        )
    lines += [""] + _configs_table(result) + [""] + _rows_table(result)
    lines += [""] + _speedup_table(result) + _experts_table(result)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        nargs="+",
        default=None,
        help="upstream-style config.json files or model directories (several "
        "allowed); default: the shipped bench_configs/*.json. The embedded pair "
        "is always included",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a small grid: batch sizes {QUICK['batch_size']}, contexts "
        f"{QUICK['context']}, configs up to {QUICK['max_measure_mb']:g} MiB measured",
    )
    p.add_argument("--batch-size", type=int, nargs="+", default=None)
    p.add_argument("--context", type=int, nargs="+", default=None, help="prompt tokens")
    p.add_argument("--turns", type=int, default=None, help="lockstep turns per point")
    p.add_argument("--block-steps", type=int, default=None, help="steps per block")
    p.add_argument(
        "--max-measure-mb",
        type=float,
        default=None,
        help="measure configs up to this many MiB of weights (the rest: projection)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="measure a point only if bs x context is at most this",
    )
    gpu = p.add_argument_group("given hardware (all three: projection only)")
    gpu.add_argument("--bandwidth-gbs", type=float, default=None)
    gpu.add_argument("--peak-tflops", type=float, default=None)
    gpu.add_argument("--op-overhead-us", type=float, default=None)
    p.add_argument(
        "--scalar-us",
        type=float,
        default=None,
        help="cost of one num_token_non_padded scalar per DSpark step; default: "
        f"measured here, {GPU_SCALAR_US:g} us for given hardware",
    )
    p.add_argument(
        "--kernels",
        choices=("slice", "fused"),
        default=None,
        help="slice: this code's MoE paths and KV gather (default when measuring "
        "here); fused: routed MoE and paged attention (default for given hardware)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--plot-dir", default=None, help="write a PNG per config here")
    args = p.parse_args(argv)
    check_seed(p, "--seed", args.seed)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    hardware = (args.bandwidth_gbs, args.peak_tflops, args.op_overhead_us)
    if any(v is not None for v in hardware) and None in hardware:
        p.error("--bandwidth-gbs, --peak-tflops and --op-overhead-us go together")
    if any(v is not None and not (is_finite(v) and v > 0) for v in hardware):
        p.error("hardware figures must be finite and > 0")
    if args.scalar_us is not None and not (
        is_finite(args.scalar_us) and args.scalar_us >= 0
    ):
        p.error("--scalar-us must be finite and >= 0")
    if min(args.batch_size) < 1 or min(args.context) < 1:
        p.error("--batch-size and --context values must be >= 1")
    if args.turns < 3 or args.block_steps < 1:
        p.error("--turns must be >= 3 (an interval needs 3 pairs), --block-steps >= 1")
    if not (is_finite(args.max_measure_mb) and args.max_measure_mb > 0):
        p.error("--max-measure-mb must be finite and > 0")
    if args.max_prefill_tokens < 1:
        p.error("--max-prefill-tokens must be > 0")
    args.batch_size = sorted(set(args.batch_size))
    args.context = sorted(set(args.context))
    bench_plots.check_json_path(p, args.json)
    bench_plots.prepare_plot_dir(p, args.plot_dir)
    if args.config is None:
        args.config = shipped_configs()
    names = set()
    for path in args.config:
        try:
            spec = load_spec(path)
        except ValueError as e:
            p.error(f"--config: {e}")
        if spec.name == "embedded":
            p.error(f"--config: {path}: the embedded pair is always included")
        if spec.name in names:
            p.error(f"--config: {path}: a second config named {spec.name!r}")
        names.add(spec.name)
    start = time.perf_counter()
    try:
        result = run(args)
    except ValueError as e:  # what the engines refuse (a seed, a device, ...)
        print(f"bench_scaling: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted("bench_scaling")
    result["wall_s"] = time.perf_counter() - start
    print(format_report(result), flush=True)
    print(f"\nwall time {result['wall_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot_dir:
        for path in bench_plots.scaling_plots(result, args.plot_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

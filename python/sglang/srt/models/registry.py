"""The embedded model pairs: no downloads, weights drawn from a seed.

A "model path" here names a preset, and ``get_hf_config`` gives its config
the way a checkpoint's ``config.json`` would: ``tiny-moe`` bundles a DSpark
draft (upstream's ``dspark_*`` fields), ``tiny-moe-nodraft`` is a target with
none, and ``tiny-moe-dspark-b3`` is a separate draft with a block of 3.
"""

from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Dict, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.models.dspark import DSparkDraftConfig, DSparkDraftModel
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM

DEFAULT_MODEL_PATH = "tiny-moe"


@dataclass(frozen=True)
class TargetPreset:
    config: TinyMoEConfig
    bundled_draft: Optional[DSparkDraftConfig]  # the draft shipped in its config


TARGETS: Dict[str, TargetPreset] = {
    "tiny-moe": TargetPreset(TinyMoEConfig(), bundled_draft=DSparkDraftConfig()),
    "tiny-moe-nodraft": TargetPreset(TinyMoEConfig(), bundled_draft=None),
}
DRAFTS: Dict[str, DSparkDraftConfig] = {
    "tiny-moe-dspark-b3": DSparkDraftConfig(block_size=3, markov_rank=8),
}


def get_target_preset(name: str) -> TargetPreset:
    if name not in TARGETS:
        raise ValueError(f"unknown model path {name!r}; known: {sorted(TARGETS)}")
    return TARGETS[name]


def _dspark_fields(draft: DSparkDraftConfig) -> dict:
    # Upstream's names for the block, Markov rank, context layers and mask id.
    return {
        "dspark_block_size": draft.block_size,
        "dspark_markov_rank": draft.markov_rank,
        "dspark_target_layer_ids": list(draft.target_layer_ids),
        "dspark_noise_token_id": draft.mask_token_id,
        "dspark_num_layers": draft.num_layers,
        "dspark_num_experts": draft.num_experts,
        "dspark_top_k": draft.top_k,
    }


def get_hf_config(path: str) -> SimpleNamespace:
    """The config a checkpoint at ``path`` would carry in its config.json."""
    if path in TARGETS:
        preset = TARGETS[path]
        fields = {"architectures": ["TinyMoEForCausalLM"], **asdict(preset.config)}
        if preset.bundled_draft is not None:
            fields.update(_dspark_fields(preset.bundled_draft))
        return SimpleNamespace(**fields)
    if path in DRAFTS:
        return SimpleNamespace(
            architectures=["DSparkDraftModel"], **_dspark_fields(DRAFTS[path])
        )
    known = sorted(TARGETS) + sorted(DRAFTS)
    raise ValueError(f"unknown model path {path!r}; known: {known}")


def get_draft_config(path: str) -> DSparkDraftConfig:
    """The DSpark draft a path carries: a target's bundled one, or a draft's."""
    cfg = get_hf_config(path)
    if getattr(cfg, "dspark_block_size", None) is None:
        raise ValueError(f"model path {path!r} carries no DSpark draft")
    return DSparkDraftConfig(
        num_layers=cfg.dspark_num_layers,
        num_experts=cfg.dspark_num_experts,
        top_k=cfg.dspark_top_k,
        target_layer_ids=tuple(cfg.dspark_target_layer_ids),
        markov_rank=cfg.dspark_markov_rank,
        block_size=cfg.dspark_block_size,
        mask_token_id=cfg.dspark_noise_token_id,
    )


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Seeded weights, identical on every device and every EP rank.

    Drawn on the CPU in module order; an EP MoE draws all experts and keeps
    its rank's slice, so ranks agree on the full model. (Its router gate is
    an nn.Linear, drawn when the walk reaches it.)
    """
    gen = torch.Generator().manual_seed(seed)

    def draw(shape, std):
        return torch.randn(shape, generator=gen) * std

    for module in model.modules():
        if isinstance(module, EPMoE):
            e, two_i, h = module.num_experts, module.w13.shape[1], module.w13.shape[2]
            module.load_full_experts(
                draw((e, two_i, h), h**-0.5),
                draw((e, h, two_i // 2), (two_i // 2) ** -0.5),
            )
        elif isinstance(module, nn.Embedding):
            module.weight.copy_(draw(module.weight.shape, 1.0))
        elif isinstance(module, nn.Linear):
            in_features = module.weight.shape[1]
            module.weight.copy_(draw(module.weight.shape, in_features**-0.5))


def load_target(name: str, *, seed: int, device) -> TinyMoEForCausalLM:
    model = TinyMoEForCausalLM(get_target_preset(name).config)
    init_random_weights(model, seed)
    return model.to(device).eval()


def load_draft(
    name: str, *, target: TinyMoEForCausalLM, seed: int, device
) -> DSparkDraftModel:
    draft = DSparkDraftModel(get_draft_config(name), target)
    # Shared target modules are already initialized; draw only the draft's own.
    own = [m for n, m in draft.named_children() if n not in ("embed_tokens", "lm_head")]
    holder = nn.ModuleList(own)
    init_random_weights(holder, seed + 1)
    return draft.to(device).eval()

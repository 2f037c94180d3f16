"""The embedded model pairs: no downloads, weights drawn from a seed.

A "model path" here names a preset. ``tiny-moe`` bundles a DSpark draft;
``tiny-moe-nodraft`` is a target with none.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.models.dspark_draft import DSparkDraftConfig, DSparkDraftModel
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM

DEFAULT_MODEL_PATH = "tiny-moe"


@dataclass(frozen=True)
class TargetPreset:
    config: TinyMoEConfig
    bundled_draft: Optional[str]  # draft preset shipped with this target


TARGETS: Dict[str, TargetPreset] = {
    "tiny-moe": TargetPreset(TinyMoEConfig(), bundled_draft="tiny-moe-dspark"),
    "tiny-moe-nodraft": TargetPreset(TinyMoEConfig(), bundled_draft=None),
}
DRAFTS: Dict[str, DSparkDraftConfig] = {
    "tiny-moe-dspark": DSparkDraftConfig(),
    "tiny-moe-dspark-b3": DSparkDraftConfig(block_size=3, markov_rank=8),
}


def _lookup(table: dict, name: str, what: str):
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {sorted(table)}")
    return table[name]


def get_target_preset(name: str) -> TargetPreset:
    return _lookup(TARGETS, name, "model path")


def get_draft_config(name: str) -> DSparkDraftConfig:
    return _lookup(DRAFTS, name, "draft model path")


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

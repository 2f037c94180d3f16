"""The embedded models: shipped checkpoints, and seeded random presets.

A model path is either a checkpoint directory (``config.json`` +
``model.safetensors``, read by ``srt/model_loader/loader.py``) or the name
of a random preset, whose name says so. The default is the shipped, trained
``checkpoints/tiny-moe-dspark``: a target that bundles its DSpark draft
(upstream's ``dspark_*`` fields); ``checkpoints/tiny-moe-dspark-draft`` is
the same draft alone. The presets: ``random-tiny-moe`` (bundles a draft),
``random-tiny-moe-nodraft`` and the separate draft ``random-tiny-moe-dspark-b3``
(block of 3). Retrain the shipped pair with ``python -m sglang.train_tiny_pair``.
"""

import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Dict, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.model_loader.loader import (
    DRAFT_ARCH,
    bundles_draft,
    draft_config_from,
    dspark_fields,
    load_draft_checkpoint,
    load_target_checkpoint,
    read_config,
    target_config_from,
)
from sglang.srt.models.dspark import DSparkDraftConfig, DSparkDraftModel
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM

CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
TRAINED_TARGET_PATH = os.path.join(CHECKPOINT_DIR, "tiny-moe-dspark")
TRAINED_DRAFT_PATH = os.path.join(CHECKPOINT_DIR, "tiny-moe-dspark-draft")
DEFAULT_MODEL_PATH = TRAINED_TARGET_PATH


@dataclass(frozen=True)
class TargetPreset:
    """A target's architecture and its bundled draft (a preset's or a
    checkpoint's)."""

    config: TinyMoEConfig
    bundled_draft: Optional[DSparkDraftConfig]  # the draft shipped in its config


TARGETS: Dict[str, TargetPreset] = {
    "random-tiny-moe": TargetPreset(TinyMoEConfig(), bundled_draft=DSparkDraftConfig()),
    "random-tiny-moe-nodraft": TargetPreset(TinyMoEConfig(), bundled_draft=None),
}
DRAFTS: Dict[str, DSparkDraftConfig] = {
    "random-tiny-moe-dspark-b3": DSparkDraftConfig(block_size=3, markov_rank=8),
}


def _is_preset(path: str) -> bool:
    return path in TARGETS or path in DRAFTS


def _unknown(path: str) -> ValueError:
    known = sorted(TARGETS) + sorted(DRAFTS)
    return ValueError(
        f"unknown model path {path!r}: not a checkpoint directory, nor a random "
        f"preset ({known})"
    )


def get_hf_config(path: str) -> SimpleNamespace:
    """The config a model path carries: its config.json, or a preset's."""
    if not _is_preset(path):
        if not os.path.isdir(path):
            raise _unknown(path)
        return SimpleNamespace(**read_config(path))
    if path in TARGETS:
        preset = TARGETS[path]
        fields = {"architectures": ["TinyMoEForCausalLM"], **asdict(preset.config)}
        if preset.bundled_draft is not None:
            fields.update(dspark_fields(preset.bundled_draft))
        return SimpleNamespace(**fields)
    return SimpleNamespace(architectures=[DRAFT_ARCH], **dspark_fields(DRAFTS[path]))


def get_target_preset(path: str) -> TargetPreset:
    """The target a model path names (a preset, or a checkpoint directory's
    config.json): its architecture and the draft it bundles, if any."""
    if _is_preset(path):
        if path not in TARGETS:
            raise ValueError(f"model path {path!r} is a DSpark draft, not a target")
        return TARGETS[path]
    if not os.path.isdir(path):
        raise _unknown(path)
    cfg = read_config(path)
    return TargetPreset(
        target_config_from(cfg, path=path),
        bundled_draft=draft_config_from(cfg, path=path) if bundles_draft(cfg) else None,
    )


def get_draft_config(path: str) -> DSparkDraftConfig:
    """The DSpark draft a path carries: a target's bundled one, or a draft's."""
    if not _is_preset(path) and not os.path.isdir(path):
        raise _unknown(path)
    cfg = vars(get_hf_config(path))
    if not bundles_draft(cfg):
        raise ValueError(f"model path {path!r} carries no DSpark draft")
    return draft_config_from(cfg, path=path)


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


def load_target(path: str, *, seed: int, device) -> TinyMoEForCausalLM:
    """A checkpoint directory's target, or a random preset drawn from ``seed``."""
    if not _is_preset(path):
        return load_target_checkpoint(path, device=device)
    model = TinyMoEForCausalLM(get_target_preset(path).config)
    init_random_weights(model, seed)
    return model.to(device).eval()


def load_draft(
    path: str, *, target: TinyMoEForCausalLM, seed: int, device
) -> DSparkDraftModel:
    """A checkpoint directory's draft (bundled or alone), or a random preset's."""
    if not _is_preset(path):
        return load_draft_checkpoint(path, target=target, device=device)
    draft = DSparkDraftModel(get_draft_config(path), target)
    # Shared target modules are already initialized; draw only the draft's own.
    own = [m for n, m in draft.named_children() if n not in ("embed_tokens", "lm_head")]
    holder = nn.ModuleList(own)
    init_random_weights(holder, seed + 1)
    return draft.to(device).eval()

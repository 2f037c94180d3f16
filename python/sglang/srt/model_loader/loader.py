"""Checkpoint directories: ``config.json`` + ``model.safetensors``, one loader.

A target checkpoint's config carries the architecture and sizes under
``TinyMoEConfig``'s field names; a target that bundles its DSpark draft also
carries upstream's ``dspark_*`` fields, and its weights file holds the draft's
own tensors under ``dspark.`` (the embedding and LM head are the target's,
shared, never stored twice). A draft-only checkpoint (architecture
``DSparkDraftModel``) carries the same ``dspark_*`` fields, plus the target
``hidden_size`` and ``vocab_size`` it was trained for, and only ``dspark.*``
tensors.

Weights are stored in bf16 and cast to the run dtype on load. Every problem
is a ValueError naming the file and the field or tensor.
"""

import errno
import json
import os
import re
import shutil
import tempfile
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.models.dspark import DSparkDraftConfig, DSparkDraftModel
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM
from sglang.srt.utils.common import as_created

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TARGET_ARCH = "TinyMoEForCausalLM"
DRAFT_ARCH = "DSparkDraftModel"
DRAFT_PREFIX = "dspark."
STORAGE_DTYPE = torch.bfloat16

# config.json field -> DSparkDraftConfig field (upstream's names first).
DSPARK_FIELDS = {
    "dspark_block_size": "block_size",
    "dspark_markov_rank": "markov_rank",
    "dspark_target_layer_ids": "target_layer_ids",
    "dspark_noise_token_id": "mask_token_id",
    "dspark_num_layers": "num_layers",
    "dspark_num_experts": "num_experts",
    "dspark_top_k": "top_k",
}
_TARGET_FIELDS = tuple(TinyMoEConfig.__dataclass_fields__)


def target_fields(config: TinyMoEConfig) -> dict:
    return {
        "architectures": [TARGET_ARCH],
        **{f: getattr(config, f) for f in _TARGET_FIELDS},
    }


def dspark_fields(config: DSparkDraftConfig) -> dict:
    fields = {k: getattr(config, v) for k, v in DSPARK_FIELDS.items()}
    fields["dspark_target_layer_ids"] = list(config.target_layer_ids)
    return fields


def read_json(file: str):
    """A JSON file's content, or ValueError naming the file."""
    try:
        with open(file) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None


def read_config(path: str) -> dict:
    """The checkpoint's config.json, checked for a known architecture."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path!r} does not exist")
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise ValueError(f"{file}: missing (a checkpoint needs {CONFIG_NAME})")
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: must hold a JSON object")
    stored = str(STORAGE_DTYPE).removeprefix("torch.")
    if cfg.get("torch_dtype", stored) != stored:
        raise ValueError(
            f"{file}: field 'torch_dtype' is {cfg['torch_dtype']!r}; checkpoints "
            f"store {stored!r}"
        )
    arch = cfg.get("architectures")
    if arch not in ([TARGET_ARCH], [DRAFT_ARCH]):
        raise ValueError(
            f"{file}: field 'architectures' must be [{TARGET_ARCH!r}] or "
            f"[{DRAFT_ARCH!r}], got {arch!r}"
        )
    return cfg


def _int_field(cfg: dict, name: str, file: str, *, minimum: int = 1) -> int:
    if name not in cfg:
        raise ValueError(f"{file}: field {name!r} is missing")
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{file}: field {name!r} must be an int >= {minimum}, got {value!r}"
        )
    return value


def target_config_from(cfg: dict, *, path: str) -> TinyMoEConfig:
    file = os.path.join(path, CONFIG_NAME)
    if cfg["architectures"] != [TARGET_ARCH]:
        raise ValueError(
            f"{file}: field 'architectures' is {cfg['architectures']!r}, not a target model"
        )
    config = TinyMoEConfig(**{f: _int_field(cfg, f, file) for f in _TARGET_FIELDS})
    _check_top_k(config, file, prefix="")
    if config.hidden_size % config.num_heads or config.head_dim % 2:
        raise ValueError(
            f"{file}: field 'num_heads' is {config.num_heads}, but hidden_size="
            f"{config.hidden_size} must split into heads of an even size (rotary)"
        )
    return config


def _check_top_k(config, file: str, *, prefix: str) -> None:
    """Each row's experts are distinct experts of the layer's."""
    if config.top_k > config.num_experts:
        raise ValueError(
            f"{file}: field '{prefix}top_k' is {config.top_k}, more than "
            f"{prefix}num_experts={config.num_experts}"
        )


def bundles_draft(cfg: dict) -> bool:
    return any(k in cfg for k in DSPARK_FIELDS)


def draft_config_from(cfg: dict, *, path: str) -> DSparkDraftConfig:
    file = os.path.join(path, CONFIG_NAME)
    if not bundles_draft(cfg):
        raise ValueError(f"{file}: no DSpark draft (no {', '.join(DSPARK_FIELDS)})")
    values = {}
    for name, attr in DSPARK_FIELDS.items():
        if name == "dspark_target_layer_ids":
            ids = cfg.get(name)
            if (
                not isinstance(ids, list)
                or not ids
                or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0
                    for i in ids
                )
            ):
                raise ValueError(
                    f"{file}: field {name!r} must be a non-empty list of ints >= 0, got {ids!r}"
                )
            if any(a >= b for a, b in zip(ids, ids[1:])):
                raise ValueError(
                    f"{file}: field {name!r} must be strictly increasing (each "
                    f"layer's hidden states once, in order), got {ids!r}"
                )
            values[attr] = tuple(ids)
        else:
            minimum = 0 if name == "dspark_noise_token_id" else 1
            values[attr] = _int_field(cfg, name, file, minimum=minimum)
    config = DSparkDraftConfig(**values)
    _check_top_k(config, file, prefix="dspark_")
    return config


def _expected_shapes(
    module: nn.Module, *, prefix: str, skip: Iterable[str] = ()
) -> Dict[str, Tuple[int, ...]]:
    """Full (unsharded) tensor shapes of ``module``: EP experts count them all."""
    shapes = {
        n: tuple(t.shape) for n, t in module.state_dict().items() if n not in skip
    }
    for name, m in module.named_modules():
        if isinstance(m, EPMoE):
            for w in ("w13", "w2"):
                key = f"{name}.{w}"
                shapes[key] = (m.num_experts,) + shapes[key][1:]
    return {prefix + n: s for n, s in shapes.items()}


def _fields_matching(
    name: str, expected: Tuple[int, ...], got: Tuple[int, ...], fields: Dict
) -> str:
    """The config fields a tensor's mismatched dims come from (by value; a
    list field, like the context layer ids, by its length times hidden_size)."""
    dims = [e for i, e in enumerate(expected) if i >= len(got) or got[i] != e]
    hidden = fields.get("hidden_size", 0)
    hits = []
    for f, v in fields.items():
        if isinstance(v, list):
            if any(d == len(v) * hidden for d in dims):
                hits.append(f)
        elif isinstance(v, int) and any(d in (v, 2 * v, 3 * v) for d in dims):
            hits.append(f)
    if re.search(r"layers\.\d+\.", name):
        hits += [f for f in fields if f.endswith("num_layers")]
    return ", ".join(f"{f}={fields[f]}" for f in dict.fromkeys(hits)) or "the sizes"


def _read_tensors(path: str) -> Dict[str, torch.Tensor]:
    file = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(file):
        raise ValueError(f"{file}: missing (a checkpoint needs {WEIGHTS_NAME})")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: unreadable safetensors ({e})") from None


def _check_tensors(
    tensors: Dict[str, torch.Tensor],
    expected: Dict[str, Tuple[int, ...]],
    *,
    path: str,
    fields: Dict[str, int],
    own: str,  # which stored names this check covers: "target" or "draft"
) -> None:
    file, cfg_file = os.path.join(path, WEIGHTS_NAME), os.path.join(path, CONFIG_NAME)
    # Only the fields that size this model: a bundle's config carries both.
    fields = {
        k: v
        for k, v in fields.items()
        if k.startswith("dspark_") == (own == "draft")
        or (own == "draft" and k in ("hidden_size", "vocab_size"))
    }
    mine = {n for n in tensors if n.startswith(DRAFT_PREFIX) == (own == "draft")}
    for name, shape in expected.items():
        if name not in tensors:
            why = _fields_matching(name, shape, (), fields)
            raise ValueError(
                f"{file}: tensor {name!r} is missing, but {cfg_file} ({why}) needs it"
            )
        got = tuple(tensors[name].shape)
        if got != shape:
            why = _fields_matching(name, shape, got, fields)
            raise ValueError(
                f"{file}: tensor {name!r} has shape {list(got)}, but {cfg_file} ({why}) implies {list(shape)}"
            )
        if tensors[name].dtype != STORAGE_DTYPE:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {tensors[name].dtype}; "
                f"checkpoints store {STORAGE_DTYPE}"
            )
        finite = torch.isfinite(tensors[name])
        if not bool(finite.all()):
            # A NaN draft would load and verify blocks it never gets
            # accepted: output stays correct, speculation silently a loss.
            bad = int((~finite).sum())
            raise ValueError(
                f"{file}: tensor {name!r} has {bad} non-finite value(s) (NaN or "
                f"inf) of {finite.numel()}: a corrupt checkpoint"
            )
    extra = sorted(mine - set(expected))
    if extra:
        why = _fields_matching(extra[0], (), (), fields)
        raise ValueError(
            f"{file}: unexpected tensor {extra[0]!r}; {cfg_file} ({why}) has no place for it"
        )


@torch.no_grad()
def _load_into(
    module: nn.Module,
    tensors: Dict[str, torch.Tensor],
    *,
    prefix: str,
    skip: Iterable[str] = (),
) -> None:
    experts = set()
    for name, m in module.named_modules():
        if isinstance(m, EPMoE):  # each EP rank keeps its slice of the full experts
            m.load_full_experts(
                tensors[f"{prefix}{name}.w13"], tensors[f"{prefix}{name}.w2"]
            )
            experts.update((f"{name}.w13", f"{name}.w2"))
    for name, t in module.state_dict(keep_vars=True).items():
        if name not in experts and name not in skip:
            t.copy_(tensors[prefix + name])


def _int_fields(cfg: dict) -> Dict:
    """The size fields of a config: ints and lists of ints."""
    return {
        k: v
        for k, v in cfg.items()
        if (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, list) and all(isinstance(i, int) for i in v))
    }


def load_target_checkpoint(
    path: str, *, device, dtype: torch.dtype = torch.float32
) -> TinyMoEForCausalLM:
    """The target model of a checkpoint directory, cast to ``dtype``."""
    cfg = read_config(path)
    config = target_config_from(cfg, path=path)
    tensors = _read_tensors(path)
    if not bundles_draft(cfg) and any(n.startswith(DRAFT_PREFIX) for n in tensors):
        _check_tensors(tensors, {}, path=path, fields=_int_fields(cfg), own="draft")
    with torch.device("meta"):  # the shapes, before sizes a typo made allocate
        shapes = _expected_shapes(TinyMoEForCausalLM(config), prefix="")
    _check_tensors(tensors, shapes, path=path, fields=_int_fields(cfg), own="target")
    model = TinyMoEForCausalLM(config).to(dtype)
    _load_into(model, tensors, prefix="")
    return model.to(device).eval()


_SHARED = ("embed_tokens.weight", "lm_head.weight")


def load_draft_checkpoint(
    path: str, *, target: TinyMoEForCausalLM, device, dtype: torch.dtype = torch.float32
) -> DSparkDraftModel:
    """The DSpark draft of a checkpoint directory (bundled or alone), reading
    ``target``'s embedding and LM head."""
    cfg = read_config(path)
    file = os.path.join(path, CONFIG_NAME)
    tcfg = target.config
    shared = target.embed_tokens.weight.dtype
    if dtype != shared:
        # It shares the target's embedding and LM head: casting it would cast
        # them, under the target.
        raise ValueError(
            f"dtype={dtype} for the draft, but its target (whose embedding and "
            f"LM head it shares) is {shared}: load both in one dtype"
        )
    # A draft's sizes must fit the target whose hidden states and vocab it reads.
    for name in ("hidden_size", "vocab_size"):
        if cfg["architectures"] == [DRAFT_ARCH] and _int_field(
            cfg, name, file
        ) != getattr(tcfg, name):
            raise ValueError(
                f"{file}: field {name!r} is {cfg[name]}, but the target has {name}={getattr(tcfg, name)}"
            )
    draft_cfg = draft_config_from(cfg, path=path)
    ids = draft_cfg.target_layer_ids
    if max(ids) >= tcfg.num_layers - 1:
        raise ValueError(
            f"{file}: field 'dspark_target_layer_ids' is {list(ids)}, but the target has "
            f"num_layers={tcfg.num_layers} (ids must be < {tcfg.num_layers - 1})"
        )
    if draft_cfg.mask_token_id >= tcfg.vocab_size:
        raise ValueError(
            f"{file}: field 'dspark_noise_token_id' is {draft_cfg.mask_token_id}, outside "
            f"the target's vocab_size={tcfg.vocab_size}"
        )
    tensors = _read_tensors(path)
    if cfg["architectures"] == [DRAFT_ARCH]:  # a draft alone: nothing else
        stray = sorted(n for n in tensors if not n.startswith(DRAFT_PREFIX))
        if stray:
            raise ValueError(
                f"{os.path.join(path, WEIGHTS_NAME)}: unexpected tensor "
                f"{stray[0]!r} in a draft-only checkpoint (its tensors are "
                f"{DRAFT_PREFIX}*; the embedding and LM head are the target's)"
            )
    with torch.device("meta"):  # its own modules; the shared ones are real
        meta = DSparkDraftModel(draft_cfg, target)
    expected = _expected_shapes(meta, prefix=DRAFT_PREFIX, skip=_SHARED)
    fields = {
        **_int_fields(cfg),
        "hidden_size": tcfg.hidden_size,
        "vocab_size": tcfg.vocab_size,
    }
    _check_tensors(tensors, expected, path=path, fields=fields, own="draft")
    draft = DSparkDraftModel(draft_cfg, target)
    draft.to(dtype)  # copy_ below casts the stored bf16 to the run dtype
    _load_into(draft, tensors, prefix=DRAFT_PREFIX, skip=_SHARED)
    return draft.to(device).eval()


def _stored(
    module: nn.Module, *, prefix: str, skip: Iterable[str] = ()
) -> Dict[str, torch.Tensor]:
    # EP size 1 only: every expert is local, so state_dict holds the full model.
    return {
        prefix + n: t.detach().to("cpu", STORAGE_DTYPE).contiguous()
        for n, t in module.state_dict().items()
        if n not in skip
    }


def save_checkpoint(
    path: str,
    *,
    target: Optional[TinyMoEForCausalLM] = None,
    draft: Optional[DSparkDraftModel] = None,
) -> None:
    """Write a target (bundling ``draft`` when given) or a draft-only
    checkpoint, whole or not at all (``replace_dir``): a reader, or a rerun
    that checks whether it exists, never finds half of one. The folder is
    replaced: files of other names in it go too."""
    from safetensors.torch import save_file

    if target is None and draft is None:
        raise ValueError("save_checkpoint needs a target, a draft, or both")
    for m in (target, draft):
        for sub in () if m is None else m.modules():
            if isinstance(sub, EPMoE) and sub.ep_size != 1:
                raise ValueError(f"save_checkpoint needs EP size 1, got {sub.ep_size}")
    tensors: Dict[str, torch.Tensor] = {}
    if target is not None:
        config = target_fields(target.config)
        tensors.update(_stored(target, prefix=""))
    else:
        tcfg = draft.embed_tokens.weight.shape
        config = {
            "architectures": [DRAFT_ARCH],
            "vocab_size": tcfg[0],
            "hidden_size": tcfg[1],
        }
    if draft is not None:
        config.update(dspark_fields(draft.config))
        tensors.update(_stored(draft, prefix=DRAFT_PREFIX, skip=_SHARED))
    config["torch_dtype"] = str(STORAGE_DTYPE).removeprefix("torch.")
    staging = _staging(path)
    try:
        with open(os.path.join(staging, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        save_file(
            tensors, os.path.join(staging, WEIGHTS_NAME), metadata={"format": "pt"}
        )
        for name in (CONFIG_NAME, WEIGHTS_NAME, ""):  # readable as made in place
            as_created(os.path.join(staging, name))
        replace_dir(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging(path: str) -> str:
    """A new, empty folder of its own beside ``path`` (the same file system,
    so renames work; unique to this call, whatever thread or process)."""
    path = os.path.normpath(path)
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=parent)


def replace_dir(src: str, dst: str) -> None:
    """Put the folder ``src`` at ``dst`` by renames: ``dst`` is its old
    contents, missing for an instant, or ``src``'s, never a mix."""
    olds = []
    try:
        while True:  # another writer may put a folder back between the renames
            if os.path.islink(dst):
                raise ValueError(f"{dst!r} is a symlink: give the folder it points to")
            if os.path.lexists(dst):
                # Not a folder, unless another writer just moved it away.
                if not os.path.isdir(dst) and os.path.lexists(dst):
                    raise ValueError(f"{dst!r} exists and is not a directory")
                olds.append(_staging(dst))
                try:
                    os.rename(dst, os.path.join(olds[-1], "old"))
                except FileNotFoundError:  # another writer moved it first
                    pass
            try:
                os.rename(src, dst)
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
    finally:
        for old in olds:
            shutil.rmtree(old, ignore_errors=True)

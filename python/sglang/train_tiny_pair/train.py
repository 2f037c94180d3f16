"""Train the embedded target, then distill its DSpark draft; write both.

    python -m sglang.train_tiny_pair            # the shipped pair (~15 min, 1 core)
    python -m sglang.train_tiny_pair --tiny --output-dir /tmp/pair   # seconds

Phases, each resumable (a finished phase's output in ``--work-dir`` is
reused; a phase in progress resumes from its last snapshot):

1. ``target``: a next-byte language model on the stdlib corpus's train files.
   Its last ``joint_steps`` also train a draft on the same windows (the
   draft's loss reaches the target through the hidden states the draft reads
   and the shared embedding / LM head, never through the target's
   probabilities, which are detached): a one-layer draft cannot recompute
   much, so the layers it reads learn to carry what it needs.
2. ``distill-data``: held-in prompts continued by that target (saved in bf16
   and reloaded, exactly as shipped): most rows sampled at temperature 1,
   the rest greedy.
3. ``draft``: the DSpark draft, started from phase 1's, distilled from the
   frozen target on those sequences (the target's outputs computed once):
   context = the target's hidden states at the draft's layers, every block
   slot's Markov-corrected distribution q against the target's p; loss =
   cross-entropy weighted toward the early slots, minus the block's expected
   accepted drafts (``block_distill_loss``); embedding and LM head are the
   target's, frozen.
4. ``export``: ``<output-dir>/tiny-moe-dspark`` (the target bundling its draft)
   and ``<output-dir>/tiny-moe-dspark-draft`` (the draft alone), then the
   held-out report: target loss, per-position acceptance, expected accepted
   length.

Every random draw comes from a generator seeded by (seed, phase, step), so a
resumed run makes the same weights as an uninterrupted one.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sglang.srt.layers.sampler import sample_tokens
from sglang.srt.model_loader.loader import (
    WEIGHTS_NAME,
    bundles_draft,
    load_draft_checkpoint,
    load_target_checkpoint,
    read_config,
    replace_dir,
    save_checkpoint,
)
from sglang.srt.models.dspark import DSparkDraftConfig, DSparkDraftModel
from sglang.srt.models.registry import CHECKPOINT_DIR, init_random_weights
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM
from sglang.srt.utils.common import (
    as_created,
    check_dir,
    check_seed,
    checked_num_threads,
    interrupted,
)
from sglang.stdlib_corpus import MASK_BYTE, load_stdlib_corpus, sample_prompts
from sglang.train_tiny_pair.evaluate import evaluate_pair, format_report
from sglang.train_tiny_pair.forward import draft_block_logits, target_forward

PHASES = ("target", "distill-data", "draft", "export")
TARGET_NAME, DRAFT_NAME = "tiny-moe-dspark", "tiny-moe-dspark-draft"


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    target_steps: int = 2800
    target_batch: int = 22
    target_seq_len: int = 192  # the positions the bench and the distillation use
    # Higher than a large model's: the tiny target learns faster with it
    # (the comparison is in docs/training.md).
    target_lr: float = 8e-3
    # The last joint_steps of the target phase also train a draft on the
    # corpus windows, its loss (times joint_weight) flowing into the target's
    # trunk, so the layers the draft reads learn features a one-layer draft
    # can use; the draft phase starts from that draft.
    joint_steps: int = 1000
    joint_weight: float = 2.0
    joint_anchors: int = 32  # block anchors per window
    num_distill_seqs: int = 8192
    distill_seq_len: int = 192
    distill_prompt_lens: tuple = (16, 32, 64, 96, 128)
    greedy_fraction: float = 0.25  # of distillation rows; the rest sample at T=1
    draft_steps: int = 3000
    draft_batch: int = 16
    draft_anchors: int = 64  # block anchors per sequence per step
    draft_lr: float = 1.5e-2  # the same for the draft (docs/training.md)
    # Block slot k's cross-entropy is weighted by slot_decay ** k (normalized):
    # an early slot's miss ends the block, so it costs more accepted tokens.
    slot_decay: float = 0.5
    # Minus this times the expected accepted drafts per block, sum over k of
    # prod_{j <= k} sum_x min(p_j(x), q_j(x)): the quantity verify rewards.
    accept_weight: float = 0.5
    markov_rank: int = 16  # the draft's Markov head (DSparkDraftConfig)
    min_anchor: int = 8  # the first block needs some context
    eval_seqs: int = 64
    eval_prompt_len: int = 64
    snapshot_every: int = 200


TINY = TrainConfig(
    target_steps=6,
    target_batch=4,
    target_seq_len=64,
    joint_steps=2,
    num_distill_seqs=8,
    distill_seq_len=48,
    distill_prompt_lens=(16,),
    draft_steps=4,
    draft_batch=4,
    draft_anchors=4,
    eval_seqs=4,
    eval_prompt_len=16,
    snapshot_every=2,
)


def _generator(cfg: TrainConfig, phase: str, step: int) -> torch.Generator:
    tag = PHASES.index(phase)
    seed = (cfg.seed * 7 + tag) * 1_000_003 + step
    return torch.Generator().manual_seed(seed % 2**64)  # what manual_seed takes


def _lr(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _train_loop(
    *,
    desc: str,
    groups: List[Tuple[List[torch.nn.Parameter], float]],  # (params, peak lr)
    state_modules: torch.nn.Module,
    loss_at: Callable[[int], torch.Tensor],
    steps: int,
    snapshot: str,
    every: int,
) -> None:
    """AdamW with warmup + cosine (each group to its own peak); resumes from
    ``snapshot`` when present. A parameter without a gradient in a step
    (a draft before the joint steps) is left alone, weight decay included."""
    params = [p for group, _ in groups for p in group]
    opt = torch.optim.AdamW(
        [{"params": group} for group, _ in groups],
        betas=(0.9, 0.95),
        weight_decay=0.01,
    )
    start = 0
    if os.path.exists(snapshot):
        state = torch.load(snapshot, weights_only=True)
        state_modules.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"{desc}: resuming at step {start} from {snapshot}", flush=True)
    bar = tqdm(
        range(start, steps), desc=desc, initial=start, total=steps, file=sys.stderr
    )
    for step in bar:
        for param_group, (_, peak) in zip(opt.param_groups, groups):
            param_group["lr"] = _lr(step, steps, peak)
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % every == 0 and step + 1 < steps:
            save_whole(
                {
                    "model": state_modules.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step + 1,
                },
                snapshot,
            )
    bar.close()


def save_whole(obj, path: str) -> None:
    """``torch.save`` that a kill or an error never leaves half done at
    ``path`` (a rerun skips a phase whose output exists): written to a file
    of its own beside it (two writers never share one), then renamed."""
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)),
        prefix=os.path.basename(path) + ".",
        suffix=".tmp",
    )
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        as_created(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _byte_stream(files: List[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(files)), dtype=torch.uint8)


def _draft_own(draft: DSparkDraftModel) -> torch.nn.ModuleList:
    """The draft's own modules: all but the target's embedding and LM head."""
    return torch.nn.ModuleList(
        m for n, m in draft.named_children() if n not in ("embed_tokens", "lm_head")
    )


def target_loss(
    model: TinyMoEForCausalLM,
    window: torch.Tensor,  # [B, T + 1] byte ids
    *,
    draft: Optional[DSparkDraftModel] = None,
    anchors: Optional[torch.Tensor] = None,  # [A]; with ``draft``
    cfg: TrainConfig,
) -> torch.Tensor:
    """Next-byte cross-entropy; with ``draft``, plus ``joint_weight`` times the
    draft's loss on the same window. The target's probabilities are detached
    there: only the hidden states the draft reads carry its gradient into
    the target, so the target's own distribution is trained by its LM loss."""
    ids = window[:, :-1]
    logits, aux = target_forward(
        model, ids, capture=() if draft is None else draft.config.target_layer_ids
    )
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)
    )
    if draft is None:
        return loss
    return loss + cfg.joint_weight * distill_loss(
        draft,
        ids=ids,
        probs=torch.softmax(logits.detach(), dim=-1),
        aux_hidden=aux,
        anchors=anchors,
        slot_decay=cfg.slot_decay,
        accept_weight=cfg.accept_weight,
    )


def train_target(cfg: TrainConfig, stream: torch.Tensor, work: str) -> None:
    """The LM; its last ``joint_steps`` also train a draft (``target_loss``)."""
    model = TinyMoEForCausalLM(TinyMoEConfig())
    init_random_weights(model, cfg.seed)
    model.train()
    draft = new_draft(cfg, model)  # re-started from the target at the joint start
    own = _draft_own(draft).train()
    T, B = cfg.target_seq_len, cfg.target_batch
    candidates = torch.arange(cfg.min_anchor, T - draft.config.block_size + 1)
    joint_start = max(0, cfg.target_steps - cfg.joint_steps)

    def loss_at(step: int) -> torch.Tensor:
        gen = _generator(cfg, "target", step)
        starts = torch.randint(0, stream.numel() - T - 1, (B,), generator=gen)
        window = stream[starts.unsqueeze(1) + torch.arange(T + 1)].long()  # [B, T + 1]
        if step < joint_start:
            return target_loss(model, window, cfg=cfg)
        if step == joint_start:
            init_draft_from_target(draft, model)
        pick = torch.randperm(candidates.numel(), generator=gen)[: cfg.joint_anchors]
        anchors = candidates[pick.sort().values]
        return target_loss(model, window, draft=draft, anchors=anchors, cfg=cfg)

    _train_loop(
        desc="target",
        groups=[
            (list(model.parameters()), cfg.target_lr),
            (list(own.parameters()), cfg.draft_lr),
        ],
        state_modules=torch.nn.ModuleList([model, own]),
        loss_at=loss_at,
        steps=cfg.target_steps,
        snapshot=os.path.join(work, "target.snapshot.pt"),
        every=cfg.snapshot_every,
    )
    save_checkpoint(
        os.path.join(work, "target"),
        target=model.eval(),
        draft=draft.eval() if cfg.joint_steps else None,
    )


@torch.no_grad()
def generate(
    model: TinyMoEForCausalLM,
    prompts: torch.Tensor,  # [B, P] int64
    *,
    new_tokens: int,
    temperatures: torch.Tensor,  # [B]; 0 = greedy
    generator: torch.Generator,
) -> torch.Tensor:  # [B, P + new_tokens]
    """Continue ``prompts`` with the target, one cached step per token."""
    B, P = prompts.shape
    c = model.config
    cache = [
        tuple(torch.zeros(B, c.num_heads, P + new_tokens, c.head_dim) for _ in range(2))
        for _ in range(c.num_layers)
    ]
    out = torch.empty(B, P + new_tokens, dtype=torch.long)
    out[:, :P] = prompts
    logits, _ = target_forward(model, prompts, cache=cache)
    for t in range(P, P + new_tokens):
        out[:, t] = sample_tokens(
            logits=logits[:, -1], temperatures=temperatures, generator=generator
        )
        if t + 1 < P + new_tokens:
            logits, _ = target_forward(model, out[:, t : t + 1], start=t, cache=cache)
    return out


def make_distill_data(cfg: TrainConfig, train_files: List[bytes], work: str) -> None:
    target = load_target_checkpoint(os.path.join(work, "target"), device="cpu")
    L, groups = cfg.distill_seq_len, len(cfg.distill_prompt_lens)
    per_group = -(-cfg.num_distill_seqs // groups)
    seqs = []
    for g, plen in enumerate(
        tqdm(cfg.distill_prompt_lens, desc="distill-data", file=sys.stderr)
    ):
        gen = _generator(cfg, "distill-data", g)
        prompts = sample_prompts(
            train_files, num=per_group, length=plen, seed=cfg.seed * 1000 + g
        )
        temps = (torch.rand(per_group, generator=gen) >= cfg.greedy_fraction).float()
        for i in range(0, per_group, 512):  # bounded KV cache per call
            seqs.append(
                generate(
                    target,
                    torch.tensor(prompts[i : i + 512]),
                    new_tokens=L - plen,
                    temperatures=temps[i : i + 512],
                    generator=gen,
                )
            )
    data = torch.cat(seqs)[: cfg.num_distill_seqs].to(torch.uint8)
    save_whole({"seqs": data}, os.path.join(work, "distill.pt"))


@dataclass(frozen=True)
class TargetOutputs:
    """The frozen target's outputs on every distillation sequence, computed
    once: the draft phase then runs only the draft (the target forward was
    half of a step)."""

    probs: torch.Tensor  # [N, T, vocab] bf16: softmax of the logits, T = 1
    aux_hidden: torch.Tensor  # [N, T, n * hidden] fp32: the draft's context


@torch.no_grad()
def target_outputs(
    target: TinyMoEForCausalLM,
    seqs: torch.Tensor,  # [N, T] uint8
    *,
    layer_ids,
    chunk: int = 64,
) -> TargetOutputs:
    n, t = seqs.shape
    c = target.config
    probs = torch.empty(n, t, c.vocab_size, dtype=torch.bfloat16)
    aux = torch.empty(n, t, len(layer_ids) * c.hidden_size)
    for i in range(0, n, chunk):
        logits, hidden = target_forward(
            target, seqs[i : i + chunk].long(), capture=layer_ids
        )
        probs[i : i + chunk] = torch.softmax(logits, dim=-1)
        aux[i : i + chunk] = hidden
    return TargetOutputs(probs=probs, aux_hidden=aux)


def block_distill_loss(
    q_logits: torch.Tensor,  # [B, A, gamma, vocab]: the draft's corrected logits
    p: torch.Tensor,  # [B, A, gamma, vocab]: the target's probabilities there
    *,
    slot_decay: float,
    accept_weight: float,
) -> torch.Tensor:
    """Cross-entropy of each block slot k against the target, weighted by
    ``slot_decay ** k`` (normalized to mean 1), minus ``accept_weight`` times
    the block's expected accepted drafts: sum over k of prod_{j <= k}
    sum_x min(p_j(x), q_j(x)), each slot's rejection-sampling acceptance."""
    gamma = q_logits.shape[-2]
    log_q = torch.log_softmax(q_logits, dim=-1)
    weights = slot_decay ** torch.arange(gamma, dtype=log_q.dtype)  # [gamma]
    ce = -(p * log_q).sum(-1)  # [B, A, gamma]
    loss = (ce * (weights / weights.mean())).mean()
    if accept_weight:
        accept = torch.minimum(p, log_q.exp()).sum(-1)  # [B, A, gamma]
        loss = loss - accept_weight * accept.cumprod(dim=-1).sum(-1).mean()
    return loss


def distill_loss(
    draft: DSparkDraftModel,
    *,
    ids: torch.Tensor,  # [B, T]
    probs: torch.Tensor,  # [B, T, vocab]: the target's next-token distributions
    aux_hidden: torch.Tensor,  # [B, T, n * hidden]
    anchors: torch.Tensor,  # [A]
    slot_decay: float,
    accept_weight: float,
) -> torch.Tensor:
    """``block_distill_loss`` of the blocks at ``anchors``, the draft run as
    inference runs it (``draft_block_logits``)."""
    gamma = draft.config.block_size
    q = draft_block_logits(
        draft, aux_hidden=aux_hidden, ids=ids, anchors=anchors, gamma=gamma
    )  # [B, A, gamma, vocab]
    pos = (anchors.unsqueeze(1) + torch.arange(gamma)).view(-1)  # slot k: row p + k
    return block_distill_loss(
        q,
        probs[:, pos].float().view_as(q),
        slot_decay=slot_decay,
        accept_weight=accept_weight,
    )


def new_draft(cfg: TrainConfig, target: TinyMoEForCausalLM) -> DSparkDraftModel:
    draft = DSparkDraftModel(
        DSparkDraftConfig(mask_token_id=MASK_BYTE, markov_rank=cfg.markov_rank),
        target,
    )
    init_random_weights(_draft_own(draft), cfg.seed + 1)
    init_draft_from_target(draft, target)
    return draft


@torch.no_grad()
def init_draft_from_target(draft: DSparkDraftModel, target: TinyMoEForCausalLM) -> None:
    """Start the draft as the target's last layer: ``fc`` passes the deepest
    context layer through, so the context K/V begin as that layer's own;
    attention, norms and the first ``num_experts`` experts are copied; the
    Markov head keeps its random start. (Measured: a better start than
    random weights for the same steps.)"""
    last, h = target.layers[-1], target.config.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, -h:].copy_(torch.eye(h))
    draft.context_norm.weight.copy_(last.input_layernorm.weight)
    draft.norm.weight.copy_(target.norm.weight)
    for layer in draft.layers:
        layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(
            last.post_attention_layernorm.weight
        )
        layer.self_attn.qkv_proj.weight.copy_(last.self_attn.qkv_proj.weight)
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        n = layer.mlp.num_experts
        layer.mlp.gate.weight.copy_(last.mlp.gate.weight[:n])
        layer.mlp.w13.copy_(last.mlp.w13[:n])
        layer.mlp.w2.copy_(last.mlp.w2[:n])


def train_draft(cfg: TrainConfig, work: str) -> None:
    target_dir = os.path.join(work, "target")
    target = load_target_checkpoint(target_dir, device="cpu")
    target.requires_grad_(False)  # embedding and LM head stay the target's
    if bundles_draft(read_config(target_dir)):  # the joint steps' draft
        draft = load_draft_checkpoint(target_dir, target=target, device="cpu")
    else:
        draft = new_draft(cfg, target)
    own = _draft_own(draft).train()
    seqs = torch.load(os.path.join(work, "distill.pt"), weights_only=True)["seqs"]
    outputs = target_outputs(target, seqs, layer_ids=draft.config.target_layer_ids)
    gamma, T = draft.config.block_size, seqs.shape[1]
    candidates = torch.arange(cfg.min_anchor, T - gamma + 1)

    def loss_at(step: int) -> torch.Tensor:
        gen = _generator(cfg, "draft", step)
        rows = torch.randint(0, seqs.shape[0], (cfg.draft_batch,), generator=gen)
        pick = torch.randperm(candidates.numel(), generator=gen)[: cfg.draft_anchors]
        return distill_loss(
            draft,
            ids=seqs[rows].long(),
            probs=outputs.probs[rows],
            aux_hidden=outputs.aux_hidden[rows],
            anchors=candidates[pick.sort().values],
            slot_decay=cfg.slot_decay,
            accept_weight=cfg.accept_weight,
        )

    _train_loop(
        desc="draft",
        groups=[(list(own.parameters()), cfg.draft_lr)],
        state_modules=own,
        loss_at=loss_at,
        steps=cfg.draft_steps,
        snapshot=os.path.join(work, "draft.snapshot.pt"),
        every=cfg.snapshot_every,
    )
    save_checkpoint(os.path.join(work, "draft"), draft=draft.eval())


def export(cfg: TrainConfig, work: str, output_dir: str, heldout: List[bytes]) -> Dict:
    target = load_target_checkpoint(os.path.join(work, "target"), device="cpu")
    draft = load_draft_checkpoint(
        os.path.join(work, "draft"), target=target, device="cpu"
    )
    target_dir = os.path.join(output_dir, TARGET_NAME)
    draft_dir = os.path.join(output_dir, DRAFT_NAME)
    # Both written beside their places first, then renamed in: an interrupt
    # leaves the old pair or the new one, not a new target beside an old
    # draft (but for the instant between the two renames).
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export.", dir=output_dir)
    try:
        staged = [os.path.join(staging, d) for d in (TARGET_NAME, DRAFT_NAME)]
        save_checkpoint(staged[0], target=target, draft=draft)
        save_checkpoint(staged[1], draft=draft)
        replace_dir(staged[0], target_dir)
        replace_dir(staged[1], draft_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # Report on what ships: reloaded from the written directories.
    target = load_target_checkpoint(target_dir, device="cpu")
    draft = load_draft_checkpoint(target_dir, target=target, device="cpu")
    gen = _generator(cfg, "export", 0)
    plen = cfg.eval_prompt_len
    prompts = sample_prompts(heldout, num=cfg.eval_seqs, length=plen, seed=cfg.seed)
    report = evaluate_pair(
        target=target,
        draft=draft,
        heldout_stream=_byte_stream(heldout),
        prompts=torch.tensor(prompts),
        continue_fn=lambda p, t: generate(
            target,
            p,
            new_tokens=cfg.distill_seq_len - plen,
            temperatures=t,
            generator=gen,
        ),
        window_len=cfg.target_seq_len,
        seed=cfg.seed,
    )
    report["target_dir"], report["draft_dir"] = target_dir, draft_dir
    report["target_params"] = sum(p.numel() for p in target.parameters())
    own = [
        p
        for n, p in draft.named_parameters()
        if not n.startswith(("embed_tokens", "lm_head"))
    ]
    report["draft_params"] = sum(p.numel() for p in own)
    report["bytes"] = {
        d: os.path.getsize(os.path.join(d, WEIGHTS_NAME))
        for d in (target_dir, draft_dir)
    }
    return report


def _claim_work_dir(cfg: TrainConfig, work_dir: str) -> None:
    """The work dir's phases and snapshots are this configuration's: its
    first run records the configuration, a rerun must match it."""
    stamp = os.path.join(work_dir, "train_config.json")
    mine = json.loads(json.dumps(asdict(cfg)))  # as read back: lists, not tuples
    if os.path.exists(stamp):
        with open(stamp) as f:
            theirs = json.load(f)
        if theirs != mine:
            diff = {
                k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v
            }
            raise ValueError(
                f"--work-dir {work_dir} holds a run of another configuration "
                f"(field: (theirs, this run's) {diff}): pass --restart to clear "
                f"it, or another --work-dir"
            )
        return
    if os.path.exists(stamp + ".tmp"):  # a first run cut short right here
        os.remove(stamp + ".tmp")
    if os.listdir(work_dir):
        raise ValueError(
            f"--work-dir {work_dir} holds files of a run whose configuration is "
            f"not recorded: pass --restart to clear it, or another --work-dir"
        )
    with open(stamp + ".tmp", "w") as f:
        json.dump(mine, f, indent=1)
    os.replace(stamp + ".tmp", stamp)


def run(*, cfg: TrainConfig, work_dir: str, output_dir: str, phases=PHASES) -> Dict:
    os.makedirs(work_dir, exist_ok=True)
    _claim_work_dir(cfg, work_dir)
    corpus = load_stdlib_corpus()
    train_files = corpus.read("train")
    outputs = {
        "target": os.path.join(work_dir, "target"),
        "distill-data": os.path.join(work_dir, "distill.pt"),
        "draft": os.path.join(work_dir, "draft"),
    }
    timings, report = {}, {}
    for phase in phases:
        t0 = time.perf_counter()
        if phase in outputs and os.path.exists(outputs[phase]):
            print(f"{phase}: done already ({outputs[phase]}), skipping", flush=True)
            continue
        if phase == "target":
            train_target(cfg, _byte_stream(train_files), work_dir)
        elif phase == "distill-data":
            make_distill_data(cfg, train_files, work_dir)
        elif phase == "draft":
            train_draft(cfg, work_dir)
        else:
            report = export(cfg, work_dir, output_dir, corpus.read("heldout"))
        timings[phase] = time.perf_counter() - t0
        print(f"{phase}: {timings[phase]:.0f} s", flush=True)
    report["phase_seconds"] = timings
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--output-dir",
        default=CHECKPOINT_DIR,
        help="where the two checkpoint directories go (default: the shipped ones)",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="phase outputs and snapshots, reused on a rerun (default: a folder "
        "under the system temp dir, per seed and size)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a few steps of each phase (CI)")
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument(
        "--markov-rank",
        type=int,
        default=None,
        help="rank of the draft's Markov head (default 16, as shipped)",
    )
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--restart", action="store_true", help="clear --work-dir first")
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads"
    )
    args = p.parse_args(argv)
    cfg = replace(TINY if args.tiny else TrainConfig(), seed=args.seed)
    for name in ("target_steps", "draft_steps", "markov_rank"):
        if getattr(args, name) is not None:
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1")
            cfg = replace(cfg, **{name: getattr(args, name)})
    check_seed(p, "--seed", args.seed)
    if args.num_threads is not None:
        try:
            torch.set_num_threads(
                checked_num_threads("--num-threads", args.num_threads)
            )
        except ValueError as e:
            p.error(str(e))
    work = args.work_dir or os.path.join(
        tempfile.gettempdir(),
        f"sglang_train_tiny_pair_s{cfg.seed}_t{cfg.target_steps}_d{cfg.draft_steps}"
        f"_m{cfg.markov_rank}",
    )
    # A folder that cannot be made fails before the training, not after.
    check_dir(p, "--work-dir", work, make=False)
    if "export" in args.phases:
        check_dir(p, "--output-dir", args.output_dir, make=False)
    if args.restart and os.path.isdir(work):
        shutil.rmtree(work)
    print(f"work dir: {work}; output dir: {args.output_dir}", flush=True)
    start = time.perf_counter()
    try:
        report = run(
            cfg=cfg, work_dir=work, output_dir=args.output_dir, phases=args.phases
        )
    except ValueError as e:
        print(f"train_tiny_pair: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the phases resume from their snapshots
        return interrupted("train_tiny_pair", f"the same command resumes from {work}")
    if "export" in args.phases:
        print(format_report(report))
        for d, size in report["bytes"].items():
            print(f"wrote {d} ({size / 1e6:.2f} MB)")
        print(
            f"parameters: target {report['target_params']:,}, draft (own) "
            f"{report['draft_params']:,}"
        )
    print(f"wall time: {time.perf_counter() - start:.0f} s (this invocation)")
    return 0

"""Held-out figures for a target + DSpark draft pair.

- target loss: next-byte cross-entropy on held-out windows (nats and bits/byte);
- per block position k (1-based), on held-out prompts continued by the target:
  at temperature 1, the acceptance probability sum_x min(p(x), q(x)) of
  rejection sampling; greedy, whether argmax q == argmax p;
- expected accepted length (committed tokens per verify step, bonus
  included, the bench's measure): decoding is replayed along each
  continuation, a block at the first generated position, the next block
  where the last one stopped. Greedy, with the greedy continuation teacher
  forced, this is exactly what greedy decoding accepts; at temperature 1
  each slot is accepted with its probability above (seeded draws), an
  estimate: an accepted token follows min(p, q), not p.
"""

from typing import Callable, Dict

import torch
import torch.nn.functional as F

from sglang.srt.models.dspark import DSparkDraftModel
from sglang.srt.models.tiny_moe import TinyMoEForCausalLM
from sglang.train_tiny_pair.forward import draft_block_logits, target_forward


@torch.no_grad()
def target_heldout_loss(
    target: TinyMoEForCausalLM,
    stream: torch.Tensor,  # [N] uint8 held-out bytes
    *,
    windows: int,
    window_len: int,
    seed: int,
) -> float:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(
        0, stream.numel() - window_len - 1, (windows,), generator=gen
    )
    total = 0.0
    for chunk in starts.split(16):
        w = stream[chunk.unsqueeze(1) + torch.arange(window_len + 1)].long()
        logits, _ = target_forward(target, w[:, :-1])
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
        ).item()
    return total / (windows * window_len)


@torch.no_grad()
def block_acceptance(
    target: TinyMoEForCausalLM,
    draft: DSparkDraftModel,
    seqs: torch.Tensor,  # [N, T]: prompts and their target continuations
    *,
    first_anchor: int,  # the first generated position
    greedy: bool,
) -> Dict:
    """Per-slot acceptance and the expected accepted length, every anchor."""
    gamma = draft.config.block_size
    anchors = torch.arange(first_anchor, seqs.shape[1] - gamma + 1)
    pos = (anchors.unsqueeze(1) + torch.arange(gamma)).view(-1)
    accepts, ce = [], 0.0
    for rows in seqs.split(4):
        logits, aux = target_forward(
            target, rows, capture=draft.config.target_layer_ids
        )
        q = draft_block_logits(
            draft, aux_hidden=aux, ids=rows, anchors=anchors, gamma=gamma
        )
        p_logits = logits[:, pos].view_as(q)  # [B, A, gamma, vocab]
        p = torch.softmax(p_logits, dim=-1)
        ce += -(p * torch.log_softmax(q, dim=-1)).sum(-1).sum().item()
        if greedy:
            accepts.append((q.argmax(-1) == p_logits.argmax(-1)).float())
        else:
            accepts.append(torch.minimum(p, torch.softmax(q, dim=-1)).sum(-1))
    a = torch.cat(accepts)  # [N, anchors, gamma]
    return {
        "per_position": a.mean(dim=(0, 1)).tolist(),
        "expected_accept_length": replay_accept_length(a, seed=0),
        "distill_ce": ce / a.numel(),
    }


def replay_accept_length(
    accept: torch.Tensor,  # [N, anchors, gamma]: per-slot acceptance probability
    *,
    seed: int,
) -> float:
    """Committed tokens per verify step along each row: a block at anchor 0,
    then at the anchor after its committed tokens."""
    gen = torch.Generator().manual_seed(seed)
    n, num_anchors, _ = accept.shape
    passed = torch.rand(accept.shape, generator=gen) < accept  # 0/1 stay 0/1
    # Committed tokens of the block at each anchor: leading accepted + 1.
    committed = (passed.long().cumprod(dim=2).sum(dim=2) + 1).tolist()
    tokens = steps = 0
    for row in committed:
        i = 0
        while i < num_anchors:
            tokens, steps, i = tokens + row[i], steps + 1, i + row[i]
    return tokens / steps


def evaluate_pair(
    *,
    target: TinyMoEForCausalLM,
    draft: DSparkDraftModel,
    heldout_stream: torch.Tensor,
    prompts: torch.Tensor,  # [N, P] held-out prompts
    continue_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    window_len: int,
    seed: int,
) -> Dict:
    """``continue_fn(prompts, temperatures)`` returns prompts + continuation."""
    n, plen = prompts.shape
    report = {
        "target_heldout_nats_per_byte": target_heldout_loss(
            target, heldout_stream, windows=n, window_len=window_len, seed=seed
        )
    }
    for name, temp in (("temperature_1", 1.0), ("greedy", 0.0)):
        seqs = continue_fn(prompts, torch.full((n,), temp))
        report[name] = block_acceptance(
            target, draft, seqs, first_anchor=plen, greedy=temp == 0
        )
    return report


def format_report(report: Dict) -> str:
    nats = report["target_heldout_nats_per_byte"]
    lines = [
        f"target held-out loss: {nats:.4f} nats/byte ({nats / 0.693147:.3f} bits/byte)"
    ]
    for name in ("temperature_1", "greedy"):
        r = report[name]
        per = " ".join(f"{a:.3f}" for a in r["per_position"])
        lines.append(
            f"{name}: draft distill CE {r['distill_ce']:.4f}; acceptance per block "
            f"position 1..{len(r['per_position'])}: {per}; expected accepted "
            f"length {r['expected_accept_length']:.2f}"
        )
    return "\n".join(lines)

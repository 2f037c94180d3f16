"""Token sampling without a host sync, by the Gumbel-max rule.

A draw from softmax(logits / T) is argmax(logits / T + G), G = -log E with
E ~ Exp(1); multiplied by T > 0 it is argmax(logits - T log E). Written that
way, T = 0 is greedy (the noise term vanishes), so one rule serves greedy,
sampled and mixed rows alike. ``draw_log_exp1_`` fills a buffer with the
noise (log E) ahead of a step, from a generator; the step itself reads the
buffer, so the draws stay outside compiled code and CUDA graphs.
"""

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

_TINY = torch.finfo(torch.float32).tiny


class SamplingMode(enum.Enum):
    """How a batch samples, decided once when the batch is built."""

    GREEDY = "greedy"  # every row T = 0
    SAMPLED = "sampled"  # every row T > 0
    MIXED = "mixed"


@dataclass(frozen=True)
class SamplingBatchInfo:
    """A batch's sampling parameters, on the host, derived once when the
    batch is built (as upstream's ``SamplingBatchInfo``); a worker copies
    them into its step buffers once per batch."""

    temperatures: torch.Tensor  # [bs] float32, host; 0 = greedy
    mode: SamplingMode

    @classmethod
    def from_temperatures(cls, temperatures: Sequence[float]) -> "SamplingBatchInfo":
        # The mode comes from the float32 values the kernels see: a
        # temperature that rounds to 0 in float32 is greedy.
        t = torch.tensor([float(x) for x in temperatures], dtype=torch.float32)
        sampled = int((t > 0).sum())
        if sampled == 0:
            mode = SamplingMode.GREEDY
        elif sampled == t.shape[0]:
            mode = SamplingMode.SAMPLED
        else:
            mode = SamplingMode.MIXED
        return cls(temperatures=t, mode=mode)


def draw_log_exp1_(
    out: torch.Tensor, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Fill ``out`` with log E, E ~ Exp(1) (E = -log U, U ~ Uniform[0, 1)).
    U is clamped to the smallest normal float first, so E is finite and > 0
    (U < 1) and log E is finite: a noise of E = 0 would pick its token
    whatever that token's probability. Returns ``out``."""
    return out.uniform_(generator=generator).clamp_min_(_TINY).log_().neg_().log_()


def gumbel_argmax(
    *,
    scores: torch.Tensor,  # [..., vocab]: logits (or log-probabilities)
    log_e: torch.Tensor,  # [..., vocab]: log Exp(1) noise
    neg_temperatures: torch.Tensor,  # [..., 1]: -T per row, 0 = greedy
    out: torch.Tensor,  # [...] int64
    scratch: torch.Tensor,  # like scores
) -> torch.Tensor:
    """A draw from softmax(scores / T) per row (argmax where T = 0), into
    ``out``: argmax(scores - T log E)."""
    torch.addcmul(scores, log_e, neg_temperatures, out=scratch)
    return torch.argmax(scratch, dim=-1, out=out)


def sample_tokens(
    *,
    logits: torch.Tensor,  # [N, vocab]
    temperatures: Sequence[float],  # N host values (or a host tensor); 0 = greedy
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:  # [N] int64
    """``gumbel_argmax`` with its own buffers, for one-off draws (a prefill's
    first token, the training data); an all-greedy call draws no noise."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    t = torch.as_tensor(temperatures, dtype=torch.float32).reshape(-1, 1)
    if not bool((t > 0).any()):
        return torch.argmax(logits, dim=-1, out=out)
    neg_t = -t.to(logits.dtype)
    return gumbel_argmax(
        scores=logits,
        log_e=draw_log_exp1_(torch.empty_like(logits), generator),
        neg_temperatures=neg_t.to(logits.device),
        out=out,
        scratch=torch.empty_like(logits),
    )

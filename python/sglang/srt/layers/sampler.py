"""Token sampling without a host sync: greedy rows take the argmax, others
take argmax(probs / Exp(1) noise), which samples from probs."""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingBatchInfo:
    """A batch's sampling state, derived once when the batch is built (as
    upstream's ``SamplingBatchInfo``): a decode step reads it, never
    rebuilds it. ``None`` stands for an all-greedy batch."""

    temperatures: torch.Tensor  # [bs] float32; 0 = greedy
    inv_temperatures: torch.Tensor  # [bs, 1]: 1 / T; 1 on greedy rows
    is_sampled: torch.Tensor  # [bs] bool: T > 0
    all_sampled: bool  # no greedy row (known on the host, no sync)

    @classmethod
    def from_temperatures(
        cls, temperatures: Sequence[float], device
    ) -> Optional["SamplingBatchInfo"]:
        # The flags come from the float32 values the kernels see, on the host
        # (no sync): a temperature that rounds to 0 in float32 is greedy, as
        # in sample_tokens.
        t = torch.tensor([float(x) for x in temperatures], dtype=torch.float32)
        is_sampled = t > 0
        if not bool(is_sampled.any()):
            return None
        # As temperature_probs: T clamped at 1e-6, so logits / T stays finite.
        inv = torch.where(is_sampled, 1.0 / t.clamp_min(1e-6), torch.ones_like(t))
        return cls(
            temperatures=t.to(device),
            inv_temperatures=inv.unsqueeze(1).to(device),
            is_sampled=is_sampled.to(device),
            all_sampled=bool(is_sampled.all()),
        )


def sample_tokens(
    *,
    logits: torch.Tensor,  # [N, vocab]
    temperatures: Optional[torch.Tensor],  # [N]; 0 = greedy; None = all greedy
    generator: Optional[torch.Generator] = None,
    out: Optional[torch.Tensor] = None,  # [N] int64, filled in place when given
) -> torch.Tensor:  # [N] int64
    """Greedy batches (``temperatures`` None) with ``out`` allocate nothing."""
    greedy = torch.argmax(logits, dim=-1, out=out)
    if temperatures is None:
        return greedy
    # Greedy rows take ``greedy`` below: their probs need no one-hot.
    probs = temperature_probs(logits, temperatures, greedy_one_hot=False)
    noise = exp1_noise_(torch.empty_like(probs), generator)
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy, out=out)


def exp1_noise_(
    out: torch.Tensor, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Fill ``out`` with Exp(1) draws, -log U for U ~ Uniform[0, 1): one
    uniform draw per element (measured on the CPU: exponential_ costs about
    3x as much as these four ops).
    U is clamped to the smallest normal float first, so a draw is never
    infinite, and never 0 (U < 1): a noise of 0 would pick its token whatever
    that token's probability. Returns ``out``."""
    return out.uniform_(generator=generator).clamp_min_(_TINY).log_().neg_()


def temperature_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    greedy_one_hot: bool = True,
) -> torch.Tensor:
    """softmax(logits / T) per row; greedy rows (T = 0) get a one-hot argmax,
    or, with ``greedy_one_hot=False`` (for callers that replace greedy rows'
    results anyway), softmax(logits / 1e-6)."""
    # logits: [..., vocab]; temperatures broadcast over the leading dims.
    t = temperatures.reshape(
        temperatures.shape + (1,) * (logits.dim() - temperatures.dim())
    )
    probs = torch.softmax(logits.float() / t.clamp_min(1e-6), dim=-1)
    if not greedy_one_hot:
        return probs
    # scatter, not F.one_hot: one_hot checks its ids on the host (a sync).
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(t > 0, probs, one_hot)

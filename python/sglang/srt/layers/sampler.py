"""Token sampling without a host sync: greedy rows take the argmax, others
take argmax(probs / Exp(1) noise), which samples from probs."""

from typing import Optional

import torch


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
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy, out=out)


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

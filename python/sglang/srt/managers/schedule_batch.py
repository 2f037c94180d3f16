"""Request and batch state: the only mutable state handed between parts."""

import numbers
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch

from sglang.srt.layers.sampler import SamplingBatchInfo


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy

    def __post_init__(self) -> None:
        # numpy scalars are accepted and stored as Python numbers, once.
        n = self.max_new_tokens
        if (
            isinstance(n, (bool, np.bool_))
            or not isinstance(n, numbers.Integral)
            or n <= 0
        ):
            raise ValueError(f"max_new_tokens must be an int > 0, got {n!r}")
        t = self.temperature
        if (
            isinstance(t, (bool, np.bool_))
            or not isinstance(t, numbers.Real)
            or not 0 <= t < float("inf")
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        object.__setattr__(self, "max_new_tokens", int(n))
        object.__setattr__(self, "temperature", float(t))


def as_token_ids(ids, *, vocab_size: int) -> List[int]:
    """Token ids as Python ints, or ValueError naming the first bad one.

    Accepted: Python ints and numpy / torch integer scalars of any width in
    [0, vocab_size). Floats, bools, strings, arrays and the like are not.
    """
    out = []
    for pos, t in enumerate(ids):
        if isinstance(t, torch.Tensor):
            ok = t.dim() == 0 and not (
                t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool
            )
            value = int(t.item()) if ok else None
        elif isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            value = None
        else:
            value = int(t)
        if value is None or not 0 <= value < vocab_size:
            raise ValueError(
                f"token id {t!r} at position {pos} is not an integer in the "
                f"vocabulary [0, {vocab_size})"
            )
        out.append(value)
    return out


@dataclass
class Req:
    rid: int
    origin_input_ids: List[int]
    sampling_params: SamplingParams
    output_ids: List[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    kv_slots: List[int] = field(default_factory=list)
    finished_reason: Optional[str] = None
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0

    @property
    def seq_len(self) -> int:
        """Committed tokens; the last one (the bonus) is not yet in the KV."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def append_tokens(self, tokens: List[int], eos_token_id: Optional[int]) -> None:
        """Commit tokens up to max_new_tokens or the first EOS; drop the rest."""
        for tok in tokens:
            self.output_ids.append(tok)
            if eos_token_id is not None and tok == eos_token_id:
                self.finished_reason = "stop"
                return
            if len(self.output_ids) >= self.sampling_params.max_new_tokens:
                self.finished_reason = "length"
                return


@dataclass
class ScheduleBatch:
    """The running requests, with their per-step state on the device.

    Built when the set of requests changes; between such changes the worker
    advances ``seq_lens`` and ``last_ids`` in place, so a step sends nothing
    from host to device.
    """

    reqs: List[Req]
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    last_ids: torch.Tensor  # [bs] int64, the bonus token: next step's anchor
    sampling_info: Optional[SamplingBatchInfo]  # None when all greedy

    @classmethod
    def from_reqs(cls, reqs: List[Req], device) -> "ScheduleBatch":
        if not reqs:
            raise ValueError("a batch needs at least one request")

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            reqs=list(reqs),
            req_pool_indices=tensor([r.req_pool_idx for r in reqs]),
            seq_lens=tensor([r.seq_len for r in reqs]),
            last_ids=tensor([r.output_ids[-1] for r in reqs]),
            sampling_info=SamplingBatchInfo.from_temperatures(
                [r.sampling_params.temperature for r in reqs], device
            ),
        )

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def temperatures(self) -> Optional[torch.Tensor]:
        """[bs] float32, 0 = greedy; None when all greedy."""
        info = self.sampling_info
        return None if info is None else info.temperatures


@dataclass(frozen=True)
class StepOutput:
    """What one decode step committed, per request (host lists)."""

    output_ids: List[List[int]]  # tokens to append, in order
    accepted_drafts: List[int]  # drafts accepted (always 0 without speculation)

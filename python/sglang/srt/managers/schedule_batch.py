"""Request and batch state: the only mutable state handed between parts."""

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch

from sglang.srt.layers.sampler import (
    NO_EXTRAS,
    SamplingBatchInfo,
    SamplingMode,
    SamplingTensors,
)
from sglang.srt.mem_cache.memory_pool import DUMMY_REQ_INDEX
from sglang.srt.utils.common import SEED_BOUND, is_finite


def _bad_bool(x) -> bool:
    return isinstance(x, (bool, np.bool_))


def _int(name: str, value, *, lo: int, hi: Optional[int] = None, text="") -> int:
    if _bad_bool(value) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int{text}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an int{text}, got {value!r}")
    return int(value)


def _real(name: str, value, *, ok, text: str) -> float:
    if (
        _bad_bool(value)
        or not isinstance(value, numbers.Real)
        or not is_finite(value)
        or not ok(value)
    ):
        raise ValueError(f"{name} must be a finite number {text}, got {value!r}")
    return float(value)


# Upstream's: a temperature below it samples greedily (here: stored as 0).
SAMPLING_EPS = 1e-6
# The sampling arithmetic runs in float32: past this temperature the noise
# term (T * log E, |log E| < 17) would overflow. A penalty below its floor
# would divide logits past float32's range.
MAX_TEMPERATURE = 1e30
MIN_REPETITION_PENALTY = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters: upstream's names and meanings
    (temperature 0 is greedy here, upstream's default is 1). numpy scalars
    are accepted and stored as Python numbers, once."""

    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy (so is anything below SAMPLING_EPS)
    # (0, 1]: the tokens whose higher-ranked mass is at most top_p (upstream's
    # rule: at an exact tie, one more than the smallest set with this mass)
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens; else the k most likely
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the top one's p
    repetition_penalty: float = 1.0  # [1e-6, 2]: > 1 discourages prompt/output ids
    frequency_penalty: float = 0.0  # [-2, 2], x each output id's count
    presence_penalty: float = 0.0  # [-2, 2], once per output id
    stop_token_ids: Optional[Tuple[int, ...]] = None  # end the request there
    ignore_eos: bool = False  # EOS neither stops nor is masked
    min_new_tokens: int = 0  # EOS and stop ids masked until this many
    sampling_seed: Optional[int] = None  # [0, 2**63): draws of its own

    def __post_init__(self) -> None:
        fix = object.__setattr__
        fix(
            self,
            "max_new_tokens",
            _int("max_new_tokens", self.max_new_tokens, lo=1, text=" > 0"),
        )
        t = _real(
            "temperature",
            self.temperature,
            ok=lambda t: 0 <= t <= MAX_TEMPERATURE,
            text=f"in [0, {MAX_TEMPERATURE:g}]",
        )
        fix(self, "temperature", 0.0 if t < SAMPLING_EPS else t)
        fix(
            self,
            "top_p",
            _real("top_p", self.top_p, ok=lambda x: 0 < x <= 1, text="in (0, 1]"),
        )
        if (
            _bad_bool(self.top_k)
            or not isinstance(self.top_k, numbers.Integral)
            or (self.top_k < 1 and self.top_k != -1)
        ):
            raise ValueError(
                f"top_k must be -1 (all tokens) or an int >= 1, got {self.top_k!r}"
            )
        fix(self, "top_k", int(self.top_k))
        fix(
            self,
            "min_p",
            _real("min_p", self.min_p, ok=lambda x: 0 <= x <= 1, text="in [0, 1]"),
        )
        fix(
            self,
            "repetition_penalty",
            _real(
                "repetition_penalty",
                self.repetition_penalty,
                ok=lambda x: MIN_REPETITION_PENALTY <= x <= 2,
                text=f"in [{MIN_REPETITION_PENALTY:g}, 2]",
            ),
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = _real(
                name, getattr(self, name), ok=lambda x: -2 <= x <= 2, text="in [-2, 2]"
            )
            fix(self, name, value)
        stops = self.stop_token_ids
        if stops is not None:
            if isinstance(stops, (str, bytes)) or not isinstance(stops, (list, tuple)):
                raise ValueError(
                    f"stop_token_ids must be a list of token ids, got {stops!r}"
                )
            fix(
                self,
                "stop_token_ids",
                tuple(_int("stop_token_ids", t, lo=0, text=" >= 0") for t in stops),
            )
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        fix(self, "ignore_eos", bool(self.ignore_eos))
        fix(
            self,
            "min_new_tokens",
            _int(
                "min_new_tokens",
                self.min_new_tokens,
                lo=0,
                hi=self.max_new_tokens,
                text=f" in [0, max_new_tokens={self.max_new_tokens}]",
            ),
        )
        if self.sampling_seed is not None:
            fix(
                self,
                "sampling_seed",
                _int(
                    "sampling_seed",
                    self.sampling_seed,
                    lo=0,
                    hi=SEED_BOUND - 1,
                    text=" in [0, 2**63)",
                ),
            )

    @property
    def is_penalized(self) -> bool:
        """Its logits depend on its history (penalties, min_new_tokens)."""
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.min_new_tokens > 0
        )

    @property
    def is_truncated(self) -> bool:
        """Its distribution is cut (top_k, top_p, min_p)."""
        return self.top_p < 1 or self.top_k != -1 or self.min_p > 0


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


def kv_slots_needed(*, prompt_len: int, max_new_tokens: int, lookahead: int) -> int:
    """KV slots a request may touch: its prompt, its outputs but the last
    (never written), and ``lookahead`` positions past them (DSpark's verify
    window, gamma; 0 for plain decoding)."""
    return prompt_len + max_new_tokens - 1 + lookahead


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
    spec_verified_drafts: int = 0  # drafts the target verified, all steps
    # The confidence of each draft of its last block (the verify planner's).
    spec_draft_confidence: Optional[List[float]] = None
    # The first position whose draft context waits in the worker's stash
    # (committed by plain steps); None: the draft's context is whole.
    draft_context_from: Optional[int] = None
    eos_token_id: Optional[int] = None  # the engine's, set when queued
    return_logprob: bool = False
    # The target's log-probability of each output token (return_logprob).
    output_token_logprobs: List[float] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        """Committed tokens; the last one (the bonus) is not yet in the KV."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def append_tokens(
        self,
        tokens: List[int],
        eos_token_id: Optional[int],
        logprobs: Optional[List[float]] = None,
    ) -> None:
        """Commit tokens up to max_new_tokens, or the first EOS (unless
        ignored) or stop id once min_new_tokens are out; drop the rest.
        ``logprobs`` (one per token) are kept when the request asked. A
        finished request takes none."""
        if self.finished:
            return
        sp = self.sampling_params
        for i, tok in enumerate(tokens):
            self.output_ids.append(tok)
            if self.return_logprob and logprobs is not None:
                self.output_token_logprobs.append(logprobs[i])
            stop = (
                eos_token_id is not None and tok == eos_token_id and not sp.ignore_eos
            ) or (sp.stop_token_ids is not None and tok in sp.stop_token_ids)
            if stop and len(self.output_ids) > sp.min_new_tokens:
                self.finished_reason = "stop"
                return
            if len(self.output_ids) >= sp.max_new_tokens:
                self.finished_reason = "length"
                return


@dataclass(frozen=True)
class BatchState:
    """A batch's per-step device state, as views of a worker's step buffers
    (``BatchStateBuffers.cut``): what a decode step reads and advances."""

    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    last_ids: torch.Tensor  # [bs] int64, the bonus token: next step's anchor
    temperatures: torch.Tensor  # [bs] float32; 0 = greedy
    inv_temperatures: torch.Tensor  # [bs, 1]: 1 / T; 1 on greedy rows
    neg_temperatures: torch.Tensor  # [bs, 1]: -T (0 on greedy rows)
    is_sampled: torch.Tensor  # [bs] bool: T > 0
    # The other sampling parameters and the tokens they count: loaded only
    # for a batch that uses them (its SamplingExtras).
    sampling: SamplingTensors


class BatchStateBuffers:
    """The state of up to ``max_batch_size`` rows, allocated once; rows past
    a batch hold the dummy request (its KV is the scratch slot only), so a
    step padded to a larger size touches nothing live."""

    def __init__(self, *, max_batch_size: int, vocab_size: int, device) -> None:
        n, dev = max_batch_size, device
        self.req_pool_indices = torch.full((n,), DUMMY_REQ_INDEX, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.last_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.temperatures = torch.zeros(n, device=dev)
        self.inv_temperatures = torch.ones(n, 1, device=dev)
        self.neg_temperatures = torch.zeros(n, 1, device=dev)
        self.is_sampled = torch.zeros(n, dtype=torch.bool, device=dev)
        self._is_greedy = torch.ones(n, dtype=torch.bool, device=dev)  # scratch

        self.sampling = SamplingTensors.empty(
            n, vocab_size, dev, inv_temperatures=self.inv_temperatures
        )

    def cut(self, bs: int) -> BatchState:
        sampling = SamplingTensors(
            **{
                f.name: getattr(self.sampling, f.name)[:bs]
                for f in dataclasses.fields(SamplingTensors)
            }
        )
        return BatchState(
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            last_ids=self.last_ids[:bs],
            temperatures=self.temperatures[:bs],
            inv_temperatures=self.inv_temperatures[:bs],
            neg_temperatures=self.neg_temperatures[:bs],
            is_sampled=self.is_sampled[:bs],
            sampling=sampling,
        )

    def reset(self) -> None:
        """Every row the dummy request."""
        self.pad(0)
        self.req_pool_indices.fill_(DUMMY_REQ_INDEX)
        for t, value in (
            (self.temperatures, 0.0),
            (self.inv_temperatures, 1.0),
            (self.neg_temperatures, 0.0),
            (self.is_sampled, False),
        ):
            t.fill_(value)

    def bind(self, batch: "ScheduleBatch", state: BatchState) -> None:
        """Move ``batch``'s device state into ``state`` (these buffers cut to
        its size), once: its tensors become views of them, and the rows past
        it become the dummy request. Binding a bound batch does nothing."""
        if batch.seq_lens is state.seq_lens:
            return
        bs = batch.batch_size
        self.reset()
        state.req_pool_indices.copy_(batch.req_pool_indices)
        state.seq_lens.copy_(batch.seq_lens)
        state.last_ids.copy_(batch.last_ids)
        t = state.temperatures
        t.copy_(batch.sampling_info.temperatures)  # host to device, once a batch
        torch.gt(t, 0, out=state.is_sampled)
        torch.neg(t, out=state.neg_temperatures.view(bs))
        # 1 / T, with T clamped at 1e-6 so that logits / T stays finite; 1 on
        # greedy rows.
        inv = state.inv_temperatures.view(bs)
        torch.clamp_min(t, 1e-6, out=inv).reciprocal_()
        inv.masked_fill_(torch.le(t, 0, out=self._is_greedy[:bs]), 1.0)
        if batch.sampling_info.extras != NO_EXTRAS:
            state.sampling.load(batch.sampling_info, state.is_sampled)
        batch.req_pool_indices = state.req_pool_indices
        batch.seq_lens, batch.last_ids = state.seq_lens, state.last_ids

    def pad(self, bs: int) -> None:
        """Rows from ``bs`` on back to the dummy request's position and
        token, which a padded step advanced (its other fields stay dummy)."""
        self.seq_lens[bs:].fill_(1)
        self.last_ids[bs:].zero_()


@dataclass
class ScheduleBatch:
    """The running requests, with their per-step state on the device.

    Built when the set of requests changes. A worker binds it to its step
    buffers once (``BatchStateBuffers.bind``): the state moves into them and
    the batch's tensors become views of them; from then on the worker advances
    ``seq_lens`` and ``last_ids`` in place, so a step sends nothing from host
    to device. ``seq_lens_cpu`` mirrors ``seq_lens`` on the host (the worker
    advances it from what each step reads back), so a step never reads the
    device to size its attention.

    Under data-parallel attention the scheduler stamps each step's batch
    with every DP rank's counts (``Scheduler``'s per-step sync), so that all
    ranks run the same forwards; a rank with no running request steps an
    ``idle`` batch.
    """

    reqs: List[Req]
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    last_ids: torch.Tensor  # [bs] int64, the bonus token: next step's anchor
    sampling_info: SamplingBatchInfo
    seq_lens_cpu: List[int]
    # Data-parallel attention, per DP rank in rank order; None without it.
    global_num_tokens: Optional[List[int]] = None  # running requests
    global_num_tokens_for_logprob: Optional[List[int]] = None
    # Each rank's verify tier (``local_verify_tier_num_tokens``; -1: no
    # budget, 0: idle).
    global_verify_tier_num_tokens: Optional[List[int]] = None
    can_run_dp_cuda_graph: bool = False

    @classmethod
    def from_reqs(cls, reqs: List[Req], device) -> "ScheduleBatch":
        if not reqs:
            raise ValueError("a batch needs at least one request")

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        seq_lens = [r.seq_len for r in reqs]
        return cls(
            reqs=list(reqs),
            req_pool_indices=tensor([r.req_pool_idx for r in reqs]),
            seq_lens=tensor(seq_lens),
            last_ids=tensor([r.output_ids[-1] for r in reqs]),
            sampling_info=SamplingBatchInfo.from_reqs(reqs),
            seq_lens_cpu=seq_lens,
        )

    @classmethod
    def idle(cls, device) -> "ScheduleBatch":
        """No request: what a DP rank with nothing running steps, so that
        its MoE joins the other ranks' collectives."""
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(
            reqs=[],
            req_pool_indices=empty,
            seq_lens=empty.clone(),
            last_ids=empty.clone(),
            sampling_info=SamplingBatchInfo.from_temperatures([]),
            seq_lens_cpu=[],
        )

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def is_idle(self) -> bool:
        return not self.reqs

    @property
    def sampling_mode(self) -> SamplingMode:
        return self.sampling_info.mode


@dataclass(frozen=True)
class StepOutput:
    """What one decode step committed, per request (host lists)."""

    output_ids: List[List[int]]  # tokens to append, in order
    accepted_drafts: List[int]  # drafts accepted (always 0 without speculation)
    verified_drafts: Optional[List[int]] = None  # drafts verified; None: 0
    # The target's log-probability of each token of output_ids; None when no
    # request of the batch asked.
    logprobs: Optional[List[List[float]]] = None

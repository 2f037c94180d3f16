"""Token sampling without a host sync, by the Gumbel-max rule.

A draw from softmax(logits / T) is argmax(logits / T + G), G = -log E with
E ~ Exp(1); multiplied by T > 0 it is argmax(logits - T log E). Written that
way, T = 0 is greedy (the noise term vanishes), so one rule serves greedy,
sampled and mixed rows alike. ``draw_log_exp1_`` fills a buffer with the
noise (log E) ahead of a step, from a generator; the step itself reads the
buffer, so the draws stay outside compiled code and CUDA graphs.

The sampling parameters beyond the temperature (upstream's names) enter
through one logits-processing step, ``process_logits``, that plain
sampling, the draft's block sampling and the verify all run, per position
with that position's history: repetition, frequency and presence penalties
(the history's tokens; for a drafted position, the drafts before it too),
``min_new_tokens`` (EOS and stop ids masked until that many tokens), then
``top_k``, ``top_p`` and ``min_p`` on softmax(logits / T). A request with a
``sampling_seed`` draws its noise from a counter-based hash of (seed,
output position, token) instead of the engine's generator
(``fill_seeded_log_e_``): its tokens depend on its prompt, parameters and
seed alone.
"""

import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

_TINY = torch.finfo(torch.float32).tiny
# Upstream's top_k for every token: exact in float32, past any vocabulary.
TOP_K_ALL = 1 << 30


class SamplingMode(enum.Enum):
    """How a batch samples, decided once when the batch is built."""

    GREEDY = "greedy"  # every row T = 0
    SAMPLED = "sampled"  # every row T > 0
    MIXED = "mixed"


@dataclass(frozen=True)
class SamplingExtras:
    """What a batch's step does beyond temperature sampling, decided once
    when the batch is built; each is a variant of the step (its graph)."""

    penalized: bool = False  # penalties or min_new_tokens: need the history
    truncated: bool = False  # top_k, top_p or min_p
    seeded: bool = False  # a sampled request with a sampling_seed
    logprobs: bool = False  # a request returns its tokens' logprobs

    @property
    def processed(self) -> bool:
        """The logits go through ``process_logits``."""
        return self.penalized or self.truncated

    @property
    def counted(self) -> bool:
        """The step counts its committed tokens (history, output position)."""
        return self.penalized or self.seeded


NO_EXTRAS = SamplingExtras()


def _mode(t: torch.Tensor) -> SamplingMode:
    # From the float32 values the kernels see: a temperature that rounds to
    # 0 in float32 is greedy.
    sampled = int((t > 0).sum())
    if sampled == 0:
        return SamplingMode.GREEDY
    return SamplingMode.SAMPLED if sampled == t.shape[0] else SamplingMode.MIXED


@dataclass(frozen=True)
class SamplingBatchInfo:
    """A batch's sampling parameters, on the host, derived once when the
    batch is built (as upstream's ``SamplingBatchInfo``); a worker copies
    them into its step buffers once per batch."""

    temperatures: torch.Tensor  # [bs] float32, host; 0 = greedy
    mode: SamplingMode
    extras: SamplingExtras = NO_EXTRAS
    # [bs, 7] float32: top_k (0: all), top_p, min_p, repetition, frequency
    # and presence penalties, min_new_tokens; None without extras.
    params: Optional[torch.Tensor] = None
    seeds: Optional[torch.Tensor] = None  # [bs] int64, -1: the generator's
    # Per request: the ids min_new_tokens masks (stop ids, and EOS unless
    # ignored), the prompt, the output so far.
    stop_ids: Optional[List[List[int]]] = None
    prompts: Optional[List[List[int]]] = None
    outputs: Optional[List[List[int]]] = None

    @classmethod
    def from_temperatures(cls, temperatures: Sequence[float]) -> "SamplingBatchInfo":
        t = torch.tensor([float(x) for x in temperatures], dtype=torch.float32)
        return cls(temperatures=t, mode=_mode(t))

    @classmethod
    def from_reqs(cls, reqs: Sequence[Any]) -> "SamplingBatchInfo":
        """From requests (``schedule_batch.Req``: their sampling params,
        prompt, output, eos id and return_logprob)."""
        plain = cls.from_temperatures([r.sampling_params.temperature for r in reqs])
        extras = SamplingExtras(
            penalized=any(r.sampling_params.is_penalized for r in reqs),
            truncated=any(r.sampling_params.is_truncated for r in reqs),
            seeded=any(
                r.sampling_params.sampling_seed is not None
                and r.sampling_params.temperature > 0
                for r in reqs
            ),
            logprobs=any(r.return_logprob for r in reqs),
        )
        if extras == NO_EXTRAS:
            return plain
        params, seeds, stop_ids = [], [], []
        for r in reqs:
            sp = r.sampling_params
            params.append(
                [
                    # Any top_k past the vocabulary keeps every token; capped
                    # so that float32 holds it (10**400 does not fit).
                    min(max(sp.top_k, 0), TOP_K_ALL),
                    sp.top_p,
                    sp.min_p,
                    sp.repetition_penalty,
                    sp.frequency_penalty,
                    sp.presence_penalty,
                    sp.min_new_tokens,
                ]
            )
            seeds.append(-1 if sp.sampling_seed is None else sp.sampling_seed)
            stops = list(sp.stop_token_ids or ())
            if r.eos_token_id is not None and not sp.ignore_eos:
                stops.append(r.eos_token_id)
            stop_ids.append(stops)
        return cls(
            temperatures=plain.temperatures,
            mode=plain.mode,
            extras=extras,
            params=torch.tensor(params, dtype=torch.float32),
            seeds=torch.tensor(seeds, dtype=torch.int64),
            stop_ids=stop_ids,
            prompts=[list(r.origin_input_ids) for r in reqs],
            outputs=[list(r.output_ids) for r in reqs],
        )


@dataclass(frozen=True)
class SamplingTensors:
    """A batch's sampling state on the device, per row (views of a worker's
    step buffers, or a prefill's own): what ``process_logits`` and the
    seeded noise read, advanced by each step's committed tokens."""

    inv_temperatures: torch.Tensor  # [B, 1]: 1 / T; 1 on greedy rows
    top_k: torch.Tensor  # [B, 1] int64; vocab size when off
    top_p: torch.Tensor  # [B, 1]
    min_p: torch.Tensor  # [B, 1]
    repetition_penalty: torch.Tensor  # [B, 1]
    frequency_penalty: torch.Tensor  # [B, 1]
    presence_penalty: torch.Tensor  # [B, 1]
    min_new_tokens: torch.Tensor  # [B] int64
    out_lens: torch.Tensor  # [B] int64: output tokens so far
    seeds: torch.Tensor  # [B] int64; -1: none
    is_seeded: torch.Tensor  # [B, 1] bool: a sampled row with a seed
    counts: torch.Tensor  # [B, V] float32: output tokens so far, by id
    seen: torch.Tensor  # [B, V] bool: prompt and output tokens
    stop_mask: torch.Tensor  # [B, V] bool: masked until min_new_tokens

    @classmethod
    def empty(
        cls,
        rows: int,
        vocab_size: int,
        device,
        inv_temperatures: Optional[torch.Tensor] = None,
    ) -> "SamplingTensors":
        """Neutral parameters for ``rows`` rows (nothing changes a logit)."""

        def col(value, dtype=torch.float32):
            return torch.full((rows, 1), value, dtype=dtype, device=device)

        ints = torch.zeros(3, rows, dtype=torch.int64, device=device)
        return cls(
            inv_temperatures=col(1.0) if inv_temperatures is None else inv_temperatures,
            top_k=col(vocab_size, torch.int64),
            top_p=col(1.0),
            min_p=col(0.0),
            repetition_penalty=col(1.0),
            frequency_penalty=col(0.0),
            presence_penalty=col(0.0),
            min_new_tokens=ints[0],
            out_lens=ints[1],
            seeds=ints[2],
            is_seeded=col(False, torch.bool),
            counts=torch.zeros(rows, vocab_size, device=device),
            seen=torch.zeros(rows, vocab_size, dtype=torch.bool, device=device),
            stop_mask=torch.zeros(rows, vocab_size, dtype=torch.bool, device=device),
        )

    def load(self, info: SamplingBatchInfo, is_sampled: torch.Tensor) -> None:
        """Fill from a batch's host info (one copy per tensor, once a batch)."""
        bs, vocab = self.counts.shape
        dev = self.counts.device
        p = info.params.to(dev)
        top_k = p[:, 0].long()
        self.top_k.copy_(torch.where(top_k > 0, top_k, vocab).unsqueeze(1))
        for i, t in enumerate(
            (
                self.top_p,
                self.min_p,
                self.repetition_penalty,
                self.frequency_penalty,
                self.presence_penalty,
            ),
            start=1,
        ):
            t.copy_(p[:, i : i + 1])
        self.min_new_tokens.copy_(p[:, 6].long())
        self.seeds.copy_(info.seeds)
        torch.logical_and(self.seeds >= 0, is_sampled, out=self.is_seeded.view(bs))
        self.out_lens.copy_(torch.tensor([len(o) for o in info.outputs]))
        counts = torch.zeros(bs, vocab)
        seen = torch.zeros(bs, vocab, dtype=torch.bool)
        stop = torch.zeros(bs, vocab, dtype=torch.bool)
        for b in range(bs):
            out = torch.tensor(info.outputs[b], dtype=torch.int64)
            counts[b].index_add_(0, out, torch.ones(out.shape[0]))
            seen[b, torch.tensor(info.prompts[b], dtype=torch.int64)] = True
            seen[b, out] = True
            stop[b, torch.tensor(info.stop_ids[b], dtype=torch.int64)] = True
        self.counts.copy_(counts)
        self.seen.copy_(seen)
        self.stop_mask.copy_(stop)

    def advance_(self, tokens: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        """Count a step's committed tokens: ``tokens`` [B, K] int64, of
        which ``valid`` [B, K] (bool; None: all) were committed."""
        ones = torch.ones(tokens.shape, device=tokens.device)
        if valid is not None:
            ones = ones * valid
        delta = torch.zeros_like(self.counts).scatter_add_(1, tokens, ones)
        self.counts.add_(delta)
        self.seen.logical_or_(delta > 0)
        self.out_lens.add_(ones.sum(1).long())


def draw_log_exp1_(
    out: torch.Tensor, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Fill ``out`` with log E, E ~ Exp(1) (E = -log U, U ~ Uniform[0, 1)).
    Returns ``out``."""
    return log_exp1_(out.uniform_(generator=generator))


def log_exp1_(u: torch.Tensor) -> torch.Tensor:
    """Uniform[0, 1) draws, in place, into log E, E = -log U ~ Exp(1): for a
    caller that draws them together with others (one generator call).
    U is clamped to the smallest normal float first, so E is finite and > 0
    (U < 1) and log E is finite: a noise of E = 0 would pick its token
    whatever that token's probability. Returns ``u``."""
    return u.clamp_min_(_TINY).log_().neg_().log_()


def process_logits(
    logits: torch.Tensor,  # [S, B, V]: S positions of each of B rows
    st: SamplingTensors,  # B rows
    *,
    history: Optional[torch.Tensor] = None,  # [S, B, V]: tokens before a slot
    slot_offsets: Optional[torch.Tensor] = None,  # [S, 1] int64, 0..S-1
    extras: SamplingExtras = SamplingExtras(penalized=True, truncated=True),
) -> torch.Tensor:  # [S, B, V], new
    """The sampling parameters applied to ``logits``: position s of row b
    predicts output token ``out_lens[b] + s``, with the committed tokens
    plus ``history[s, b]`` (drafted tokens before it) as its history.
    Penalties first (upstream's order: repetition over prompt and output,
    frequency and presence over the output), then ``min_new_tokens``'s
    mask, then the truncations of softmax(logits / T) as -inf (greedy rows:
    T taken as 1; their argmax always survives). ``extras`` skips what no
    row of the batch uses. No host read. Neutral values leave a row's
    logits bitwise unchanged."""
    out = logits
    if extras.penalized:
        counts = st.counts if history is None else st.counts + history
        seen = st.seen if history is None else st.seen | (history > 0)
        rp = st.repetition_penalty
        penalized = torch.where(out > 0, out / rp, out * rp)
        out = torch.where(seen, penalized, out)
        out = out - (st.frequency_penalty * counts + st.presence_penalty * (counts > 0))
        position = st.out_lens if slot_offsets is None else st.out_lens + slot_offsets
        early = (position < st.min_new_tokens).unsqueeze(-1)  # [S, B, 1]
        out = out.masked_fill(early & st.stop_mask, float("-inf"))
    if extras.truncated:
        scaled = out * st.inv_temperatures
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        before = torch.cumsum(probs, dim=-1) - probs  # mass ranked above
        drop = (  # [S, B, V], by rank
            (ranks >= st.top_k)
            | ((before > st.top_p) & (st.top_p < 1))
            | (probs < st.min_p * probs[..., :1])
        )
        mask = torch.zeros_like(drop).scatter(-1, order, drop)
        out = out.masked_fill(mask, float("-inf"))
    return out


# splitmix64's constants, as signed 64-bit values (torch has no uint64 math).
def _i64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (
    _i64(0x9E3779B97F4A7C15),
    _i64(0xBF58476D1CE4E5B9),
    _i64(0x94D049BB133111EB),
)
_POSITION = _i64(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seeded_log_e(
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [S, B] int64: output positions
    vocab: int,
) -> torch.Tensor:  # [S, B, V] float32
    """log E, E ~ Exp(1), as a function of (seed, output position, token)
    alone: a counter-based hash (splitmix64's finalizer) instead of a
    generator's stream, so that a request's draws do not depend on what
    else its batch held or how its steps fell."""
    tokens = torch.arange(vocab, device=seeds.device)
    key = _mix(seeds * _GOLDEN + positions * _POSITION)  # [S, B]
    bits = _mix(key.unsqueeze(-1) + (tokens + 1) * _GOLDEN)  # [S, B, V]
    u = (_shr(bits, 11).double() + 0.5) * 2.0**-53  # in (0, 1)
    return u.log().neg().log().float()


def fill_seeded_log_e_(
    log_e: torch.Tensor,  # [S, B, V]: the step's noise, rows in place
    st: SamplingTensors,
    slot_offsets: torch.Tensor,  # [S, 1] int64: output position - out_lens
) -> None:
    """The seeded rows' noise: position s of row b is output token
    ``out_lens[b] + slot_offsets[s]``."""
    positions = st.out_lens + slot_offsets  # [S, B]
    seeded = seeded_log_e(st.seeds, positions, log_e.shape[-1])
    torch.where(st.is_seeded, seeded, log_e, out=log_e)


def token_logprobs(
    logits: torch.Tensor,  # [..., V]: the model's, before any processing
    tokens: torch.Tensor,  # [...] int64
) -> torch.Tensor:  # [...] float32
    """log softmax(logits)[token]: the model's own log-probability (T = 1,
    no sampling parameter applied): vLLM's raw logprobs, and upstream
    SGLang's only with SGLANG_RETURN_ORIGINAL_LOGPROB (its default applies
    the temperature)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


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


def sample_next_(
    logits: torch.Tensor,  # [B, V]: each row's next-token logits
    mode: SamplingMode,
    *,
    sampling: SamplingTensors,
    neg_temperatures: torch.Tensor,  # [B, 1]
    log_e: torch.Tensor,  # [B, V]: the step's noise (unread when greedy)
    scratch: torch.Tensor,  # [B, V]
    out: torch.Tensor,  # [B] int64
    extras: SamplingExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Plain decoding's rule for one token per row, into ``out``: the
    sampling parameters' processing (when the batch uses any), then the
    argmax (greedy) or the Gumbel rule. Returns the logits it sampled from
    before processing (the model's own, what logprobs read)."""
    raw = logits
    if extras.processed:
        logits = process_logits(logits.unsqueeze(0), sampling, extras=extras)[0]
    if mode is SamplingMode.GREEDY:
        torch.argmax(logits, dim=-1, out=out)
    else:
        gumbel_argmax(
            scores=logits,
            log_e=log_e,
            neg_temperatures=neg_temperatures,
            out=out,
            scratch=scratch,
        )
    return raw


def sample_first_token(
    logits: torch.Tensor,  # [1, vocab]: the prompt's last row
    req: Any,  # a schedule_batch.Req
    generator: Optional[torch.Generator] = None,
) -> tuple:
    """A prefill's first token by the request's own parameters (the same
    processing and seeded noise as a decode step), and its log-probability
    when the request asked for it (else None)."""
    info = SamplingBatchInfo.from_reqs([req])
    t = req.sampling_params.temperature
    if info.extras == NO_EXTRAS:
        return (
            int(sample_tokens(logits=logits, temperatures=[t], generator=generator)),
            None,
        )
    vocab, device = logits.shape[-1], logits.device
    inv = torch.full((1, 1), 1.0 / t if t > 0 else 1.0, device=device)
    st = SamplingTensors.empty(1, vocab, device, inv_temperatures=inv)
    st.load(info, torch.tensor([t > 0], device=device))
    processed = logits
    if info.extras.processed:
        processed = process_logits(logits.unsqueeze(0), st, extras=info.extras)[0]
    if t > 0:
        log_e = torch.empty_like(processed)
        if bool(st.is_seeded[0, 0]):  # its own draws, not the generator's
            fill_seeded_log_e_(
                log_e.unsqueeze(0),
                st,
                torch.zeros(1, 1, dtype=torch.int64, device=device),
            )
        else:
            draw_log_exp1_(log_e, generator)
        processed = processed - t * log_e
    token = torch.argmax(processed, dim=-1)
    logprob = float(token_logprobs(logits, token)) if req.return_logprob else None
    return int(token), logprob

"""The verify window and how much of it a step verifies.

- ``VerifyWindow``: the gamma + 1 positions and KV slots of one decode step,
  filled first: the draft block uses the first gamma, the verify all.
- The verify budget: how many drafted tokens a step verifies in all. The
  host picks it per step (``DSparkVerifyPlanner``, from the drafts'
  calibrated confidence and a measured cost table) as a token-count tier
  (``local_verify_tier_num_tokens``; across data-parallel ranks
  ``dp_global_verify_tier_num_tokens`` and the step shape they agree on,
  ``dp_verify_drafts_per_req``); on the device
  ``ScheduleVerifyLensTopk`` shares it among requests by confidence (a
  bucket's padding requests last) and
  ``ragged_verify_layout`` places the rows: the verify runs only those.
"""

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


@dataclass(frozen=True)
class VerifyWindow:
    """Views of the step buffers: valid until the next step fills them."""

    positions: torch.Tensor  # [bs, gamma + 1]: seq_len - 1 .. seq_len - 1 + gamma
    out_cache_loc: torch.Tensor  # [bs, gamma + 1]


class VerifyWindowPlanner:
    """Fills a step's window with ``out=`` ops (three kernels, no host read)."""

    def __init__(self, *, req_to_token: torch.Tensor, gamma: int, device) -> None:
        self.req_to_token = req_to_token  # [max_reqs + 1, context_len] int64
        self._flat_table = req_to_token.view(-1)
        self._offsets = torch.arange(gamma + 1, device=device) - 1  # [gamma + 1]

    def plan(
        self,
        *,
        seq_lens: torch.Tensor,  # [bs, 1] int64
        req_pool_indices: torch.Tensor,  # [bs, 1] int64
        window: VerifyWindow,  # filled in place
        table_index: torch.Tensor,  # [bs, gamma + 1] scratch
        flat_table_index: torch.Tensor,  # [bs * (gamma + 1)]: its flat view
        flat_slots: torch.Tensor,  # [bs * (gamma + 1)]: window.out_cache_loc's
    ) -> VerifyWindow:
        """Columns in and flat views given, so that a step reshapes nothing."""
        positions = window.positions
        torch.add(seq_lens, self._offsets, out=positions)  # [bs, gamma + 1]
        # slots[b, j] = req_to_token[req_pool_indices[b], positions[b, j]],
        # gathered from the flat table.
        width = self.req_to_token.shape[1]
        torch.add(positions, req_pool_indices, alpha=width, out=table_index)
        torch.index_select(self._flat_table, 0, flat_table_index, out=flat_slots)
        return window


@dataclass(frozen=True)
class DSparkScheduleConfig:
    """The verify schedule's bounds."""

    # Verify rows per request at least, the anchor (bonus) row included: 1
    # lets a request verify no draft at all.
    min_verify_len: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.min_verify_len, int) or self.min_verify_len < 0:
            raise ValueError(
                f"min_verify_len must be an int >= 0, got {self.min_verify_len!r}"
            )


def local_verify_tier_num_tokens(
    *,
    bs: int,
    verify_token_budget: Optional[int],
    verify_num_draft_tokens: int,
    min_verify_len: int,
) -> int:
    """The verify rows this rank runs: every request's floor of
    ``max(min_verify_len, 1)`` rows plus the draft-token budget, at most the
    whole window (``verify_num_draft_tokens`` = gamma + 1 rows) per request;
    -1 when there is no budget (the rank is pinned to the plain tier)."""
    if verify_token_budget is None:
        return -1
    floor = bs * max(min_verify_len, 1)
    return min(floor + verify_token_budget, bs * verify_num_draft_tokens)


def dp_global_verify_tier_num_tokens(
    *, global_tier_num_tokens: Optional[Sequence[int]]
) -> Optional[int]:
    """The tier every DP rank runs, from each rank's local one: None (all
    pinned to the plain tier) when any rank has no budget (-1) or every rank
    is idle (0); otherwise the largest, which covers every rank's floor."""
    if global_tier_num_tokens is None:
        return None
    tiers = list(global_tier_num_tokens)
    if any(t < 0 for t in tiers) or not any(tiers):
        return None
    return max(tiers)


def dp_verify_drafts_per_req(
    *,
    global_num_reqs: Sequence[int],
    global_tier_num_tokens: Sequence[int],
    gamma: int,
) -> Optional[int]:
    """Drafts per request that every DP rank verifies in a step, from what
    they all gathered (so busy and idle ranks derive the same graph key):
    None when every rank is idle (no step); the whole block when any rank
    has no budget; otherwise the most that any busy rank planned (its tier
    over its requests, less the anchor row). Each rank then runs ``rows *
    (1 + k)`` verify rows, ``rows`` the busiest rank's requests padded:
    at least every rank's tier, and at least every rank's plan."""
    tier = dp_global_verify_tier_num_tokens(
        global_tier_num_tokens=global_tier_num_tokens
    )
    if tier is None:
        return gamma if any(global_num_reqs) else None
    plans = [
        t // n - 1 for t, n in zip(global_tier_num_tokens, global_num_reqs) if n > 0
    ]
    return min(max(plans), gamma)


# The confidence a blind row's drafts are scheduled by, whatever they are.
BLIND_CONFIDENCE = 0.5


def blind_gains(gamma: int, device) -> torch.Tensor:
    """[gamma, 1]: a blind row's gains, BLIND_CONFIDENCE ** (k + 1)."""
    k = torch.arange(1, gamma + 1, device=device, dtype=torch.float32)
    return torch.pow(BLIND_CONFIDENCE, k).unsqueeze(1)


class ScheduleVerifyLensTopk:
    """How many drafts each request verifies, on the device (no host read):
    the ``budget`` draft positions with the highest chance that they and
    every draft before them are accepted (the running product of the
    confidences), so each request verifies a prefix of its block.

    ``blind`` rows (unseeded sampled ones) are scheduled by a constant
    confidence instead of their drafts': rejection sampling returns the
    target's distribution only when how many drafts are judged does not
    depend on the drafts judged (a high-q draft verified more often skews
    the output). Greedy rows' output is deterministic and seeded rows' is
    the target's perturbed argmax whatever is verified: their drafts may
    decide."""

    @staticmethod
    def execute(
        *,
        confidence: torch.Tensor,  # [gamma, bs]: P(accept draft k | drafts < k accepted)
        budget: int,  # draft positions to verify in all, 0 < budget < gamma * bs
        verify_lens: torch.Tensor,  # [bs] int64, out: drafts to verify
        gains: torch.Tensor,  # [gamma, bs] scratch
        top_values: torch.Tensor,  # [budget] scratch
        top_index: torch.Tensor,  # [budget] int64 scratch
        ones: torch.Tensor,  # [budget] int64 ones
        real_requests: Optional[torch.Tensor] = None,  # [] int64: real of the bs
        requests_1: Optional[torch.Tensor] = None,  # [bs] int64: 1..bs
        padded: Optional[torch.Tensor] = None,  # [bs] bool scratch
        blind: Optional[torch.Tensor] = None,  # [bs] bool: not by their drafts
        blind_gains: Optional[torch.Tensor] = None,  # [gamma, 1]: theirs
    ) -> torch.Tensor:
        torch.cumprod(confidence, dim=0, out=gains)
        if blind is not None:
            torch.where(blind, blind_gains, gains, out=gains)
        if real_requests is not None:
            # Requests past the real ones pad a bucket: they take only what
            # the real requests' whole blocks leave of the budget.
            torch.gt(requests_1, real_requests, out=padded)
            gains.masked_fill_(padded, -1.0)
        torch.topk(gains.view(-1), budget, sorted=False, out=(top_values, top_index))
        # Flat index k * bs + b: request b; count each request's picks (the
        # gains fall along a block, so the picks are a prefix).
        top_index.remainder_(verify_lens.shape[0])
        return verify_lens.zero_().scatter_add_(0, top_index, ones)


def ragged_verify_layout(
    *,
    verify_lens: torch.Tensor,  # [bs] int64: drafts each request verifies
    width: int,  # gamma + 1 places per request
    row_ids: torch.Tensor,  # [T] int64: 0..T-1, T = bs + sum(verify_lens)
    requests_1: torch.Tensor,  # [bs] int64: 1..bs
    row_ends: torch.Tensor,  # [bs] int64 scratch
    row_req: torch.Tensor,  # [T] int64 scratch: each row's request
    query_index: torch.Tensor,  # [T] int64, out: each row's place b * width + j
) -> torch.Tensor:
    """The places a ragged verify runs, request-major and ascending: request
    b's anchor and its first ``verify_lens[b]`` drafts (device ops only)."""
    # Request b's rows end (exclusive) at sum over b' <= b of (lens + 1).
    torch.cumsum(verify_lens, 0, out=row_ends).add_(requests_1)
    torch.searchsorted(row_ends, row_ids, right=True, out=row_req)
    # Its rows start at ends - (lens + 1); row r is its place r - start.
    row_ends.sub_(verify_lens).sub_(1)
    torch.index_select(row_ends, 0, row_req, out=query_index)
    torch.sub(row_ids, query_index, out=query_index)
    return query_index.add_(row_req, alpha=width)


class DSparkVerifyPlanner:
    """The verify budget of each step, on the host, from what earlier steps
    read back (no extra device read).

    A draft's confidence is its probability under the draft's own
    distribution, q(d) (softmax at T = 1 for greedy rows): no extra head to
    train, and it ranks drafts (see the calibration table in
    docs/benchmarks.md), but its level is off (greedy drafts are accepted
    far more often than q(d) says). So it is calibrated online: per sampling
    kind (greedy, sampled) and confidence bin, the acceptance seen so far
    of drafts verified after an accepted prefix, with ``prior_weight``
    draws of the running acceptance at the draft's position as the prior
    (optimistic at first, so a new workload drafts and is measured). Each
    request's last block gives its expected gain per draft position (the
    running product of the calibrated acceptances; a request without a
    block yet takes the running acceptance per position); the budget is
    the tier, bs * L drafts
    for L in 0..gamma, with the most expected committed tokens (bs + the top
    gains) per second of the cost table. The table is measured over dummy
    requests; the steps this planner times (``observe_cost``) scale it, per
    batch size, for plain and for drafting steps apart (the host's own work,
    the real context), each step moving its scale at most a tenth (one
    stalled step cannot tip the plans). The calibration forgets: its counts
    decay by ``DECAY`` a step, so a workload that changes is followed.
    Budget 0 is a plain decode step; after ``explore_every`` plans of one
    kind in a row (plain, or drafting) one step is of the other, so the
    estimates of both stay fresh. A plan holds for ``replan_every`` steps of the
    same batch size (planning is host work every step would pay), a plain
    one for one step: the blocks' confidence behind it is spent (the worker
    clears it), and the next plan expects the running acceptance; the step
    before the next plan reports its drafts' confidence (``wants_confidence``)
    and is observed, and so is every ``replan_every``-th step when the batch
    size changes sooner than that (each change plans anew, so no plan would
    run out: requests that join and leave every few steps would never be
    observed). An exploring drafting step holds for that one step; under
    EP without DP attention the ranks hold what they agreed on instead
    (``hold``), so that they plan, and all-gather, on the same steps.
    """

    BINS = 10
    TIE = 0.02  # rates this close are equal (the cost table's own noise)
    DECAY = 0.999  # per observed step: the calibration's memory, ~1000 steps

    def __init__(
        self,
        *,
        gamma: int,
        cost_table,
        prior_weight: float = 4.0,
        explore_every: int = 32,
        replan_every: int = 4,
    ) -> None:
        self.gamma, self.cost_table = gamma, cost_table
        self.prior_weight, self.explore_every = prior_weight, explore_every
        self.replan_every = replan_every
        self.reset()

    def reset(self) -> None:
        """Forget what steps taught it (calibration, running acceptance,
        measured cost scales, streaks, the plan held): as made, with the
        same cost table."""
        gamma = self.gamma
        # Plain Python lists: a plan touches at most bs * gamma numbers, where
        # numpy's per-call cost would dominate.
        # [greedy / sampled][bin]: drafts judged after an accepted prefix,
        # their acceptances, and the sum of their raw confidences.
        self.seen = [[0.0] * self.BINS for _ in range(2)]
        self.accepted = [[0.0] * self.BINS for _ in range(2)]
        self.raw_sum = [[0.0] * self.BINS for _ in range(2)]
        # Running acceptance per draft position (after an accepted prefix):
        # the calibration's prior, and what a request without a block yet
        # is expected to accept.
        self.position_rate = [0.9] * gamma
        self._plain_streak = self._draft_streak = 0
        self._countdown, self._last = 0, (0, 0)  # steps the plan holds; (bs, budget)
        self._since_report = 0  # steps since the last that reported confidence
        # bs -> [plain steps', drafting steps'] measured / table cost.
        self._scale: dict = {}
        self._tier_costs: dict = {}  # bs -> the table's cost per L, made once

    def step_cost(self, *, bs: int, budget: int) -> float:
        """Seconds of a step: the table's, scaled by what steps measured."""
        scale = self._scale.get(bs, (1.0, 1.0))[budget > 0]
        return scale * self.cost_table.cost(bs=bs, budget=budget)

    def observe_cost(self, *, bs: int, budget: int, seconds: float) -> None:
        """A step's measured seconds: the running scale of its kind."""
        scale = self._scale.setdefault(bs, [1.0, 1.0])
        s = scale[budget > 0]
        ratio = seconds / self.cost_table.cost(bs=bs, budget=budget)
        scale[budget > 0] += 0.1 * (min(max(ratio, s / 2), 2 * s) - s)

    def _bin(self, raw: float) -> int:
        """A confidence's bin; a non-finite one (a broken draft) counts as 0."""
        if not math.isfinite(raw):
            return 0
        return min(max(int(raw * self.BINS), 0), self.BINS - 1)

    def calibrate(self, raw: float, sampled: bool, position: int) -> float:
        """P(accept | confidence, sampling kind, draft position)."""
        b = self._bin(raw)
        seen, accepted = self.seen[sampled][b], self.accepted[sampled][b]
        w = self.prior_weight
        return (accepted + w * self.position_rate[position]) / (seen + w)

    def held(self, bs: int) -> Optional[int]:
        """The budget while a plan holds for this batch size (the step uses
        it and counts down); None when it is time to plan."""
        if self._countdown > 0 and self._last[0] == bs:
            self._tick()
            self._countdown -= 1
            return self._last[1]
        return None

    def _tick(self) -> None:
        """A new step (held or planned): counted since the last that reported."""
        if self.wants_confidence:
            self._since_report = 0
        self._since_report += 1

    def drop_hold(self) -> None:
        """The next step plans, whatever plan was held."""
        self._countdown = 0

    def hold(self, budget: int) -> None:
        """Hold ``budget`` for the batch size just planned: ``replan_every``
        steps, a plain one for one step (its blocks' confidence is spent). The
        plan's own, or what the ranks agreed on instead: ranks that hold the
        same budget plan again on the same step."""
        self._countdown = self.replan_every - 1 if budget else 0
        self._last = (self._last[0], budget)

    @property
    def wants_confidence(self) -> bool:
        """The next step plans, or ``replan_every`` steps went unreported:
        this one's drafts report their confidence."""
        return self._countdown == 0 or self._since_report >= self.replan_every

    def plan(
        self,
        *,
        confidence: Sequence[Optional[Sequence[float]]],  # per request: [gamma] raw
        sampled: Sequence[bool],  # per request
        rows: Optional[int] = None,  # the step's bucket (None: bs, unpadded)
        blind: Optional[Sequence[bool]] = None,  # per request (None: none)
    ) -> int:
        """A new plan: the budget (drafts to verify in all, a multiple of bs)
        for this step and the ``replan_every - 1`` after it (``held``; none
        after a plain or an exploring one). A
        request's confidence is None before its first block. In a bucket of
        ``rows``, tier L verifies L * rows drafts, the real requests' first.

        Each tier is credited with the calibrated chances of the drafts the
        device will pick for it: ``ScheduleVerifyLensTopk`` ranks them by
        the running product of the raw confidences (here the last block's),
        and a ``blind`` request's (an unseeded sampled one) by
        BLIND_CONFIDENCE's, so that the blind take equal shares whatever
        they would accept."""
        self._tick()
        bs, g = len(confidence), self.gamma
        rows = bs if rows is None else rows
        blind = [False] * bs if blind is None else blind
        picks = []  # (the device's ranking key, the calibrated chance) a draft
        for raw, kind, alike in zip(confidence, sampled, blind):
            p = key = 1.0
            for k in range(g):
                c = (
                    self.position_rate[k]
                    if raw is None
                    else self.calibrate(raw[k], kind, k)
                )
                p *= c
                if alike:
                    key *= BLIND_CONFIDENCE
                elif raw is None:  # its block's confidence is not known yet
                    key *= c
                elif math.isnan(raw[k]) or key == math.inf:
                    key = math.inf  # a broken draft's: topk ranks NaN first
                else:
                    key *= raw[k]
                picks.append((key, p))
        picks.sort(key=lambda pick: pick[0], reverse=True)
        # Equal keys (the blind requests' at one position) are picked in no
        # set order: each is credited the mean chance of its group.
        gains = []
        for _, group in itertools.groupby(picks, key=lambda pick: pick[0]):
            chances = [p for _, p in group]
            gains += [sum(chances) / len(chances)] * len(chances)
        costs = self._tier_costs.get(bs)
        if costs is None:
            costs = self._tier_costs[bs] = [
                self.cost_table.cost(bs=bs, budget=bs * L) for L in range(g + 1)
            ]
        plain, drafting = self._scale.get(bs, (1.0, 1.0))
        rates, expected = [bs / (plain * costs[0])], float(bs)
        for L in range(1, g + 1):
            expected += sum(gains[(L - 1) * rows : L * rows])
            rates.append(expected / (drafting * costs[L]))
        # The most tokens per second; within TIE of it, the larger budget
        # (more tokens a step, for the same throughput).
        top = max(rates)
        best = bs * max(L for L, r in enumerate(rates) if r >= (1 - self.TIE) * top)
        explore = False
        if best == 0:
            self._plain_streak, self._draft_streak = self._plain_streak + 1, 0
            if self._plain_streak >= self.explore_every:
                self._plain_streak, best = 0, bs  # draft once: fresh estimates
                explore = True
        else:
            self._plain_streak, self._draft_streak = 0, self._draft_streak + 1
            if self._draft_streak >= self.explore_every:
                self._draft_streak, best = 0, 0  # one plain step: its cost
        self._last = (bs, best)
        self.hold(best)
        if explore:  # one step, observed (a plain step holds for one already)
            self._countdown = 0
        return best

    def observe(
        self,
        *,
        confidence: Sequence[Sequence[float]],  # per request: [gamma] raw
        sampled: Sequence[bool],
        accept_lens: Sequence[int],
        verify_lens: Sequence[int],
    ) -> None:
        """Count the drafts this step verified after an accepted prefix (the
        counts so far decayed by ``DECAY``)."""
        for counts in (self.seen, self.accepted, self.raw_sum):
            for row in counts:
                row[:] = [c * self.DECAY for c in row]
        judged_at, took_at = [0] * self.gamma, [0] * self.gamma
        for raw, kind, a, n in zip(confidence, sampled, accept_lens, verify_lens):
            for k in range(min(a + 1, n)):  # judged: its prefix was accepted
                b = self._bin(raw[k])
                took = k < a
                self.seen[kind][b] += 1
                self.accepted[kind][b] += took
                self.raw_sum[kind][b] += raw[k] if math.isfinite(raw[k]) else 0.0
                judged_at[k] += 1
                took_at[k] += took
        for k, n in enumerate(judged_at):
            if n:
                rate = took_at[k] / n
                self.position_rate[k] += 0.1 * (rate - self.position_rate[k])

    def calibration_table(self) -> List[dict]:
        """Per sampling kind and confidence bin: drafts judged, their mean
        confidence (the raw prediction), and the acceptance observed."""
        rows = []
        for kind, name in enumerate(("greedy", "sampled")):
            for b in range(self.BINS):
                n = self.seen[kind][b]
                if n:
                    rows.append(
                        {
                            "kind": name,
                            "bin": [b / self.BINS, (b + 1) / self.BINS],
                            "drafts": int(n),
                            "predicted": self.raw_sum[kind][b] / n,
                            "observed": self.accepted[kind][b] / n,
                        }
                    )
        return rows

"""The decode loop: continuous batching over a waiting queue.

Each step admits waiting requests (up to the running cap, while request
rows and KV slots last), prefills them, then runs one decode step over the
running batch. Requests leave when they reach max_new_tokens or EOS.
A request reserves its worst-case KV slots on admission, so a running
request never runs out of KV and no committed token is lost.

Failure safety: a request is always in exactly one place (waiting, being
admitted, running, or released), a step that raises (even while its tokens
are appended to its requests) leaves every prefilled, unfinished request
running and the batch rebuilt from host state, releases the finished, and
``abort_requests`` returns everything a set of requests held, rebuilding the
free lists from the requests still running so an interrupt anywhere (even
inside a release) leaks nothing. ``check_pool_accounting`` states the
invariant: free + held == total, for request rows and for KV slots.

Data-parallel attention (``dp_group`` given): each rank schedules its own
requests, but every model forward is collective (the MoE's), so all ranks
run the same forwards in the same order. Each step the ranks gather, on
the CPU group, whether they have work and the prompt lengths they admit
(upstream's MLP sync of a prefill batch): every rank runs as many prefill
forwards as the busiest, idle forwards (``ForwardMode.IDLE``, one masked
row) where it has none. Then they gather their running requests and verify
tiers (of a decode batch), and every rank steps a decode of the same shape,
an idle batch where it runs nothing. ``has_work`` stays true on every rank
until a step's sync finds all of them done. A collective that fails (a
rank raised, died or stalled past the timeout) raises on every rank.
"""

import contextlib
import logging
import time
from collections import deque
from typing import Deque, Iterable, Iterator, List, Optional, Protocol

import torch
import torch.distributed as dist

from sglang.srt.distributed.parallel_state import all_gather_ints
from sglang.srt.managers.schedule_batch import (
    Req,
    ScheduleBatch,
    StepOutput,
    as_token_ids,
    kv_slots_needed,
)
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool, TokenSlotAllocator

logger = logging.getLogger(__name__)
# The draft-health warning's own logger: a run whose draft is random on
# purpose (bench_scaling's stand-in weights) quiets it alone.
DRAFT_HEALTH_LOGGER = f"{__name__}.draft_health"


class DecodeWorker(Protocol):
    """What the scheduler drives: the Engine hands it a plain or a DSpark
    worker, and it needs no more than this."""

    device: torch.device
    lookahead: int  # KV positions a step may write past the last token

    def prefill(
        self, *, req: Req, global_num_tokens: Optional[List[int]] = None
    ) -> int: ...

    def decode_step(self, *, batch: ScheduleBatch) -> StepOutput: ...

    # Data-parallel attention only:
    def idle_prefill(self, *, global_num_tokens: List[int]) -> None: ...

    def local_verify_tier(self, batch: ScheduleBatch) -> int: ...

    def flush_cache(self) -> None: ...


class Scheduler:
    # Draft health: over this many request-steps that verified a draft, a
    # mean acceptance below HEALTH_FLOOR drafts a step is logged, once.
    HEALTH_WINDOW = 256
    HEALTH_FLOOR = 0.05

    def __init__(
        self,
        *,
        worker: DecodeWorker,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenSlotAllocator,
        max_running_requests: int,
        vocab_size: int,
        eos_token_id: Optional[int] = None,
        dp_group=None,
    ) -> None:
        self.worker = worker
        self.req_to_token_pool, self.allocator = req_to_token_pool, allocator
        self.max_running_requests = max_running_requests
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        # Speculation may write up to gamma positions past the last token.
        self.lookahead = worker.lookahead
        self.waiting: Deque[Req] = deque()
        self.running: List[Req] = []
        self._admitting: List[Req] = []  # popped from waiting, not yet running
        self._batch: Optional[ScheduleBatch] = None
        self.num_decode_steps = 0
        self._step_times: List[List[float]] = []  # open record_step_times()
        # Data-parallel attention: the CPU group the ranks sync steps on; the
        # most requests a step admits (the sync's fixed width).
        # Accepted drafts of the last drafting request-steps (draft health).
        self._accepted: Deque[int] = deque(maxlen=self.HEALTH_WINDOW)
        self._warned_draft = False
        self.dp_group = dp_group
        self._dp_max_admit = max_running_requests
        self._dp_busy = False  # some rank had work at the last sync
        self.num_dp_steps = 0

    @contextlib.contextmanager
    def record_step_times(self) -> Iterator[List[float]]:
        """The seconds of each decode step taken inside (the worker's step,
        synchronized on CUDA), appended to the yielded list: how benches
        time steps (recordings may nest; each gets every step inside it).
        Outside them the scheduler keeps only the count
        (``num_decode_steps``): a long-lived engine grows nothing."""
        times: List[float] = []
        self._step_times.append(times)
        try:
            yield times
        finally:
            # By identity: two recordings' lists may be equal.
            self._step_times = [t for t in self._step_times if t is not times]

    def kv_need(self, req: Req) -> int:
        """Slots a request may touch: prompt, outputs but the last (it never
        enters the KV), and the verify window past them."""
        return kv_slots_needed(
            prompt_len=len(req.origin_input_ids),
            max_new_tokens=req.sampling_params.max_new_tokens,
            lookahead=self.lookahead,
        )

    def add_request(self, req: Req) -> None:
        """Queue a request, or raise ValueError; the others are unaffected."""
        self.check_request(req)
        self.waiting.append(req)

    def check_lengths(self, *, prompt_len: int, max_new_tokens: int) -> None:
        """A request of these lengths fits the context and the KV, or
        ValueError naming the limit it passes (checked from the lengths
        alone: a bench can ask before it builds its prompts)."""
        context = self.req_to_token_pool.max_context_len
        if prompt_len + max_new_tokens > context:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} "
                f"= {prompt_len + max_new_tokens} exceeds context_length {context}"
            )
        need = kv_slots_needed(
            prompt_len=prompt_len,
            max_new_tokens=max_new_tokens,
            lookahead=self.lookahead,
        )
        capacity = min(context, self.allocator.num_slots)
        if need > capacity:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} "
                f"- 1 (the last is never written) + lookahead {self.lookahead} = "
                f"{need} exceeds the KV capacity {capacity}"
            )

    def check_request(self, req: Req) -> None:
        """Validate a request before it is queued; its token ids become Python
        ints (converted once). Raises ValueError naming the bad value."""
        ids = req.origin_input_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"request {req.rid}: input_ids must be a list of token ids, "
                f"got {type(ids).__name__}"
            )
        if not ids:
            raise ValueError(f"request {req.rid}: input_ids is empty")
        try:
            ids = as_token_ids(ids, vocab_size=self.vocab_size)
        except ValueError as e:
            raise ValueError(f"request {req.rid}: {e}") from None
        try:
            self.check_lengths(
                prompt_len=len(ids), max_new_tokens=req.sampling_params.max_new_tokens
            )
        except ValueError as e:
            raise ValueError(f"request {req.rid}: {e}") from None
        stops = req.sampling_params.stop_token_ids or ()
        bad = [t for t in stops if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"request {req.rid}: stop_token_ids {bad} are not in the "
                f"vocabulary [0, {self.vocab_size})"
            )
        sp = req.sampling_params
        masked = set(stops)  # what min_new_tokens masks, EOS unless ignored
        if self.eos_token_id is not None and not sp.ignore_eos:
            masked.add(self.eos_token_id)
        if sp.min_new_tokens > 0 and len(masked) >= self.vocab_size:
            raise ValueError(
                f"request {req.rid}: min_new_tokens {sp.min_new_tokens} masks "
                f"every token: stop_token_ids and EOS cover the whole "
                f"vocabulary [0, {self.vocab_size})"
            )
        req.origin_input_ids = ids
        req.eos_token_id = self.eos_token_id

    def flush_cache(self) -> bool:
        """With no request waiting or running: forget what past steps taught
        the engine (the worker's learned state, the draft-health window), so
        that what runs next behaves as on a fresh engine; False, and nothing
        forgotten, while there is work."""
        if self.has_work():
            return False
        self.worker.flush_cache()
        self._accepted.clear()
        self._warned_draft = False
        return True

    def has_work(self) -> bool:
        """Requests wait or run here; under DP attention also while any rank
        had work at the last step's sync (all ranks step until all are done)."""
        return bool(self.waiting or self._admitting or self.running) or self._dp_busy

    def start_round(self) -> None:
        """Before the steps of a round of requests (an ``Engine.generate``
        call): the worker starts it (``start_round``), and under DP attention
        every rank steps at least once, even one given no request, so that
        the first sync finds who has work."""
        self.worker.start_round()
        self._dp_busy = self.dp_group is not None

    def _admit(self, *, prefill: bool = True) -> None:
        """Move waiting requests into ``_admitting``, each with its row and
        slots, and (``prefill``) its first token; ``step`` moves them on even
        when this raises."""
        while (
            self.waiting
            and len(self.running) + len(self._admitting) < self.max_running_requests
            and len(self._admitting) < self._dp_max_admit
            and self.req_to_token_pool.available() > 0
            and self.allocator.available() >= self.kv_need(self.waiting[0])
        ):
            req = self.waiting.popleft()
            self._admitting.append(req)
            req.req_pool_idx = self.req_to_token_pool.alloc()
            req.kv_slots = self.allocator.alloc(self.kv_need(req))
            table = self.req_to_token_pool.req_to_token
            table[req.req_pool_idx, : len(req.kv_slots)] = torch.tensor(
                req.kv_slots, device=table.device
            )
            if prefill:
                self._prefill(req)

    def _prefill(self, req: Req, global_num_tokens: Optional[List[int]] = None):
        if global_num_tokens is None:
            first = self.worker.prefill(req=req)
        else:  # every DP rank's prompt this forward
            first = self.worker.prefill(req=req, global_num_tokens=global_num_tokens)
        req.append_tokens([int(first)], self.eos_token_id)

    def _join(self) -> List[Req]:
        """Admitted requests join the running batch; those finished by their
        first token are released and returned. One whose admission failed
        (no first token) is released and aborted, never retried."""
        admitted, self._admitting = self._admitting, []
        joined = [r for r in admitted if r.output_ids and not r.finished]
        if joined:
            self.running.extend(joined)
            self._batch = None
        finished = [r for r in admitted if r.finished]
        for req in admitted:
            if not req.output_ids:
                req.finished_reason = "abort"
                self._release(req)  # its KV is back before the error surfaces
        for req in finished:
            self._release(req)
        return finished

    def _release(self, req: Req) -> None:
        row, slots = req.req_pool_idx, req.kv_slots
        req.kv_slots, req.req_pool_idx = [], None
        if row is not None:
            self.allocator.free(slots)
            self.req_to_token_pool.free(row)

    def _raise_if_stuck(self) -> None:
        """Nothing running and the head request cannot be admitted: with the
        pools whole that cannot happen (check_request bounds every request),
        so say what is missing instead of spinning."""
        req = self.waiting[0]
        rows, slots = self.req_to_token_pool, self.allocator
        raise RuntimeError(
            f"scheduler stuck: request {req.rid} waits with nothing running; it "
            f"needs 1 request row ({rows.available()} of {rows.max_reqs} free) and "
            f"{self.kv_need(req)} KV slots ({slots.available()} of "
            f"{slots.num_slots} free); running cap {self.max_running_requests}. "
            f"Rows or slots are held by no running request"
        )

    def step(self) -> List[Req]:
        """Admit, prefill, decode once; return the requests finished by it."""
        if self.dp_group is not None:
            return self._step_dp()
        finished = self._retire_finished()  # left by an interrupted step
        try:
            self._admit()
        finally:
            # Requests prefilled before a failure are valid: they run on.
            finished += self._join()
        if self.waiting and not self.running and not finished:
            self._raise_if_stuck()
        if self.running:
            finished.extend(self._decode(self._running_batch()))
        return finished

    def _dp_sync(self, values: List[int], what: str) -> List[List[int]]:
        return all_gather_ints(values=values, group=self.dp_group, what=what)

    def _step_dp(self) -> List[Req]:
        """One step in lockstep with the other DP ranks (see the module doc)."""
        try:
            return self._step_in_lockstep()
        except RuntimeError as e:  # a collective failed, here or at a peer
            raise RuntimeError(
                f"DP attention rank {dist.get_rank()}: step {self.num_dp_steps} "
                f"did not complete, and the ranks' collectives are now out of "
                f"step (a rank raised, died or stalled past dist_timeout): {e}"
            ) from e

    def _step_in_lockstep(self) -> List[Req]:
        retired = self._retire_finished()  # left by an interrupted step
        self._admit(prefill=False)
        lens = [len(r.origin_input_ids) for r in self._admitting]
        busy = bool(self.waiting or self.running or self._admitting)
        pad = [0] * (self._dp_max_admit - len(lens))
        ranks = self._dp_sync([int(busy), len(lens)] + lens + pad, "DP step start")
        self._dp_busy = any(r[0] for r in ranks)
        if not self._dp_busy:
            return retired
        self.num_dp_steps += 1
        try:
            for i in range(max(r[1] for r in ranks)):
                counts = [r[2 + i] for r in ranks]  # every rank's prompt
                if i < len(lens):
                    self._prefill(self._admitting[i], counts)
                else:
                    self.worker.idle_prefill(global_num_tokens=counts)
        finally:
            finished = retired + self._join()
        if self.waiting and not self.running and not finished:
            self._raise_if_stuck()
        batch = (
            self._running_batch()
            if self.running
            else ScheduleBatch.idle(self.worker.device)
        )
        tier = self.worker.local_verify_tier(batch)
        ranks = self._dp_sync([batch.batch_size, tier], "DP decode step")
        global_bs = [r[0] for r in ranks]
        if max(global_bs) == 0:
            return finished
        batch.global_num_tokens = global_bs
        batch.global_num_tokens_for_logprob = list(global_bs)
        batch.global_verify_tier_num_tokens = [r[1] for r in ranks]
        finished.extend(self._decode(batch))
        return finished

    def _running_batch(self) -> ScheduleBatch:
        if self._batch is None:
            self._batch = ScheduleBatch.from_reqs(self.running, self.worker.device)
        return self._batch

    def _decode(self, batch: ScheduleBatch) -> List[Req]:
        start = time.perf_counter()
        try:
            out = self.worker.decode_step(batch=batch)
            if batch.is_idle:
                return []
            if batch.seq_lens.is_cuda:
                torch.cuda.synchronize(batch.seq_lens.device)
            self.num_decode_steps += 1
            if self._step_times:
                seconds = time.perf_counter() - start
                for times in self._step_times:
                    times.append(seconds)
            self._append_outputs(out)
        except BaseException:
            # The batch's device state may be half-advanced, or ahead of
            # requests that did not get this step's tokens (an interrupt
            # while they are appended); the requests' host state is whole,
            # so the batch is rebuilt from it. Those already finished are
            # released all the same.
            self._batch = None
            self._retire_finished()
            raise
        return self._retire_finished()

    def _append_outputs(self, out) -> None:
        """The step's tokens and draft counts into its requests."""
        verified = out.verified_drafts or [0] * len(self.running)
        logprobs = out.logprobs or [None] * len(self.running)
        for req, ids, accepted, checked, lps in zip(
            self.running, out.output_ids, out.accepted_drafts, verified, logprobs
        ):
            # Tokens first: a request interrupted before it has them runs the
            # step again, and is counted then.
            req.append_tokens(ids, self.eos_token_id, lps)
            req.spec_verify_ct += 1
            req.spec_accepted_drafts += accepted
            req.spec_verified_drafts += checked
            if checked:
                self._accepted.append(accepted)
        self._check_draft_health()

    def _retire_finished(self) -> List[Req]:
        """Finished requests leave the running batch and give back their
        row and slots; returned."""
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            self._batch = None
            for req in done:
                self._release(req)
        return done

    @property
    def running_accept_length(self) -> float:
        """Accepted drafts + 1 per request-step, over the last drafting
        steps (0.0 before any)."""
        if not self._accepted:
            return 0.0
        return 1 + sum(self._accepted) / len(self._accepted)

    def _check_draft_health(self) -> None:
        window = self._accepted
        if self._warned_draft or len(window) < window.maxlen:
            return
        if sum(window) / len(window) < self.HEALTH_FLOOR:
            self._warned_draft = True
            logging.getLogger(DRAFT_HEALTH_LOGGER).warning(
                "the DSpark draft is almost never accepted: running accept "
                "length %.3f over the last %d drafting request-steps; every "
                "step pays for a block it throws away (output stays correct). "
                "Check the draft checkpoint, or run without speculation",
                self.running_accept_length,
                len(window),
            )

    def abort_requests(self, reqs: Iterable[Req]) -> None:
        """Take ``reqs`` out of every queue, mark the unfinished ones aborted,
        and return everything they held; requests not named run on."""
        reqs = list(reqs)
        gone = {id(r) for r in reqs}  # identity: Req compares by value
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        self._admitting = [r for r in self._admitting if id(r) not in gone]
        running = [r for r in self.running if id(r) not in gone]
        if len(running) != len(self.running):
            self.running, self._batch = running, None
        if not (self.waiting or self._admitting or self.running):
            # An aborted round ends here; one that keeps requests steps on,
            # in lockstep with the ranks that had work at the last sync.
            self._dp_busy = False
        for req in reqs:
            if not req.finished:
                req.finished_reason = "abort"
            req.kv_slots, req.req_pool_idx = [], None
        self.reclaim()

    def _holders(self) -> List[Req]:
        return self.running + self._admitting

    def reclaim(self) -> None:
        """Rebuild both free lists from what live requests hold."""
        holders = self._holders()
        self.req_to_token_pool.reset_free(
            held=[r.req_pool_idx for r in holders if r.req_pool_idx is not None]
        )
        self.allocator.reset_free(held=[s for r in holders for s in r.kv_slots])

    def check_pool_accounting(self) -> None:
        """Raise RuntimeError unless free + held == total, exactly, for request
        rows and KV slots (no leak, no double free, no shared slot)."""
        holders = self._holders()
        for name, free, held, total in (
            (
                "request rows",
                self.req_to_token_pool.free_rows(),
                [r.req_pool_idx for r in holders if r.req_pool_idx is not None],
                range(1, self.req_to_token_pool.max_reqs + 1),
            ),
            (
                "KV slots",
                self.allocator.free_slots(),
                [s for r in holders for s in r.kv_slots],
                range(1, self.allocator.num_slots + 1),
            ),
        ):
            if sorted(free + held) != list(total):
                leaked = sorted(set(total) - set(free) - set(held))
                raise RuntimeError(
                    f"{name}: {len(free)} free + {len(held)} held != {len(total)}; "
                    f"leaked {leaked[:8]}{'...' if len(leaked) > 8 else ''}"
                )

"""The decode loop: continuous batching over a waiting queue.

Each step admits waiting requests (up to the running cap, while request
rows and KV slots last), prefills them, then runs one decode step over the
running batch. Requests leave when they reach max_new_tokens or EOS.
A request reserves its worst-case KV slots on admission, so a running
request never runs out of KV and no committed token is lost.

Failure safety: a request is always in exactly one place (waiting, being
admitted, running, or released), a step that raises leaves every prefilled
request running and the batch rebuilt from host state, and
``abort_requests`` returns everything a set of requests held, rebuilding the
free lists from the requests still running so an interrupt anywhere (even
inside a release) leaks nothing. ``check_pool_accounting`` states the
invariant: free + held == total, for request rows and for KV slots.
"""

import time
from collections import deque
from typing import Deque, Iterable, List, Optional, Protocol

import torch

from sglang.srt.managers.schedule_batch import (
    Req,
    ScheduleBatch,
    StepOutput,
    as_token_ids,
)
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool, TokenSlotAllocator


class DecodeWorker(Protocol):
    """What the scheduler drives: the Engine hands it a plain or a DSpark
    worker, and it needs no more than this."""

    device: torch.device
    lookahead: int  # KV positions a step may write past the last token

    def prefill(self, *, req: Req) -> int: ...

    def decode_step(self, *, batch: ScheduleBatch) -> StepOutput: ...


class Scheduler:
    def __init__(
        self,
        *,
        worker: DecodeWorker,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenSlotAllocator,
        max_running_requests: int,
        vocab_size: int,
        eos_token_id: Optional[int] = None,
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
        self.decode_step_times: List[float] = []

    def kv_need(self, req: Req) -> int:
        """Slots a request may touch: prompt, outputs but the last (it never
        enters the KV), and the verify window past them."""
        return (
            len(req.origin_input_ids)
            + req.sampling_params.max_new_tokens
            - 1
            + self.lookahead
        )

    def add_request(self, req: Req) -> None:
        """Queue a request, or raise ValueError; the others are unaffected."""
        self.check_request(req)
        self.waiting.append(req)

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
        need = len(ids) + req.sampling_params.max_new_tokens - 1 + self.lookahead
        capacity = min(self.req_to_token_pool.max_context_len, self.allocator.num_slots)
        if need > capacity:
            raise ValueError(
                f"request {req.rid}: prompt of {len(ids)} tokens + max_new_tokens "
                f"{req.sampling_params.max_new_tokens} + lookahead {self.lookahead} "
                f"= {need} exceeds the KV capacity {capacity}"
            )
        req.origin_input_ids = ids

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        """Move waiting requests into ``_admitting``, each with its row, slots
        and first token; ``step`` moves them on even when this raises."""
        while (
            self.waiting
            and len(self.running) + len(self._admitting) < self.max_running_requests
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
            first = self.worker.prefill(req=req)
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
        try:
            self._admit()
        finally:
            # Requests prefilled before a failure are valid: they run on.
            finished = self._join()
        if self.waiting and not self.running and not finished:
            self._raise_if_stuck()
        if self.running:
            try:
                finished.extend(self._decode())
            except BaseException:
                # The batch's device state may be half-advanced; the requests'
                # host state is whole, so the batch is rebuilt from it.
                self._batch = None
                raise
        return finished

    def _decode(self) -> List[Req]:
        if self._batch is None:
            self._batch = ScheduleBatch.from_reqs(self.running, self.worker.device)
        start = time.perf_counter()
        out = self.worker.decode_step(batch=self._batch)
        if self._batch.seq_lens.is_cuda:
            torch.cuda.synchronize()
        self.decode_step_times.append(time.perf_counter() - start)
        verified = out.verified_drafts or [0] * len(self.running)
        for req, ids, accepted, checked in zip(
            self.running, out.output_ids, out.accepted_drafts, verified
        ):
            req.spec_verify_ct += 1
            req.spec_accepted_drafts += accepted
            req.spec_verified_drafts += checked
            req.append_tokens(ids, self.eos_token_id)
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            self._batch = None
            for req in done:
                self._release(req)
        return done

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

"""The decode loop: continuous batching over a waiting queue.

Each step admits waiting requests (up to the running cap, while request
rows and KV slots last), prefills them, then runs one decode step over the
running batch. Requests leave when they reach max_new_tokens or EOS.
A request reserves its worst-case KV slots on admission, so a running
request never runs out of KV and no committed token is lost.
"""

import numbers
import time
from collections import deque
from typing import TYPE_CHECKING, Deque, List, Optional, Union

import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool, TokenSlotAllocator

if TYPE_CHECKING:
    from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorker

# A worker with device, lookahead, prefill(*, req) and decode_step(*, batch).
DecodeWorker = Union[TpModelWorker, "DSparkWorker"]


class Scheduler:
    def __init__(
        self,
        *,
        worker: "DecodeWorker",
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
        ids = req.origin_input_ids
        if not ids:
            raise ValueError(f"request {req.rid}: input_ids is empty")
        bad = [
            t
            for t in ids
            if isinstance(t, bool)
            or not isinstance(t, numbers.Integral)
            or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ValueError(
                f"request {req.rid}: token id {bad[0]!r} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        need = self.kv_need(req)
        capacity = min(self.req_to_token_pool.max_context_len, self.allocator.num_slots)
        if need > capacity:
            raise ValueError(
                f"request {req.rid}: prompt of {len(ids)} tokens + max_new_tokens "
                f"{req.sampling_params.max_new_tokens} + lookahead {self.lookahead} "
                f"= {need} exceeds the KV capacity {capacity}"
            )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> List[Req]:
        admitted = []
        while (
            self.waiting
            and len(self.running) + len(admitted) < self.max_running_requests
            and self.req_to_token_pool.available() > 0
            and self.allocator.available() >= self.kv_need(self.waiting[0])
        ):
            req = self.waiting.popleft()
            req.req_pool_idx = self.req_to_token_pool.alloc()
            req.kv_slots = self.allocator.alloc(self.kv_need(req))
            table = self.req_to_token_pool.req_to_token
            table[req.req_pool_idx, : len(req.kv_slots)] = torch.tensor(
                req.kv_slots, device=table.device
            )
            try:
                first = self.worker.prefill(req=req)
            except Exception:
                self._release(req)  # give its KV back before the error surfaces
                raise
            req.append_tokens([int(first)], self.eos_token_id)
            admitted.append(req)
        return admitted

    def _release(self, req: Req) -> None:
        self.allocator.free(req.kv_slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.kv_slots, req.req_pool_idx = [], None

    def step(self) -> List[Req]:
        """Admit, prefill, decode once; return the requests finished by it."""
        admitted = self._admit()
        finished = [r for r in admitted if r.finished]
        joined = [r for r in admitted if not r.finished]
        if joined:
            self.running.extend(joined)
            self._batch = None
        if self.running:
            if self._batch is None:
                self._batch = ScheduleBatch.from_reqs(self.running, self.worker.device)
            start = time.perf_counter()
            out = self.worker.decode_step(batch=self._batch)
            if self._batch.seq_lens.is_cuda:
                torch.cuda.synchronize()
            self.decode_step_times.append(time.perf_counter() - start)
            for req, ids, accepted in zip(
                self.running, out.output_ids, out.accepted_drafts
            ):
                req.spec_verify_ct += 1
                req.spec_accepted_drafts += accepted
                req.append_tokens(ids, self.eos_token_id)
            done = [r for r in self.running if r.finished]
            if done:
                finished.extend(done)
                self.running = [r for r in self.running if not r.finished]
                self._batch = None
        for req in finished:
            self._release(req)
        return finished

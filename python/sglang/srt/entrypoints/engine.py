"""The offline engine: ``Engine(...).generate(input_ids=..., sampling_params=...)``.

Failure handling:

- every request of a call is validated (token ids converted once to Python
  ints) before anything is queued or allocated;
- whatever ends a call early (an exception, a raising ``progress`` callback,
  KeyboardInterrupt) aborts every request of that call and returns every
  request row and KV slot before the exception leaves ``generate()``;
- ``generate()`` calls on one engine are serialized by a lock; calling it
  again from inside its own ``progress`` callback is a RuntimeError;
- under expert parallelism the ranks agree on the configuration and seed at
  start-up and on the requests of every call, or all of them raise
  ValueError; every collective has ``dist_timeout``;
- under data-parallel attention (``enable_dp_attention=True, dp_size=N``, one
  engine per rank of an N-process world: ``torchrun --nproc-per-node N``)
  every rank is given the same requests, decodes its share (index ``i`` on
  rank ``i % N``) and returns every request's result. A rank whose call
  fails (an exception, or a peer that raised, died or stalled past
  ``dist_timeout``) leaves the group out of step: its later calls raise.
"""

import dataclasses
import hashlib
import os
import threading
from contextlib import nullcontext
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from sglang.srt.distributed.parallel_state import (
    all_gather_objects,
    check_ranks_agree,
    destroy_model_parallel,
    digest_of,
    get_moe_ep_cpu_group,
    init_parallel_from_distributed,
)
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.registry import load_draft, load_target
from sglang.srt.server_args import KV_CACHE_DTYPE, ServerArgs, _checked_int
from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
from sglang.srt.utils.common import SEED_BOUND

# Fields that legitimately differ per rank (each rank has its own GPU and
# threads); every other ServerArgs field must agree over the EP group.
_PER_RANK_FIELDS = ("device", "num_threads")


def _config_digest(args: ServerArgs) -> bytes:
    fields = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(args)
        if f.name not in _PER_RANK_FIELDS
    }
    fields["device_type"] = torch.device(args.device).type
    return digest_of(fields)


class Engine:
    def __init__(self, **kwargs) -> None:
        known = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {unknown}; known: {sorted(known)}"
            )
        self.server_args = args = ServerArgs(**kwargs)
        self._check_group = self._init_expert_parallel(args)
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            # Which device "cuda" is, fixed now: later calls enter it again
            # whatever device is current then.
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)  # process-wide, as torch has it
        if device.type == "cuda" and device.index is not None:
            # The current device, process-wide as upstream's runner sets it:
            # streams, graph capture and synchronize act on the current
            # device, not on the one a tensor is on (each call below
            # enters it again, for a process with engines on two devices).
            torch.cuda.set_device(device)
        # Data-parallel attention: this rank and the number of ranks.
        self.dp_rank = dist.get_rank() if args.enable_dp_attention else 0
        self.dp_size = args.dp_size
        self.generator = torch.Generator(device=device)
        self.reseed(args.random_seed)
        target = load_target(args.model_path, seed=args.random_seed, device=device)
        cfg = target.config
        self.vocab_size = cfg.vocab_size
        self.req_to_token_pool = ReqToTokenPool(
            max_reqs=args.max_running_requests,
            max_context_len=args.context_length,
            device=device,
        )
        self.allocator = TokenSlotAllocator(args.max_total_tokens)

        def kv_pool(num_layers: int) -> KVPool:
            return KVPool(
                num_layers=num_layers,
                num_slots=args.max_total_tokens,
                num_heads=cfg.num_heads,
                head_dim=cfg.head_dim,
                dtype=KV_CACHE_DTYPE,
                device=device,
            )

        def runner(model, pool) -> ModelRunner:
            return ModelRunner(
                forward=model.forward,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool=pool,
                device=device,
            )

        target_worker = TpModelWorker(
            model=target,
            model_runner=runner(target, kv_pool(cfg.num_layers)),
            device=device,
            generator=self.generator,
            max_batch_size=args.max_running_requests,
        )
        self.worker: Union[TpModelWorker, DSparkWorkerV2]
        if args.speculative_algorithm == "DSPARK":
            draft = load_draft(
                args.speculative_draft_model_path,
                target=target,
                seed=args.random_seed,
                device=device,
            )
            self.dspark_config = DSparkConfig.from_models(
                draft=draft.config,
                target=cfg,
                gamma=args.speculative_dspark_block_size,
            )
            self.worker = DSparkWorkerV2(
                target_worker=target_worker,
                draft_model=draft,
                draft_runner=runner(draft, kv_pool(draft.config.num_layers)),
                config=self.dspark_config,
                max_batch_size=args.max_running_requests,
                bucket_sizes=args.cuda_graph_bs,
                use_cuda_graph=args.use_cuda_graph,
                verify_budget=args.speculative_verify_budget,
                cost_table_path=args.speculative_dspark_sps_table_path,
            )
        else:
            target_worker.init_decode(
                bucket_sizes=args.cuda_graph_bs, use_cuda_graph=args.use_cuda_graph
            )
            self.worker = target_worker
        self.scheduler = Scheduler(
            worker=self.worker,
            req_to_token_pool=self.req_to_token_pool,
            allocator=self.allocator,
            max_running_requests=args.max_running_requests,
            vocab_size=cfg.vocab_size,
            eos_token_id=args.eos_token_id,
            dp_group=self._check_group if args.enable_dp_attention else None,
        )
        self._rank_failure: Optional[BaseException] = None
        # The next call's first request id; a call that is refused takes
        # none, so DP ranks, given the same calls, number them alike.
        self._next_rid = 0
        self._lock = threading.Lock()
        self._lock_owner: Optional[int] = None  # thread id inside generate()
        self._num_calls = 0
        # Requests of a call whose clean-up was itself interrupted.
        self._unclean: List[Req] = []

    def reseed(self, seed: int) -> None:
        """The engine's generator (unseeded sampling's draws) from ``seed``.
        Under DP attention each rank draws its own stream of it (rank 0 the
        seed's own): the ranks sample different requests, which must not
        share their noise. ``seed``: an int in [0, 2**63), as ``random_seed``."""
        seed = _checked_int("seed", seed, lo=0, hi=SEED_BOUND, hi_text="2**63")
        mixed = (seed + self.dp_rank * 0x9E3779B97F4A7C15) % 2**64
        self.generator.manual_seed(mixed)

    def flush_cache(self) -> bool:
        """Upstream's name (whose flush also clears the prefix cache; there
        is none here): when idle, forget what past steps taught the engine
        (the DSpark verify planner's calibration and cost scales, the
        draft-health window), so that later calls behave as on a fresh
        engine of the same configuration (its measured cost table kept).
        False, and nothing forgotten, while a call runs or requests remain.
        Every rank flushes its own: under expert parallelism alone too, since
        every call's first step plans anew on all ranks (a call that starts
        between the check and the flush is waited for, then flushed after)."""
        if self._lock.locked():  # a generate() is running
            return False
        # ``with``, not a bare acquire(): an interrupt raised as acquire()
        # returns would leave the lock held, and every later call waiting.
        with self._lock:
            self._finish_abort()
            return self.scheduler.flush_cache()

    def _finish_abort(self) -> None:
        """The last call's requests, when an interrupt cut short their abort
        (the call ended, the lock is held): they give back what they hold."""
        if self._unclean:
            self.scheduler.abort_requests(self._unclean)
            self._unclean = []

    @staticmethod
    def _init_expert_parallel(args: ServerArgs):
        """On a distributed world, build the EP groups with ``dist_timeout``
        and check that every rank got the same configuration and seed; return
        the group the per-call checks use (None on one process). Under DP
        attention a world of ``dp_size`` ranks is required; launched by
        torchrun (its environment set), the engine joins it."""
        if args.enable_dp_attention and not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                raise ValueError(
                    f"enable_dp_attention with dp_size={args.dp_size} needs "
                    f"{args.dp_size} ranks, one engine each: launch with "
                    f"torchrun --nproc-per-node {args.dp_size}, or call "
                    f"torch.distributed.init_process_group first"
                )
            dist.init_process_group(
                "gloo", timeout=timedelta(seconds=args.dist_timeout)
            )
        if not (dist.is_available() and dist.is_initialized()):
            destroy_model_parallel()  # a destroyed world's layout is gone too
            return None
        world = dist.get_world_size()
        if args.enable_dp_attention and world != args.dp_size:
            raise ValueError(
                f"dp_size={args.dp_size} but the torch.distributed world has "
                f"{world} ranks: one DP attention rank per process"
            )
        if world == 1:
            destroy_model_parallel()
            return None
        # Before any group is built: the MoE's all-reduce runs inside the
        # captured step, and a graph captures NCCL's kernels; gloo's CUDA
        # collectives go through the host.
        config = dist.get_backend_config()  # e.g. "cpu:gloo,cuda:nccl"
        by_device = dict(p.split(":", 1) for p in config.split(",") if ":" in p)
        if args.use_cuda_graph and by_device.get("cuda") != "nccl":
            raise ValueError(
                f"expert parallelism over {world} ranks with CUDA graphs needs "
                f"CUDA collectives on nccl, but torch.distributed runs them as "
                f"{config!r}: initialize it with nccl (or no backend named), or "
                f"pass disable_cuda_graph=True"
            )
        init_parallel_from_distributed(
            attn_dp_size=args.dp_size,
            moe_a2a_backend=args.moe_a2a_backend,
            timeout_s=args.dist_timeout,
        )
        group = get_moe_ep_cpu_group()
        check_ranks_agree(
            digest=_config_digest(args),
            group=group,
            what="the engine configuration and random_seed",
        )
        return group

    def generate(
        self,
        *,
        input_ids: List[List[int]],
        sampling_params: Optional[Union[Dict, List[Dict]]] = None,
        return_logprob: Union[bool, List[bool]] = False,
        progress: Optional[Callable[[int], None]] = None,
    ) -> List[Dict]:
        """One dict per request: ``output_ids`` and ``meta_info``.

        ``sampling_params`` take upstream's names (``SamplingParams``).
        ``return_logprob`` (for all requests, or one per request) adds
        ``meta_info["output_token_logprobs"]``: (log-probability, token id)
        per output token, under the target's own logits (T = 1, no sampling
        parameter applied).

        ``progress``, when given, is called after every step with the number
        of tokens that step committed.

        Every request is validated before any runs: a bad one raises
        ValueError naming its index and value, and nothing is queued. Calls
        are serialized: a second thread waits for the first to finish.
        """
        me = threading.get_ident()
        if self._lock_owner == me:
            raise RuntimeError(
                "Engine.generate() called again from inside its own progress "
                "callback; calls on one engine are serialized, so this would "
                "deadlock"
            )
        cuda = self._device.type == "cuda"
        with self._lock, torch.cuda.device(self._device) if cuda else nullcontext():
            try:
                self._lock_owner = me
                return self._generate_locked(
                    input_ids, sampling_params, return_logprob, progress
                )
            finally:
                self._lock_owner = None

    def _generate_locked(
        self, input_ids, sampling_params, return_logprob, progress
    ) -> List[Dict]:
        scheduler = self.scheduler
        if self._rank_failure is not None:
            raise RuntimeError(
                f"rank {dist.get_rank()}: an earlier call failed "
                f"({self._rank_failure!r}), so the ranks' collectives are out of "
                f"step; restart every rank"
            )
        self._finish_abort()
        error: Optional[ValueError] = None
        try:
            if progress is not None and not callable(progress):
                raise ValueError(f"progress must be callable, got {progress!r}")
            reqs = self._make_requests(input_ids, sampling_params, return_logprob)
        except ValueError as e:
            error, reqs = e, []
        self._num_calls += 1
        if self._check_group is not None:
            # Every rank gathers before any raises, so all of them learn of
            # a mismatch (or of another rank's bad request) at once. Expert
            # parallelism alone also needs one generator state on every rank
            # (their steps, drafts and noise the same; under DP attention
            # each rank draws its own stream): a rank reseeded alone differs.
            state = {
                "call": self._num_calls,
                "rejected": error is not None,
                "requests": [
                    [
                        r.origin_input_ids,
                        dataclasses.asdict(r.sampling_params),
                        r.return_logprob,
                    ]
                    for r in reqs
                ],
            }
            if self.dp_size == 1:
                generator = self.generator.get_state().numpy().tobytes()
                state["generator"] = hashlib.sha256(generator).hexdigest()
            try:
                check_ranks_agree(
                    digest=digest_of(state),
                    group=self._check_group,
                    what="the requests and the generator state",
                )
            except ValueError:
                if error is None:
                    raise
        if error is not None:
            raise error
        self._next_rid += len(reqs)
        mine = reqs[self.dp_rank :: self.dp_size]  # all of them without DP
        self._unclean = mine
        try:
            for req in mine:
                scheduler.add_request(req)
            scheduler.start_round()
            committed = 0
            while scheduler.has_work():
                scheduler.step()
                if progress is not None:
                    now = sum(len(r.output_ids) for r in mine)
                    progress(now - committed)
                    committed = now
            results = [self._result(r) for r in mine]
            if self.dp_size > 1:  # every rank returns every request's result
                shares = all_gather_objects(
                    obj=results, group=self._check_group, what="DP results"
                )
                results = [
                    shares[i % self.dp_size][i // self.dp_size]
                    for i in range(len(reqs))
                ]
        except BaseException as e:
            # Whatever ended the call: its requests give back every row and
            # slot before the exception leaves generate().
            scheduler.abort_requests(mine)
            self._unclean = []
            if self._check_group is not None:  # the ranks' collectives part
                self._rank_failure = e
                if self.dp_size == 1 and isinstance(e, RuntimeError):
                    # (DP attention's scheduler says so of its steps itself.)
                    raise RuntimeError(
                        f"EP rank {dist.get_rank()}: call {self._num_calls} did "
                        f"not complete, and the ranks' collectives are now out of "
                        f"step (a rank raised, died or stalled past "
                        f"dist_timeout): {e}"
                    ) from e
            raise
        self._unclean = []
        return results

    def _make_requests(self, input_ids, sampling_params, return_logprob) -> List[Req]:
        """Validated requests (token ids as Python ints), or ValueError naming
        the request index and the bad value; nothing is queued either way."""
        if not isinstance(input_ids, list) or not all(
            isinstance(ids, (list, tuple)) for ids in input_ids
        ):
            raise ValueError("input_ids must be a list of token-id lists")
        if isinstance(return_logprob, list):
            if len(return_logprob) != len(input_ids) or not all(
                isinstance(x, bool) for x in return_logprob
            ):
                raise ValueError(
                    f"return_logprob must be a bool or one bool per request, got "
                    f"{return_logprob!r}"
                )
            logprob_flags = return_logprob
        elif isinstance(return_logprob, bool):
            logprob_flags = [return_logprob] * len(input_ids)
        else:
            raise ValueError(
                f"return_logprob must be a bool or a list of bools, got "
                f"{return_logprob!r}"
            )
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(input_ids):
                raise ValueError(
                    f"{len(sampling_params)} sampling_params for {len(input_ids)} requests"
                )
            params = sampling_params
        elif sampling_params is None or isinstance(sampling_params, dict):
            params = [sampling_params or {}] * len(input_ids)
        else:
            raise ValueError(
                f"sampling_params must be a dict, a list of dicts or None, got "
                f"{type(sampling_params).__name__}"
            )
        reqs = []
        for i, (ids, p, logprob) in enumerate(zip(input_ids, params, logprob_flags)):
            if not isinstance(p, dict):
                raise ValueError(
                    f"input {i}: sampling_params must be a dict, got {p!r}"
                )
            try:
                sp = SamplingParams(**p)
            except (TypeError, ValueError) as e:
                raise ValueError(f"input {i}: bad sampling_params {p!r}: {e}") from None
            req = Req(
                rid=self._next_rid + i,
                origin_input_ids=list(ids),
                sampling_params=sp,
                return_logprob=logprob,
            )
            try:
                self.scheduler.check_request(req)
            except ValueError as e:
                raise ValueError(f"input {i}: {e}") from None
            reqs.append(req)
        return reqs

    def _result(self, req: Req) -> Dict:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "finish_reason": req.finished_reason,
            "spec_verify_ct": req.spec_verify_ct,
            # Drafts the target verified per verify step (gamma without
            # a verify budget; fewer where the planner cut the block).
            "spec_verify_tokens": (
                req.spec_verified_drafts / req.spec_verify_ct
                if req.spec_verify_ct
                else 0.0
            ),
            # Accepted drafts + 1 per verify step, counted before the
            # output is cut at max_new_tokens or EOS (upstream's measure).
            "spec_accept_length": (
                1 + req.spec_accepted_drafts / req.spec_verify_ct
                if req.spec_verify_ct
                else 0.0
            ),
            # The engine's, over its last drafting steps of any request:
            # near 1.0 is a draft that is never accepted.
            "spec_running_accept_length": self.scheduler.running_accept_length,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = list(
                zip(req.output_token_logprobs, req.output_ids)
            )
        return {"output_ids": list(req.output_ids), "meta_info": meta}

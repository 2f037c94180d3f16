"""The offline engine: ``Engine(...).generate(input_ids=..., sampling_params=...)``."""

import itertools
from typing import Callable, Dict, List, Optional, Union

import torch

from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.registry import load_draft, load_target
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorker


class Engine:
    def __init__(self, **kwargs) -> None:
        self.server_args = args = ServerArgs(**kwargs)
        device = torch.device(args.device)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)  # process-wide, as torch has it
        self.generator = torch.Generator(device=device).manual_seed(args.random_seed)
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
                dtype=torch.float32,
                device=device,
            )

        def runner(model, pool) -> ModelRunner:
            return ModelRunner(
                forward=model.forward,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool=pool,
                device=device,
                bucket_sizes=args.cuda_graph_bs,
                use_cuda_graph=args.use_cuda_graph,
            )

        target_worker = TpModelWorker(
            model=target,
            model_runner=runner(target, kv_pool(cfg.num_layers)),
            device=device,
            generator=self.generator,
        )
        self.worker: Union[TpModelWorker, DSparkWorker]
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
            self.worker = DSparkWorker(
                target_worker=target_worker,
                draft_model=draft,
                draft_runner=runner(draft, kv_pool(draft.config.num_layers)),
                config=self.dspark_config,
                max_batch_size=args.max_running_requests,
            )
        else:
            target_worker.enable_decode_graphs()
            self.worker = target_worker
        self.scheduler = Scheduler(
            worker=self.worker,
            req_to_token_pool=self.req_to_token_pool,
            allocator=self.allocator,
            max_running_requests=args.max_running_requests,
            vocab_size=cfg.vocab_size,
            eos_token_id=args.eos_token_id,
        )
        self._rids = itertools.count()

    def generate(
        self,
        *,
        input_ids: List[List[int]],
        sampling_params: Optional[Union[Dict, List[Dict]]] = None,
        progress: Optional[Callable[[int], None]] = None,
    ) -> List[Dict]:
        """One dict per request: ``output_ids`` and ``meta_info``.

        ``progress``, when given, is called after every step with the number
        of tokens that step committed.

        Every request is validated before any runs: a bad one raises
        ValueError naming it, and nothing is queued.
        """
        if not isinstance(input_ids, list) or not all(
            isinstance(ids, list) for ids in input_ids
        ):
            raise ValueError("input_ids must be a list of token-id lists")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(input_ids):
                raise ValueError(
                    f"{len(sampling_params)} sampling_params for {len(input_ids)} requests"
                )
            params = sampling_params
        else:
            params = [sampling_params or {}] * len(input_ids)
        reqs = []
        for i, (ids, p) in enumerate(zip(input_ids, params)):
            try:
                sp = SamplingParams(**p)
            except (TypeError, ValueError) as e:
                raise ValueError(f"input {i}: bad sampling_params {p!r}: {e}") from None
            reqs.append(
                Req(
                    rid=next(self._rids), origin_input_ids=list(ids), sampling_params=sp
                )
            )
        scheduler = self.scheduler
        # Validate all, then queue all, so a bad request queues nothing.
        for i, req in enumerate(reqs):
            try:
                scheduler.check_request(req)
            except ValueError as e:
                raise ValueError(f"input {i}: {e}") from None
        for req in reqs:
            scheduler.add_request(req)
        committed = 0
        while scheduler.has_work():
            scheduler.step()
            if progress is not None:
                now = sum(len(r.output_ids) for r in reqs)
                progress(now - committed)
                committed = now
        return [self._result(r) for r in reqs]

    def _result(self, req: Req) -> Dict:
        return {
            "output_ids": list(req.output_ids),
            "meta_info": {
                "id": req.rid,
                "prompt_tokens": len(req.origin_input_ids),
                "completion_tokens": len(req.output_ids),
                "finish_reason": req.finished_reason,
                "spec_verify_ct": req.spec_verify_ct,
                # Accepted drafts + 1 per verify step, counted before the
                # output is cut at max_new_tokens or EOS (upstream's measure).
                "spec_accept_length": (
                    1 + req.spec_accepted_drafts / req.spec_verify_ct
                    if req.spec_verify_ct
                    else 0.0
                ),
            },
        }

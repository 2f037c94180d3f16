"""DSparkWorkerV2: prefill, and the decode step as one pipeline.

A decode step is five phases, in order, each one call:

1. draft: bind the batch to the step buffers (once per batch), pad it to
   its bucket, plan the verify budget, draw the step's noise; then fill the
   verify window, build the step's attention metadata (once, for all
   three forwards), and propose the block (``DraftBlockProposer``: its
   inputs, the draft forward, the Markov head's left-to-right sampling);
   under a budget, share it among the requests by the drafts' confidence
   (the real requests first, then those padding the bucket; an unseeded
   sampled request's share never depends on its own drafts, which keeps
   rejection sampling lossless) and lay out the rows to verify;
2. verify: the target forward over ``[bonus, d_1..d_gamma]``, or, under a
   budget, over each request's bonus and first ``verify_lens`` drafts
   (a ragged verify); budget 0 is a plain decode step (no draft forward);
3. accept: greedy or rejection sampling, chosen once per batch
   (``dspark_verify.accept``): accept lengths, and the bonus straight into
   the batch's ``last_ids``;
4. commit: sequence lengths advance by accepted + 1, and the target's
   hidden states of the window become the draft's context KV (rejected
   drafts need no rollback: their slots lie past the new length and are
   overwritten next step);
5. output: the step's one host read of the tokens.

Phases 1 (after its preparation) to 4 are the device step: no host read,
only the step buffers, so on CUDA it is one graph replay per bucket
(``GraphRunner``) and on the CPU it compiles whole (a test proves it).
Every phase, and the model's own computations inside them (``attention
metadata``, ``draft forward``, ``verify forward``, ``context write``), runs
in a named span of ``self.spans``: benches and profilers observe the step
through it.

Under data-parallel attention every rank runs the same step shape, its
graph key: the busiest rank's requests padded to their bucket, and the
drafts per request that ``dp_verify_drafts_per_req`` derives from every
rank's verify tier (the scheduler gathers them); each forward carries every
rank's counts for the MoE, and a rank with no request steps an idle batch
(dummy rows, all masked) through the same code.
"""

import logging
import os
import time
from dataclasses import replace
from typing import List, Optional, Tuple, Union

import torch

from sglang.srt.distributed.parallel_state import (
    all_gather_ints,
    check_ranks_agree,
    digest_of,
    get_moe_ep_cpu_group,
)
from sglang.srt.layers.sampler import (
    NO_EXTRAS,
    SamplingExtras,
    SamplingMode,
    draw_log_exp1_,
    fill_seeded_log_e_,
    log_exp1_,
)
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, StepOutput
from sglang.srt.managers.tp_worker import TpModelWorker, dp_rows
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    fill_mlp_sync_metadata,
    target_num_token_non_padded,
)
from sglang.srt.model_executor.graph_runner import GraphRunner
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.dspark import DSparkDraftModel
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.dspark_components.dspark_buffers import (
    DSparkStepBuffers,
    DSparkStepViews,
)
from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
from sglang.srt.speculative.dspark_components.dspark_cost_table import (
    MEASURED,
    VerifyCostTable,
    measure_cost_table,
)
from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockProposer
from sglang.srt.speculative.dspark_components.dspark_planner import (
    DSparkVerifyPlanner,
    ScheduleVerifyLensTopk,
    VerifyWindowPlanner,
    dp_verify_drafts_per_req,
    local_verify_tier_num_tokens,
    ragged_verify_layout,
)
from sglang.srt.speculative.dspark_components.dspark_verify import accept, sample_anchor
from sglang.srt.utils.phases import PhaseSpans

logger = logging.getLogger(__name__)


class DSparkWorkerV2:
    # The spans of a decode step, in order, and the model's own computations
    # inside them (what observers add up as model compute).
    PHASES = ("draft", "verify", "accept", "commit", "output")
    MODEL_SPANS = (
        "attention metadata",
        "draft forward",
        "verify forward",
        "context write",
    )

    def __init__(
        self,
        *,
        target_worker: TpModelWorker,
        draft_model: DSparkDraftModel,
        draft_runner: ModelRunner,
        config: DSparkConfig,
        max_batch_size: int,
        bucket_sizes: Optional[List[int]] = None,
        use_cuda_graph: bool = False,
        verify_budget: Union[str, int] = "off",
        cost_table_path: Optional[str] = None,
    ) -> None:
        self.target_worker = target_worker
        self.target_runner = target_worker.model_runner
        self.draft_model, self.draft_runner = draft_model, draft_runner
        self.config, self.gamma = config, config.gamma
        # KV positions a step may write past the last committed token.
        self.lookahead = config.gamma
        self.device = target_worker.device
        self.generator = target_worker.generator
        self.max_batch_size = max_batch_size
        self.verify_budget = verify_budget  # "auto", "off" or drafts per step
        self.spans = PhaseSpans()
        # This engine's EP CPU group (the process-wide one is the last
        # engine's built): the verify budget's and the cost table's exchanges.
        self._ep_cpu_group = get_moe_ep_cpu_group()
        target_worker.model.set_layers_to_capture(config.target_layer_ids)
        self.buffers = DSparkStepBuffers(
            max_batch_size=max_batch_size,
            gamma=config.gamma,
            vocab_size=config.vocab_size,
            markov_rank=draft_model.markov_w1.weight.shape[1],
            mask_token_id=config.mask_token_id,
            target_runner=self.target_runner,
            draft_runner=draft_runner,
            query_shape=(
                target_worker.model.config.num_heads,
                target_worker.model.config.head_dim,
            ),
        )
        self.window_planner = VerifyWindowPlanner(
            req_to_token=self.target_runner.req_to_token_pool.req_to_token,
            gamma=config.gamma,
            device=self.device,
        )
        self.proposer = DraftBlockProposer(
            draft_model=draft_model,
            draft_model_runner=draft_runner,
            config=config,
            device=self.device,
            spans=self.spans,
        )
        self._stash_seconds = 0.0  # this step's write of plain steps' context
        # On a GPU the output phase reads one packed buffer (and the drafts'
        # confidence) into pinned host memory; on the CPU it reads in place.
        self._host = None
        if torch.device(self.device).type == "cuda":
            self._host = torch.zeros(self.buffers.packed.shape).long().pin_memory()
            self._host_confidence = torch.zeros(
                self.buffers.confidence.shape
            ).pin_memory()
        self._rows: Optional[int] = None  # the size the last step ran at
        # The target hidden states of steps that drafted nothing (budget 0), by
        # KV slot: their draft context is written when drafting resumes, so
        # that a plain step costs what plain decoding does. Made before the
        # capture below: a plain step's graph writes it.
        self.context_stash: Optional[torch.Tensor] = None
        if verify_budget != "off":
            target_config = target_worker.model.config
            self.context_stash = torch.zeros(
                draft_runner.token_to_kv_pool.k.shape[1],  # slots, scratch included
                len(config.target_layer_ids) * target_config.hidden_size,
                device=self.device,
            )
        self.graph_runner = GraphRunner(
            step=self._device_step,
            bucket_sizes=bucket_sizes,
            use_cuda_graph=use_cuda_graph,
            reset=self.buffers.state.reset,
        )
        for rows in self.graph_runner.buckets if use_cuda_graph else ():
            self.buffers.at(rows)  # views before capture, outside it
        self.graph_runner.capture(self._variants)
        # The graphs read the proposer's tensors: kept alive should a caller
        # (a bench, a test) replace the proposer.
        self.captured_proposer = self.proposer
        self.planner: Optional[DSparkVerifyPlanner] = None
        if verify_budget == "auto":
            self.planner = DSparkVerifyPlanner(
                gamma=self.gamma, cost_table=self._cost_table(cost_table_path)
            )

    def _variants(
        self, rows: int
    ) -> List[Tuple[SamplingMode, int, bool, SamplingExtras]]:
        """Every (sampling mode, budget, with confidence) a step of ``rows``
        rows may run: its CUDA graphs. A ragged verify always reports
        confidence (it shares the budget by it); a full one when the planner
        asks; a plain step drafts nothing. Steps with sampling parameters
        beyond the temperature (``SamplingExtras``) run eagerly."""
        variants = []
        for budget in self._budgets(rows):
            if budget == 0:
                kinds = (False,)
            elif budget < rows * self.gamma:
                kinds = (True,)
            else:
                kinds = (False, True) if self.verify_budget == "auto" else (False,)
            variants += [(m, budget, c, NO_EXTRAS) for m in SamplingMode for c in kinds]
        return variants

    def _budgets(self, rows: int) -> List[int]:
        """The verify budgets a step of ``rows`` rows may run (its graphs)."""
        full = rows * self.gamma
        if self.verify_budget == "off":
            return [full]
        if self.verify_budget == "auto":
            return [rows * per_req for per_req in range(self.gamma + 1)]
        return [min(self.verify_budget, full)]

    def _cost_table(self, path: Optional[str]) -> VerifyCostTable:
        """The measured cost table: read from ``path`` when it exists, else
        measured here (and saved to ``path`` when given); logged. EP ranks
        agree first on which: measuring runs the MoE's collectives."""
        exists = path is not None and os.path.exists(path)
        group = self._ep_cpu_group
        if group is not None:
            check_ranks_agree(
                digest=digest_of(exists),
                group=group,
                what=f"cost table {path!r} (present on some ranks only: every "
                f"rank loads it or every rank measures, which runs collectives)",
            )
        if exists:
            problem, table = None, None
            try:
                table = VerifyCostTable.load(path)
            except ValueError as e:
                problem = str(e)
            if table is not None and table.gamma != self.gamma:
                problem = (
                    f"cost table {path!r} is for gamma {table.gamma}, not {self.gamma}"
                )
            elif (
                table is not None
                and table.measured_for != digest_of(self._cost_key()).hex()
            ):
                problem = (
                    f"cost table {path!r} was measured for another configuration "
                    f"(model, device, context, threads, batch sizes or parallel "
                    f"layout): remove it to measure this one"
                )
            if group is not None:
                # Every rank learns when one refuses (it would leave the others
                # waiting at their first exchange): ranks reading one file
                # measured by another's configuration (another num_threads).
                check_ranks_agree(
                    digest=digest_of(problem is None),
                    group=group,
                    what=f"cost table {path!r}, which fits some ranks' "
                    f"configuration only (ranks sharing one file: the same "
                    f"num_threads and GPU model)",
                )
            if problem is not None:
                raise ValueError(problem)
        else:
            table = self._measure_cost_table()
            if path is not None:
                table.save(path)
        logger.info("%s", table.format())
        return table

    def _cost_key(self) -> tuple:
        """What a cost table depends on: the step's shapes and the context it
        is measured at, the device (a GPU's model), the machine's threads,
        graphs and the parallel layout."""
        parallel = get_parallel()
        device = torch.device(self.device)
        return (
            self.config,
            device.type,
            torch.cuda.get_device_name(device) if device.type == "cuda" else "",
            self._cost_context(),
            torch.get_num_threads(),
            tuple(self.graph_runner.buckets),
            self.graph_runner.use_cuda_graph,
            self.max_batch_size,
            repr(self.target_worker.model.config),
            repr(self.draft_model.config),
            parallel.moe_ep_size,
            parallel.attn_dp_size,
            parallel.moe_a2a_backend,
        )

    def _cost_context(self) -> int:
        """The keys each dummy request of the measurement attends: up to 128."""
        width = self.window_planner.req_to_token.shape[1]
        return max(1, min(128, width - self.gamma - 1))

    def _measure_cost_table(self) -> VerifyCostTable:
        """Time this worker's device step over dummy requests (a context of
        up to 128 keys, all in the scratch slot) per batch size and budget.
        Each request's anchor is a different token, so that the rows take
        the experts a real batch does, not all the same two."""
        state, context = self.buffers.state, self._cost_context()
        sizes = sorted({min(2**i, self.max_batch_size) for i in range(12)})
        cuda = torch.device(self.device).type == "cuda"
        anchors = torch.randint(
            self.config.vocab_size,
            state.last_ids.shape,
            generator=torch.Generator().manual_seed(0),
        ).to(self.device)

        parallel = get_parallel()

        def run_step(bs: int, budget: int) -> None:
            state.reset()
            state.seq_lens.fill_(context)
            state.last_ids.copy_(anchors)
            rows = self.graph_runner.padded_size(bs)
            if rows != self._rows:
                self.buffers.set_constants(rows)
                self._rows = rows
            budget = budget * rows // bs
            self.buffers.real_requests.fill_(bs)  # as a step of bs would
            # Each batch's real rows, as a step of bs requests counts them:
            # under EP > 1 the router masks the rest (by the scalars).
            v = self.buffers.at(rows)
            verify = self._verify_batch(v, rows, budget)
            num_verify = self._verify_rows(bs, budget)
            target_num_token_non_padded(
                num_verify, self.buffers.verify_scalar, self.device
            )
            verify.num_token_non_padded_cpu = num_verify
            self.proposer.count_real_rows(
                views=v, num_tokens=bs * self.gamma, scalar=self.buffers.draft_scalar
            )
            if parallel.enable_dp_attention:  # every rank measures the same
                for fb in (verify, v.draft_batch):
                    fb.global_num_tokens_cpu = [
                        fb.num_token_non_padded_cpu
                    ] * parallel.attn_dp_size
            self.graph_runner.run(
                rows=rows,
                variant=(
                    SamplingMode.GREEDY,
                    budget,
                    0 < budget < rows * self.gamma,
                    NO_EXTRAS,
                ),
                max_kv_len=context + self.gamma,
            )

        key = self._cost_key()
        table = MEASURED.get(key)
        if self._ep_cpu_group is not None:
            # Measuring runs the MoE's collectives: every rank measures when
            # one must (ranks differing in num_threads differ in their keys,
            # and in what this process measured before).
            cached = all_gather_ints(
                values=[table is not None],
                group=self._ep_cpu_group,
                what="whether the cost table is measured",
            )
            if not all(r[0] for r in cached):
                table = None
        if table is None:
            with torch.no_grad():
                table = measure_cost_table(
                    run_step=run_step,
                    batch_sizes=sizes,
                    gamma=self.gamma,
                    sync=torch.cuda.synchronize if cuda else (lambda: None),
                    measured_for=digest_of(key).hex(),
                )
            state.reset()
            MEASURED[key] = table
        return table

    def prefill(
        self, *, req: Req, global_num_tokens: Optional[List[int]] = None
    ) -> int:
        first, out, forward_batch = self.target_worker.forward_prefill(
            req=req, capture_hidden=True, global_num_tokens=global_num_tokens
        )
        # The prompt's target hidden states become the draft's context KV.
        self.draft_model.write_context(
            aux_hidden_states=out.aux_hidden_states,
            positions=forward_batch.positions,
            out_cache_loc=forward_batch.out_cache_loc,
            kv_pool=self.draft_runner.token_to_kv_pool,
        )
        return first

    def idle_prefill(self, *, global_num_tokens: List[int]) -> None:
        self.target_worker.idle_prefill(global_num_tokens=global_num_tokens)

    def flush_cache(self) -> None:
        """The verify planner forgets what steps taught it (its cost table
        stays: it was measured for this configuration)."""
        if self.planner is not None:
            self.planner.reset()

    def start_round(self) -> None:
        """Before a round of requests: expert-parallel ranks without DP
        attention, which hold the plan they agreed on, drop it, so that all
        of them plan (and agree) on the round's first step: a rank flushed
        alone, which forgot its held plan, would plan and gather while the
        others ran on into the MoE's collectives."""
        if self.planner is not None and self._agrees_plans:
            self.planner.drop_hold()

    @property
    def _agrees_plans(self) -> bool:
        """Expert-parallel ranks without DP attention run the same steps
        (their MoE all-reduces pair up): they agree on every plan."""
        return self._ep_cpu_group is not None and not get_parallel().enable_dp_attention

    def local_verify_tier(self, batch: ScheduleBatch) -> int:
        """This rank's verify tier for the DP sync: its requests' anchor rows
        plus the drafts it plans to verify; -1 without a per-step plan
        (``off`` or a fixed budget: every rank runs the same anyway), 0 idle."""
        if batch.is_idle:
            return 0
        if self.planner is None:
            return -1
        return local_verify_tier_num_tokens(
            bs=batch.batch_size,
            verify_token_budget=self._local_budget(batch),
            verify_num_draft_tokens=self.gamma + 1,
            min_verify_len=1,
        )

    def decode_step(self, *, batch: ScheduleBatch) -> StepOutput:
        start = time.perf_counter()
        bs, mode = batch.batch_size, batch.sampling_mode
        if bs > self.max_batch_size:
            raise ValueError(
                f"batch of {bs} exceeds max_batch_size={self.max_batch_size}"
            )
        with self.spans("draft"):
            rows, budget = self._prepare(batch, mode)
        # The verify's longest kv_len: the longest sequence + gamma.
        max_kv_len = max(batch.seq_lens_cpu, default=1) + self.gamma
        # Confidence for the planner's next plan, and for a ragged verify's
        # schedule.
        observed = (
            self.planner is not None
            and self.planner.wants_confidence
            and not batch.is_idle
        )
        confident = budget > 0 and (observed or budget < rows * self.gamma)
        extras = batch.sampling_info.extras
        self.graph_runner.run(
            rows=rows, variant=(mode, budget, confident, extras), max_kv_len=max_kv_len
        )
        with self.spans("output"):
            out = self._output(batch, rows, budget, budget > 0 and observed)
        if self.planner is not None and bs:  # what the step cost, as planned
            real = budget * bs // rows
            # Less the context the plain steps before it stashed (their cost,
            # not a drafting step's: after a plain streak it skewed the scale
            # up). On a GPU only its launch is timed here.
            seconds = time.perf_counter() - start - self._stash_seconds
            self.planner.observe_cost(bs=bs, budget=real, seconds=seconds)
        return out

    def _plan(self, batch: ScheduleBatch, rows: int) -> int:
        """This step's verify budget: drafts to verify over ``rows`` rows."""
        if self.planner is None:
            return self._budgets(rows)[0]
        if batch.global_verify_tier_num_tokens is not None:
            # DP attention: what every rank's tier, gathered, makes of it.
            return rows * dp_verify_drafts_per_req(
                global_num_reqs=batch.global_num_tokens,
                global_tier_num_tokens=batch.global_verify_tier_num_tokens,
                gamma=self.gamma,
            )
        return self._local_budget(batch) // batch.batch_size * rows

    def _local_budget(self, batch: ScheduleBatch) -> int:
        """The planner's budget for this rank's batch: drafts to verify over
        its requests (a multiple of their number)."""
        planner, bs = self.planner, batch.batch_size
        budget = planner.held(bs)
        if budget is None:
            sampled = [r.sampling_params.temperature > 0 for r in batch.reqs]
            budget = planner.plan(
                confidence=[r.spec_draft_confidence for r in batch.reqs],
                sampled=sampled,
                rows=self.graph_runner.padded_size(bs),
                # As _lay_out_ragged schedules them: unseeded sampled rows.
                blind=[
                    s and r.sampling_params.sampling_seed is None
                    for s, r in zip(sampled, batch.reqs)
                ],
            )
            if self._agrees_plans:
                # Every EP rank runs the same steps (their MoE all-reduces
                # pair up): the largest of their plans, held by all.
                ranks = all_gather_ints(
                    values=[budget], group=self._ep_cpu_group, what="the verify budget"
                )
                budget = max(r[0] for r in ranks)
                planner.hold(budget)
        return budget

    def _prepare(self, batch: ScheduleBatch, mode: SamplingMode) -> Tuple[int, int]:
        """Host-side work before the device step: bind and pad the batch,
        plan the budget, set the scalars' counts, draw the noise. Returns
        the rows to run and the budget (drafts to verify over them)."""
        bs, buffers, g = batch.batch_size, self.buffers, self.gamma
        buffers.state.bind(batch, buffers.at(bs).state)
        rows = self.graph_runner.padded_size(dp_rows(batch))
        if rows > bs:
            buffers.state.pad(bs)
        if rows != self._rows:
            buffers.set_constants(rows)
            self._rows = rows
        budget = self._plan(batch, rows)
        v = buffers.at(rows)
        verify = self._verify_batch(v, rows, budget)
        if 0 < budget < rows * g:  # the requests that share it first
            buffers.real_requests.fill_(bs)
        num_tokens = self._verify_rows(bs, budget)
        verify.num_token_non_padded = target_num_token_non_padded(
            num_tokens, buffers.verify_scalar, self.device
        )
        verify.num_token_non_padded_cpu = num_tokens
        idle = batch.is_idle
        verify.forward_mode = ForwardMode.IDLE if idle else ForwardMode.TARGET_VERIFY
        v.draft_batch.forward_mode = (
            ForwardMode.IDLE if idle else ForwardMode.DRAFT_EXTEND_V2
        )
        if batch.global_num_tokens is not None:  # every DP rank's rows
            batch.can_run_dp_cuda_graph = self.graph_runner.is_graphed(rows)
            fill_mlp_sync_metadata(
                verify,
                global_counts=batch.global_num_tokens,
                global_counts_for_logprob=batch.global_num_tokens_for_logprob,
                can_run_dp_cuda_graph=batch.can_run_dp_cuda_graph,
                device=self.device,
                rows_of=lambda n: self._verify_rows(n, budget),
            )
        self._stash_seconds = 0.0
        if budget > 0:
            began = time.perf_counter()
            if self._write_stashed_context(batch):
                self._stash_seconds = time.perf_counter() - began
            self.proposer.prepare(views=v, batch=batch, scalar=buffers.draft_scalar)
        if mode is not SamplingMode.GREEDY:
            seeded, st = batch.sampling_info.extras.seeded, v.state.sampling
            if budget == 0:  # the bonus alone
                draw_log_exp1_(v.bonus_noise_rows, self.generator)
                if seeded:  # seeded rows: their own draws, position out_lens
                    fill_seeded_log_e_(
                        v.bonus_noise_rows.unsqueeze(0), st, v.slot_offsets[:1]
                    )
            else:
                # One draw for the noise and acceptance's u (log_e's first).
                v.draws.uniform_(generator=self.generator)
                log_exp1_(v.log_e)
                if seeded:  # slot j draws for output position out_lens + j
                    fill_seeded_log_e_(v.log_e, st, v.slot_offsets)
        return rows, budget

    def _verify_rows(self, num_reqs: int, budget: int) -> int:
        """A verify's real rows with ``num_reqs`` real requests: each one's
        anchor and the drafts it verifies (request-major). The budget goes
        to the real requests first (those padding a bucket take what is
        left: ``ScheduleVerifyLensTopk``), so the host knows the count."""
        return num_reqs + min(budget, num_reqs * self.gamma)

    def _write_stashed_context(self, batch: ScheduleBatch) -> bool:
        """Before drafting: the draft context of positions that plain steps
        committed (stashed target hidden states) into the draft's KV.
        Whether there was any."""
        slots, positions, written = [], [], []
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu):
            if req.draft_context_from is not None:
                # The anchor (seq_len - 1) enters this step's verify.
                span = range(req.draft_context_from, seq_len - 1)
                slots += [req.kv_slots[p] for p in span]
                positions += span
                written.append(req)
        if slots:
            with self.spans("context write"):
                slots_t = torch.tensor(slots, device=self.device)
                self.draft_model.write_context(
                    aux_hidden_states=self.context_stash.index_select(0, slots_t),
                    positions=torch.tensor(positions, device=self.device),
                    out_cache_loc=slots_t,
                    kv_pool=self.draft_runner.token_to_kv_pool,
                )
        for req in written:  # only once written: a failed write is redone
            req.draft_context_from = None
        return bool(slots)

    def _verify_batch(self, v: DSparkStepViews, rows: int, budget: int) -> ForwardBatch:
        """The target batch a step of this budget runs."""
        if budget == 0:
            return v.plain_batch
        if budget == rows * self.gamma:
            return v.verify_batch
        return self.buffers.ragged(rows, budget).batch

    def _device_step(
        self,
        rows: int,
        variant: Tuple[SamplingMode, int, bool, SamplingExtras],
        max_kv_len: Optional[int],
    ) -> None:
        """Draft -> verify -> accept -> commit over the first ``rows`` rows of
        the step buffers: device work only (graph-safe, compilable)."""
        mode, budget, confident, extras = variant
        v = self.buffers.at(rows)
        verify = self._verify_batch(v, rows, budget)
        ragged = 0 < budget < rows * self.gamma
        with self.spans("draft"):
            self._fill_window(v, max_kv_len, plain=budget == 0)
            if budget > 0:
                self.proposer.propose(
                    views=v, mode=mode, confidence=confident, extras=extras
                )
            if ragged:
                self._lay_out_ragged(v, rows, budget, mode, extras)
        with self.spans("verify"), self.spans("verify forward"):
            out = self.target_runner.forward(verify)
        with self.spans("accept"):
            if budget == 0:
                sample_anchor(views=v, logits=out.logits, mode=mode, extras=extras)
            else:
                accept(
                    views=v,
                    target_logits=out.logits,
                    mode=mode,
                    query_index=verify.query_index,
                    extras=extras,
                )
        with self.spans("commit"):
            self._commit(v, verify, out.aux_hidden_states, drafted=budget > 0)
            if extras.counted:
                v.state.sampling.advance_(v.committed, v.committed_valid)

    def _fill_window(
        self, v: DSparkStepViews, max_kv_len: Optional[int], *, plain: bool
    ) -> None:
        """The window, the verify batch's first column and kv_lens (the
        drafts land in its other columns), and the step's attention metadata
        (for a plain step: its own batch's, one row per request)."""
        state = v.state
        self.window_planner.plan(
            seq_lens=v.seq_len_col,
            req_pool_indices=v.req_pool_col,
            window=v.window,
            table_index=v.table_index,
            flat_table_index=v.flat_table_index,
            flat_slots=v.verify_batch.out_cache_loc,
        )
        target = self.target_worker.model
        if plain:  # the anchors alone: the window's first column
            v.plain_positions.copy_(v.window_anchor_positions)
            v.plain_slots.copy_(v.window_anchor_slots)
            batch = v.plain_batch
            batch.max_kv_len = None if max_kv_len is None else max_kv_len - self.gamma
            with self.spans("attention metadata"):
                batch.attn_metadata = target.init_forward_metadata(batch)
            return
        v.verify_anchors.copy_(state.last_ids)
        torch.add(v.window.positions, 1, out=v.verify_kv_lens)  # causal
        v.verify_batch.max_kv_len = max_kv_len
        with self.spans("attention metadata"):
            # Built once, read by the draft block (its slots and mask, up to
            # the block's bound), the verify and the context write.
            v.verify_batch.attn_metadata = target.init_forward_metadata(v.verify_batch)

    def _lay_out_ragged(
        self,
        v: DSparkStepViews,
        rows: int,
        budget: int,
        mode: SamplingMode,
        extras: SamplingExtras,
    ) -> None:
        """Share the budget among the requests by confidence (unseeded
        sampled rows blind to their drafts': ``ScheduleVerifyLensTopk``),
        place the rows to verify, and give their batch the window's metadata
        cut to them."""
        r, buffers = self.buffers.ragged(rows, budget), self.buffers
        blind = None
        if mode is not SamplingMode.GREEDY:
            blind = v.state.is_sampled
            if extras.seeded:  # seeded rows are sampled ones: the others
                seeded = v.state.sampling.is_seeded.view(-1)
                blind = torch.logical_xor(blind, seeded, out=v.blind_requests)
        ScheduleVerifyLensTopk.execute(
            confidence=v.confidence,
            budget=budget,
            verify_lens=v.verify_lens,
            gains=v.gains,
            top_values=r.top_values,
            top_index=r.top_index,
            ones=r.ones,
            real_requests=self.buffers.real_requests,
            requests_1=v.requests_1,
            padded=v.padded_requests,
            blind=blind,
            blind_gains=buffers.blind_gains,
        )
        ragged_verify_layout(
            verify_lens=v.verify_lens,
            width=self.gamma + 1,
            row_ids=r.row_ids,
            requests_1=v.requests_1,
            row_ends=v.row_ends,
            row_req=r.row_req,
            query_index=r.query_index,
        )
        batch, window = r.batch, v.verify_batch
        torch.index_select(window.input_ids, 0, r.query_index, out=batch.input_ids)
        torch.index_select(window.positions, 0, r.query_index, out=batch.positions)
        torch.index_select(
            window.out_cache_loc, 0, r.query_index, out=batch.out_cache_loc
        )
        with self.spans("attention metadata"):
            full = window.attn_metadata
            batch.attn_metadata = replace(
                full,
                cos=full.cos.index_select(0, r.query_index),
                sin=full.sin.index_select(0, r.query_index),
                query_index=r.query_index,
                query_grid=buffers.query_grid(rows),
            )

    def _commit(
        self,
        v: DSparkStepViews,
        verify: ForwardBatch,
        aux_hidden_states: torch.Tensor,
        *,
        drafted: bool,
    ) -> None:
        state = v.state
        state.seq_lens.add_(v.accept_lens).add_(1)  # committed = accepted + 1
        if not drafted:  # a plain step: its context waits for the next draft
            self.context_stash.index_copy_(0, verify.out_cache_loc, aux_hidden_states)
        else:
            with self.spans("context write"):
                # Every verified row: rows past the accepted ones are
                # overwritten next step.
                self.draft_model.write_context(
                    aux_hidden_states=aux_hidden_states,
                    positions=verify.positions,
                    out_cache_loc=verify.out_cache_loc,
                    kv_pool=self.draft_runner.token_to_kv_pool,
                    metadata=verify.attn_metadata,
                )
        if self._host is not None:  # one buffer for the output phase's read
            v.packed[:, 0].copy_(v.accept_lens)
            v.packed[:, 1].copy_(v.verify_lens)
            v.packed[:, 2:-1].copy_(v.drafts)
            v.packed[:, -1].copy_(state.last_ids)

    def _output(
        self, batch: ScheduleBatch, rows: int, budget: int, observed: bool
    ) -> StepOutput:
        """The step's one host read; the host's sequence lengths advance, and
        on an observed step the planner learns from what was accepted."""
        bs, g, drafted = batch.batch_size, self.gamma, observed
        # The request-major buffers' first bs rows are the same at any size;
        # the confidence is slot-major, read at the size the step ran.
        v, ran = self.buffers.at(bs), self.buffers.at(rows)
        if self._host is None:
            accept_lens, drafts = v.accept_lens.tolist(), v.drafts.tolist()
            bonus, verify_lens = v.state.last_ids.tolist(), v.verify_lens
            confidence = ran.confidence.t().tolist() if drafted else None
        else:
            host = self._host[:bs]
            host.copy_(v.packed, non_blocking=True)
            if drafted:
                conf_host = self._host_confidence[: g * rows].view(g, rows)
                conf_host.copy_(ran.confidence, non_blocking=True)
            torch.cuda.current_stream(v.packed.device).synchronize()  # its device's
            packed = host.tolist()
            accept_lens, verify_lens = [r[0] for r in packed], host[:, 1]
            drafts, bonus = [r[2:-1] for r in packed], [r[-1] for r in packed]
            confidence = conf_host.t().tolist() if drafted else None
        if budget == 0 or budget == rows * g:  # known here: no read needed
            verify_lens = [budget // rows] * bs
        else:
            verify_lens = verify_lens.tolist()
        seq_lens = batch.seq_lens_cpu
        for i, (req, a) in enumerate(zip(batch.reqs, accept_lens)):
            if budget == 0:
                if req.draft_context_from is None:
                    req.draft_context_from = seq_lens[i] - 1  # this step's anchor
                # Its last block's confidence was spent on this plain step:
                # the next plan expects the running acceptance of it again.
                req.spec_draft_confidence = None
            seq_lens[i] += a + 1
        if drafted:  # confidence: [rows][g], the real requests first
            confidence = confidence[:bs]
            self.planner.observe(
                confidence=confidence,
                sampled=[r.sampling_params.temperature > 0 for r in batch.reqs],
                accept_lens=accept_lens,
                verify_lens=verify_lens,
            )
            for req, row in zip(batch.reqs, confidence):
                req.spec_draft_confidence = row
        logprobs = None
        if batch.sampling_info.extras.logprobs:  # a request asked: one more read
            rows_lp = v.logprobs.tolist()
            logprobs = [lp[: a + 1] for lp, a in zip(rows_lp, accept_lens)]
        return StepOutput(
            output_ids=[d[:a] + [b] for d, a, b in zip(drafts, accept_lens, bonus)],
            accepted_drafts=accept_lens,
            verified_drafts=verify_lens,
            logprobs=logprobs,
        )

"""DSparkWorker: prefill, and the decode step as one pipeline.

A decode step is five phases, in order, each one call:

1. draft: bind the batch to the step buffers (once per batch), pad it to
   its bucket, draw the step's noise; then fill the verify window, build
   the step's attention metadata (once, for all three forwards), and
   propose the block (``DraftBlockProposer``: its inputs, the draft
   forward, the Markov head's left-to-right sampling);
2. verify: the target forward over ``[bonus, d_1..d_gamma]``;
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
"""

from typing import List, Optional

import torch

from sglang.srt.layers.sampler import SamplingMode, draw_log_exp1_
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, StepOutput
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.forward_batch_info import target_num_token_non_padded
from sglang.srt.model_executor.graph_runner import GraphRunner
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.dspark import DSparkDraftModel
from sglang.srt.speculative.dspark_components.dspark_buffers import (
    DSparkStepBuffers,
    DSparkStepViews,
)
from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockProposer
from sglang.srt.speculative.dspark_components.dspark_planner import VerifyWindowPlanner
from sglang.srt.speculative.dspark_components.dspark_verify import accept
from sglang.srt.utils.phases import PhaseSpans


class DSparkWorker:
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
        self.spans = PhaseSpans()
        target_worker.model.set_layers_to_capture(config.target_layer_ids)
        self.buffers = DSparkStepBuffers(
            max_batch_size=max_batch_size,
            gamma=config.gamma,
            vocab_size=config.vocab_size,
            markov_rank=draft_model.markov_w1.weight.shape[1],
            mask_token_id=config.mask_token_id,
            target_runner=self.target_runner,
            draft_runner=draft_runner,
        )
        self.window_planner = VerifyWindowPlanner(
            req_to_token=self.target_runner.req_to_token_pool.req_to_token,
            gamma=config.gamma,
            device=self.device,
        )
        self.proposer = DraftBlockProposer(
            draft_model=draft_model,
            draft_runner=draft_runner,
            config=config,
            device=self.device,
            spans=self.spans,
        )
        # On a GPU the output phase reads one packed buffer into pinned host
        # memory; on the CPU it reads the buffers in place.
        self._host = None
        if torch.device(self.device).type == "cuda":
            self._host = torch.zeros(self.buffers.packed.shape).long().pin_memory()
        self._rows: Optional[int] = None  # the size the last step ran at
        self.graph_runner = GraphRunner(
            step=self._device_step,
            bucket_sizes=bucket_sizes,
            use_cuda_graph=use_cuda_graph,
            reset=self.buffers.state.reset,
        )
        for rows in self.graph_runner.buckets if use_cuda_graph else ():
            self.buffers.at(rows)  # views before capture, outside it
        self.graph_runner.capture(list(SamplingMode))

    def prefill(self, *, req: Req) -> int:
        first, out, forward_batch = self.target_worker.forward_prefill(
            req=req, capture_hidden=True
        )
        # The prompt's target hidden states become the draft's context KV.
        self.draft_model.write_context(
            aux_hidden_states=out.aux_hidden_states,
            positions=forward_batch.positions,
            out_cache_loc=forward_batch.out_cache_loc,
            kv_pool=self.draft_runner.token_to_kv_pool,
        )
        return first

    def decode_step(self, *, batch: ScheduleBatch) -> StepOutput:
        bs, mode = batch.batch_size, batch.sampling_mode
        if bs > self.max_batch_size:
            raise ValueError(
                f"batch of {bs} exceeds max_batch_size={self.max_batch_size}"
            )
        with self.spans("draft"):
            rows = self._prepare(batch, mode)
        # The verify's longest kv_len: the longest sequence + gamma.
        max_kv_len = max(batch.seq_lens_cpu) + self.gamma
        self.graph_runner.run(rows=rows, variant=mode, max_kv_len=max_kv_len)
        with self.spans("output"):
            return self._output(batch)

    def _prepare(self, batch: ScheduleBatch, mode: SamplingMode) -> int:
        """Host-side work before the device step: bind and pad the batch,
        set the scalars' counts, draw the noise. Returns the rows to run."""
        bs, buffers = batch.batch_size, self.buffers
        buffers.state.bind(batch, buffers.at(bs).state)
        rows = self.graph_runner.padded_size(bs)
        if rows > bs:
            buffers.state.pad(bs)
        if rows != self._rows:
            buffers.set_constants(rows)
            self._rows = rows
        v = buffers.at(rows)
        num_tokens = bs * (self.gamma + 1)  # the verify's real rows
        v.verify_batch.num_token_non_padded = target_num_token_non_padded(
            num_tokens, buffers.verify_scalar, self.device
        )
        v.verify_batch.num_token_non_padded_cpu = num_tokens
        self.proposer.prepare(views=v, batch=batch, scalar=buffers.draft_scalar)
        if mode is not SamplingMode.GREEDY:
            draw_log_exp1_(v.log_e, self.generator)
            v.u.uniform_(generator=self.generator)
        return rows

    def _device_step(
        self, rows: int, mode: SamplingMode, max_kv_len: Optional[int]
    ) -> None:
        """Draft -> verify -> accept -> commit over the first ``rows`` rows of
        the step buffers: device work only (graph-safe, compilable)."""
        v = self.buffers.at(rows)
        v.verify_batch.max_kv_len = max_kv_len
        with self.spans("draft"):
            self._fill_inputs(v)
            self.proposer.propose(views=v, mode=mode)
        with self.spans("verify"), self.spans("verify forward"):
            out = self.target_runner.forward(v.verify_batch)
        with self.spans("accept"):
            accept(views=v, target_logits=out.logits, mode=mode)
        with self.spans("commit"):
            self._commit(v, out.aux_hidden_states)

    def _fill_inputs(self, v: DSparkStepViews) -> None:
        """The window, the verify batch's first column and kv_lens (the
        drafts land in its other columns), and the step's attention metadata."""
        state = v.state
        self.window_planner.plan(
            seq_lens=v.seq_len_col,
            req_pool_indices=v.req_pool_col,
            window=v.window,
            table_index=v.table_index,
            flat_table_index=v.flat_table_index,
            flat_slots=v.verify_batch.out_cache_loc,
        )
        v.verify_anchors.copy_(state.last_ids)
        torch.add(v.window.positions, 1, out=v.verify_kv_lens)  # causal
        with self.spans("attention metadata"):
            # Built once, read by the draft block (its slots and mask, up to
            # the block's bound), the verify and the context write.
            v.verify_batch.attn_metadata = (
                self.target_worker.model.init_forward_metadata(v.verify_batch)
            )

    def _commit(self, v: DSparkStepViews, aux_hidden_states: torch.Tensor) -> None:
        state = v.state
        state.seq_lens.add_(v.accept_lens).add_(1)  # committed = accepted + 1
        with self.spans("context write"):
            # Every window row: rows past the accepted ones are overwritten
            # next step.
            self.draft_model.write_context(
                aux_hidden_states=aux_hidden_states,
                positions=v.verify_batch.positions,
                out_cache_loc=v.verify_batch.out_cache_loc,
                kv_pool=self.draft_runner.token_to_kv_pool,
                metadata=v.verify_batch.attn_metadata,
            )
        if self._host is not None:  # one buffer for the output phase's read
            v.packed[:, 0].copy_(v.accept_lens)
            v.packed[:, 1:-1].copy_(v.drafts)
            v.packed[:, -1].copy_(state.last_ids)

    def _output(self, batch: ScheduleBatch) -> StepOutput:
        """The step's one host read; the host's sequence lengths advance."""
        bs = batch.batch_size
        v = self.buffers.at(bs)
        if self._host is None:
            accept_lens, drafts = v.accept_lens.tolist(), v.drafts.tolist()
            bonus = v.state.last_ids.tolist()
        else:
            host = self._host[:bs]
            host.copy_(v.packed, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            rows = host.tolist()
            accept_lens = [r[0] for r in rows]
            drafts, bonus = [r[1:-1] for r in rows], [r[-1] for r in rows]
        seq_lens = batch.seq_lens_cpu
        for i, a in enumerate(accept_lens):
            seq_lens[i] += a + 1
        return StepOutput(
            output_ids=[d[:a] + [b] for d, a, b in zip(drafts, accept_lens, bonus)],
            accepted_drafts=accept_lens,
        )

"""DSparkWorker: prefill, and the decode step in DSpark order.

window -> propose -> verify -> accept -> commit (target hidden -> draft KV)
-> next input (bonus, new seq len). Rejected drafts need no rollback: their
slots lie past the new sequence length and are overwritten next step.
"""

from dataclasses import replace
from typing import Dict, List, Tuple

import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, StepOutput
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.dspark import DSparkDraftModel
from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockProposer
from sglang.srt.speculative.dspark_components.dspark_planner import (
    VerifyWindow,
    VerifyWindowPlanner,
)
from sglang.srt.speculative.dspark_components.dspark_verify import (
    VerifyBuffers,
    rejection_verify_into,
    verify,
)


class DSparkWorker:
    def __init__(
        self,
        *,
        target_worker: TpModelWorker,
        draft_model: DSparkDraftModel,
        draft_runner: ModelRunner,
        config: DSparkConfig,
        max_batch_size: int,
        use_graphs: bool = True,
    ) -> None:
        self.target_worker = target_worker
        self.draft_model, self.draft_runner = draft_model, draft_runner
        self.config, self.gamma = config, config.gamma
        # KV positions a step may write past the last committed token.
        self.lookahead = config.gamma
        self.device = target_worker.device
        self.generator = target_worker.generator
        self.req_to_token = target_worker.req_to_token
        target_worker.model.set_layers_to_capture(config.target_layer_ids)
        if use_graphs:
            target_worker.model_runner.add_graph_runner(
                forward_mode=ForwardMode.TARGET_VERIFY,
                tokens_per_req=self.gamma + 1,
                capture_hidden_mode=CaptureHiddenMode.FULL,
            )
            draft_runner.add_graph_runner(
                forward_mode=ForwardMode.TARGET_VERIFY, tokens_per_req=self.gamma
            )
        self.proposer = DraftBlockProposer(
            draft_model=draft_model,
            draft_runner=draft_runner,
            config=config,
            max_batch_size=max_batch_size,
            device=self.device,
        )
        self.planner = VerifyWindowPlanner(
            req_to_token=self.req_to_token,
            gamma=self.gamma,
            max_batch_size=max_batch_size,
            device=self.device,
        )
        # Per-step buffers, allocated once at the largest batch.
        shape, dev = (max_batch_size, self.gamma + 1), self.device
        self._kv_lens = torch.zeros(shape, dtype=torch.int64, device=dev)
        self._verify_ids = torch.zeros(shape, dtype=torch.int64, device=dev)
        self._num_token_non_padded = torch.zeros((), dtype=torch.int32, device=dev)
        self.verify_buffers = VerifyBuffers(
            max_batch_size=max_batch_size,
            gamma=self.gamma,
            device=dev,
            vocab_size=draft_model.lm_head.weight.shape[0],
        )
        # On a GPU, one host read per step and no allocation: accept lengths
        # and output ids are packed into one device buffer and copied into
        # pinned host memory. On the CPU the results are read in place.
        self._host_result = None
        if torch.device(dev).type == "cuda":
            self._step_result = torch.zeros(
                (max_batch_size, self.gamma + 2), dtype=torch.int64, device=dev
            )
            self._host_result = torch.zeros(
                self._step_result.shape, dtype=torch.int64
            ).pin_memory()
        # Per batch size: (bonus column, draft columns, flat ids, kv_lens,
        # flat kv_lens) of the buffers above, made once.
        self._views: Dict[int, Tuple[torch.Tensor, ...]] = {}

    def _cut(self, bs: int) -> Tuple[torch.Tensor, ...]:
        views = self._views.get(bs)
        if views is None:
            ids, kv_lens = self._verify_ids[:bs], self._kv_lens[:bs]
            views = (ids[:, 0], ids[:, 1:], ids.view(-1), kv_lens, kv_lens.view(-1))
            self._views[bs] = views
        return views

    def _read_back(self, result, bs: int) -> Tuple[List[int], List[List[int]]]:
        """(accept lengths, output ids) of a step as host lists."""
        if self._host_result is None:
            return result.accept_lens.tolist(), result.output_ids.tolist()
        packed, host = self._step_result[:bs], self._host_result[:bs]
        packed[:, 0].copy_(result.accept_lens)
        packed[:, 1:].copy_(result.output_ids)
        host.copy_(packed, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        rows = host.tolist()
        return [r[0] for r in rows], [r[1:] for r in rows]

    def _commit_to_draft(self, aux_hidden_states, forward_batch: ForwardBatch) -> None:
        # Target hidden states of these rows become the draft's context KV.
        self.draft_model.write_context(
            aux_hidden_states=aux_hidden_states,
            forward_batch=replace(
                forward_batch, token_to_kv_pool=self.draft_runner.token_to_kv_pool
            ),
        )

    def prefill(self, *, req: Req) -> int:
        first, out, forward_batch = self.target_worker.forward_prefill(
            req=req, capture_hidden=True
        )
        self._commit_to_draft(out.aux_hidden_states, forward_batch)
        return first

    def window(self, batch: ScheduleBatch) -> VerifyWindow:
        return self.planner.plan(
            seq_lens=batch.seq_lens, req_pool_indices=batch.req_pool_indices
        )

    def decode_step(self, *, batch: ScheduleBatch) -> StepOutput:
        bs, gamma = batch.batch_size, self.gamma
        window = self.window(batch)
        # The verify batch [bs, gamma + 1]: bonus, d_1..d_gamma, filled below
        # (its ids are views of the buffers); built first for its metadata.
        bonus_col, draft_cols, input_ids, kv_lens, flat_kv_lens = self._cut(bs)
        torch.add(window.positions, 1, out=kv_lens)  # causal
        forward_batch = ForwardBatch.init_new(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            tokens_per_req=gamma + 1,
            input_ids=input_ids,
            positions=window.positions.view(-1),
            out_cache_loc=window.out_cache_loc.view(-1),
            req_pool_indices=batch.req_pool_indices,
            kv_lens=flat_kv_lens,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            num_token_non_padded_buffer=self._num_token_non_padded,
        )
        runner = self.target_worker.model_runner
        if runner.runs_as_given(forward_batch):
            # Eager and unpadded: the verify's metadata, built once, also
            # serves the draft block (its slots and mask, up to the block's
            # bound, one key less) and the context write (the same rows'
            # rotary tables).
            forward_batch.req_to_token_pool = runner.req_to_token_pool
            forward_batch.attn_metadata = (
                self.target_worker.model.init_forward_metadata(forward_batch)
            )
        proposal = self.proposer.propose(
            batch=batch,
            window=window,
            generator=self.generator,
            verify_metadata=forward_batch.attn_metadata,
        )
        bonus_col.copy_(batch.last_ids)
        draft_cols.copy_(proposal.draft_tokens)
        out = runner.forward(forward_batch)
        info = batch.sampling_info
        args = dict(
            draft_tokens=proposal.draft_tokens,
            draft_probs=proposal.draft_probs,
            target_logits=out.logits.view(bs, gamma + 1, -1),
            buffers=self.verify_buffers,
            generator=self.generator,
        )
        if info is not None and info.all_sampled:  # no allocation, as greedy
            result = rejection_verify_into(
                inv_temperatures=info.inv_temperatures, **args
            )
        else:  # all greedy (into the buffers), or mixed
            result = verify(
                draft_logits=proposal.draft_logits,
                temperatures=batch.temperatures,
                **args,
            )
        # Commit every row: rows past the accepted ones are overwritten next step.
        self._commit_to_draft(out.aux_hidden_states, forward_batch)
        batch.seq_lens.add_(result.accept_lens).add_(1)  # committed = accepted + 1
        batch.last_ids.copy_(result.bonus_ids)
        accept_lens, output_ids = self._read_back(result, bs)
        return StepOutput(
            output_ids=[ids[: a + 1] for ids, a in zip(output_ids, accept_lens)],
            accepted_drafts=accept_lens,
        )

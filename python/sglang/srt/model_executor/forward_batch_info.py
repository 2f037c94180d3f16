"""The batch a model forward reads, what it returns, and who needs
``num_token_non_padded``.

``ForwardBatch.init_new`` is the construction path for target batches
(prefill, plain decode, verify): it makes the scalar under
``enable_num_token_non_padded()`` (through ``target_num_token_non_padded``,
which a step also calls to refill a batch it reuses). The DSpark draft block
gets it from the proposer, through its own helper
(``dspark_draft._make_num_token_non_padded``).

Layout: every request in a batch has the same number of places
(``tokens_per_req``): 1 for decode, gamma for the DSpark draft block,
gamma + 1 for target verify, the prompt length for a single-request extend.
Places are request-major: place ``b * tokens_per_req + j``. A batch runs
every place as a row, or, with ``query_index``, only some of them (a ragged
verify: each request verifies its own number of drafts); ``kv_lens`` is
then still given for every place, the other fields for the rows run.
"""

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch

from sglang.srt.runtime_context import get_parallel

if TYPE_CHECKING:
    from sglang.srt.layers.attention import AttentionMetadata
    from sglang.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    """Upstream's members, in upstream's order (so their values match), up to
    the ones this slice runs; MIXED (chunked prefill) is never made here."""

    EXTEND = enum.auto()  # prefill
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()  # a DP rank with no request: an empty forward
    # Speculative decoding: verify a batch in the target model.
    TARGET_VERIFY = enum.auto()
    # Speculative decoding: a batch in the draft model (the DSpark block).
    DRAFT_EXTEND_V2 = enum.auto()

    def is_extend(self, include_draft_extend_v2: bool = False) -> bool:
        """Upstream's meaning: a target verify is an extend too."""
        return (
            self == ForwardMode.EXTEND
            or self == ForwardMode.MIXED
            or (include_draft_extend_v2 and self == ForwardMode.DRAFT_EXTEND_V2)
            or self == ForwardMode.TARGET_VERIFY
        )

    def is_extend_without_speculative(self) -> bool:
        return self.is_extend() and not self.is_target_verify()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self == ForwardMode.DECODE or self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0  # no hidden states returned
    LAST = 1  # the last row of each request
    FULL = 2  # every row

    def need_capture(self) -> bool:
        return self != CaptureHiddenMode.NULL

    def is_full(self) -> bool:
        return self == CaptureHiddenMode.FULL

    def is_last(self) -> bool:
        return self == CaptureHiddenMode.LAST


@dataclass(frozen=True)
class ModelOutput:
    """What a model forward returns."""

    logits: torch.Tensor  # [T, vocab]
    aux_hidden_states: Optional[torch.Tensor] = None  # [T, n_layers * hidden]


def enable_num_token_non_padded() -> bool:
    """Only the EP MoE router reads the scalar, so only EP > 1 needs it."""
    return get_parallel().moe_ep_size > 1


def target_num_token_non_padded(
    num_tokens: int, buffer: Optional[torch.Tensor], device
) -> Optional[torch.Tensor]:
    """A target batch's scalar: None unless EP > 1 reads it; then ``buffer``
    (a 0-dim int32 device tensor allocated once) filled with ``num_tokens``
    (a kernel fill, no host-to-device copy), or a new scalar without one."""
    if not enable_num_token_non_padded():
        return None
    if buffer is None:
        return torch.full((), num_tokens, dtype=torch.int32, device=device)
    return buffer.fill_(num_tokens)


def step_num_token_non_padded(buffer: torch.Tensor) -> Optional[torch.Tensor]:
    """A step batch's scalar as the step buffers build it: ``buffer`` (not
    filled here) when EP > 1 reads it, so that a CUDA graph captured from
    the batch reads it too; each step fills it before it runs. Else None."""
    return buffer if enable_num_token_non_padded() else None


def fill_mlp_sync_metadata(
    forward_batch,
    *,
    global_counts: Sequence[int],
    global_counts_for_logprob: Sequence[int],
    can_run_dp_cuda_graph: bool,
    device,
    num_tokens_per_req: int = 1,
    num_tokens_for_logprob_per_req: int = 1,
    rows_of: Optional[Callable[[int], int]] = None,
) -> None:
    """A forward's data-parallel sync fields, from every rank's raw counts
    (requests on a decode step; tokens, with widths 1, on a prefill) scaled
    into this forward's rows per request, or, with ``rows_of``, into the
    rows of a rank with that count (a ragged verify's are not a multiple of
    its requests). The device copies are skipped when a CUDA graph runs the
    batch, else uploaded."""
    if rows_of is None:
        gnt = [int(n) * num_tokens_per_req for n in global_counts]
        gnt_logprob = [
            int(n) * num_tokens_for_logprob_per_req for n in global_counts_for_logprob
        ]
    else:
        gnt = [rows_of(int(n)) for n in global_counts]
        gnt_logprob = [rows_of(int(n)) for n in global_counts_for_logprob]
    forward_batch.original_global_num_tokens_cpu = list(global_counts)
    forward_batch.global_num_tokens_cpu = gnt
    forward_batch.global_num_tokens_for_logprob_cpu = gnt_logprob
    forward_batch.can_run_dp_cuda_graph = can_run_dp_cuda_graph
    if can_run_dp_cuda_graph:
        forward_batch.global_num_tokens_gpu = None
        forward_batch.global_num_tokens_for_logprob_gpu = None
    else:
        forward_batch.global_num_tokens_gpu = torch.tensor(gnt).to(device)
        forward_batch.global_num_tokens_for_logprob_gpu = torch.tensor(gnt_logprob).to(
            device
        )


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    tokens_per_req: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each row writes
    req_pool_indices: torch.Tensor  # [bs] int64, row of the req->slot table
    # [bs * tokens_per_req] int64: place attends key positions < this
    kv_lens: torch.Tensor
    # Real rows; the rest is padding up to a graph bucket. None: mask nothing.
    num_token_non_padded: Optional[torch.Tensor] = None  # [] int32, on device
    num_token_non_padded_cpu: int = 0
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # The pools the attention reads and writes (the draft has its own KV pool).
    req_to_token_pool: Optional["ReqToTokenPool"] = None
    token_to_kv_pool: Optional["KVPool"] = None
    # The longest of kv_lens, known on the host (the scheduler's sequence
    # lengths): attention reads keys up to it without a device read. None:
    # read it from the device (one host sync).
    max_kv_len: Optional[int] = None
    # Built by the caller for this very batch, to share it beyond one forward
    # (the DSpark step: the verify's, also read by the draft block and the
    # context write); None: the model builds its own.
    attn_metadata: Optional["AttentionMetadata"] = None
    # [num_tokens] int64: each row's place in the [bs, tokens_per_req] grid,
    # ascending; None: every place is a row, in order.
    query_index: Optional[torch.Tensor] = None
    # Data-parallel attention (``fill_mlp_sync_metadata``); None without it.
    # Every DP rank's real rows in this forward, in rank order: what the MoE
    # gather sizes its buffer by.
    global_num_tokens_cpu: Optional[List[int]] = None
    # The unscaled per-rank counts they came from (requests, for a decode
    # step; what graph-bucket admission reads).
    original_global_num_tokens_cpu: Optional[List[int]] = None
    global_num_tokens_for_logprob_cpu: Optional[List[int]] = None
    # Device copies; None when a CUDA graph runs the batch (its own buffers
    # hold them).
    global_num_tokens_gpu: Optional[torch.Tensor] = None
    global_num_tokens_for_logprob_gpu: Optional[torch.Tensor] = None
    can_run_dp_cuda_graph: bool = False

    def __post_init__(self) -> None:
        places = self.batch_size * self.tokens_per_req
        if self.kv_lens.shape[0] != places:
            raise ValueError(
                f"kv_lens has {self.kv_lens.shape[0]} rows, expected batch_size * "
                f"tokens_per_req = {places}"
            )
        rows = self.num_tokens
        for name in ("input_ids", "positions", "out_cache_loc"):
            got = getattr(self, name).shape[0]
            if got != rows:
                what = (
                    "query_index"
                    if self.query_index is not None
                    else ("batch_size * tokens_per_req")
                )
                raise ValueError(f"{name} has {got} rows, expected {what} = {rows}")
        if self.req_pool_indices.shape[0] != self.batch_size:
            raise ValueError(
                f"req_pool_indices has {self.req_pool_indices.shape[0]} rows, "
                f"expected batch_size = {self.batch_size}"
            )

    @classmethod
    def init_new(
        cls,
        *,
        forward_mode: ForwardMode,
        batch_size: int,
        tokens_per_req: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
        num_token_non_padded_buffer: Optional[torch.Tensor] = None,  # [] int32
        max_kv_len: Optional[int] = None,
    ) -> "ForwardBatch":
        """A target batch; ``num_token_non_padded`` is None unless EP > 1 reads it.

        When it is read, the count is filled into ``num_token_non_padded_buffer``
        (a caller's buffer allocated once: a kernel fill, no host-to-device
        copy), or into a new device scalar when no buffer is given.
        """
        num_tokens = batch_size * tokens_per_req
        return cls(
            forward_mode=forward_mode,
            batch_size=batch_size,
            tokens_per_req=tokens_per_req,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            kv_lens=kv_lens,
            num_token_non_padded=target_num_token_non_padded(
                num_tokens, num_token_non_padded_buffer, input_ids.device
            ),
            num_token_non_padded_cpu=num_tokens,
            capture_hidden_mode=capture_hidden_mode,
            max_kv_len=max_kv_len,
        )

    @property
    def num_tokens(self) -> int:
        """Rows run: every place, or the ones ``query_index`` names."""
        if self.query_index is not None:
            return self.query_index.shape[0]
        return self.batch_size * self.tokens_per_req

"""ServerArgs: the engine's arguments, validated and resolved once."""

from dataclasses import dataclass
from typing import List, Optional

import torch

from sglang.srt.arg_groups.speculative_hook import _handle_dspark
from sglang.srt.models.registry import DEFAULT_MODEL_PATH, get_target_preset

SPECULATIVE_ALGORITHMS = (None, "DSPARK")


@dataclass
class ServerArgs:
    model_path: Optional[str] = None  # None: the embedded default pair
    speculative_algorithm: Optional[str] = None  # None or "DSPARK"
    speculative_draft_model_path: Optional[str] = None  # None: the bundled draft
    # The verify width, gamma + 1 (upstream's meaning); None: draft's block + 1.
    speculative_num_draft_tokens: Optional[int] = None
    device: Optional[str] = None  # None: cuda when present, else cpu
    random_seed: int = 0
    cuda_graph_bs: Optional[List[int]] = None  # padded buckets
    disable_cuda_graph: bool = False
    max_running_requests: int = 8
    max_total_tokens: int = 4096  # KV slots
    context_length: int = 512  # per-request positions
    eos_token_id: Optional[int] = None
    # torch intra-op threads for this process; None: 1 on CPU (the slice's ops
    # are tiny and dispatch-bound, so more threads only add sync and
    # oversubscription), torch's default on CUDA (the host only launches).
    num_threads: Optional[int] = None

    def __post_init__(self) -> None:
        if self.model_path is None:
            self.model_path = DEFAULT_MODEL_PATH
        preset = get_target_preset(self.model_path)
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                f"got {self.speculative_algorithm!r}"
            )
        if self.speculative_algorithm == "DSPARK":
            _handle_dspark(self)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.num_threads is None and not self.device.startswith("cuda"):
            self.num_threads = 1
        if self.num_threads is not None and (
            isinstance(self.num_threads, bool)
            or not isinstance(self.num_threads, int)
            or self.num_threads < 1
        ):
            raise ValueError(
                f"num_threads must be an int >= 1, got {self.num_threads!r}"
            )
        if self.cuda_graph_bs is None:
            self.cuda_graph_bs = [
                b for b in (1, 2, 4, 8, 16, 32) if b < self.max_running_requests
            ] + [self.max_running_requests]
        for name in ("max_running_requests", "max_total_tokens", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        max_position = preset.config.max_position
        if self.context_length > max_position:
            raise ValueError(
                f"context_length={self.context_length} exceeds the model's "
                f"max_position={max_position}"
            )
        if (
            not self.cuda_graph_bs
            or max(self.cuda_graph_bs) > self.max_running_requests
        ):
            raise ValueError(
                f"cuda_graph_bs must be non-empty and <= max_running_requests="
                f"{self.max_running_requests}, got {self.cuda_graph_bs}"
            )

    @property
    def speculative_dspark_block_size(self) -> int:
        """gamma: the draft block, one less than the verify width."""
        return self.speculative_num_draft_tokens - 1

    @property
    def use_cuda_graph(self) -> bool:
        return self.device.startswith("cuda") and not self.disable_cuda_graph

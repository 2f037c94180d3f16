"""Process-wide parallel layout (TP and MoE expert parallelism).

This is the one process-wide fact in the slice: everything else takes its
inputs explicitly. Sizes default to 1, i.e. a single process with no
parallelism.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    moe_ep_size: int = 1
    moe_ep_rank: int = 0
    # The group experts are split over; None on a single process. A state with
    # moe_ep_size > 1 and no group is fine for predicates; the EP MoE layer
    # refuses it.
    moe_ep_group: Optional[object] = None

    def __post_init__(self) -> None:
        for size_name, rank_name in (
            ("tp_size", "tp_rank"),
            ("moe_ep_size", "moe_ep_rank"),
        ):
            size, rank = getattr(self, size_name), getattr(self, rank_name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{size_name} must be an int >= 1, got {size!r}")
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ValueError(f"{rank_name} must be an int, got {rank!r}")
            if not 0 <= rank < size:
                raise ValueError(
                    f"{rank_name} must be in [0, {size_name}={size}), got {rank}"
                )


_PARALLEL = ParallelState()


def get_parallel() -> ParallelState:
    return _PARALLEL


def set_parallel(state: ParallelState) -> ParallelState:
    """Set the process's parallel state explicitly; returns the previous one."""
    global _PARALLEL
    if not isinstance(state, ParallelState):
        raise ValueError(f"expected a ParallelState, got {type(state).__name__}")
    previous, _PARALLEL = _PARALLEL, state
    return previous


def init_parallel_from_distributed(
    *, moe_ep_size: Optional[int] = None, timeout_s: float = 60.0
) -> ParallelState:
    """Build the state from an initialized torch.distributed world.

    The world is one TP group and one EP group (both span every rank), the
    layout of an EP-only MoE deployment; ``moe_ep_size`` defaults to the world.
    """
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_size = world if moe_ep_size is None else moe_ep_size
    if ep_size != world:
        raise ValueError(
            f"moe_ep_size={ep_size} must equal the world size {world} in this slice"
        )
    group = None
    if ep_size > 1:
        # A timeout so that a dead rank ends the run instead of hanging it.
        group = dist.new_group(
            ranks=list(range(world)), timeout=timedelta(seconds=timeout_s)
        )
    state = ParallelState(
        tp_size=world,
        tp_rank=rank,
        moe_ep_size=ep_size,
        moe_ep_rank=rank,
        moe_ep_group=group,
    )
    set_parallel(state)
    return state


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

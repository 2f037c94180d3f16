"""Process groups: build the EP group from an initialized torch.distributed
world and stamp the layout into the parallel context (``runtime_context``)."""

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from sglang.srt.runtime_context import ParallelContext, get_parallel


def init_parallel_from_distributed(
    *, moe_ep_size: Optional[int] = None, timeout_s: float = 60.0
) -> ParallelContext:
    """Build the groups and record them in ``get_parallel()`` for the process.

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
    parallel = get_parallel()
    parallel.override_permanently(
        tp_size=world,
        tp_rank=rank,
        moe_ep_size=ep_size,
        moe_ep_rank=rank,
        moe_ep_group=group,
    )
    return parallel

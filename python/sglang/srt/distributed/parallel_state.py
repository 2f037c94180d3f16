"""Process groups: build the EP group from an initialized torch.distributed
world and stamp the layout into the parallel context (``runtime_context``);
check that the ranks agree before they run collectives that assume it.

Every group is made with a timeout (ServerArgs ``dist_timeout`` when the
Engine builds them), so a rank that dies or stalls makes the others raise
instead of hanging. Besides the EP group (the MoE's collectives) there is
a gloo group on the CPU for small control messages (the agreement digests,
data-parallel attention's per-step counts), as upstream keeps a
``cpu_group`` next to each device group.
"""

import hashlib
import json
import socket
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from sglang.srt.runtime_context import ParallelContext, get_parallel

DIGEST_BYTES = 32  # sha256

_MOE_EP_CPU_GROUP: Optional[Any] = None


def get_open_port() -> int:
    """A free TCP port on 127.0.0.1, for a process group of local ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed_environment(
    *, rank: int, world_size: int, port: int, timeout_s: float, backend: str = "gloo"
) -> None:
    """Join a process group of ranks on this machine; a dead rank ends every
    collective within ``timeout_s`` instead of hanging it."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_parallel_from_distributed(
    *,
    moe_ep_size: Optional[int] = None,
    attn_dp_size: int = 1,
    moe_a2a_backend: str = "none",
    timeout_s: float = 60.0,
) -> ParallelContext:
    """Build the groups and record them in ``get_parallel()`` for the process.

    The world is one TP group and one EP group (both span every rank), the
    layout of an EP-only MoE deployment; ``moe_ep_size`` defaults to the
    world. With ``attn_dp_size`` > 1 (it must then be the world too) each
    rank is also a data-parallel attention rank: it decodes its own
    requests, and the MoE moves rows between ranks by ``moe_a2a_backend``.
    Every rank must call this, in the same order (new groups are collective).
    """
    global _MOE_EP_CPU_GROUP
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_size = world if moe_ep_size is None else moe_ep_size
    if ep_size != world:
        raise ValueError(
            f"moe_ep_size={ep_size} must equal the world size {world} in this slice"
        )
    if attn_dp_size not in (1, world):
        raise ValueError(
            f"dp_size={attn_dp_size} must equal the world size {world} (one DP "
            f"attention rank per process) in this slice"
        )
    if moe_a2a_backend != "none" and attn_dp_size == 1:
        raise ValueError(
            f"moe_a2a_backend={moe_a2a_backend!r} dispatches each rank's own rows: "
            f"it needs enable_dp_attention (without it every rank holds the same "
            f"rows and the MoE all-reduces)"
        )
    group = None
    if ep_size > 1:
        # A timeout so that a dead rank ends the run instead of hanging it.
        timeout = timedelta(seconds=timeout_s)
        ranks = list(range(world))
        group = dist.new_group(ranks=ranks, timeout=timeout)
        _MOE_EP_CPU_GROUP = dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")
    parallel = get_parallel()
    parallel.override_permanently(
        tp_size=world,
        tp_rank=rank,
        moe_ep_size=ep_size,
        moe_ep_rank=rank,
        moe_ep_group=group,
        enable_dp_attention=attn_dp_size > 1,
        attn_dp_size=attn_dp_size,
        attn_dp_rank=rank if attn_dp_size > 1 else 0,
        moe_a2a_backend=moe_a2a_backend,
    )
    return parallel


def destroy_model_parallel() -> None:
    """Forget the groups and the layout ``init_parallel_from_distributed``
    recorded (a destroyed process group's, say): back to one process."""
    global _MOE_EP_CPU_GROUP
    _MOE_EP_CPU_GROUP = None
    get_parallel().clear_stamp()


def get_moe_ep_cpu_group():
    """The EP ranks' gloo group for control messages; None on one process."""
    if get_parallel().moe_ep_size == 1:
        return None
    if _MOE_EP_CPU_GROUP is None:
        raise ValueError(
            "moe_ep_size > 1 but no EP groups were built: call "
            "init_parallel_from_distributed on every rank"
        )
    return _MOE_EP_CPU_GROUP


def digest_of(value: Any) -> bytes:
    """sha256 of a JSON-able value (keys sorted), the same on every rank."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).digest()


def _gathered(gather, *, what: str):
    """Run ``gather``; a rank that is dead, or does not reach the same call
    within the group's timeout, makes it raise RuntimeError naming ``what``."""
    try:
        return gather()
    except RuntimeError as e:  # gloo: peer closed, or timed out
        raise RuntimeError(
            f"rank {dist.get_rank()}: the ranks did not all answer the exchange "
            f"of {what} (a rank died, raised, stalled past dist_timeout, or is in "
            f"another call): {e}"
        ) from e


def all_gather_digests(*, digest: bytes, group, what: str) -> list:
    """Every rank's digest, in rank order (RuntimeError naming ``what`` when
    a rank does not answer in time)."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"digest must be {DIGEST_BYTES} bytes, got {len(digest)}")
    rows = all_gather_ints(values=list(digest), group=group, what=what)
    return [bytes(r) for r in rows]


def all_gather_ints(*, values: List[int], group, what: str) -> List[List[int]]:
    """Every rank's ``values`` (the same length on every rank), in rank
    order: one gloo all-gather; RuntimeError naming ``what`` when a rank does
    not answer in time."""
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _gathered(lambda: dist.all_gather(gathered, mine, group=group), what=what)
    return [t.tolist() for t in gathered]


def all_gather_objects(*, obj: Any, group, what: str) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    out: list = [None] * dist.get_world_size(group)
    _gathered(lambda: dist.all_gather_object(out, obj, group=group), what=what)
    return out


def check_ranks_agree(*, digest: bytes, group, what: str) -> None:
    """All-gather ``digest`` and raise ValueError on every rank when any two
    ranks differ: all ranks gather before any raises, so all of them learn."""
    digests = all_gather_digests(digest=digest, group=group, what=what)
    if len(set(digests)) > 1:
        by_digest: dict = {}
        for rank, d in enumerate(digests):
            by_digest.setdefault(d.hex()[:12], []).append(rank)
        raise ValueError(
            f"EP ranks disagree on {what}: ranks grouped by digest {by_digest}; "
            f"give every rank the same"
        )

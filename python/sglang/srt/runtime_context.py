"""The process-wide parallel context, read through ``get_parallel()``.

The parallel layout (TP, data-parallel attention and MoE expert
parallelism: sizes, ranks, the EP group, the MoE dispatch) is the one
process-wide fact in the slice; everything else takes its inputs
explicitly. Values resolve in upstream's order: a scoped override
(``with get_parallel().override(moe_ep_size=2):``), then a permanent one
(``override_permanently``, set once the process groups are built), then the
single-process defaults. Upstream publishes many more fields from its
ServerArgs; this slice has the ones the DSpark path and the MoE read.
"""

from contextlib import contextmanager
from typing import Any, Dict, Iterator

_DEFAULTS: Dict[str, Any] = {
    "tp_size": 1,
    "tp_rank": 0,
    "moe_ep_size": 1,
    "moe_ep_rank": 0,
    # The group experts are split over; None on a single process. A context
    # with moe_ep_size > 1 and no group is fine for predicates; the EP MoE
    # layer refuses it.
    "moe_ep_group": None,
    # Data-parallel attention: each of attn_dp_size ranks decodes its own
    # requests (its own batch and KV); the MoE is expert-parallel over them.
    "enable_dp_attention": False,
    "attn_dp_size": 1,
    "attn_dp_rank": 0,
    # How MoE rows reach the ranks that own their experts under DP
    # attention: "none" (gather every rank's rows, all-reduce the shares)
    # or "all_to_all" (send each real row only to its experts' ranks).
    "moe_a2a_backend": "none",
}

MOE_A2A_BACKENDS = ("none", "all_to_all")


def _validate(values: Dict[str, Any]) -> None:
    for size_name, rank_name in (
        ("tp_size", "tp_rank"),
        ("moe_ep_size", "moe_ep_rank"),
        ("attn_dp_size", "attn_dp_rank"),
    ):
        size, rank = values[size_name], values[rank_name]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{size_name} must be an int >= 1, got {size!r}")
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ValueError(f"{rank_name} must be an int, got {rank!r}")
        if not 0 <= rank < size:
            raise ValueError(
                f"{rank_name} must be in [0, {size_name}={size}), got {rank}"
            )
    if values["moe_a2a_backend"] not in MOE_A2A_BACKENDS:
        raise ValueError(
            f"moe_a2a_backend must be one of {MOE_A2A_BACKENDS}, got "
            f"{values['moe_a2a_backend']!r}"
        )
    if not isinstance(values["enable_dp_attention"], bool):
        raise ValueError(
            f"enable_dp_attention must be a bool, got {values['enable_dp_attention']!r}"
        )


class ParallelContext:
    """Sizes, ranks, the EP group and the MoE dispatch of this process;
    attributes read as ``get_parallel().moe_ep_size``."""

    __slots__ = ("_overrides", "_stamp")

    def __init__(self) -> None:
        self._overrides: Dict[str, Any] = {}  # scoped: restored on `with` exit
        self._stamp: Dict[str, Any] = {}  # permanent until clear_stamp()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in _DEFAULTS:
            raise AttributeError(f"ParallelContext has no {name!r}")
        return self._resolved()[name]

    def _resolved(self) -> Dict[str, Any]:
        return {**_DEFAULTS, **self._stamp, **self._overrides}

    @staticmethod
    def _check_names(values: Dict[str, Any]) -> None:
        unknown = sorted(set(values) - set(_DEFAULTS))
        if unknown:
            raise ValueError(
                f"unknown parallel field(s): {unknown}; known: {sorted(_DEFAULTS)}"
            )

    def override_permanently(self, **values: Any) -> None:
        """Set values for the rest of the process (or until ``clear_stamp``);
        an inconsistent result raises and changes nothing."""
        self._check_names(values)
        _validate({**_DEFAULTS, **self._stamp, **values, **self._overrides})
        self._stamp.update(values)

    def clear_stamp(self) -> None:
        self._stamp.clear()

    @contextmanager
    def override(self, **values: Any) -> Iterator["ParallelContext"]:
        """Force values inside a ``with`` block; nests, restores on exit."""
        self._check_names(values)
        _validate({**self._resolved(), **values})
        saved = dict(self._overrides)
        self._overrides.update(values)
        try:
            yield self
        finally:
            self._overrides = saved

    def reset(self) -> None:
        """Back to a single process: no overrides, nothing stamped."""
        self._overrides.clear()
        self._stamp.clear()


_PARALLEL = ParallelContext()


def get_parallel() -> ParallelContext:
    return _PARALLEL

"""Request -> KV slot table, and the target and draft KV pools.

Slot 0 is scratch: padded rows of a graph bucket write there, and row 0 of
the request table (the dummy request) points only at it, so padding never
touches a live request's KV.

Each pool can say what it would take before it is built (``nbytes_for``),
so a configuration that cannot fit is rejected before anything is
allocated, and each free list can be rebuilt from the rows and slots still
held (``reset_free``), so whatever interrupted a release, nothing leaks.
"""

import os
from typing import Iterable, List

import torch

SCRATCH_SLOT = 0
DUMMY_REQ_INDEX = 0


class ReqToTokenPool:
    """Maps (request row, position) -> KV slot."""

    def __init__(self, *, max_reqs: int, max_context_len: int, device) -> None:
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(
                f"max_reqs and max_context_len must be >= 1, got "
                f"{max_reqs}, {max_context_len}"
            )
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        # [max_reqs + 1, max_context_len]; row 0 is the dummy request.
        self.req_to_token = torch.full(
            (max_reqs + 1, max_context_len),
            SCRATCH_SLOT,
            dtype=torch.int64,
            device=device,
        )
        self._free_rows: List[int] = list(range(1, max_reqs + 1))

    @staticmethod
    def nbytes_for(*, max_reqs: int, max_context_len: int) -> int:
        return (max_reqs + 1) * max_context_len * 8  # int64 table

    def available(self) -> int:
        return len(self._free_rows)

    def free_rows(self) -> List[int]:
        return list(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows")
        return self._free_rows.pop(0)

    def free(self, row: int) -> None:
        if not 1 <= row <= self.max_reqs or row in self._free_rows:
            raise ValueError(f"request row {row} is not allocated")
        self.req_to_token[row].fill_(SCRATCH_SLOT)
        self._free_rows.append(row)

    def reset_free(self, *, held: Iterable[int]) -> None:
        """Every row but ``held`` becomes free (and points at scratch again)."""
        held = set(held)
        free = [r for r in range(1, self.max_reqs + 1) if r not in held]
        if free:
            self.req_to_token[free] = SCRATCH_SLOT
        self._free_rows = free


class TokenSlotAllocator:
    """A free list of KV slots 1..num_slots (slot 0 is scratch)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: List[int] = list(range(1, num_slots + 1))
        self._free_set = set(self._free)  # the same slots, to refuse a double free

    def available(self) -> int:
        return len(self._free)

    def free_slots(self) -> List[int]:
        return list(self._free)

    def alloc(self, n: int) -> List[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV slots, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        self._free_set.difference_update(out)
        return out

    def free(self, slots: List[int]) -> None:
        """Give ``slots`` back; a slot out of range (the scratch slot 0
        included), free already, or given twice is a ValueError and nothing
        is freed (a slot freed twice would later serve two requests)."""
        slots = list(slots)
        seen = set()
        for s in slots:
            if not 1 <= s <= self.num_slots or s in self._free_set or s in seen:
                raise ValueError(f"KV slot {s} is not allocated")
            seen.add(s)
        self._free.extend(slots)
        self._free_set |= seen

    def reset_free(self, *, held: Iterable[int]) -> None:
        """Every slot but ``held`` becomes free."""
        held = set(held)
        self._free = [s for s in range(1, self.num_slots + 1) if s not in held]
        self._free_set = set(self._free)


class KVPool:
    """Per-layer K and V buffers indexed by slot: [num_layers, slots, heads, dim]."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        head_dim: int,
        dtype,
        device,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def nbytes_for(
        *, num_layers: int, num_slots: int, num_heads: int, head_dim: int, dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * (num_slots + 1) * num_heads * head_dim * element

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # slots: [T]; k, v: [T, heads, dim]
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation on ``device`` can take now: free GPU memory on
    CUDA; on the CPU, MemAvailable (or free physical pages without /proc)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

"""Descriptor rows that know which memory they address (pure).

NIXL takes one memory type per descriptor list (``DRAM`` or ``VRAM``) and a device id per row.
A :class:`MemDescs` is an ``(n, 3)`` uint64 array of rows ``(addr, length, device id)`` that carries
its list's memory type, so a plan made for VRAM cannot be posted as DRAM by a caller that only
passes arrays along.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DRAM = "DRAM"


class MemDescs(np.ndarray):
    mem_type: str

    def __array_finalize__(self, obj: Any) -> None:
        self.mem_type = getattr(obj, "mem_type", DRAM)


def mem_descs(rows: np.ndarray, mem_type: str) -> MemDescs:
    out = np.ascontiguousarray(rows, dtype=np.uint64).view(MemDescs)
    out.mem_type = mem_type
    return out


def mem_type_of(rows: np.ndarray) -> str:
    return getattr(rows, "mem_type", DRAM)

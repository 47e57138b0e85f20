"""How fast this machine runs a fixed piece of Python right now (shared VMs drift by 1.5-2x)."""

from __future__ import annotations

import hashlib
import statistics
import time


def cpu_calibration_ms(repeats: int = 7) -> float:
    """Median time of a fixed piece of Python work (integer loop, SHA-256) on this process's CPUs:
    the same code measures 1.5-2x apart at different hours of a shared VM, so each report says
    how fast the machine was while it ran."""

    def once() -> float:
        t = time.perf_counter()
        x = 0
        for i in range(200_000):
            x += i * i % 7
        h = hashlib.sha256()
        for _ in range(2000):
            h.update(b"x" * 1024)
        return (time.perf_counter() - t) * 1e3

    return statistics.median(once() for _ in range(repeats))

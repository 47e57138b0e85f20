"""Garbage-collection pauses as a Prometheus histogram, by generation (``gc.callbacks``).

A full collection stops the whole process (the scheduler's event loop included) for as long as it
walks every tracked object; this is how an operator sees those pauses next to the latencies they
land in.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

PAUSE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class GcPauses:
    """Observes each collection's duration into ``<prefix>_gc_pause_seconds{generation}`` once
    installed; ``remove`` takes the callback out again."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            f"{prefix}_gc_pause_seconds",
            "Garbage-collection pauses of this process, by generation (2: full collections)",
            ["generation"],
            buckets=PAUSE_BUCKETS,
            registry=registry,
        )
        self._by_generation = [self.histogram.labels(str(g)) for g in range(3)]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self._by_generation[min(2, int(info.get("generation", 2)))].observe(time.perf_counter() - self._started)
            self._started = 0.0

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

"""GC pause histogram (services/common/gc_pauses.py): every collection is observed under its
generation once installed, none after removal."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from kvpush.services.common.gc_pauses import GcPauses


def _count(registry: CollectorRegistry, generation: str) -> float:
    value = registry.get_sample_value("t_gc_pause_seconds_count", {"generation": generation})
    return value or 0.0


def test_collections_are_observed_by_generation_until_removed() -> None:
    registry = CollectorRegistry()
    pauses = GcPauses("t", registry).install()
    try:
        assert gc.callbacks.count(pauses) == 1
        pauses.install()
        assert gc.callbacks.count(pauses) == 1  # installing twice adds it once
        before = _count(registry, "2")
        gc.collect(2)
        gc.collect(0)
        assert _count(registry, "2") == before + 1
        assert _count(registry, "0") >= 1
        total = registry.get_sample_value("t_gc_pause_seconds_sum", {"generation": "2"})
        assert total is not None and total > 0
    finally:
        pauses.remove()
    assert pauses not in gc.callbacks
    after = _count(registry, "2")
    gc.collect(2)
    assert _count(registry, "2") == after


def test_the_scheduler_exports_its_gc_pauses() -> None:
    from kvpush.services.scheduler.metrics import Metrics
    from kvpush.services.scheduler.registry import Registry

    metrics = Metrics(Registry())
    metrics.gc_pauses.install()
    try:
        gc.collect(2)
    finally:
        metrics.gc_pauses.remove()
    assert (metrics.registry.get_sample_value("kvpush_scheduler_gc_pause_seconds_count", {"generation": "2"}) or 0) >= 1

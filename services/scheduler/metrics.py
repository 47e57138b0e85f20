"""Prometheus metrics of the scheduler, on a registry of their own (one per server)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpush.services.common.gc_pauses import GcPauses
from kvpush.services.scheduler.model import Role
from kvpush.services.scheduler.registry import Registry

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0)


class _RegistryCollector(Collector):
    """Gauges read from the registry at scrape time: nothing to keep in sync."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        alive = GaugeMetricFamily("kvpush_scheduler_instances", "Live registered instances", labels=["role"])
        for role in Role:
            alive.add_metric([role.value], len(self._registry.live(role)))
        yield alive
        yield GaugeMetricFamily(
            "kvpush_scheduler_open_assignments", "Assignments not released yet", value=len(self._registry.open)
        )
        free = GaugeMetricFamily(
            "kvpush_scheduler_projected_free_blocks",
            "Decode free KV blocks minus the scheduler's unreported assignments",
            labels=["engine_id"],
        )
        reserved = GaugeMetricFamily(
            "kvpush_scheduler_reserved_unfilled_blocks",
            "Reserved-but-unfilled KV blocks as last reported",
            labels=["engine_id"],
        )
        for inst in self._registry.live(Role.DECODE):
            free.add_metric([inst.engine_id], inst.projected_free)
            reserved.add_metric([inst.engine_id], inst.load.reserved_unfilled_blocks if inst.load else 0)
        yield free
        yield reserved
        speed = GaugeMetricFamily(
            "kvpush_scheduler_prefill_seconds_per_token",
            "Local prefill: a prefill instance's learned speed (absent until its first finished prefill)",
            labels=["engine_id"],
        )
        wait = GaugeMetricFamily(
            "kvpush_scheduler_prefill_queue_wait_seconds",
            "Local prefill: how long a prompt assigned now would wait behind a prefill instance's queue",
            labels=["engine_id"],
        )
        now = self._registry.clock()
        for inst in self._registry.live(Role.PREFILL):
            backlog = inst.backlog
            if backlog is None or backlog.s_per_token is None:
                continue
            speed.add_metric([inst.engine_id], backlog.s_per_token)
            wait.add_metric([inst.engine_id], backlog.wait_s(now) or 0.0)
        yield speed
        yield wait


class Metrics:
    def __init__(self, registry: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.assign_latency = Histogram(
            "kvpush_scheduler_assign_seconds",
            "Assign handling time, queueing included",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvpush_scheduler_decisions_total",
            "Assignments per chosen instance",
            ["role", "engine_id"],
            registry=r,
        )
        self.rejections = Counter(
            "kvpush_scheduler_rejections_total", "Refused assignments by reason", ["reason"], registry=r
        )
        self.lease_expiries = Counter(
            "kvpush_scheduler_lease_expiries_total", "Instances declared dead", ["role", "cause"], registry=r
        )
        self.releases = Counter(
            "kvpush_scheduler_releases_total", "Assignments ended, by outcome", ["outcome"], registry=r
        )
        self.reroutes = Counter(
            "kvpush_scheduler_reroutes_total", "Reroute calls (retry elsewhere) by result", ["result"], registry=r
        )
        self.leg_failures = Counter(
            "kvpush_scheduler_leg_failures_total",
            "Undelivered prefill legs, by whether the decode's load stream took the notice",
            ["result"],
            registry=r,
        )
        self.first_tokens = Counter(
            "kvpush_scheduler_first_tokens_total",
            "First tokens from prefill engines (first-token hand-off), by whether decode's load stream took them",
            ["result"],
            registry=r,
        )
        self.first_token_awaits = Counter(
            "kvpush_scheduler_first_token_awaits_total",
            "AwaitFirstToken calls by how they ended: answered, closed (the assignment closed first), "
            "cancelled (the caller left), refused",
            ["result"],
            registry=r,
        )
        self.generate = Counter("kvpush_scheduler_generate_total", "Generate calls by result", ["result"], registry=r)
        self.ttft = Histogram(
            "kvpush_scheduler_generate_ttft_seconds",
            "Generate: time to the first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.generate_phase = Histogram(
            "kvpush_scheduler_generate_phase_seconds",
            "Generate, per phase: assign (admission and choice), first_token (legs sent to the first "
            "token: prefill's, relayed, with the hand-off), second_token (first to second token: "
            "decode's part of the hand-off)",
            ["phase"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        r.register(_RegistryCollector(registry))
        # Installed by the scheduler's main (one per process), not per server.
        self.gc_pauses = GcPauses("kvpush_scheduler", r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

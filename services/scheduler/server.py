"""Scheduler server: grpc.aio server, health and reflection, lease sweeper, graceful stop."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from kvpush.services.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection, service_name
from kvpush.services.common.logs import get_logger
from kvpush.services.common.security import SCHEDULER_POLICY, Security
from kvpush.services.scheduler.convert import LegSealer
from kvpush.services.scheduler.generate import OpenAIClient
from kvpush.services.scheduler.local_prefill import LocalPrefillConfig
from kvpush.services.scheduler.metrics import Metrics
from kvpush.services.scheduler.policy import LeastBusy, decode_policy
from kvpush.services.scheduler.registry import LeaseConfig, Registry
from kvpush.services.scheduler.servicer import SchedulerServicer, ServicerConfig
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

PROBE_PERIOD_S = 0.2
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SchedulerConfig:
    listen: str = "127.0.0.1:0"
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    decode_policy: str = "p2c"
    local_prefill: LocalPrefillConfig = field(default_factory=LocalPrefillConfig)  # off by default
    servicer: ServicerConfig = field(default_factory=ServicerConfig)
    model: str = ""  # served model name for Generate; empty: first entry of GET /v1/models
    http_read_timeout_s: float = 600.0
    # mTLS with per-method roles (services/common/security.py); None: plaintext (library and test
    # use, logged). The CLI requires TLS files or an explicit --insecure.
    security: Security | None = None
    # Signs both kv_transfer_params legs of every assignment (connectors verify them with the public
    # key). None (library and test use): unsigned legs, which connectors accept only with insecure=true.
    leg_signer: LegSealer | None = None
    # Probe each instance's OpenAI server: assignable only once GET /health answers 200.
    readiness_probe: bool = False


class SchedulerServer:
    """Owns the registry, the servicer and the grpc.aio server of one scheduler process."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.log = get_logger("scheduler")
        self.registry = Registry(
            lease=config.lease,
            decode_policy=decode_policy(config.decode_policy),
            prefill_policy=LeastBusy(),
            require_ready=config.readiness_probe,
            local_prefill=config.local_prefill,
        )
        self.metrics = Metrics(self.registry)
        self.client = OpenAIClient(model=config.model, read_timeout_s=config.http_read_timeout_s)
        self.servicer = SchedulerServicer(
            self.registry, self.metrics, self.client, config.servicer, signer=config.leg_signer
        )
        # The shared health servicer is a sync one; the executor runs it next to the aio handlers.
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sched-health")
        self.security = config.security or Security.insecure("scheduler")
        self.server = grpc.aio.server(
            options=SERVER_OPTIONS,
            migration_thread_pool=self._executor,
            interceptors=self.security.interceptors(SCHEDULER_POLICY),
        )
        pb_grpc.add_SchedulerServicer_to_server(self.servicer, self.server)
        self.health = add_health_and_reflection(self.server, ["Scheduler"])
        self.port = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        host = self.config.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        self.port = self.security.add_port(self.server, self.config.listen)
        if self.port == 0:
            raise RuntimeError(f"could not bind {self.config.listen}")
        await self.server.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="lease-sweeper")
        if self.config.readiness_probe:
            self._prober = asyncio.create_task(self._probe(), name="readiness-prober")
        self.log.info(
            "scheduler_started",
            address=self.address,
            lease_interval_s=self.config.lease.interval_s,
            lease_misses=self.config.lease.misses,
            decode_policy=self.config.decode_policy,
            mtls=self.security.secure,
        )

    async def _sweep(self) -> None:
        """Declares instances dead as soon as their lease runs out."""
        lease = self.registry.lease
        while True:
            nxt = self.registry.next_expiry()
            delay = lease.interval_s if nxt is None else nxt - time.monotonic() + 0.001
            await asyncio.sleep(min(max(delay, 0.001), lease.interval_s))
            self.registry.expire()
            self.registry.expire_assignments()

    async def _probe(self) -> None:
        """Makes registered instances assignable once their OpenAI server answers ``/health``."""
        while True:
            specs = self.registry.unready()
            if specs:
                results = await asyncio.gather(
                    *(self.client.healthy(s.http_endpoint, PROBE_TIMEOUT_S) for s in specs), return_exceptions=True
                )
                for spec, ok in zip(specs, results, strict=True):
                    if ok is True and self.registry.mark_ready(spec.engine_id, spec.incarnation):
                        self.log.info(
                            "instance_ready",
                            engine_id=spec.engine_id,
                            incarnation=spec.incarnation,
                            role=spec.role.value,
                        )
            await asyncio.sleep(PROBE_PERIOD_S)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Refuses new assignments at once, lets in-flight Assign/Generate calls finish for up to
        ``grace_s``, then closes every stream and stops."""
        if self.servicer.shutting_down:
            await self._stopped.wait()
            return
        self.log.info("scheduler_stopping", grace_s=grace_s, inflight=self.servicer._inflight)
        self.servicer.begin_shutdown()
        for name in (service_name("Scheduler"), ""):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        idle = await self.servicer.wait_idle(grace_s)
        for task in (self._sweeper, self._prober):
            if task is not None:
                task.cancel()
        await self.server.stop(0.2)
        self.servicer.cancel_background()
        await self.client.close()
        self._executor.shutdown(wait=False)
        self.log.info("scheduler_stopped", drained=idle)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

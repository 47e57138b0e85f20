"""Helpers for the scheduler tests: an in-process scheduler on an ephemeral port and fake
instances that register and keep a real load stream. (Collected by pytest, holds no tests.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpush.services.common.security import Security
from kvpush.services.scheduler.convert import LegSealer
from kvpush.services.scheduler.local_prefill import LocalPrefillConfig
from kvpush.services.scheduler.registry import LeaseConfig
from kvpush.services.scheduler.server import SchedulerConfig, SchedulerServer
from kvpush.services.scheduler.servicer import ServicerConfig
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

WAIT_S = 5.0  # bound on every wait for an event in these tests


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def scheduler(
    interval_s: float = 0.05,
    misses: int = 3,
    settle_s: float = 0.05,
    policy: str = "p2c",
    security: Security | None = None,
    client: Security | None = None,
    leg_signer: LegSealer | None = None,
    local_prefill: LocalPrefillConfig | None = None,
    **servicer: Any,
) -> AsyncIterator[tuple[SchedulerServer, pb_grpc.SchedulerStub, grpc.aio.Channel]]:
    """``security``: the server's (None: plaintext); ``client``: the returned channel's (None:
    plaintext, else e.g. a frontend certificate)."""
    server = SchedulerServer(
        SchedulerConfig(
            listen="127.0.0.1:0",
            lease=LeaseConfig(interval_s=interval_s, misses=misses, settle_s=settle_s),
            decode_policy=policy,
            local_prefill=local_prefill or LocalPrefillConfig(),
            servicer=ServicerConfig(**servicer),
            security=security,
            leg_signer=leg_signer,
        )
    )
    await server.start()
    channel = client.aio_channel(server.address) if client else grpc.aio.insecure_channel(server.address)
    try:
        yield server, pb_grpc.SchedulerStub(channel), channel
    finally:
        await channel.close()
        await server.stop(1.0)


def info(
    engine_id: str,
    role: int = pb.ROLE_DECODE,
    incarnation: str = "inc1",
    blocks: int = 1000,
    tp: int = 1,
    http: str = "",
    first_token_handoff: bool = False,
    vocab_size: int = 0,
) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        vocab_size=vocab_size,
        first_token_handoff=first_token_handoff,
        engine_id=engine_id,
        role=role,
        incarnation=incarnation,
        tp_size=tp,
        agent_endpoints=[f"127.0.0.1:{7000 + r}" for r in range(tp)],
        total_kv_blocks=blocks,
        tokens_per_block=16,
        http_endpoint=http or f"http://127.0.0.1:1/{engine_id}",
    )


@dataclass
class FakeInstance:
    """Registers and keeps a load stream open, reporting ``load`` every ``period_s``."""

    stub: pb_grpc.SchedulerStub
    info: pb.InstanceInfo
    period_s: float = 0.02
    free_blocks: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    reporting: asyncio.Event = field(default_factory=asyncio.Event)
    acks: int = 0
    leg_failures: list[pb.LegFailure] = field(default_factory=list)  # pushed on the load stream
    first_tokens: list[pb.FirstToken] = field(default_factory=list)  # relayed to it on the load stream
    got_first_token: asyncio.Event = field(default_factory=asyncio.Event)
    outgoing_first_tokens: list[pb.FirstToken] = field(default_factory=list)  # sent with the next report
    outgoing_prefills_done: list[pb.PrefillDone] = field(default_factory=list)  # sent with the next report
    _call: Any = None
    _task: asyncio.Task[None] | None = None
    _closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> FakeInstance:
        await self.stub.Register(pb.RegisterRequest(instance=self.info), timeout=WAIT_S)
        self.reporting.set()
        self._call = self.stub.ReportLoad(self._reports())
        self._task = asyncio.create_task(self._read_acks())
        return self

    def report(self) -> pb.LoadReport:
        free = self.info.total_kv_blocks if self.free_blocks is None else self.free_blocks
        report = pb.LoadReport(
            engine_id=self.info.engine_id, incarnation=self.info.incarnation, free_blocks=free, **self.extra
        )
        report.first_tokens.extend(self.outgoing_first_tokens)
        self.outgoing_first_tokens.clear()
        report.prefills_done.extend(self.outgoing_prefills_done)
        self.outgoing_prefills_done.clear()
        return report

    async def _reports(self) -> AsyncIterator[pb.LoadReport]:
        while True:
            await self.reporting.wait()
            if self._closed.is_set():
                # Goodbye: a draining report, then the half-close.
                self.extra["draining"] = True
                yield self.report()
                return
            yield self.report()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.period_s)

    async def _read_acks(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for ack in self._call:
                self.acks += 1
                self.leg_failures.extend(ack.leg_failures)
                if ack.first_tokens:
                    self.first_tokens.extend(ack.first_tokens)
                    self.got_first_token.set()

    async def close(self) -> None:
        """Says goodbye: a draining report, then a half-close (deregistration)."""
        self._closed.set()
        self.reporting.set()
        if self._task:
            await asyncio.wait_for(self._task, WAIT_S)

    def cancel(self) -> None:
        """Breaks the stream (as a crash would)."""
        self._call.cancel()


async def handoff_engines(stub: Any, prefills: tuple[str, ...] = ("p0",)) -> list[FakeInstance]:
    """A decode ``d0`` that takes the first-token hand-off and the prefills, each with its load
    stream acknowledged."""
    insts = [await FakeInstance(stub, info("d0", first_token_handoff=True)).start()]
    for p in prefills:
        insts.append(await FakeInstance(stub, info(p, pb.ROLE_PREFILL)).start())
    await wait_for(lambda: all(i.acks for i in insts))
    return insts


async def close_instances(insts: list[FakeInstance]) -> None:
    for i in insts:
        await i.close()


async def wait_for(pred: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Polls an in-process condition (state the test cannot get an event for) within a bound."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def status_code(call: Any) -> grpc.StatusCode:
    """The status an awaited unary call ended with (OK when it returned)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def next_event(stream: Any, timeout: float = WAIT_S) -> pb.InstanceEvent:
    return await asyncio.wait_for(stream.read(), timeout)

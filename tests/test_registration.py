"""An engine's registration with the scheduler over real gRPC: the load stream, first tokens sent
in their own call (``ReportFirstTokens``), and first tokens delivered at least once on the load
stream across its loss."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from scheduler_support import WAIT_S, FakeInstance, info, run, scheduler, wait_for

from kvpush.connector import registration
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.registration import Registration
from kvpush.services.common import limits
from kvpush.services.scheduler.local_prefill import LocalPrefillConfig
from kvpush.services.scheduler.servicer import SchedulerServicer
from kvpush.v1 import kvpush_pb2 as pb


def _config(address: str, engine_id: str) -> ConnectorConfig:
    extra = {"scheduler_address": address, "load_report_ms": 20, "insecure": True}
    return ConnectorConfig.from_vllm(
        SimpleNamespace(kv_role="kv_producer", engine_id=engine_id, kv_connector_extra_config=extra)
    )


class _Loads:
    """A load callback the test can hold: while held, no load report leaves the engine."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()

    def __call__(self) -> pb.LoadReport:
        self.open.wait()
        return pb.LoadReport(free_blocks=10)


@contextlib.asynccontextmanager
async def _prefill_and_decode(
    server: Any, stub: Any, **kw: Any
) -> AsyncIterator[tuple[Registration, FakeInstance, _Loads]]:
    """Decode ``d0`` on its load stream (acked once, so the scheduler relays to it) and prefill
    ``p0``'s registration, registered; on the way out a held load is let go (the registration
    thread may wait in it), then both stop."""
    decode = await FakeInstance(stub, info("d0")).start()
    await wait_for(lambda: decode.acks > 0)  # its first report is in: tokens can be relayed to it
    loads = _Loads()
    reg = Registration(_config(server.address, "p0"), info("p0", pb.ROLE_PREFILL), loads, **kw).start()
    try:
        assert await asyncio.to_thread(reg.registered.wait, WAIT_S)
        yield reg, decode, loads
    finally:
        loads.open.set()
        await asyncio.to_thread(reg.stop)
        await decode.close()


def test_a_first_token_in_a_report_the_scheduler_refused_goes_out_again_on_the_next_stream() -> None:
    """Prefill is starved of CPU past its lease (as in the soak, next to a restarting engine): the
    scheduler declares it dead, and refuses the report that carries the token it sampled meanwhile.
    The token must still reach decode once prefill registers again; lost, decode's request would
    fail after first_token_wait_s although its KV had landed."""

    async def body() -> None:
        async with (
            scheduler(interval_s=0.1) as (server, stub, _),
            _prefill_and_decode(server, stub) as (
                reg,
                decode,
                loads,
            ),
        ):
            await wait_for(lambda: "p0" in server.registry.instances)
            loads.open.clear()  # starved: the next report waits in load()
            await wait_for(lambda: "p0" not in server.registry.instances)  # its lease ran out
            reg.first_token(pb.FirstToken(transfer_id="t1", decode_engine_id="d0", token_id=42))
            loads.open.set()  # that report, with the token, reaches a scheduler that dropped p0
            await wait_for(lambda: bool(decode.first_tokens))
            assert [(t.transfer_id, t.token_id, t.prefill_engine_id) for t in decode.first_tokens] == [("t1", 42, "p0")]
            assert "p0" in server.registry.instances  # registered again

    run(body())


def test_acked_first_tokens_are_sent_once() -> None:
    async def body() -> None:
        async with (
            scheduler(interval_s=0.1) as (server, stub, _),
            _prefill_and_decode(server, stub) as (
                reg,
                decode,
                _,
            ),
        ):
            for i in range(3):
                reg.first_token(pb.FirstToken(transfer_id=f"t{i}", decode_engine_id="d0", token_id=i))
            await wait_for(lambda: len(decode.first_tokens) == 3)
            seen = decode.acks
            await wait_for(lambda: decode.acks >= seen + 10)  # many reports later
            assert sorted(t.transfer_id for t in decode.first_tokens) == ["t0", "t1", "t2"]

    run(body())


def test_a_first_token_reaches_decode_while_no_load_report_can_leave() -> None:
    """The prefill's load stream is stuck (its report waits in ``load``): the token still reaches
    decode, so it went in its own call; the push held for it is released by then."""

    async def body() -> None:
        sent: list[str] = []
        async with (
            scheduler(interval_s=1.0) as (server, stub, _),
            _prefill_and_decode(server, stub, on_tokens_sent=sent.extend) as (reg, decode, loads),
        ):
            await wait_for(lambda: "p0" in server.registry.instances)
            loads.open.clear()
            reg.first_token(pb.FirstToken(transfer_id="t1", decode_engine_id="d0", token_id=42))
            await asyncio.wait_for(decode.got_first_token.wait(), WAIT_S)
            assert [(t.transfer_id, t.token_id, t.prefill_engine_id) for t in decode.first_tokens] == [("t1", 42, "p0")]
            assert sent == ["t1"]
            assert not reg._first_tokens  # nothing queued for the load stream

    run(body())


def test_a_scheduler_without_the_call_gets_the_token_on_the_load_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older scheduler answers UNIMPLEMENTED: the token goes out on the next load report, and
    later tokens take that path at once."""

    async def unimplemented(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")

    monkeypatch.setattr(SchedulerServicer, "ReportFirstTokens", unimplemented)

    async def body() -> None:
        async with (
            scheduler(interval_s=0.1) as (server, stub, _),
            _prefill_and_decode(server, stub) as (
                reg,
                decode,
                _,
            ),
        ):
            reg.first_token(pb.FirstToken(transfer_id="t1", decode_engine_id="d0", token_id=1))
            await wait_for(lambda: len(decode.first_tokens) == 1)
            assert not reg._direct_ok
            reg.first_token(pb.FirstToken(transfer_id="t2", decode_engine_id="d0", token_id=2))
            await wait_for(lambda: len(decode.first_tokens) == 2)
            assert [(t.transfer_id, t.token_id) for t in decode.first_tokens] == [("t1", 1), ("t2", 2)]

    run(body())


def test_finished_prefills_reach_the_scheduler_queue_estimate() -> None:
    """A prefill finished without the hand-off goes on the next load report: the scheduler's
    estimate of that engine's queue retires it and learns the engine's speed from it."""

    async def body() -> None:
        async with (
            scheduler(interval_s=0.1, local_prefill=LocalPrefillConfig(wait_ms=150)) as (server, stub, _),
            _prefill_and_decode(server, stub) as (reg, _decode, _loads),
        ):
            await wait_for(lambda: "p0" in server.registry.instances)
            req = pb.AssignRequest(prompt_tokens=256, max_tokens=4, allow_prefill_on_decode=True)
            a = await stub.Assign(req, timeout=WAIT_S)
            backlog = server.registry.instances["p0"].backlog
            assert a.prefill.engine_id == "p0" and backlog is not None and len(backlog) == 1
            reg.prefill_done(a.transfer_id)
            await wait_for(lambda: backlog.samples == 1)
            assert len(backlog) == 0 and backlog.s_per_token is not None and backlog.s_per_token > 0

    run(body())


def test_finished_prefills_carry_their_age_and_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each finished prefill leaves with its age at the report (a duration: the scheduler's clock is
    another host's), once; beyond one report's bound the oldest are forgotten."""
    now = [100.0]
    monkeypatch.setattr(registration.time, "monotonic", lambda: now[0])
    reg = Registration(_config("127.0.0.1:1", "p0"), info("p0", pb.ROLE_PREFILL), _Loads())
    reg.prefill_done("t1")
    now[0] += 0.25
    reg.prefill_done("t2")
    now[0] += 0.5
    assert [(d.transfer_id, d.age_us) for d in reg._take_prefills_done()] == [("t1", 750_000), ("t2", 500_000)]
    assert reg._take_prefills_done() == []
    for i in range(limits.MAX_EXPECTATIONS_PER_CALL + 2):
        reg.prefill_done(f"u{i}")
    taken = reg._take_prefills_done()
    assert len(taken) == limits.MAX_EXPECTATIONS_PER_CALL and taken[0].transfer_id == "u2"

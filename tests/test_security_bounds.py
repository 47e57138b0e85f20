"""Every bound of services/common/limits.py, hit over real gRPC: the real PrefillAgent, DecodeRank
and Scheduler servers answer INVALID_ARGUMENT or RESOURCE_EXHAUSTED, keep nothing, and keep serving."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scheduler_support import WAIT_S, FakeInstance, info, run, scheduler, wait_for
from scheduler_support import status_code as _code

from kvpush.services.common import limits
from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig
from kvpush.services.prefill_agent.agent import PrefillAgent, PrefillAgentConfig
from kvpush.services.scheduler.generate import Chunk, OpenAIClient
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.security_support import (
    NUM_BLOCKS,
    FakeEngine,
    RawStream,
    decode_layout,
    hello,
    regions,
    reservation,
    serving,
)
from tests.transfer_nodes import shape

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillAgent]:
    cfg = PrefillAgentConfig(
        engine_id="bounds-prefill",
        rank=0,
        tp_size=1,
        shape=shape(),
        max_open_transfers_per_decode=3,
        max_entries_per_decode=50,
        outbox_depth=8,
    )
    agent = PrefillAgent(cfg, FakeEngine(), regions()).start()  # type: ignore[arg-type]
    yield agent
    agent.stop()


def _on_writer(agent: PrefillAgent, fn: Any) -> Any:
    return agent.writer.call(fn).result(5)


def _quiet(agent: PrefillAgent) -> None:
    """Every stream gone and nothing open in the table (the writer may lag the stream's end)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _on_writer(agent, lambda: (len(agent.writer._sessions), agent.writer.table.active_count())) == (0, 0):
            return
        time.sleep(0.02)  # a bounded poll of the writer thread's state
    raise AssertionError("the prefill agent kept state")


def _hello_status(agent: PrefillAgent, h: pb.Hello) -> tuple[grpc.StatusCode, float]:
    t0 = time.monotonic()
    code = RawStream(agent.endpoint, pb.DecodeMessage(hello=h)).status()
    return code, time.monotonic() - t0


# ----- the reservations stream ----------------------------------------------------------------


def test_hello_bounds(prefill: PrefillAgent) -> None:
    huge_tp = hello()
    huge_tp.decode.tp_size = 2**32 - 1  # once sized a list on the event loop
    above_max = hello()
    above_max.decode.tp_size = limits.MAX_TP + 1
    missing_ranks = hello()
    missing_ranks.decode.tp_size = 2
    many_regions = hello()
    many_regions.decode_ranks[0].regions.extend([pb.LayerRegion()] * (limits.MAX_REGIONS_PER_RANK + 1))
    long_id = hello(engine_id="e" * (limits.MAX_ID_CHARS + 1))
    long_endpoint = hello()
    long_endpoint.decode_ranks[0].completion_endpoint = "h" * (limits.MAX_ENDPOINT_CHARS + 1)
    for h in (huge_tp, above_max, missing_ranks, many_regions, long_id, long_endpoint):
        code, took = _hello_status(prefill, h)
        assert code is INVALID and took < 5.0
    # gRPC itself refuses a message above the size limit.
    too_big = hello()
    too_big.decode_ranks[0].nixl_agent_metadata = b"x" * (limits.MAX_MESSAGE_BYTES + 1)
    assert _hello_status(prefill, too_big)[0] is EXHAUSTED
    assert serving(prefill.endpoint)
    ok = RawStream(prefill.endpoint, pb.DecodeMessage(hello=hello()))
    assert ok.recv_kind("hello_ack").prefill.engine_id == "bounds-prefill"
    ok.close()
    _quiet(prefill)


def test_reservation_bounds_are_rejected_and_the_stream_keeps_serving(prefill: PrefillAgent) -> None:
    s = RawStream(prefill.endpoint, pb.DecodeMessage(hello=hello("bounds-res")))
    s.recv_kind("hello_ack")
    groups = pb.Reservation(transfer_id="groups", epoch=1, num_tokens=32)
    groups.block_ids.extend([pb.BlockIds(ids=[1])] * (limits.MAX_KV_GROUPS + 1))
    short_key = reservation("short-key")
    short_key.completion_key = b"k" * 8  # a guessable completion-notice key
    cases = [
        short_key,
        reservation("lease", lease_ms=limits.MAX_LEASE_MS + 1),
        groups,
        reservation("ids", ids=[0] * (limits.MAX_BLOCK_IDS_PER_GROUP + 1)),
        reservation("region", ids=[0] * (NUM_BLOCKS + 1)),  # more ids than the decode region holds
        reservation("skip", num_skip_blocks=limits.MAX_BLOCK_IDS_PER_GROUP + 1),
        reservation("t" * (limits.MAX_ID_CHARS + 1)),
    ]
    for r in cases:
        s.send(reservation=r)
        rej = s.recv_kind("rejected")
        assert rej.code == INVALID.value[0], (r.transfer_id[:20], rej.message)
        assert len(rej.transfer_id) <= limits.MAX_ID_CHARS
    assert _on_writer(prefill, lambda: prefill.writer.table.active_count()) == 0  # nothing was kept
    s.send(reservation=reservation("fine"))
    s.send(cancel=pb.Cancel(transfer_id="fine", epoch=1))
    assert s.recv_kind("cancel_ack").transfer_id == "fine"
    s.close()
    _quiet(prefill)


def test_open_transfers_per_decode_engine_are_bounded(prefill: PrefillAgent) -> None:
    greedy = RawStream(prefill.endpoint, pb.DecodeMessage(hello=hello("greedy")))
    modest = RawStream(prefill.endpoint, pb.DecodeMessage(hello=hello("modest")))
    greedy.recv_kind("hello_ack")
    modest.recv_kind("hello_ack")
    for i in range(4):
        greedy.send(reservation=reservation(f"g{i}"))
    rej = greedy.recv_kind("rejected")
    assert (rej.transfer_id, rej.code) == ("g3", EXHAUSTED.value[0])
    modest.send(reservation=reservation("m0"))  # another engine is not affected
    modest.send(cancel=pb.Cancel(transfer_id="m0", epoch=1))
    assert modest.recv_kind("cancel_ack").transfer_id == "m0"
    assert _on_writer(prefill, lambda: prefill.writer.table.open_count("greedy")) == 3
    greedy.close()
    modest.close()
    _quiet(prefill)


def test_a_stream_whose_outbox_overflows_is_closed_with_resource_exhausted(prefill: PrefillAgent) -> None:
    """More messages queued towards a stream than its outbox holds (a peer that does not read, and
    a burst of acks for the cancels it sent) end the stream with RESOURCE_EXHAUSTED."""
    s = RawStream(prefill.endpoint, pb.DecodeMessage(hello=hello("slow-reader")), read=False)

    def connected() -> bool:
        return _on_writer(prefill, lambda: any(k.startswith("slow-reader/") for k in prefill.writer._sessions))

    deadline = time.monotonic() + 10
    while not connected() and time.monotonic() < deadline:
        time.sleep(0.01)  # a bounded poll of the writer thread's state
    # Hold the writer while the cancels reach its inbox, so their acks come out in one burst.
    release = threading.Event()
    held = prefill.writer.call(lambda: release.wait(10))
    try:
        for i in range(200):
            s.send(cancel=pb.Cancel(transfer_id=f"c{i}", epoch=1))
        deadline = time.monotonic() + 10
        while prefill.writer._inbox.qsize() < 200 and time.monotonic() < deadline:
            time.sleep(0.01)  # a bounded poll of the writer's inbox
    finally:
        release.set()
    held.result(10)
    deadline = time.monotonic() + 10
    while connected() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not connected()  # the server ended it, not the client (which never half-closed)
    assert s.status(timeout=10) is EXHAUSTED
    assert serving(prefill.endpoint)
    # Tombstones of unknown cancels stop at the per-engine cap.
    assert _on_writer(prefill, lambda: prefill.writer.table.entry_count("slow-reader")) <= 50
    s.close()
    _quiet(prefill)


# ----- the decode rank ------------------------------------------------------------------------


@pytest.fixture
def rank() -> Iterator[DecodeRank]:
    cfg = DecodeRankConfig(
        engine_id="bounds-decode", rank=0, tp_size=1, shape=shape(), expect_wait_s=0.05, max_pending_barriers=2
    )
    r = DecodeRank(cfg, FakeEngine(), regions()).start()  # type: ignore[arg-type]
    yield r
    r.stop()


def _exp(tid: str, request_id: str = "", ranks: list[int] | None = None) -> pb.Expectation:
    return pb.Expectation(
        transfer_id=tid,
        epoch=1,
        request_id=request_id or f"r-{tid}",
        prefill_ranks=[0] if ranks is None else ranks,
        prefill_engine_id="P",
    )


def test_decode_rank_bounds(rank: DecodeRank) -> None:
    stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(rank.endpoint))
    with pytest.raises(grpc.RpcError) as err:
        stub.Expect(pb.ExpectRequest(expectations=[_exp("x")] * (limits.MAX_EXPECTATIONS_PER_CALL + 1)), timeout=5)
    assert err.value.code() is INVALID
    resp = stub.Expect(
        pb.ExpectRequest(
            expectations=[
                _exp("t" * (limits.MAX_ID_CHARS + 1)),
                _exp("wide", ranks=list(range(limits.MAX_TP + 1))),
                _exp("repeat", ranks=[0, 0]),
                pb.Expectation(
                    transfer_id="short-key", epoch=1, request_id="r", prefill_ranks=[0], completion_key=b"k" * 8
                ),
                _exp("a"),
                _exp("b"),
                _exp("c"),  # a third pending transfer: past the bound
            ]
        ),
        timeout=5,
    )
    assert [r.code for r in resp.results] == [INVALID.value[0]] * 4 + [0, 0, EXHAUSTED.value[0]]
    assert rank.table.pending_count() == 2
    # The refused request is still released (as FAILED) when the agent settles it.
    stub.Settle(pb.Settlement(transfer_id="c", epoch=1, status=pb.TRANSFER_STATUS_FAILED), timeout=5)
    assert [(r.request_id, r.outcome.value) for r in rank.take_released(1.0)] == [("r-c", "failed")]
    for bad in (
        lambda: stub.Complete(
            pb.Completion(transfer_id="t" * (limits.MAX_ID_CHARS + 1), epoch=1, status=pb.TRANSFER_STATUS_OK),
            timeout=5,
        ),
        lambda: stub.Settle(
            pb.Settlement(transfer_id="t" * (limits.MAX_ID_CHARS + 1), epoch=1, status=pb.TRANSFER_STATUS_FAILED),
            timeout=5,
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            bad()
        assert err.value.code() is INVALID
    for tid in ("a", "b"):
        stub.Settle(pb.Settlement(transfer_id=tid, epoch=1, status=pb.TRANSFER_STATUS_CANCELLED), timeout=5)
    assert rank.table.pending_count() == 0
    assert serving(rank.endpoint)


# ----- the scheduler --------------------------------------------------------------------------


class _HangingClient(OpenAIClient):
    """Both legs wait until cancelled: a Generate stays in flight."""

    async def prefill(self, endpoint: str, p: Any, params: Any) -> None:
        await asyncio.Event().wait()

    async def decode(self, endpoint: str, p: Any, params: Any, max_tokens: int | None = None) -> AsyncIterator[Chunk]:
        await asyncio.Event().wait()
        yield Chunk([], "")


async def _stream_code(call: Any) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_scheduler_bounds() -> None:
    async def body() -> None:
        async with scheduler(interval_s=5.0, max_watch_subscribers=2, max_generate=1, max_instances=3) as (
            server,
            stub,
            channel,
        ):
            server.servicer.client = _HangingClient()
            big_tp = info("big")
            big_tp.tp_size = 2**32 - 1
            long_http = info("web", http="http://" + "h" * limits.MAX_ENDPOINT_CHARS)
            for bad in (big_tp, info("e" * (limits.MAX_ID_CHARS + 1)), long_http, info("mismatch", tp=2)):
                if bad.engine_id == "mismatch":
                    del bad.agent_endpoints[1]
                assert await _code(stub.Register(pb.RegisterRequest(instance=bad), timeout=WAIT_S)) is INVALID
            for i in (info("d0"), info("p0", pb.ROLE_PREFILL), info("d1")):
                await stub.Register(pb.RegisterRequest(instance=i), timeout=WAIT_S)
            assert await _code(stub.Register(pb.RegisterRequest(instance=info("d2")), timeout=WAIT_S)) is EXHAUSTED
            await stub.Register(pb.RegisterRequest(instance=info("d1")), timeout=WAIT_S)  # a refresh still works

            for req in (
                pb.AssignRequest(prompt_tokens=8, max_tokens=limits.MAX_MAX_TOKENS + 1),
                pb.AssignRequest(prompt_tokens=8, transfer_id="t" * (limits.MAX_ID_CHARS + 1)),
                pb.AssignRequest(prompt_tokens=8, prefix_hint="h" * (limits.MAX_PREFIX_HINT_CHARS + 1)),
            ):
                assert await _code(stub.Assign(req, timeout=WAIT_S)) is INVALID
            gen = pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=limits.MAX_MAX_TOKENS + 1)
            assert await _stream_code(stub.Generate(gen, timeout=WAIT_S)) is INVALID
            gen = pb.GenerateRequest(prompt_token_ids=[1], max_tokens=1, request_id="r" * (limits.MAX_ID_CHARS + 1))
            assert await _stream_code(stub.Generate(gen, timeout=WAIT_S)) is INVALID
            huge = pb.GenerateRequest(prompt_token_ids=[2**31] * (limits.MAX_MESSAGE_BYTES // 5 + 1), max_tokens=1)
            assert await _stream_code(stub.Generate(huge, timeout=WAIT_S)) is EXHAUSTED

            # One Generate in flight is the bound: the next is refused, the first is unaffected.
            first = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2), timeout=30)
            await wait_for(lambda: server.servicer._generating == 1)
            second = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2), timeout=WAIT_S)
            assert await _stream_code(second) is EXHAUSTED
            first.cancel()
            await wait_for(lambda: server.servicer._generating == 0 and not server.registry.open)

            watches = [stub.Watch(pb.WatchRequest()) for _ in range(2)]
            await wait_for(lambda: len(server.servicer._subscribers) == 2)
            assert await _stream_code(stub.Watch(pb.WatchRequest(), timeout=WAIT_S)) is EXHAUSTED
            for w in watches:
                w.cancel()
            await wait_for(lambda: not server.servicer._subscribers)

            long_report = pb.LoadReport(engine_id="d0", incarnation="i" * (limits.MAX_ID_CHARS + 1))
            assert await _stream_code(stub.ReportLoad(iter([long_report]), timeout=WAIT_S)) is INVALID

            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            listing = await stub.ListInstances(pb.ListInstancesRequest(), timeout=WAIT_S)
            assert sorted(s.instance.engine_id for s in listing.instances) == ["d0", "d1", "p0"]
            d = await FakeInstance(stub, info("d0")).start()  # a live instance keeps reporting
            await wait_for(lambda: d.acks >= 1)
            with contextlib.suppress(Exception):
                await d.close()

    run(body())


def test_decode_layout_of_the_helpers_is_accepted(prefill: PrefillAgent) -> None:
    """The helpers' Hello is a valid one, so the refusals above are the bounds' doing."""
    h = hello("valid")
    h.decode_ranks[0].CopyFrom(decode_layout())
    s = RawStream(prefill.endpoint, pb.DecodeMessage(hello=h))
    assert s.recv_kind("hello_ack")
    s.close()
    _quiet(prefill)

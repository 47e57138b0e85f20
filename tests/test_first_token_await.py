"""``AwaitFirstToken`` over real gRPC: a frontend that used ``Assign`` with the first-token hand-off
gets prefill's token from the scheduler the moment prefill reports it (or at once when it already
has), from a rerouted prefill too, and never a token from a prefill that is not the transfer's;
every other call gets its status and waits for nothing (docs/first_token.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from scheduler_support import WAIT_S, FakeInstance, close_instances, handoff_engines, info, run, scheduler, wait_for
from scheduler_support import status_code as _code

from kvpush.services.common import limits
from kvpush.services.common.security import Security, TlsFiles
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc


async def _assign(stub: Any, handoff: bool = True) -> pb.Assignment:
    req = pb.AssignRequest(prompt_tokens=10, max_tokens=4, first_token_from_prefill=handoff)
    a: pb.Assignment = await stub.Assign(req, timeout=WAIT_S)
    assert a.first_token_from_prefill is handoff
    return a


async def _report(stub: Any, prefill: str, a: pb.Assignment, token: int, stopped: bool = False) -> None:
    ft = pb.FirstToken(transfer_id=a.transfer_id, decode_engine_id="d0", token_id=token, stopped=stopped)
    await stub.ReportFirstTokens(
        pb.FirstTokenReport(engine_id=prefill, incarnation="inc1", first_tokens=[ft]), timeout=WAIT_S
    )


def _await(stub: Any, a: pb.Assignment, epoch: int | None = None) -> Any:
    req = pb.AwaitFirstTokenRequest(transfer_id=a.transfer_id, epoch=a.epoch if epoch is None else epoch)
    return stub.AwaitFirstToken(req, timeout=WAIT_S)


async def _waiting(server: Any, stub: Any, a: pb.Assignment) -> asyncio.Future[Any]:
    """An AwaitFirstToken call for ``a``, once the scheduler holds it waiting."""
    call = asyncio.ensure_future(_await(stub, a))
    await wait_for(lambda: server.servicer._awaiting_first_token == 1)
    return call


def _counted(server: Any, result: str) -> float:
    value = server.metrics.registry.get_sample_value("kvpush_scheduler_first_token_awaits_total", {"result": result})
    return value or 0.0


def test_the_frontend_gets_prefills_token_when_it_is_reported_and_at_once_after() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            insts = await handoff_engines(stub)
            a = await _assign(stub)
            call = await _waiting(server, stub, a)
            assert not call.done()
            await _report(stub, "p0", a, 11)
            got = await asyncio.wait_for(call, WAIT_S)
            assert (got.token_id, got.stopped, got.prefill_engine_id) == (11, False, "p0")
            again = await _await(stub, a)  # kept on the assignment: answered at once
            assert (again.token_id, again.prefill_engine_id) == (11, "p0")
            await asyncio.wait_for(insts[0].got_first_token.wait(), WAIT_S)  # decode got it too
            assert [t.token_id for t in insts[0].first_tokens] == [11]
            # A second report (a relay's copy, another token) changes nothing: the first one won.
            await _report(stub, "p0", a, 12, stopped=True)
            assert (await _await(stub, a)).token_id == 11
            assert _counted(server, "answered") == 3
            assert not server.servicer._first_tokens.waiters and server.servicer._awaiting_first_token == 0
            await close_instances(insts)

    run(body())


def test_a_token_from_a_prefill_that_is_not_the_transfers_is_never_answered() -> None:
    """Another registered prefill engine reports a token for the transfer (a buggy or hostile
    one): decode's stream relays it named as that engine (decode refuses it), but the frontend's
    wait goes on until the transfer's own prefill reports."""

    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            insts = await handoff_engines(stub, ("p0", "p1"))
            a = await _assign(stub)
            other = "p1" if a.prefill.engine_id == "p0" else "p0"
            call = await _waiting(server, stub, a)
            await _report(stub, other, a, 99)
            assert server.registry.open[a.transfer_id].sampled is None
            assert not call.done()
            await _report(stub, a.prefill.engine_id, a, 11)
            got = await asyncio.wait_for(call, WAIT_S)
            assert (got.token_id, got.prefill_engine_id) == (11, a.prefill.engine_id)
            await close_instances(insts)

    run(body())


def test_a_rerouted_transfers_token_comes_from_its_new_prefill() -> None:
    """The prefill leg's engine failed before it reported; decode rerouted the transfer: the
    frontend, which never saw a prefill answer, gets the new prefill's token under the epoch it
    was assigned."""

    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            insts = await handoff_engines(stub, ("p0", "p1"))
            a = await _assign(stub)
            first = a.prefill.engine_id
            call = await _waiting(server, stub, a)
            moved = await stub.Reroute(
                pb.RerouteRequest(
                    transfer_id=a.transfer_id,
                    decode_engine_id="d0",
                    failed_prefill_engine_id=first,
                    reason="test: prefill died",
                    prompt_token_ids=[1, 2, 3],
                ),
                timeout=WAIT_S,
            )
            new = server.registry.open[a.transfer_id].prefill.engine_id
            assert new != first and moved.epoch != a.epoch
            await _report(stub, new, a, 12)
            got = await asyncio.wait_for(call, WAIT_S)
            assert (got.token_id, got.prefill_engine_id) == (12, new)
            assert (await _await(stub, a, epoch=moved.epoch)).token_id == 12
            await close_instances(insts)

    run(body())


def test_calls_that_cannot_be_answered_get_their_status_and_wait_for_nothing() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0, max_first_token_awaits=1) as (server, stub, _):
            insts = await handoff_engines(stub)
            a = await _assign(stub)
            plain = await _assign(stub, handoff=False)

            def req(tid: str, epoch: int) -> Any:
                return stub.AwaitFirstToken(pb.AwaitFirstTokenRequest(transfer_id=tid, epoch=epoch), timeout=WAIT_S)

            bad = grpc.StatusCode.INVALID_ARGUMENT
            assert await _code(req("", a.epoch)) is bad
            assert await _code(req("t" * (limits.MAX_ID_CHARS + 1), a.epoch)) is bad
            assert await _code(req("nobody", 1)) is grpc.StatusCode.NOT_FOUND
            precondition = grpc.StatusCode.FAILED_PRECONDITION
            assert await _code(req(a.transfer_id, a.epoch + 1)) is precondition  # not its epoch
            assert await _code(_await(stub, plain)) is precondition  # no hand-off granted
            # The bound on waiting calls: the second waiter is refused, not queued.
            call = await _waiting(server, stub, a)
            assert await _code(_await(stub, a)) is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _counted(server, "refused") == 6
            # The assignment closes while the call waits: ABORTED with the reason, nothing left behind.
            await stub.Release(
                pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_FAILED), timeout=WAIT_S
            )
            assert await _code(call) is grpc.StatusCode.ABORTED
            assert _counted(server, "closed") == 1
            assert not server.servicer._first_tokens.waiters and server.servicer._awaiting_first_token == 0
            # A caller that gives up leaves nothing behind either.
            b = await _assign(stub)
            short = stub.AwaitFirstToken(
                pb.AwaitFirstTokenRequest(transfer_id=b.transfer_id, epoch=b.epoch), timeout=0.2
            )
            assert await _code(short) is grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for(lambda: server.servicer._awaiting_first_token == 0)
            assert not server.servicer._first_tokens.waiters
            # The decode engine's death closes its assignment: the waiting call ends with it.
            call = await _waiting(server, stub, b)
            insts[0].cancel()
            assert await _code(call) is grpc.StatusCode.ABORTED
            await close_instances(insts[1:])

    run(body())


def test_a_waiting_call_ends_when_the_scheduler_shuts_down() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            insts = await handoff_engines(stub)
            a = await _assign(stub)
            call = await _waiting(server, stub, a)
            stopping = asyncio.ensure_future(server.stop(WAIT_S))
            assert await _code(call) is grpc.StatusCode.UNAVAILABLE
            await asyncio.wait_for(stopping, 2 * WAIT_S)
            assert server.servicer._awaiting_first_token == 0 and not server.servicer._first_tokens.waiters
            for i in insts:
                i.cancel()

    run(body())


def test_only_a_frontend_may_await_a_first_token(dev_certs: Path) -> None:
    """mTLS: engines (which see transfer ids) may not read a transfer's first token."""

    def sec(name: str) -> Security:
        return Security.mtls(TlsFiles.in_dir(dev_certs, name))

    async def body() -> None:
        async with scheduler(interval_s=1.0, security=sec("scheduler"), client=sec("frontend")) as (
            server,
            frontend,
            _,
        ):
            channels = {n: sec(n).aio_channel(server.address) for n in ("decode-0", "prefill-0")}
            try:
                stubs = {n: pb_grpc.SchedulerStub(c) for n, c in channels.items()}
                decode = await FakeInstance(stubs["decode-0"], info("decode-0", first_token_handoff=True)).start()
                prefill = await FakeInstance(stubs["prefill-0"], info("prefill-0", pb.ROLE_PREFILL)).start()
                await wait_for(lambda: decode.acks > 0 and prefill.acks > 0)
                a = await _assign(frontend)
                for engine in stubs.values():
                    assert await _code(_await(engine, a)) is grpc.StatusCode.PERMISSION_DENIED
                call = asyncio.ensure_future(_await(frontend, a))
                ft = pb.FirstToken(transfer_id=a.transfer_id, decode_engine_id="decode-0", token_id=7)
                report = pb.FirstTokenReport(engine_id="prefill-0", incarnation="inc1", first_tokens=[ft])
                await stubs["prefill-0"].ReportFirstTokens(report, timeout=WAIT_S)
                got = await asyncio.wait_for(call, WAIT_S)
                assert (got.token_id, got.prefill_engine_id) == (7, "prefill-0")
                await prefill.close()
                await decode.close()
            finally:
                for c in channels.values():
                    await c.close()

    run(body())


# ----- the relay's bookkeeping, without gRPC -------------------------------------------------------


def _relay() -> Any:
    from kvpush.services.scheduler.first_tokens import FirstTokenRelay
    from kvpush.services.scheduler.load_stream_push import Outboxes
    from kvpush.services.scheduler.metrics import Metrics
    from kvpush.services.scheduler.model import InstanceSpec, Role
    from kvpush.services.scheduler.registry import Registry

    reg = Registry()
    for engine, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        reg.register(InstanceSpec(engine, role, "i", 1, ("127.0.0.1:1",), 100, 16, "", (), True))
    return FirstTokenRelay(reg, Outboxes(), Metrics(reg))


def _token_report(transfer_id: str, token: int, prefill: str = "p0") -> pb.FirstTokenReport:
    ft = pb.FirstToken(transfer_id=transfer_id, decode_engine_id="d0", token_id=token)
    return pb.FirstTokenReport(engine_id=prefill, incarnation="i", first_tokens=[ft])


def test_a_generate_wait_outlives_its_closed_assignment_and_a_replaced_ones_does_not() -> None:
    """A Generate call's future (its record is held) is neither cancelled by the record's closing
    nor at shutdown: the call still takes a token that comes after (its decode may stream on). A
    frontend's wait on an assignment that a new one of the same transfer id replaced ends when the
    new one gets its token; the new one's own wait gets it."""
    from kvpush.services.scheduler.model import Demand, Outcome

    async def body() -> None:
        relay = _relay()
        reg = relay.registry
        rec = reg.assign(Demand(10, 4), "g1")
        rec.held, rec.first_token = True, True
        held = relay.wait_for(rec)
        reg.release("g1", rec.epoch, Outcome.FAILED, "decode lease ran out")
        relay.closed(rec)
        relay.close_all()
        assert not held.done()
        assert relay.relay(_token_report("g1", 5)) is None
        assert held.result().token_id == 5 and not relay.waiters

        old = reg.assign(Demand(10, 4), "t1")
        old.first_token = True
        stale = relay.wait_for(old)
        new = reg.assign(Demand(10, 4), "t1")  # the same transfer id again: ``old`` is replaced
        new.first_token = True
        fresh = relay.wait_for(new)
        relay.relay(_token_report("t1", 6))
        assert stale.cancelled() and fresh.result().token_id == 6 and new.sampled is not None
        assert old.sampled is None and not relay.waiters
        assert relay.wait_for(new).result().token_id == 6  # kept: answered at once

    asyncio.run(asyncio.wait_for(body(), WAIT_S))

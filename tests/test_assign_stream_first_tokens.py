"""First tokens on ``AssignStream`` over real gRPC: a batch with ``first_tokens`` gets the first
token of each of its hand-off assignments on the same stream, as ``AwaitFirstToken`` would answer
it, with no call per request; never a token from a prefill that is not the transfer's; every wait
ends with its assignment, its stream, or the scheduler, and leaves nothing behind
(docs/first_token.md, docs/scheduler.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from scheduler_support import WAIT_S, close_instances, handoff_engines, run, scheduler, wait_for

from kvpush.services.scheduler.assign_client import AssignError, AssignStreamClient
from kvpush.v1 import kvpush_pb2 as pb

LEASE = {"interval_s": 0.5, "misses": 20}  # no instance dies under these tests


def _handoff(handoff: bool = True) -> pb.AssignRequest:
    return pb.AssignRequest(prompt_tokens=10, max_tokens=4, first_token_from_prefill=handoff)


async def _report(stub: Any, prefill: str, transfer_id: str, token: int) -> None:
    ft = pb.FirstToken(transfer_id=transfer_id, decode_engine_id="d0", token_id=token)
    await stub.ReportFirstTokens(
        pb.FirstTokenReport(engine_id=prefill, incarnation="inc1", first_tokens=[ft]), timeout=WAIT_S
    )


def _counted(server: Any, result: str) -> float:
    value = server.metrics.registry.get_sample_value("kvpush_scheduler_first_token_awaits_total", {"result": result})
    return value or 0.0


def _nothing_left(server: Any) -> bool:
    return not server.servicer._first_tokens.waiters and server.servicer._awaiting_first_token == 0


@pytest.mark.parametrize("compact", [False, True])
def test_a_batch_that_asks_gets_each_first_token_on_its_stream(compact: bool) -> None:
    """Two prefills: a token for the transfer from the one that is not its prefill is never
    delivered (the attack), its own prefill's is, on the stream and to decode."""

    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            insts = await handoff_engines(stub, ("p0", "p1"))
            async with AssignStreamClient(stub, compact=compact, first_tokens=True) as client:
                assign = client.assign_compact if compact else client.assign
                a, plain = await asyncio.gather(assign(_handoff()), assign(_handoff(False)))
                assert a.first_token_from_prefill and not plain.first_token_from_prefill
                prefill = a.prefill_engine_id if compact else a.prefill.engine_id
                assert server.servicer._awaiting_first_token == 1  # only the hand-off assignment waits
                with pytest.raises(ValueError):
                    await client.first_token(plain.transfer_id)
                waiting = asyncio.ensure_future(client.first_token(a.transfer_id))
                other = "p1" if prefill == "p0" else "p0"
                await _report(stub, other, a.transfer_id, 99)
                await _report(stub, prefill, a.transfer_id, 11)
                got = await asyncio.wait_for(waiting, WAIT_S)
                assert (got.token_id, got.stopped, got.prefill_engine_id) == (11, False, prefill)
                await asyncio.wait_for(insts[0].got_first_token.wait(), WAIT_S)
                assert 11 in [t.token_id for t in insts[0].first_tokens]
                assert _counted(server, "answered") == 1 and _nothing_left(server)
                with pytest.raises(ValueError):  # taken once
                    await client.first_token(a.transfer_id)
                for x in (a, plain):
                    client.release(x.transfer_id, x.epoch, pb.OUTCOME_OK)
            await close_instances(insts)

    run(body())


def test_a_stream_that_does_not_ask_waits_for_nothing() -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            insts = await handoff_engines(stub)
            async with AssignStreamClient(stub) as client:
                a = await client.assign(_handoff())
                assert a.first_token_from_prefill and _nothing_left(server)
                with pytest.raises(ValueError):
                    await client.first_token(a.transfer_id)
                await _report(stub, "p0", a.transfer_id, 5)  # kept: a unary AwaitFirstToken answers it
                got = await stub.AwaitFirstToken(
                    pb.AwaitFirstTokenRequest(transfer_id=a.transfer_id, epoch=a.epoch), timeout=WAIT_S
                )
                assert got.token_id == 5
            await close_instances(insts)

    run(body())


def test_streamed_waits_end_with_their_assignment_or_their_stream_and_leave_nothing() -> None:
    async def body() -> None:
        async with scheduler(max_first_token_awaits=1, **LEASE) as (server, stub, _):
            insts = await handoff_engines(stub)
            client = await AssignStreamClient(stub, max_batch=1, first_tokens=True).start()
            a = await client.assign(_handoff())
            over = await client.assign(_handoff())  # past the bound on waits: refused at once
            with pytest.raises(AssignError) as refused:
                await asyncio.wait_for(client.first_token(over.transfer_id), WAIT_S)
            assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _counted(server, "refused") == 1
            # The assignment closes (a Release from elsewhere): ABORTED with the reason.
            waiting = asyncio.ensure_future(client.first_token(a.transfer_id))
            await stub.Release(
                pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_FAILED), timeout=WAIT_S
            )
            with pytest.raises(AssignError) as closed:
                await asyncio.wait_for(waiting, WAIT_S)
            assert closed.value.code is grpc.StatusCode.ABORTED and "closed" in closed.value.message
            assert _counted(server, "closed") == 1 and _nothing_left(server)
            b = await client.assign(_handoff())
            assert server.servicer._awaiting_first_token == 1
            c = await client.assign(_handoff())  # refused (b waits); released below
            client.release(c.transfer_id, c.epoch, pb.OUTCOME_CANCELLED)
            # The stream ends while b waits: its wait ends with it; the token stays on b's
            # assignment for AwaitFirstToken.
            await client.close()
            await wait_for(lambda: _nothing_left(server))
            assert _counted(server, "cancelled") == 1
            await _report(stub, "p0", b.transfer_id, 7)
            got = await stub.AwaitFirstToken(
                pb.AwaitFirstTokenRequest(transfer_id=b.transfer_id, epoch=b.epoch), timeout=WAIT_S
            )
            assert got.token_id == 7
            # The decode engine's death closes its assignments: ABORTED too.
            client = await AssignStreamClient(stub, first_tokens=True).start()
            d = await client.assign(_handoff())
            waiting = asyncio.ensure_future(client.first_token(d.transfer_id))
            insts[0].cancel()
            with pytest.raises(AssignError) as dead:
                await asyncio.wait_for(waiting, 4 * WAIT_S)
            assert dead.value.code is grpc.StatusCode.ABORTED
            assert _nothing_left(server)
            await client.close()
            await close_instances(insts[1:])

    run(body())


def test_the_stream_stays_open_after_the_frontend_half_closes_until_its_tokens_came() -> None:
    """Raw stream: the answer, a half-close, then a message with only the token (no batch id),
    then the end of the stream."""

    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            insts = await handoff_engines(stub)
            call = stub.AssignStream()
            await call.write(pb.AssignStreamRequest(batch_id=3, assigns=[_handoff()], first_tokens=True))
            answer = await asyncio.wait_for(call.read(), WAIT_S)
            assert answer.batch_id == 3 and not answer.tokens_only and not answer.first_tokens
            a = answer.assigns[0].assignment
            await call.done_writing()
            await wait_for(lambda: server.servicer._awaiting_first_token == 1)
            await _report(stub, a.prefill.engine_id, a.transfer_id, 21)
            msg = await asyncio.wait_for(call.read(), WAIT_S)
            assert msg.tokens_only and msg.batch_id == 0 and not msg.assigns and not msg.releases
            [result] = msg.first_tokens
            assert (result.transfer_id, result.epoch, result.code) == (a.transfer_id, a.epoch, 0)
            assert (result.token.token_id, result.token.prefill_engine_id) == (21, a.prefill.engine_id)
            assert await asyncio.wait_for(call.read(), WAIT_S) is grpc.aio.EOF
            assert await call.code() is grpc.StatusCode.OK and _nothing_left(server)
            await close_instances(insts)

    run(body())


def test_a_streamed_wait_ends_when_the_scheduler_shuts_down() -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            insts = await handoff_engines(stub)
            client = await AssignStreamClient(stub, first_tokens=True).start()
            a = await client.assign(_handoff())
            waiting = asyncio.ensure_future(client.first_token(a.transfer_id))
            stopping = asyncio.ensure_future(server.stop(WAIT_S))
            with pytest.raises(AssignError) as stopped:
                await asyncio.wait_for(waiting, 2 * WAIT_S)
            assert stopped.value.code is grpc.StatusCode.UNAVAILABLE
            await asyncio.wait_for(stopping, 2 * WAIT_S)
            assert _nothing_left(server)
            await client.close()
            for i in insts:
                i.cancel()

    run(body())

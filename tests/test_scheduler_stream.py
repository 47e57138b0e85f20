"""Scheduler.AssignStream over real gRPC: batches of Assign and Release with Assign's and Release's
semantics item by item, legs signed once per batch, bounds, queueing, and the batching client."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.json_format import MessageToDict
from scheduler_support import WAIT_S, FakeInstance, info, run, scheduler, wait_for

from kvpush.services.common import limits, transfer_params
from kvpush.services.common.leg_signing import LegSigner, LegVerifier, check_leg
from kvpush.services.scheduler.assign_client import AssignError, AssignStreamClient, status_code
from kvpush.services.scheduler.model import State
from kvpush.v1 import kvpush_pb2 as pb

OK = 0
# Leases that a loaded test machine cannot miss: no instance dies under these tests.
LEASE = {"interval_s": 0.5, "misses": 20}
CODE = grpc.StatusCode


def _code(c: CODE) -> int:
    return int(c.value[0])


async def _one(call: grpc.aio.StreamStreamCall, req: pb.AssignStreamRequest) -> pb.AssignStreamResponse:
    await call.write(req)
    resp = await asyncio.wait_for(call.read(), WAIT_S)
    assert isinstance(resp, pb.AssignStreamResponse)
    assert resp.batch_id == req.batch_id
    assert len(resp.assigns) == len(req.assigns) and len(resp.releases) == len(req.releases)
    return resp


def _legs(a: pb.Assignment) -> tuple[transfer_params.Leg, transfer_params.Leg]:
    prefill = transfer_params.parse(MessageToDict(a.prefill_kv_transfer_params))
    decode = transfer_params.parse(MessageToDict(a.decode_kv_transfer_params))
    assert prefill is not None and decode is not None
    return prefill, decode


def test_batches_assign_release_and_sign_once() -> None:
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60)
    verifier = LegVerifier(signer.public_key())

    async def body() -> None:
        async with scheduler(leg_signer=signer, **LEASE) as (server, stub, _):
            d = await FakeInstance(stub, info("d0", blocks=100)).start()
            d1 = await FakeInstance(stub, info("d1", blocks=100)).start()
            p = await FakeInstance(stub, info("p0", pb.ROLE_PREFILL, tp=2)).start()
            call = stub.AssignStream()
            reqs = [pb.AssignRequest(prompt_tokens=32, max_tokens=16) for _ in range(6)]
            reqs.insert(2, pb.AssignRequest(prompt_tokens=0))  # invalid: answered alone
            reqs.insert(4, pb.AssignRequest(prompt_tokens=16 * 1000))  # larger than any decode
            reqs.insert(5, pb.AssignRequest(prompt_tokens=1, transfer_id="x" * (limits.MAX_ID_CHARS + 1)))
            resp = await _one(call, pb.AssignStreamRequest(batch_id=7, assigns=reqs))
            codes = [r.code for r in resp.assigns]
            assert codes == [OK, OK, _code(CODE.INVALID_ARGUMENT), OK, _code(CODE.RESOURCE_EXHAUSTED)] + [
                _code(CODE.INVALID_ARGUMENT),
                OK,
                OK,
                OK,
            ]
            assert "largest decode instance" in resp.assigns[4].message
            good = [r.assignment for r in resp.assigns if r.code == OK]
            sigs = set()
            for a in good:
                assert server.registry.open[a.transfer_id].epoch == a.epoch
                assert not server.registry.open[a.transfer_id].held  # TTL applies, as for Assign
                prefill, decode = _legs(a)
                check_leg(prefill, a.prefill.engine_id, "prefill", verifier)
                check_leg(decode, a.decode.engine_id, "decode", verifier)
                assert prefill.proof and decode.proof and prefill.sig == decode.sig
                sigs.add(prefill.sig)
            assert len(sigs) == 1  # one signature for the batch
            # Load-aware: 3 blocks each, both decodes used (p2c over two equal instances, 6 draws).
            assert sum(server.registry.instances[n].pending_blocks for n in ("d0", "d1")) == 6 * 3
            # Releases: unknown, stale epoch, missing id, bad outcome, then the real ones.
            first = good[0]
            releases = [
                pb.ReleaseRequest(transfer_id="nope", epoch=1, outcome=pb.OUTCOME_OK),
                pb.ReleaseRequest(transfer_id=first.transfer_id, epoch=first.epoch + 99, outcome=pb.OUTCOME_OK),
                pb.ReleaseRequest(transfer_id="", outcome=pb.OUTCOME_OK),
                pb.ReleaseRequest(transfer_id=first.transfer_id, epoch=first.epoch, outcome=pb.OUTCOME_UNSPECIFIED),
            ] + [pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK) for a in good]
            resp = await _one(call, pb.AssignStreamRequest(batch_id=8, releases=releases))
            assert [r.code for r in resp.releases] == [
                _code(CODE.NOT_FOUND),
                _code(CODE.FAILED_PRECONDITION),
                _code(CODE.INVALID_ARGUMENT),
                _code(CODE.INVALID_ARGUMENT),
            ] + [OK] * len(good)
            assert not server.registry.open
            assert all(server.registry.closed[a.transfer_id].state is State.OK for a in good)
            call.cancel()
            for inst in (d, d1, p):
                await inst.close()

    run(body())


def test_stream_end_releases_nothing_and_ttl_still_applies() -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0")).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            call = stub.AssignStream()
            resp = await _one(call, pb.AssignStreamRequest(batch_id=1, assigns=[pb.AssignRequest(prompt_tokens=8)]))
            tid = resp.assigns[0].assignment.transfer_id
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), WAIT_S) is grpc.aio.EOF
            assert await call.code() is CODE.OK
            await wait_for(lambda: server.servicer._inflight == 0)
            assert tid in server.registry.open  # a reconnecting frontend can still release it
            rec = server.registry.open[tid]
            expired = server.registry.expire_assignments(now=rec.created_at + server.registry.lease.assignment_ttl_s)
            assert [r.transfer_id for r in expired] == [tid] and tid not in server.registry.open
            # A unary Release of a stream's assignment: the same idempotent Release.
            resp2 = await _one(
                stub.AssignStream(), pb.AssignStreamRequest(batch_id=2, assigns=[pb.AssignRequest(prompt_tokens=8)])
            )
            a = resp2.assigns[0].assignment
            await stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK))
            assert a.transfer_id not in server.registry.open

    run(body())


def test_a_later_item_supersedes_an_earlier_one_with_the_same_transfer_id() -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0")).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            same = [pb.AssignRequest(prompt_tokens=8, transfer_id="mine") for _ in range(2)]
            resp = await _one(stub.AssignStream(), pb.AssignStreamRequest(batch_id=1, assigns=same))
            assert [r.code for r in resp.assigns] == [_code(CODE.FAILED_PRECONDITION), OK]
            assert not resp.assigns[0].HasField("assignment")
            assert server.registry.open["mine"].epoch == resp.assigns[1].assignment.epoch

    run(body())


@pytest.mark.parametrize("what", ["assigns", "releases"])
def test_a_batch_over_the_bounds_ends_the_stream(what: str) -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0")).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            call = stub.AssignStream()
            if what == "assigns":
                n = limits.MAX_ASSIGNS_PER_BATCH
                batch = pb.AssignStreamRequest(assigns=[pb.AssignRequest(prompt_tokens=1)] * n)
                await _one(call, batch)  # at the bound: answered
                batch.assigns.add(prompt_tokens=1)
            else:
                n = limits.MAX_RELEASES_PER_BATCH + 1
                batch = pb.AssignStreamRequest(releases=[pb.ReleaseRequest(transfer_id="t")] * n)
            open_before = len(server.registry.open)
            await call.write(batch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call.read(), WAIT_S)
            assert err.value.code() is CODE.INVALID_ARGUMENT
            assert len(server.registry.open) == open_before  # nothing of the refused batch was done

    run(body())


def test_max_wait_queues_for_capacity_and_zero_does_not() -> None:
    async def body() -> None:
        async with scheduler(settle_s=60.0, **LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0", blocks=4)).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            call = stub.AssignStream()
            fill = pb.AssignRequest(prompt_tokens=16 * 3, max_tokens=16)  # 4 blocks: all of d0
            resp = await _one(call, pb.AssignStreamRequest(batch_id=1, assigns=[fill, fill]))
            assert [r.code for r in resp.assigns] == [OK, _code(CODE.RESOURCE_EXHAUSTED)]
            held = resp.assigns[0].assignment
            # With max_wait_ms: the assign waits; a Release on another call frees the capacity.
            await call.write(pb.AssignStreamRequest(batch_id=2, assigns=[fill], max_wait_ms=int(WAIT_S * 1000)))
            await wait_for(lambda: server.servicer._queued == 1)
            await stub.Release(
                pb.ReleaseRequest(transfer_id=held.transfer_id, epoch=held.epoch, outcome=pb.OUTCOME_OK),
                timeout=WAIT_S,
            )
            resp = await asyncio.wait_for(call.read(), WAIT_S)
            assert resp.batch_id == 2 and resp.assigns[0].code == OK
            # Waiting ends at max_wait_ms.
            resp = await _one(call, pb.AssignStreamRequest(batch_id=3, assigns=[fill], max_wait_ms=50))
            assert resp.assigns[0].code == _code(CODE.RESOURCE_EXHAUSTED)
            assert "deadline" in resp.assigns[0].message
            call.cancel()

    run(body())


def test_client_coalesces_concurrent_assigns_and_releases() -> None:
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60)
    verifier = LegVerifier(signer.public_key())

    async def body() -> None:
        async with scheduler(leg_signer=signer, **LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0", blocks=1 << 20)).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            async with AssignStreamClient(stub, max_batch=64) as client:
                got = await asyncio.gather(*(client.assign(pb.AssignRequest(prompt_tokens=16)) for _ in range(300)))
                assert len({a.transfer_id for a in got}) == 300
                assert client.batches <= 300 // 64 + 2  # coalesced: not one message per assign
                for a in got[::37]:
                    for leg, role, engine in zip(_legs(a), ("prefill", "decode"), ("p0", "d0"), strict=True):
                        check_leg(leg, engine, role, verifier)
                with pytest.raises(AssignError) as err:
                    await client.assign(pb.AssignRequest(prompt_tokens=0))
                assert err.value.code is CODE.INVALID_ARGUMENT
                for a in got:
                    client.release(a.transfer_id, a.epoch, pb.OUTCOME_OK)
            # close() flushed the releases and waited for their answers.
            assert not server.registry.open

    run(body())


def test_client_release_rides_with_the_next_assign_or_leaves_after_its_delay() -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0", blocks=1 << 20)).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            # A delay longer than the test: the Release leaves only with the next Assign.
            async with AssignStreamClient(stub, release_delay_ms=60_000) as client:
                a = await client.assign(pb.AssignRequest(prompt_tokens=16))
                client.release(a.transfer_id, a.epoch, pb.OUTCOME_OK)
                await asyncio.sleep(0)  # the send loop runs: nothing is due
                assert client.batches == 1 and a.transfer_id in server.registry.open
                b = await client.assign(pb.AssignRequest(prompt_tokens=16))
                assert client.batches == 2  # one message: b's Assign and a's Release
                assert set(server.registry.open) == {b.transfer_id}
                client.release(b.transfer_id, b.epoch, pb.OUTCOME_OK)
            assert not server.registry.open  # close() sent the waiting Release at once
            # A short delay and no Assign after it: the Release leaves alone.
            async with AssignStreamClient(stub, release_delay_ms=20) as client:
                c = await client.assign(pb.AssignRequest(prompt_tokens=16))
                client.release(c.transfer_id, c.epoch, pb.OUTCOME_OK)
                await wait_for(lambda: not server.registry.open)
                assert client.batches == 2
            with pytest.raises(ValueError):
                AssignStreamClient(stub, release_delay_ms=-1)

    run(body())


@pytest.mark.parametrize("in_flight", [1, 2])
def test_client_keeps_at_most_max_in_flight_batches_unanswered(in_flight: int) -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0", blocks=1 << 20)).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            async with AssignStreamClient(stub, max_batch=1, max_in_flight=in_flight) as client:
                unanswered: list[int] = []
                answer = client._answer

                def counting(response: pb.AssignStreamResponse) -> None:
                    unanswered.append(len(client._sent))
                    answer(response)

                client._answer = counting  # type: ignore[method-assign]
                got = await asyncio.gather(*(client.assign(pb.AssignRequest(prompt_tokens=16)) for _ in range(60)))
                assert len({a.transfer_id for a in got}) == 60
                assert client.batches == 60 and len(unanswered) == 60  # max_batch=1: one batch per assign
                assert max(unanswered) <= in_flight
                for a in got:
                    client.release(a.transfer_id, a.epoch, pb.OUTCOME_OK)
            assert not server.registry.open

    run(body())


def test_client_fails_waiters_when_the_stream_breaks() -> None:
    async def body() -> None:
        async with scheduler(**LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0")).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            client = await AssignStreamClient(stub, max_wait_ms=int(WAIT_S * 1000)).start()
            a = await client.assign(pb.AssignRequest(prompt_tokens=8))
            assert a.transfer_id
            assert client._call is not None
            client._call.cancel()  # the stream breaks: every later call fails at once
            with pytest.raises(AssignError):
                await asyncio.wait_for(client.assign(pb.AssignRequest(prompt_tokens=8)), WAIT_S)
            await client.close()
            assert status_code(999) is CODE.UNKNOWN

    run(body())


def test_stream_grants_the_handoff_only_when_asked_and_offered() -> None:
    """As with Assign: an item asking for the first-token hand-off gets it exactly when its decode
    offers it, and the grant is in both legs and covered by the batch signature."""
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60)
    verifier = LegVerifier(signer.public_key())

    async def body() -> None:
        async with scheduler(leg_signer=signer, **LEASE) as (server, stub, _):
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            d = await FakeInstance(stub, info("d0", first_token_handoff=True)).start()
            call = stub.AssignStream()
            asks = [True, False, True]
            reqs = [pb.AssignRequest(prompt_tokens=32, max_tokens=4, first_token_from_prefill=a) for a in asks]
            resp = await _one(call, pb.AssignStreamRequest(batch_id=1, assigns=reqs))
            for asked, r in zip(asks, resp.assigns, strict=True):
                assert r.code == OK
                a = r.assignment
                assert a.first_token_from_prefill is asked
                assert server.registry.open[a.transfer_id].first_token is asked
                prefill, decode = _legs(a)
                assert prefill.first_token is asked and decode.first_token is asked
                check_leg(prefill, "p0", "prefill", verifier)
                check_leg(decode, "d0", "decode", verifier)
            # A granted leg whose grant is stripped no longer verifies: the grant is signed.
            granted = resp.assigns[0].assignment
            fields = MessageToDict(granted.decode_kv_transfer_params)
            fields[transfer_params.KEY]["first_token"] = False
            stripped = transfer_params.parse(fields)
            assert stripped is not None
            with pytest.raises(transfer_params.LegError, match="signature"):
                check_leg(stripped, "d0", "decode", verifier)
            await d.close()
            await wait_for(lambda: "d0" not in server.registry.instances)
            await FakeInstance(stub, info("d1")).start()
            resp = await _one(call, pb.AssignStreamRequest(batch_id=2, assigns=reqs[:1]))
            assert resp.assigns[0].code == OK
            a = resp.assigns[0].assignment
            assert a.decode.engine_id == "d1" and not a.first_token_from_prefill
            assert not _legs(a)[1].first_token
            call.cancel()

    run(body())


def test_compact_answers_over_the_stream_verify_and_release() -> None:
    """A client asking for compact answers gets engine ids, HTTP endpoints and JSON-text legs that
    verify, in the same batches; its releases close the assignments; failed items keep their codes."""
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60)
    verifier = LegVerifier(signer.public_key())

    async def body() -> None:
        async with scheduler(leg_signer=signer, **LEASE) as (server, stub, _):
            await FakeInstance(stub, info("d0", blocks=1 << 20)).start()
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL, tp=2)).start()
            async with AssignStreamClient(stub, max_batch=64, compact=True) as client:
                with pytest.raises(ValueError):
                    await client.assign(pb.AssignRequest(prompt_tokens=16))
                got = await asyncio.gather(
                    *(client.assign_compact(pb.AssignRequest(prompt_tokens=16)) for _ in range(100))
                )
                assert len({c.transfer_id for c in got}) == 100
                assert client.batches <= 100 // 64 + 2
                for c in got:
                    rec = server.registry.open[c.transfer_id]
                    assert rec.epoch == c.epoch
                    assert (c.prefill_engine_id, c.decode_engine_id) == ("p0", "d0")
                    assert (c.prefill_http_endpoint, c.decode_http_endpoint) == (
                        rec.prefill.http_endpoint,
                        rec.decode.http_endpoint,
                    )
                    for text, role, engine in (
                        (c.prefill_kv_transfer_params_json, "prefill", "p0"),
                        (c.decode_kv_transfer_params_json, "decode", "d0"),
                    ):
                        leg = transfer_params.parse(json.loads(text))
                        assert leg is not None and leg.transfer_id == c.transfer_id and leg.epoch == c.epoch
                        check_leg(leg, engine, role, verifier)
                with pytest.raises(AssignError) as err:
                    await client.assign_compact(pb.AssignRequest(prompt_tokens=0))
                assert err.value.code is CODE.INVALID_ARGUMENT
                for c in got:
                    client.release(c.transfer_id, c.epoch, pb.OUTCOME_OK)
            assert not server.registry.open
        async with scheduler(**LEASE) as (server, stub, _), AssignStreamClient(stub) as client:
            with pytest.raises(ValueError):
                await client.assign_compact(pb.AssignRequest(prompt_tokens=16))

    run(body())

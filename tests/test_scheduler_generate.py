"""Generate against fake vLLM OpenAI-compatible servers (aiohttp.web test doubles) and shutdown
with a Generate in flight. Real vLLM end-to-end runs live elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scheduler_support import WAIT_S, FakeInstance, info, run, scheduler, wait_for

from kvpush.services.common import transfer_params
from kvpush.services.scheduler.model import State
from kvpush.services.scheduler.server import SchedulerConfig, SchedulerServer
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc


@dataclass
class FakeVllm:
    """A fake OpenAI-compatible server: records requests, answers like vLLM with token ids."""

    role: str
    tokens: list[int] = field(default_factory=lambda: [11, 12, 13, 14])
    chunk_delay_s: float = 0.0
    status: int = 200
    hang: bool = False  # never answer (until the client goes away)
    gate: asyncio.Event | None = None  # decode waits for it before its last token
    start_gate: asyncio.Event | None = None  # decode waits for it before its first token (or its error)
    plain: bool = False  # serve a request without kv_transfer_params (else 400), as local prefill sends
    requests: list[dict[str, Any]] = field(default_factory=list)
    model_calls: int = 0
    received: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeVllm:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        self.model_calls += 1
        return web.json_response({"object": "list", "data": [{"id": f"fake-model-{self.role}"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.received.set()
        try:
            if self.hang:
                await asyncio.Event().wait()
            if self.status != 200:
                if self.start_gate is not None:
                    await self.start_gate.wait()
                return web.Response(status=self.status, text=f"{self.role} exploded: out of cheese")
            # Both legs must carry our kv_transfer_params, and of the right role.
            leg = transfer_params.parse(body.get("kv_transfer_params"))
            expected = transfer_params.DecodeLeg if self.role == "decode" else transfer_params.PrefillLeg
            if not isinstance(leg, expected) and not (self.plain and "kv_transfer_params" not in body):
                return web.Response(status=400, text=f"bad kv_transfer_params: {body['kv_transfer_params']}")
            if not body["stream"]:
                return web.json_response(
                    {"choices": [{"index": 0, "text": "x", "token_ids": [self.tokens[0]], "finish_reason": "length"}]}
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if self.start_gate is not None:
                await self.start_gate.wait()
            n = min(len(self.tokens), body["max_tokens"])
            for i, tok in enumerate(self.tokens[:n]):
                if self.gate is not None and i == n - 1:
                    await self.gate.wait()
                finish = "length" if i == n - 1 else None
                chunk = {"choices": [{"index": 0, "text": "t", "token_ids": [tok], "finish_reason": finish}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise


@contextlib.asynccontextmanager
async def cluster(
    prefill: FakeVllm | None = None,
    decode: FakeVllm | None = None,
    handoff: bool = False,
    vocab: tuple[int, int] = (0, 0),
    **kw: Any,
) -> AsyncIterator[tuple[Any, Any, FakeVllm, FakeVllm, list[FakeInstance]]]:
    p = await (prefill or FakeVllm("prefill")).start()
    d = await (decode or FakeVllm("decode")).start()
    try:
        async with scheduler(**kw) as (server, stub, channel):
            insts = [
                await FakeInstance(stub, info("p0", pb.ROLE_PREFILL, http=p.url, vocab_size=vocab[0])).start(),
                await FakeInstance(
                    stub, info("d0", http=d.url, first_token_handoff=handoff, vocab_size=vocab[1])
                ).start(),
            ]
            # Registered is not yet pushable: the scheduler opens an instance's outbox with its load
            # stream's first report, and acks that report after (a leg failure pushed before then is
            # undelivered by design: decode fails over at the reservation lease instead).
            await wait_for(lambda: all(i.acks for i in insts))
            yield server, stub, p, d, insts
            for i in insts:
                with contextlib.suppress(Exception):
                    await i.close()
    finally:
        await p.stop()
        await d.stop()


def _req(**kw: Any) -> pb.GenerateRequest:
    base: dict[str, Any] = {"prompt_token_ids": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    base.update(kw)
    return pb.GenerateRequest(**base)


def _record(first_token: bool = False) -> Any:
    """An open assignment of transfer t1 from p0 to d0, for ``run_legs`` against a fake client."""
    from kvpush.services.scheduler.model import AssignmentRecord, InstanceSpec, Role

    def spec(engine: str, role: Role) -> InstanceSpec:
        return InstanceSpec(engine, role, "i", 1, ("127.0.0.1:1",), 100, 16, f"http://127.0.0.1:1/{engine}", (), True)

    return AssignmentRecord("t1", 1, spec("p0", Role.PREFILL), spec("d0", Role.DECODE), 1, 0.0, first_token=first_token)


class _QueuedDecode:
    """A fake OpenAI client whose decode leg streams token 12 alone, then ``rest`` without a pause
    between them (they queue up behind the caller's write of 12), then fails with ``fail``."""

    def __init__(self, rest: list[Any], fail: Exception | None = None) -> None:
        self.rest, self.fail = rest, fail

    async def prefill(self, endpoint: str, p: Any, params: dict[str, Any]) -> None:
        return None

    async def decode(self, endpoint: str, p: Any, params: dict[str, Any], max_tokens: int | None = None) -> Any:
        from kvpush.services.scheduler.generate import Chunk

        yield Chunk([12], "")
        await asyncio.sleep(0)  # the caller takes the first chunk alone ...
        for chunk in self.rest:  # ... and these queue up while it is busy with it
            yield chunk
        if self.fail is not None:
            raise self.fail


async def _relayed(
    client: _QueuedDecode, max_tokens: int, got: list[tuple[list[int], str]] | None = None
) -> list[tuple[list[int], str]]:
    """What ``run_legs`` yields to a caller that takes 10 ms to write each message."""
    from kvpush.services.scheduler.generate import GenerateParams, run_legs

    got = [] if got is None else got
    loop = asyncio.get_running_loop()
    params = GenerateParams([1, 2, 3], max_tokens, 0.0, True, None)
    async for c in run_legs(client, _record(), params, loop.create_future()):  # type: ignore[arg-type]
        got.append((c.token_ids, c.finish_reason))
        await asyncio.sleep(0.01)  # a slow write to the caller
    return got


def test_generate_streams_tokens_and_releases_ok() -> None:
    async def body() -> None:
        async with cluster(interval_s=1.0) as (server, stub, p, d, _):
            msgs = [m async for m in stub.Generate(_req(seed=7, request_id="r1"), timeout=WAIT_S)]
            # In order; how many per message is the relay's (back to back, they may share one).
            assert [t for m in msgs for t in m.token_ids] == [11, 12, 13, 14]
            assert msgs[0].ttft_seconds > 0 and all(m.ttft_seconds == 0 for m in msgs[1:])
            assert msgs[-1].finished and msgs[-1].finish_reason == "length"
            assert not any(m.finished for m in msgs[:-1])
            assert {(m.decode_engine_id, m.prefill_engine_id) for m in msgs} == {("d0", "p0")}
            (pre,) = p.requests
            (dec,) = d.requests
            assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["model"] == "fake-model-prefill"
            assert dec["max_tokens"] == 4 and dec["stream"] is True and dec["model"] == "fake-model-decode"
            # Decode streams token ids; prefill's answer is read for its status only.
            assert dec["return_token_ids"] is True and pre["return_token_ids"] is False
            for b in (pre, dec):
                assert b["prompt"] == [1, 2, 3] and b["ignore_eos"] is True
                assert b["seed"] == 7 and b["temperature"] == 0.0
            dleg = transfer_params.parse(dec["kv_transfer_params"])
            pleg = transfer_params.parse(pre["kv_transfer_params"])
            assert isinstance(dleg, transfer_params.DecodeLeg) and isinstance(pleg, transfer_params.PrefillLeg)
            assert dleg.transfer_id == pleg.transfer_id == msgs[0].transfer_id
            assert dleg.prefill_engine_id == "p0" and pleg.decode_engine_id == "d0"
            rec = server.registry.closed[msgs[0].transfer_id]
            assert rec.state is State.OK and rec.epoch == dleg.epoch
            # Second call: no seed sent when unset, model names cached.
            _ = [m async for m in stub.Generate(_req(), timeout=WAIT_S)]
            assert "seed" not in d.requests[1] and d.model_calls == 1 and p.model_calls == 1
            assert not server.registry.open
            sample = server.metrics.registry.get_sample_value
            assert sample("kvpush_scheduler_generate_total", {"result": "ok"}) == 2
            assert sample("kvpush_scheduler_generate_ttft_seconds_count") == 2

    run(body())


def test_generate_decode_http_error_fails_and_aborts_the_prefill_leg() -> None:
    async def body() -> None:
        # The healthy prefill leg hangs, so the failure must abort it.
        bad = FakeVllm("decode", status=503)
        good = FakeVllm("prefill", hang=True)
        async with cluster(prefill=good, decode=bad, interval_s=1.0) as (server, stub, _p, _d, insts):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(_req(), timeout=WAIT_S):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "decode leg" in e.value.details() and "out of cheese" in e.value.details()
            await asyncio.wait_for(good.disconnected.wait(), WAIT_S)
            (rec,) = server.registry.closed.values()
            assert rec.state is State.FAILED and "out of cheese" in rec.reason
            # The prefill engine heard that no reservation will come (it frees the KV now).
            prefill_inst, decode_inst = insts
            await wait_for(lambda: bool(prefill_inst.leg_failures))
            (f,) = prefill_inst.leg_failures
            assert (f.transfer_id, f.leg) == (rec.transfer_id, pb.ROLE_DECODE), f
            assert decode_inst.leg_failures == []

    run(body())


def test_generate_prefill_http_error_leaves_the_answer_to_decode() -> None:
    """The decode engine holds the reservation and reroutes or fails the request itself: a failed
    prefill leg alone does not end the call; a decode failure after it names both."""

    async def body() -> None:
        async with cluster(prefill=FakeVllm("prefill", status=500), decode=FakeVllm("decode"), interval_s=1.0) as (
            server,
            stub,
            _p,
            _d,
            insts,
        ):
            tokens = [t for m in [m async for m in stub.Generate(_req(), timeout=WAIT_S)] for t in m.token_ids]
            assert tokens  # decode answered: the request succeeded
            (rec,) = server.registry.closed.values()
            assert rec.state is State.OK
            # The decode engine heard at once, on its load stream, that the prefill leg failed
            # (so it fails over now, not at the reservation lease); the prefill engine did not.
            prefill_inst, decode_inst = insts
            await wait_for(lambda: bool(decode_inst.leg_failures))
            (f,) = decode_inst.leg_failures
            assert (f.transfer_id, f.prefill_engine_id) == (rec.transfer_id, "p0") and "500" in f.reason, f
            assert prefill_inst.leg_failures == []
        # Decode fails only once the prefill leg's failure was seen (decode heard of it), as when a
        # decode gives up on a transfer whose prefill died: its error then names both. (Both failing
        # at once would race: decode's leg goes out first, and its error alone is then right too.)
        decode_fails = asyncio.Event()
        async with cluster(
            prefill=FakeVllm("prefill", status=500),
            decode=FakeVllm("decode", status=500, start_gate=decode_fails),
            interval_s=1.0,
        ) as (server, stub, _p, _d, (_, decode_inst)):

            async def release_decode() -> None:
                await wait_for(lambda: bool(decode_inst.leg_failures))
                decode_fails.set()

            releaser = asyncio.create_task(release_decode())
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(_req(), timeout=WAIT_S):
                    pass
            await releaser
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "after the prefill leg failed" in e.value.details()

    run(body())


def test_generate_unreachable_instance_is_unavailable() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL, http="http://127.0.0.1:9")).start()
            await FakeInstance(stub, info("d0", http="http://127.0.0.1:9")).start()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(_req(), timeout=WAIT_S):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not server.registry.open

    run(body())


def test_generate_client_cancel_aborts_both_legs() -> None:
    async def body() -> None:
        gate = asyncio.Event()  # never set: the decode stream stalls before its last token
        async with cluster(
            prefill=FakeVllm("prefill", hang=True), decode=FakeVllm("decode", gate=gate), interval_s=1.0
        ) as (server, stub, p, d, _):
            call = stub.Generate(_req(), timeout=WAIT_S)
            msgs = aiter(call)
            first = await anext(msgs)
            assert list(first.token_ids) in ([11], [11, 12, 13])  # tokens before the gate (maybe all at once)
            call.cancel()
            await asyncio.wait_for(d.disconnected.wait(), WAIT_S)
            await asyncio.wait_for(p.disconnected.wait(), WAIT_S)
            await wait_for(lambda: first.transfer_id in server.registry.closed)
            assert server.registry.closed[first.transfer_id].state is State.CANCELLED

    run(body())


def test_generate_fails_when_decode_dies() -> None:
    """Decode streamed, then its lease ran out and it streamed nothing more for decode_stall_s."""

    async def body() -> None:
        gate = asyncio.Event()
        async with cluster(decode=FakeVllm("decode", gate=gate), interval_s=0.05, decode_stall_s=0.3) as (
            server,
            stub,
            p,
            d,
            insts,
        ):
            call = stub.Generate(_req(), timeout=WAIT_S)
            await call.read()
            insts[1].reporting.clear()  # the decode instance's lease runs out
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            details = e.value.details() or ""
            assert "assignment lost" in details and "lease expired" in details, details
            assert "decode streamed nothing for 0.3s after" in details, details
            await asyncio.wait_for(d.disconnected.wait(), WAIT_S)

    run(body())


def test_generate_follows_a_streaming_decode_whose_lease_ran_out() -> None:
    """A decode starved of CPU misses its load reports and is declared dead, but it is decoding: its
    own stream decides. The call ends OK with every token; the scheduler releases nothing twice."""

    async def body() -> None:
        gate = asyncio.Event()
        async with cluster(decode=FakeVllm("decode", gate=gate), interval_s=0.05, decode_stall_s=WAIT_S) as (
            server,
            stub,
            p,
            d,
            insts,
        ):
            call = stub.Generate(_req(), timeout=WAIT_S * 2)
            first = await call.read()
            insts[1].reporting.clear()  # the decode instance's lease runs out
            await wait_for(lambda: first.transfer_id in server.registry.closed)
            assert "lease expired" in server.registry.closed[first.transfer_id].reason
            gate.set()  # decode was only slow: its last token comes
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            assert [t for m in [first, *rest] for t in m.token_ids] == [11, 12, 13, 14]
            assert await call.code() == grpc.StatusCode.OK
            assert server.registry.closed[first.transfer_id].state is State.FAILED  # as the lease left it

    run(body())


def test_generate_fails_at_once_when_decode_is_lost_before_it_streamed() -> None:
    """Before decode streams, the request still needs the assignment (its KV has not landed): losing
    it ends the call at once, whatever decode_stall_s is."""

    async def body() -> None:
        start = asyncio.Event()
        async with cluster(
            decode=FakeVllm("decode", start_gate=start), interval_s=0.05, decode_stall_s=WAIT_S * 10
        ) as (server, stub, p, d, insts):
            call = stub.Generate(_req(), timeout=WAIT_S)
            await asyncio.wait_for(d.received.wait(), WAIT_S)
            insts[1].reporting.clear()  # the decode instance's lease runs out
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "assignment lost" in (e.value.details() or "") and "streamed nothing" not in (
                e.value.details() or ""
            )

    run(body())


def test_shutdown_lets_inflight_generate_finish() -> None:
    async def body() -> None:
        gate = asyncio.Event()
        async with cluster(decode=FakeVllm("decode", gate=gate), interval_s=1.0) as (server, stub, p, d, _):
            call = stub.Generate(_req(), timeout=WAIT_S)
            got = [await call.read()]
            stopping = asyncio.ensure_future(server.stop(grace_s=WAIT_S))
            await wait_for(lambda: server.servicer.shutting_down)
            # New work is refused at once, health says NOT_SERVING...
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Assign(pb.AssignRequest(prompt_tokens=3), timeout=WAIT_S)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(_req(), timeout=WAIT_S):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            channel = grpc.aio.insecure_channel(server.address)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S
            )
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await channel.close()
            # ...while the Generate in flight runs to its end.
            assert not stopping.done()
            gate.set()
            while (m := await call.read()) is not grpc.aio.EOF:
                got.append(m)
            assert [t for m in got for t in m.token_ids] == [11, 12, 13, 14] and got[-1].finished
            await asyncio.wait_for(stopping, WAIT_S)
            assert all(r.state is State.OK for r in server.registry.closed.values())

    run(body())


def test_readiness_probe_waits_for_the_openai_server() -> None:
    """An instance that registered before its OpenAI server answers is not assignable; once
    GET /health answers 200 it is, without re-registering."""

    async def body() -> None:
        health_ok = asyncio.Event()

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if health_ok.is_set() else 503)

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        server = SchedulerServer(SchedulerConfig(listen="127.0.0.1:0", readiness_probe=True))
        await server.start()
        channel = grpc.aio.insecure_channel(server.address)
        stub = pb_grpc.SchedulerStub(channel)
        try:
            d = await FakeInstance(stub, info("d0", http=url)).start()
            p = await FakeInstance(stub, info("p0", role=pb.ROLE_PREFILL, http=url)).start()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Assign(pb.AssignRequest(prompt_tokens=10))  # no deadline: no queueing
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "not serving yet" in (err.value.details() or "")
            health_ok.set()
            a = await stub.Assign(pb.AssignRequest(prompt_tokens=10), timeout=WAIT_S)
            assert a.decode.engine_id == "d0" and a.prefill.engine_id == "p0"
            await d.close()
            await p.close()
        finally:
            await channel.close()
            await server.stop(1.0)
            await runner.cleanup()

    run(body())


def test_report_leg_failure_reaches_only_the_assignments_decode() -> None:
    """A custom frontend whose prefill POST failed says so; the scheduler pushes it to the
    assignment's decode engine at once. Unknown transfers, a prefill the leg is no longer for and
    oversized ids are refused with a clear status; nothing is pushed for them."""

    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            p0 = await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            d0 = await FakeInstance(stub, info("d0")).start()
            d1 = await FakeInstance(stub, info("d1")).start()
            await wait_for(lambda: all(i.ready for i in server.registry.instances.values()))
            a = await stub.Assign(pb.AssignRequest(prompt_tokens=16, max_tokens=4), timeout=WAIT_S)
            decode, other = (d0, d1) if a.decode.engine_id == "d0" else (d1, d0)
            ack = await stub.ReportLegFailure(
                pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id="p0", reason="connection refused"),
                timeout=WAIT_S,
            )
            assert ack.delivered
            await wait_for(lambda: bool(decode.leg_failures))
            assert [(f.transfer_id, f.prefill_engine_id, f.reason) for f in decode.leg_failures] == [
                (a.transfer_id, "p0", "connection refused")
            ]
            for bad, code in (
                (pb.LegFailure(transfer_id="nope", prefill_engine_id="p0"), grpc.StatusCode.NOT_FOUND),
                (pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id="p9"), grpc.StatusCode.FAILED_PRECONDITION),
                (pb.LegFailure(transfer_id="x" * 10_000, prefill_engine_id="p0"), grpc.StatusCode.INVALID_ARGUMENT),
                (pb.LegFailure(prefill_engine_id="p0"), grpc.StatusCode.INVALID_ARGUMENT),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ReportLegFailure(bad, timeout=WAIT_S)
                assert e.value.code() == code, bad
            assert len(decode.leg_failures) == 1 and other.leg_failures == [] and p0.leg_failures == []
            # The decode leg: the prefill engine is told, and only it.
            ack = await stub.ReportLegFailure(
                pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id="p0", leg=pb.ROLE_DECODE), timeout=WAIT_S
            )
            assert ack.delivered
            await wait_for(lambda: bool(p0.leg_failures))
            assert [(f.transfer_id, f.leg) for f in p0.leg_failures] == [(a.transfer_id, pb.ROLE_DECODE)]
            assert len(decode.leg_failures) == 1 and other.leg_failures == []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ReportLegFailure(
                    pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id="p0", leg=99), timeout=WAIT_S
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for i in (p0, d0, d1):
                await i.close()

    run(body())


def test_generate_refuses_token_ids_outside_the_vocabulary_before_any_engine_sees_them() -> None:
    """vLLM without a tokenizer does not check prompt token ids, and its engine dies on one outside
    the embedding table: Generate must refuse it (the smallest vocabulary any engine registered),
    with nothing assigned, sent or left behind, and keep serving."""

    async def body() -> None:
        async with cluster(vocab=(1000, 1024), interval_s=1.0) as (server, stub, p, d, _):
            for bad in ([1, 2, 1000], [1023], [2**32 - 1]):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(_req(prompt_token_ids=bad), timeout=WAIT_S):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"token id {max(bad)} is outside the model's vocabulary (ids 0..999)" in e.value.details()
            assert p.requests == [] and d.requests == []
            assert not server.registry.open and len(server.registry.closed) == 0
            msgs = [m async for m in stub.Generate(_req(prompt_token_ids=[0, 999]), timeout=WAIT_S)]
            assert [t for m in msgs for t in m.token_ids] == [11, 12, 13, 14]
            assert p.requests[0]["prompt"] == [0, 999]

    run(body())


def test_generate_refuses_a_temperature_that_is_not_a_finite_non_negative_number() -> None:
    async def body() -> None:
        async with cluster(interval_s=1.0) as (server, stub, p, d, _):
            for bad in (-0.5, float("inf"), float("-inf"), float("nan")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(_req(temperature=bad), timeout=WAIT_S):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
                assert "temperature must be finite and >= 0" in e.value.details()
            assert p.requests == [] and d.requests == [] and not server.registry.open

    run(body())


def test_generate_checks_no_vocabulary_when_no_engine_reports_one() -> None:
    async def body() -> None:
        async with cluster(interval_s=1.0) as (_server, stub, p, _d, _):
            msgs = [m async for m in stub.Generate(_req(prompt_token_ids=[5, 70000]), timeout=WAIT_S)]
            assert [t for m in msgs for t in m.token_ids] == [11, 12, 13, 14]
            assert p.requests[0]["prompt"] == [5, 70000]

    run(body())


# ----- first-token hand-off ----------------------------------------------------------------------


async def _relay_first_token(p: FakeVllm, pinst: FakeInstance, token: int, stopped: bool = False) -> None:
    """What a prefill engine does once it sampled: its load stream reports the first token."""
    await asyncio.wait_for(p.received.wait(), WAIT_S)
    leg = transfer_params.parse(p.requests[-1]["kv_transfer_params"])
    assert isinstance(leg, transfer_params.PrefillLeg) and leg.first_token
    pinst.outgoing_first_tokens.append(
        pb.FirstToken(
            transfer_id=leg.transfer_id, decode_engine_id=leg.decode_engine_id, token_id=token, stopped=stopped
        )
    )


def test_generate_streams_prefills_first_token_and_decode_continues() -> None:
    """With a decode that offers the hand-off, the first token is the one prefill reported (before
    decode sends anything), decode is asked for one token less, and both legs say so."""

    async def body() -> None:
        d = FakeVllm("decode", tokens=[12, 13, 14], start_gate=asyncio.Event())
        async with cluster(decode=d, handoff=True, interval_s=1.0) as (server, stub, p, _, insts):
            pinst, dinst = insts
            call = stub.Generate(_req(max_tokens=4), timeout=WAIT_S)
            relay = asyncio.create_task(_relay_first_token(p, pinst, 11))
            msgs = aiter(call)
            first = await anext(msgs)
            # Decode has streamed nothing yet: the first token can only be prefill's.
            assert list(first.token_ids) == [11] and first.ttft_seconds > 0 and not first.finished
            await relay
            await asyncio.wait_for(dinst.got_first_token.wait(), WAIT_S)
            (ft,) = dinst.first_tokens
            assert (ft.transfer_id, ft.prefill_engine_id, ft.token_id) == (first.transfer_id, "p0", 11)
            assert d.start_gate is not None
            d.start_gate.set()
            rest = [m async for m in msgs]
            assert [t for m in rest for t in m.token_ids] == [12, 13, 14]
            assert not any(m.finished for m in rest[:-1])
            assert rest[-1].finished and rest[-1].finish_reason == "length"
            (dec,) = d.requests
            assert dec["max_tokens"] == 3
            dleg = transfer_params.parse(dec["kv_transfer_params"])
            assert isinstance(dleg, transfer_params.DecodeLeg) and dleg.first_token
            assert server.registry.closed[first.transfer_id].state is State.OK
            sample = server.metrics.registry.get_sample_value
            assert sample("kvpush_scheduler_first_tokens_total", {"result": "relayed"}) == 1
            for phase in ("assign", "first_token", "second_token"):
                assert sample("kvpush_scheduler_generate_phase_seconds_count", {"phase": phase}) == 1
            assert not server.servicer._first_tokens.waiters

    run(body())


def test_generate_ends_at_a_first_token_that_stopped_the_request() -> None:
    """Prefill's token was EOS: the request ends with it (as on one instance) and the decode leg is
    aborted, never read."""

    async def body() -> None:
        d = FakeVllm("decode", tokens=[12, 13], start_gate=asyncio.Event())
        async with cluster(decode=d, handoff=True, interval_s=1.0) as (server, stub, p, _, insts):
            relay = asyncio.create_task(_relay_first_token(p, insts[0], 2, stopped=True))
            msgs = [m async for m in stub.Generate(_req(max_tokens=4, ignore_eos=False), timeout=WAIT_S)]
            await relay
            assert [list(m.token_ids) for m in msgs] == [[2]]
            assert msgs[-1].finished and msgs[-1].finish_reason == "stop"
            await asyncio.wait_for(d.disconnected.wait(), WAIT_S)
            assert server.registry.closed[msgs[0].transfer_id].state is State.OK

    run(body())


def test_no_handoff_without_a_decode_that_offers_it_or_for_one_token() -> None:
    async def body() -> None:
        async with cluster(interval_s=1.0) as (server, stub, p, d, _):
            msgs = [m async for m in stub.Generate(_req(max_tokens=4), timeout=WAIT_S)]
            assert [t for m in msgs for t in m.token_ids] == [11, 12, 13, 14]
            assert d.requests[0]["max_tokens"] == 4
            leg = transfer_params.parse(d.requests[0]["kv_transfer_params"])
            assert isinstance(leg, transfer_params.DecodeLeg) and not leg.first_token
        async with cluster(handoff=True, interval_s=1.0) as (server, stub, p, d, _):
            msgs = [m async for m in stub.Generate(_req(max_tokens=1), timeout=WAIT_S)]
            assert [list(m.token_ids) for m in msgs] == [[11]]
            leg = transfer_params.parse(d.requests[0]["kv_transfer_params"])
            assert isinstance(leg, transfer_params.DecodeLeg) and not leg.first_token

    run(body())


def test_assign_grants_the_handoff_only_when_asked_and_offered() -> None:
    async def body() -> None:
        async with cluster(handoff=True, interval_s=1.0) as (server, stub, *_):
            for asked in (False, True):
                a = await stub.Assign(
                    pb.AssignRequest(prompt_tokens=10, max_tokens=4, first_token_from_prefill=asked), timeout=WAIT_S
                )
                assert a.first_token_from_prefill is asked
                d = a.decode_kv_transfer_params.fields[transfer_params.KEY].struct_value.fields["first_token"]
                assert d.bool_value is asked
        async with cluster(interval_s=1.0) as (server, stub, *_):
            a = await stub.Assign(
                pb.AssignRequest(prompt_tokens=10, max_tokens=4, first_token_from_prefill=True), timeout=WAIT_S
            )
            assert not a.first_token_from_prefill

    run(body())


def test_generate_streams_no_token_from_a_prefill_that_is_not_its_transfers() -> None:
    """Another registered prefill engine reports a token for a Generate call's transfer (a buggy
    or hostile one that learned its id): the call does not stream it; it streams the token of the
    prefill its leg went to."""

    async def body() -> None:
        d = FakeVllm("decode", tokens=[12, 13, 14])
        async with cluster(decode=d, handoff=True, interval_s=1.0) as (server, stub, p, _, insts):
            pinst, dinst = insts
            call = stub.Generate(_req(max_tokens=4), timeout=WAIT_S)
            msgs = aiter(call)
            first = asyncio.ensure_future(anext(msgs))
            await asyncio.wait_for(p.received.wait(), WAIT_S)
            leg = transfer_params.parse(p.requests[-1]["kv_transfer_params"])
            assert isinstance(leg, transfer_params.PrefillLeg)
            other = await FakeInstance(stub, info("p1", pb.ROLE_PREFILL)).start()
            forged = pb.FirstToken(transfer_id=leg.transfer_id, decode_engine_id="d0", token_id=99)
            await stub.ReportFirstTokens(
                pb.FirstTokenReport(engine_id="p1", incarnation="inc1", first_tokens=[forged]), timeout=WAIT_S
            )
            await asyncio.wait_for(dinst.got_first_token.wait(), WAIT_S)  # relayed, so handled
            assert not first.done()
            await _relay_first_token(p, pinst, 11)
            assert list((await asyncio.wait_for(first, WAIT_S)).token_ids) == [11]
            assert [t for m in [m async for m in msgs] for t in m.token_ids] == [12, 13, 14]
            await other.close()

    run(body())


def test_first_tokens_from_a_decode_engine_are_not_relayed() -> None:
    """Only a prefill engine's load stream may report first tokens, and the relayed token names the
    stream's own engine, whatever the report says."""

    async def body() -> None:
        async with cluster(handoff=True, interval_s=1.0) as (server, stub, p, d, insts):
            pinst, dinst = insts
            dinst.outgoing_first_tokens.append(pb.FirstToken(transfer_id="t1", decode_engine_id="d0", token_id=5))
            pinst.outgoing_first_tokens.append(
                pb.FirstToken(transfer_id="t2", decode_engine_id="d0", prefill_engine_id="d0", token_id=6)
            )
            await asyncio.wait_for(dinst.got_first_token.wait(), WAIT_S)
            assert [(f.transfer_id, f.prefill_engine_id, f.token_id) for f in dinst.first_tokens] == [("t2", "p0", 6)]

    run(body())


@pytest.mark.parametrize("handoff", [True, False])
def test_legs_go_out_prefill_first_with_the_handoff_decode_first_without(handoff: bool) -> None:
    """With the hand-off the client's first token is prefill's, so its leg is sent first; without
    it decode's reservation goes first (the push starts when it and the prefill are both done)."""
    from kvpush.services.scheduler.generate import Chunk, GenerateParams, run_legs

    calls: list[str] = []
    first: list[asyncio.Future[pb.FirstToken]] = []

    class Client:
        async def prefill(self, endpoint: str, p: GenerateParams, params: dict[str, Any]) -> None:
            calls.append("prefill")

        async def decode(
            self, endpoint: str, p: GenerateParams, params: dict[str, Any], max_tokens: int | None = None
        ) -> AsyncIterator[Chunk]:
            calls.append("decode")
            first[0].set_result(pb.FirstToken(transfer_id="t1", token_id=11))  # relayed before decode answers
            await asyncio.sleep(0)
            yield Chunk([12], "length")

    rec = _record(first_token=handoff)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        first.append(loop.create_future())
        params = GenerateParams([1, 2, 3], 2, 0.0, True, None)
        legs = run_legs(Client(), rec, params, loop.create_future(), first_token=first[0])  # type: ignore[arg-type]
        got = [c.token_ids async for c in legs]
        assert calls == (["prefill", "decode"] if handoff else ["decode", "prefill"])
        assert got == ([[11], [12]] if handoff else [[12]])

    run(body())


@pytest.mark.parametrize("token_comes", [True, False])
def test_a_decode_leg_that_ends_before_the_relayed_token_waits_for_it(token_comes: bool) -> None:
    """Decode may take prefill's token from the push's completion and finish before the scheduler's
    relay of it reaches the call (the soak saw it at 40 ms, with a prefill restarting next to it):
    its chunks wait for the token and follow it; a token that never comes fails the call, bounded."""
    from kvpush.services.scheduler.generate import Chunk, GenerateParams, LegError, run_legs

    decode_finished = asyncio.Event()

    class Client:
        async def prefill(self, endpoint: str, p: GenerateParams, params: dict[str, Any]) -> None:
            return None

        async def decode(
            self, endpoint: str, p: GenerateParams, params: dict[str, Any], max_tokens: int | None = None
        ) -> AsyncIterator[Chunk]:
            yield Chunk([12], "")
            yield Chunk([13], "length")
            decode_finished.set()  # the leg's end is queued in the same step, before anything else

    rec = _record(first_token=True)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[pb.FirstToken] = loop.create_future()
        params = GenerateParams([1, 2, 3], 3, 0.0, True, None)
        legs = run_legs(
            Client(),  # type: ignore[arg-type]
            rec,
            params,
            loop.create_future(),
            first_token=first,
            first_token_after_decode_s=WAIT_S if token_comes else 0.05,
        )
        got: list[list[int]] = []

        async def collect() -> None:
            async for c in legs:
                got.append(c.token_ids)

        task = asyncio.create_task(collect())
        await asyncio.wait_for(decode_finished.wait(), WAIT_S)
        assert got == []  # decode's chunks are held for the first token
        if token_comes:
            first.set_result(pb.FirstToken(transfer_id="t1", token_id=11))
            await asyncio.wait_for(task, WAIT_S)
            assert got == [[11], [12, 13]]  # the held chunks go on as one message
        else:
            with pytest.raises(LegError, match="first token did not come"):
                await asyncio.wait_for(task, WAIT_S)
            assert got == []

    run(body())


def test_decode_chunks_that_queued_behind_a_write_go_on_as_one_message() -> None:
    """Chunks that reached the relay while the caller was still writing the previous message are
    sent as one (the relay's cost is per message); what came behind them (the leg's end, here an
    error) is still handled after them, in order."""
    from kvpush.services.scheduler.generate import Chunk, LegError

    async def body() -> None:
        ok = _QueuedDecode([Chunk([13], ""), Chunk([14], ""), Chunk([15], "length")])
        assert await asyncio.wait_for(_relayed(ok, 4), WAIT_S) == [([12], ""), ([13, 14, 15], "length")]
        cut = _QueuedDecode([Chunk([13], ""), Chunk([14], "")], fail=LegError("decode", "cut", True))
        got: list[tuple[list[int], str]] = []
        with pytest.raises(LegError, match="cut"):
            await asyncio.wait_for(_relayed(cut, 4, got), WAIT_S)
        assert got == [([12], ""), ([13, 14], "")]

    run(body())


def test_a_backlog_goes_out_in_messages_of_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """However many tokens queued (a caller that stopped reading, a first token that came late), no
    merged message holds more than MAX_TOKENS_PER_MESSAGE (a chunk over it alone stays whole)."""
    from kvpush.services.scheduler import generate
    from kvpush.services.scheduler.generate import Chunk, merged_runs

    runs = merged_runs([Chunk([1], ""), Chunk([2], ""), Chunk([3], ""), Chunk([4, 5, 6], ""), Chunk([7], "length")], 2)
    assert [(c.token_ids, c.finish_reason) for c in runs] == [([1, 2], ""), ([3], ""), ([4, 5, 6], ""), ([7], "length")]
    assert merged_runs([]) == []

    monkeypatch.setattr(generate, "MAX_TOKENS_PER_MESSAGE", 2)
    queued = _QueuedDecode([Chunk([13], ""), Chunk([14], ""), Chunk([15], ""), Chunk([16], ""), Chunk([17], "length")])
    got = run(asyncio.wait_for(_relayed(queued, 6), WAIT_S))
    assert [t for c, _ in got for t in c] == [12, 13, 14, 15, 16, 17]
    assert max(len(c) for c, _ in got) == 2 and len(got) == 4  # [12], then three of two

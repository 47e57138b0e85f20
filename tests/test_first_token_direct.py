"""``ReportFirstTokens`` over real gRPC: a prefill engine's first tokens straight from the thread
that sampled them, relayed like a load report's, and refused (nothing relayed) to anyone but the
registered prefill engine itself. The registration's side of it is in tests/test_registration.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from scheduler_support import WAIT_S, FakeInstance, info, run, scheduler, wait_for
from scheduler_support import status_code as _code

from kvpush.services.common import limits
from kvpush.services.common.security import Security, TlsFiles
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc


def sec(certs: Path, name: str) -> Security:
    return Security.mtls(TlsFiles.in_dir(certs, name))


def _token(tid: str = "t1", token_id: int = 42, decode: str = "d0") -> pb.FirstToken:
    return pb.FirstToken(transfer_id=tid, decode_engine_id=decode, token_id=token_id)


def test_hostile_first_token_reports_are_refused_and_relay_nothing() -> None:
    """Plaintext scheduler (no identities): an unregistered engine, a stale incarnation, a decode
    engine, too many tokens, overlong ids; each gets its status, decode hears nothing, and the
    scheduler keeps relaying a well-formed report."""

    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            decode = await FakeInstance(stub, info("d0")).start()
            prefill = await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()

            def report(engine: str = "p0", incarnation: str = "inc1", tokens: Any = None) -> pb.FirstTokenReport:
                return pb.FirstTokenReport(
                    engine_id=engine, incarnation=incarnation, first_tokens=[_token()] if tokens is None else tokens
                )

            async def code(r: pb.FirstTokenReport) -> grpc.StatusCode:
                return await _code(stub.ReportFirstTokens(r, timeout=WAIT_S))

            try:
                assert await code(report("p9")) is grpc.StatusCode.FAILED_PRECONDITION  # never registered
                assert await code(report(incarnation="old")) is grpc.StatusCode.FAILED_PRECONDITION
                assert await code(report("d0")) is grpc.StatusCode.PERMISSION_DENIED  # a decode engine
                many = [_token(f"t{i}") for i in range(limits.MAX_EXPECTATIONS_PER_CALL + 1)]
                assert await code(report(tokens=many)) is grpc.StatusCode.INVALID_ARGUMENT
                assert await code(report("p" * (limits.MAX_ID_CHARS + 1))) is grpc.StatusCode.INVALID_ARGUMENT
                long_tid = [_token("t" * (limits.MAX_ID_CHARS + 1))]
                assert await code(report(tokens=long_tid)) is grpc.StatusCode.OK  # that token is skipped
                acks = decode.acks
                await wait_for(lambda: decode.acks > acks + 1)  # the stream kept flowing: nothing came
                assert decode.first_tokens == []
                assert await code(report()) is grpc.StatusCode.OK
                await asyncio.wait_for(decode.got_first_token.wait(), WAIT_S)
                assert [(t.transfer_id, t.prefill_engine_id) for t in decode.first_tokens] == [("t1", "p0")]
            finally:
                await prefill.close()
                await decode.close()

    run(body())


def test_only_the_prefill_itself_may_report_its_first_tokens(dev_certs: Path) -> None:
    """mTLS: a prefill speaking for another prefill, a decode engine and a frontend are denied;
    the victim's transfer gets no token."""

    async def body() -> None:
        async with scheduler(
            interval_s=1.0, security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")
        ) as (server, frontend, _):
            channels = {
                n: sec(dev_certs, n).aio_channel(server.address) for n in ("decode-0", "prefill-0", "prefill-1")
            }
            try:
                stubs = {n: pb_grpc.SchedulerStub(c) for n, c in channels.items()}
                decode = await FakeInstance(stubs["decode-0"], info("decode-0")).start()
                victim = await FakeInstance(stubs["prefill-1"], info("prefill-1", pb.ROLE_PREFILL)).start()
                forged = pb.FirstTokenReport(
                    engine_id="prefill-1", incarnation="inc1", first_tokens=[_token(decode="decode-0")]
                )
                denied = grpc.StatusCode.PERMISSION_DENIED
                assert await _code(stubs["prefill-0"].ReportFirstTokens(forged, timeout=WAIT_S)) is denied
                assert await _code(stubs["decode-0"].ReportFirstTokens(forged, timeout=WAIT_S)) is denied
                assert await _code(frontend.ReportFirstTokens(forged, timeout=WAIT_S)) is denied
                acks = decode.acks
                await wait_for(lambda: decode.acks > acks + 1)
                assert decode.first_tokens == []
                assert await _code(stubs["prefill-1"].ReportFirstTokens(forged, timeout=WAIT_S)) is grpc.StatusCode.OK
                await asyncio.wait_for(decode.got_first_token.wait(), WAIT_S)
                assert [t.prefill_engine_id for t in decode.first_tokens] == ["prefill-1"]
                await victim.close()
                await decode.close()
            finally:
                for c in channels.values():
                    await c.close()

    run(body())

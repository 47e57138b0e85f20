"""The decode leg's stream reader (``OpenAIClient.decode``) against raw HTTP servers that split,
stall and flood their streams: chunks parse whatever the read boundaries, silence past the read
timeout fails the leg (and only then), an endless line is refused, a caller's cancel stays one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from scheduler_support import WAIT_S

from kvpush.services.scheduler.generate import MAX_STREAM_LINE, GenerateParams, LegError, OpenAIClient

PARAMS = GenerateParams(prompt_token_ids=[1, 2, 3], max_tokens=8, temperature=0.0, ignore_eos=True, seed=None)
Writer = Callable[[web.StreamResponse], Awaitable[None]]


def _event(tok: int, finish: str | None = None) -> bytes:
    chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": "t", "token_ids": [tok], "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


@contextlib.asynccontextmanager
async def server(write: Writer) -> AsyncIterator[str]:
    """An OpenAI-style server whose completion stream ``write`` produces."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await write(resp)
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _tokens(client: OpenAIClient, url: str, got: list[int] | None = None) -> list[int]:
    got = [] if got is None else got
    async for chunk in client.decode(url, PARAMS, {}):
        got.extend(chunk.token_ids)
    return got


def test_events_split_at_every_byte_boundary_parse_the_same() -> None:
    stream = (
        b"".join(_event(t) for t in (5, 6, 7)) + b": keep-alive\r\n\r\n" + _event(8, "length") + b"data: [DONE]\n\n"
    )

    async def bytewise(resp: web.StreamResponse) -> None:
        for i in range(len(stream)):  # one write, and mostly one read, per byte
            await resp.write(stream[i : i + 1])

    async def body() -> None:
        client = OpenAIClient()
        try:
            async with server(bytewise) as url:
                assert await asyncio.wait_for(_tokens(client, url), WAIT_S) == [5, 6, 7, 8]
        finally:
            await client.close()

    asyncio.run(body())


def test_a_stream_silent_past_the_read_timeout_fails_the_leg_with_what_came_before() -> None:
    async def stalls(resp: web.StreamResponse) -> None:
        await resp.write(_event(5) + _event(6))
        await asyncio.Event().wait()  # alive, but never another byte

    async def body() -> None:
        client = OpenAIClient(read_timeout_s=0.3)
        got: list[int] = []
        try:
            async with server(stalls) as url:
                t0 = time.monotonic()
                with pytest.raises(LegError) as err:
                    await asyncio.wait_for(_tokens(client, url, got), WAIT_S)
                assert time.monotonic() - t0 >= 0.3
        finally:
            await client.close()
        assert got == [5, 6]
        assert err.value.leg == "decode" and err.value.unavailable
        assert "nothing read for 0.3s" in err.value.message

    asyncio.run(body())


def test_a_steady_stream_longer_than_the_read_timeout_is_not_cut() -> None:
    async def steady(resp: web.StreamResponse) -> None:
        for t in range(12):
            await resp.write(_event(t))
            await asyncio.sleep(0.06)  # the pace of the stream, well inside the 0.5 s limit
        await resp.write(b"data: [DONE]\n\n")

    async def body() -> None:
        client = OpenAIClient(read_timeout_s=0.5)
        try:
            async with server(steady) as url:
                assert await asyncio.wait_for(_tokens(client, url), WAIT_S) == list(range(12))
        finally:
            await client.close()

    asyncio.run(body())


def test_a_line_without_end_is_refused_not_buffered() -> None:
    async def floods(resp: web.StreamResponse) -> None:
        await resp.write(_event(5))
        piece = b"x" * (1 << 16)
        for _ in range(MAX_STREAM_LINE // len(piece) + 2):
            await resp.write(piece)
        await asyncio.Event().wait()

    async def body() -> None:
        client = OpenAIClient(read_timeout_s=WAIT_S * 2)
        got: list[int] = []
        try:
            async with server(floods) as url:
                with pytest.raises(LegError) as err:
                    await asyncio.wait_for(_tokens(client, url, got), WAIT_S)
        finally:
            await client.close()
        assert got == [5]
        assert f"a stream line over {MAX_STREAM_LINE} bytes" in err.value.message and not err.value.unavailable

    asyncio.run(body())


def test_a_callers_cancel_stays_a_cancel_and_a_closed_stream_cuts_nothing_later() -> None:
    async def stalls(resp: web.StreamResponse) -> None:
        await resp.write(_event(5))
        await asyncio.Event().wait()

    async def body() -> None:
        client = OpenAIClient(read_timeout_s=0.2)
        first = asyncio.Event()

        async def reads_until_cancelled() -> None:
            async for _ in client.decode(url, PARAMS, {}):
                first.set()

        async def closes_early_then_works_on() -> str:
            gen = client.decode(url, PARAMS, {})
            async for _ in gen:
                break
            await gen.aclose()
            await asyncio.sleep(0.5)  # past the limit: the closed stream's watchdog must not cut it
            return "done"

        try:
            async with server(stalls) as url:
                task = asyncio.create_task(reads_until_cancelled())
                await asyncio.wait_for(first.wait(), WAIT_S)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert await asyncio.wait_for(closes_early_then_works_on(), WAIT_S) == "done"
        finally:
            await client.close()

    asyncio.run(body())


def test_the_events_of_one_read_go_on_as_one_chunk_and_a_bad_one_after_tokens_fails_after_them() -> None:
    """Events that arrive together (decode ran ahead of the relay) become one chunk: one message to
    the caller, not one per token. A bad event in the same read still fails the leg, after the
    tokens before it went on."""
    good = b"".join(_event(t) for t in (5, 6, 7)) + _event(8, "length") + b"data: [DONE]\n\n"
    bad = _event(5) + _event(6) + b'data: {"error": {"message": "boom"}}\n\n'

    def once(stream: bytes) -> Writer:
        async def write(resp: web.StreamResponse) -> None:
            await resp.write(stream)  # one write: one read on the other side, on loopback

        return write

    async def chunks(client: OpenAIClient, url: str, got: list[tuple[list[int], str]]) -> None:
        async for chunk in client.decode(url, PARAMS, {}):
            got.append((chunk.token_ids, chunk.finish_reason))

    async def body() -> None:
        client = OpenAIClient()
        try:
            async with server(once(good)) as url:
                got: list[tuple[list[int], str]] = []
                await asyncio.wait_for(chunks(client, url, got), WAIT_S)
                assert got == [([5, 6, 7, 8], "length")]
            async with server(once(bad)) as url:
                got = []
                with pytest.raises(LegError, match="boom"):
                    await asyncio.wait_for(chunks(client, url, got), WAIT_S)
                assert got == [([5, 6], "")]
        finally:
            await client.close()

    asyncio.run(body())

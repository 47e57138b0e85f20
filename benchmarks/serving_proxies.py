"""The serving benchmark's HTTP client and one proxy per setup: each takes a prompt and fills the
request's timings into its ``Sample``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from benchmarks.serving_model import Sample


class Client:
    """One aiohttp session for every setup, and the streaming completion that takes the timings."""

    def __init__(self, request_timeout_s: float) -> None:
        import aiohttp

        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=10)
        # Idle connections are closed here before the servers' own keep-alive (uvicorn: 5 s) can
        # close them under a request that reuses one (aiohttp: ServerDisconnectedError).
        self.session = aiohttp.ClientSession(
            timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        )
        self.models: dict[str, str] = {}

    async def close(self) -> None:
        await self.session.close()

    async def model(self, url: str) -> str:
        if url not in self.models:
            async with self.session.get(f"{url}/v1/models") as resp:
                resp.raise_for_status()
                self.models[url] = str((await resp.json())["data"][0]["id"])
        return self.models[url]

    async def body(
        self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": await self.model(url),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    async def once(
        self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, rid: str
    ) -> dict[str, Any]:
        """Non-streaming completion; returns the response JSON."""
        body = await self.body(url, prompt, max_tokens, params, stream=False)
        async with self.session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            out: dict[str, Any] = await resp.json()
            return out

    async def token_times(
        self,
        url: str,
        prompt: list[int],
        max_tokens: int,
        params: dict[str, Any] | None,
        rid: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> list[float]:
        """Streaming completion; the ``clock`` time each token arrived, one entry per token."""
        body = await self.body(url, prompt, max_tokens, params, stream=True)
        times: list[float] = []
        async with self.session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"{url}: stream error {obj['error']}")
                got = len(obj["choices"][0].get("token_ids") or [])
                if got:
                    times.extend([clock()] * got)
        return times

    async def stream(
        self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, rid: str, s: Sample
    ) -> None:
        """Streaming completion; fills TTFT (from ``s.sent``), TPOT and ``done`` into ``s``."""
        times = await self.token_times(url, prompt, max_tokens, params, rid)
        record(s, times[0] if times else 0.0, times[-1] if times else 0.0, len(times), max_tokens, _second(times))


def _second(times: Sequence[float]) -> float:
    return times[1] if len(times) > 1 else math.nan


def record(s: Sample, first: float, last: float, n: int, want: int, second: float = math.nan) -> None:
    if n != want:
        raise RuntimeError(f"got {n} tokens, expected {want}")
    s.ttft = first - s.sent
    s.tpot = (last - first) / (n - 1) if n > 1 else math.nan
    s.gap2 = second - first
    s.tpot_rest = (last - second) / (n - 2) if n > 2 else math.nan
    s.done = time.monotonic()
    s.tokens = n
    s.ok = True


Proxy = Callable[[list[int], int, Sample], Awaitable[None]]  # (prompt, max_tokens, sample)


def single_proxy(c: Client, url: str) -> Proxy:
    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        await c.stream(url, prompt, max_tokens, None, uuid.uuid4().hex, s)

    return run


class RoundRobin:
    """Backend selection of the ``two_plain`` proxy: 0, 1, ..., n-1, 0, ... in request order."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("round robin over no backends")
        self.n = n
        self._next = 0

    def pick(self) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


def round_robin_proxy(c: Client, urls: Sequence[str]) -> Proxy:
    """Each request streams from the next plain instance in turn (picked when it is sent)."""
    rr = RoundRobin(len(urls))

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        await c.stream(urls[rr.pick()], prompt, max_tokens, None, uuid.uuid4().hex, s)

    return run


def pull_proxy(c: Client, p_url: str, d_url: str) -> Proxy:
    """vLLM's toy proxy: P (max_tokens=1, do_remote_decode) first, then D with P's params."""

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        rid = uuid.uuid4().hex
        p_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        resp = await c.once(p_url, prompt, 1, p_params, rid)
        params = resp.get("kv_transfer_params")
        if not params:
            raise RuntimeError("prefill returned no kv_transfer_params")
        await c.stream(d_url, prompt, max_tokens, params, rid, s)

    return run


def push_proxy(c: Client, p_url: str, d_url: str, p_engine: str, p_host: str, p_port: int, tp: int) -> Proxy:
    """vLLM's push demo proxy: both legs at once, D told P's coordinates, the same X-Request-Id."""

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        rid = uuid.uuid4().hex
        p_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        d_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": p_engine,
            "remote_request_id": rid,
            "remote_host": p_host,
            "remote_port": p_port,
            "tp_size": tp,
            "pp_size": 1,
            "remote_block_ids": None,
        }
        await both_legs(c, p_url, d_url, prompt, max_tokens, p_params, d_params, rid, s)

    return run


async def both_legs(
    c: Client,
    p_url: str,
    d_url: str,
    prompt: list[int],
    max_tokens: int,
    p_params: dict[str, Any],
    d_params: dict[str, Any],
    rid: str,
    s: Sample,
) -> None:
    prefill = asyncio.create_task(c.once(p_url, prompt, 1, p_params, rid))
    try:
        await c.stream(d_url, prompt, max_tokens, d_params, rid, s)
        await prefill
    finally:
        if not prefill.done():
            prefill.cancel()
        with contextlib.suppress(BaseException):
            await prefill  # also retrieves a failure of P when D failed first


async def on_decode(c: Client, a: Any, prompt: list[int], max_tokens: int, rid: str, s: Sample) -> None:
    """An assignment prefilled on its decode (local prefill): one plain request to decode, whole,
    without kv_transfer_params (docs/scheduler.md, "Local prefill")."""
    s.on_decode = True
    await c.stream(a.decode.http_endpoint, prompt, max_tokens, None, rid, s)


async def release_assignment(stub: Any, a: Any, outcome: int) -> None:
    """Releases an Assign's assignment, best effort (it expires by TTL otherwise)."""
    from kvpush.v1 import kvpush_pb2 as pb

    with contextlib.suppress(Exception):
        await stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=outcome), timeout=10)


def ours_proxy(c: Client, stub: Any) -> Proxy:
    """Our scheduler's Assign, then both legs at once with its parameters, then Release."""
    from google.protobuf.json_format import MessageToDict

    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        rid = uuid.uuid4().hex
        req = pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=max_tokens, allow_prefill_on_decode=True)
        a = await stub.Assign(req, timeout=30)
        s.transfer_id = a.transfer_id
        outcome = pb.OUTCOME_FAILED
        try:
            if a.prefill_on_decode:
                await on_decode(c, a, prompt, max_tokens, rid, s)
                outcome = pb.OUTCOME_OK
                return
            await both_legs(
                c,
                a.prefill.http_endpoint,
                a.decode.http_endpoint,
                prompt,
                max_tokens,
                MessageToDict(a.prefill_kv_transfer_params),
                MessageToDict(a.decode_kv_transfer_params),
                rid,
                s,
            )
            outcome = pb.OUTCOME_OK
        finally:
            await release_assignment(stub, a, outcome)

    return run


def ours_ft_proxy(c: Client, stub: Any) -> Proxy:
    """``ours`` with the first-token hand-off, as a custom frontend does it (docs/first_token.md):
    Assign asking for it, ``AwaitFirstToken`` and both legs at once, decode asked for one token
    less; the first token is the scheduler's answer, then decode's tokens follow. The prefill leg's
    own answer carries the same token: when it arrived is kept too (``Sample.ttft_answer``, the
    recipe before ``AwaitFirstToken``), and the two tokens must agree."""
    from google.protobuf.json_format import MessageToDict

    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        if max_tokens < 2:
            raise RuntimeError("ours_ft needs max_tokens >= 2")
        rid = uuid.uuid4().hex
        req = pb.AssignRequest(
            prompt_tokens=len(prompt),
            max_tokens=max_tokens,
            first_token_from_prefill=True,
            allow_prefill_on_decode=True,
        )
        a = await stub.Assign(req, timeout=30)
        s.transfer_id = a.transfer_id
        outcome = pb.OUTCOME_FAILED
        first: list[tuple[float, int]] = []  # (when, token): the scheduler's answer, then the prefill leg's

        async def awaited() -> None:
            got = await stub.AwaitFirstToken(
                pb.AwaitFirstTokenRequest(transfer_id=a.transfer_id, epoch=a.epoch), timeout=30
            )
            first.insert(0, (time.monotonic(), int(got.token_id)))

        async def prefill() -> None:
            answer = await c.once(a.prefill.http_endpoint, prompt, 1, MessageToDict(a.prefill_kv_transfer_params), rid)
            ids = answer["choices"][0].get("token_ids")
            if not ids:
                raise RuntimeError("prefill answered no token")
            first.append((time.monotonic(), int(ids[0])))

        try:
            if a.prefill_on_decode:
                await on_decode(c, a, prompt, max_tokens, rid, s)
                outcome = pb.OUTCOME_OK
                return
            if not a.first_token_from_prefill:
                raise RuntimeError("the scheduler did not grant the first-token hand-off")
            # The prefill leg goes on the wire first (the first token is its), then the wait for
            # the token, then the decode leg: tasks run in the order they were created.
            tasks = [asyncio.create_task(prefill()), asyncio.create_task(awaited())]
            params = MessageToDict(a.decode_kv_transfer_params)
            decode = asyncio.create_task(c.token_times(a.decode.http_endpoint, prompt, max_tokens - 1, params, rid))
            tasks.append(decode)
            try:
                await asyncio.gather(*tasks)
                decoded = decode.result()
            finally:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            (at, token), (answered_at, answered) = first
            if token != answered:
                raise RuntimeError(f"AwaitFirstToken gave {token}, the prefill leg answered {answered}")
            times = sorted([at, *decoded])
            record(s, times[0], times[-1], len(times), max_tokens, _second(times))
            s.ttft_answer = answered_at - s.sent
            outcome = pb.OUTCOME_OK
        finally:
            await release_assignment(stub, a, outcome)

    return run


def grpc_proxy(stub: Any) -> Proxy:
    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        times: list[float] = []
        async for msg in stub.Generate(req, timeout=120):
            s.transfer_id = s.transfer_id or msg.transfer_id
            if msg.token_ids:
                times.extend([time.monotonic()] * len(msg.token_ids))
        record(s, times[0] if times else 0.0, times[-1] if times else 0.0, len(times), max_tokens, _second(times))

    return run

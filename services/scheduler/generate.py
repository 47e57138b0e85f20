"""Generate: both legs of one request against vLLM's OpenAI-compatible servers, concurrently.

The prefill leg is a non-streaming completion with ``max_tokens=1``; the decode leg streams, and its
``choices[0].token_ids`` (vLLM's ``return_token_ids``) are forwarded as they arrive.

With the first-token hand-off (``rec.first_token``), the request's first token is the one prefill
sampled: the scheduler relays it from prefill's load stream both to decode (which appends it to the
prompt and continues from it) and to this call, which streams it the moment it comes; the decode
leg is sent with one token less, and its tokens follow (docs/first_token.md).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpush.services.common.logs import get_logger
from kvpush.services.scheduler.convert import LegSealer, leg_params
from kvpush.services.scheduler.model import AssignmentRecord, SampledToken

log = get_logger("scheduler")

_UNAVAILABLE_HTTP = {502, 503, 504}
_MAX_BODY = 2000
# A decode stream's line (one SSE event of vLLM's: a chunk of a token or a few) is never near this.
MAX_STREAM_LINE = 1 << 20
# Tokens merged into one message at most (a few KiB): a backlog goes out in messages this size, far
# below gRPC's message limit whatever max_tokens allows.
MAX_TOKENS_PER_MESSAGE = 4096


class LegError(Exception):
    """One HTTP leg failed. ``unavailable``: the server could not be reached or said so."""

    def __init__(self, leg: str, message: str, unavailable: bool) -> None:
        super().__init__(f"{leg} leg: {message}")
        self.leg = leg
        self.message = message
        self.unavailable = unavailable


class AssignmentLost(Exception):
    """The assignment ended under the request (an instance died or was replaced)."""


@dataclass(frozen=True)
class GenerateParams:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int | None
    request_id: str = ""


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    finish_reason: str


def merged(chunks: list[Chunk]) -> Chunk:
    """Consecutive chunks of one stream as one: their tokens in order, the finish reason of the last
    that has one. What the relay sends when decode's chunks queued up behind the previous write."""
    if len(chunks) == 1:
        return chunks[0]
    tokens = [t for c in chunks for t in c.token_ids]
    finish = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), "")
    return Chunk(token_ids=tokens, finish_reason=finish)


def merged_runs(chunks: list[Chunk], limit: int | None = None) -> list[Chunk]:
    """``chunks`` merged into as few as hold at most ``limit`` tokens each (default
    ``MAX_TOKENS_PER_MESSAGE``; a single chunk over it stays whole), tokens in order."""
    limit = MAX_TOKENS_PER_MESSAGE if limit is None else limit
    runs: list[Chunk] = []
    group: list[Chunk] = []
    size = 0
    for c in chunks:
        if group and size + len(c.token_ids) > limit:
            runs.append(merged(group))
            group, size = [], 0
        group.append(c)
        size += len(c.token_ids)
    if group:
        runs.append(merged(group))
    return runs


class SilenceWatchdog:
    """Cancels the task that created it once ``heard`` was not called for ``limit_s``.

    The decode leg's limit on silence. aiohttp's ``sock_read`` timeout re-arms a timer on every
    read: a tenth of the scheduler's profile samples while it relays tokens (docs/bench_phases.md,
    runs 57-72); this one keeps one timer per ``limit_s`` and ``heard`` only stores the time.
    ``fired`` says the cancellation was its own. The cancellation lands at the task's next await:
    the stream's consumer (``run_legs``' decode leg) awaits nothing between chunks but the stream."""

    def __init__(self, limit_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "a watchdog guards a task"
        self._task = task
        self.limit_s = limit_s
        self.fired = False
        self._last = self._loop.time()
        self._handle = self._loop.call_at(self._last + limit_s, self._check)

    def heard(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        if self._task.done():
            return
        due = self._last + self.limit_s
        if self._loop.time() >= due:
            self.fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(due, self._check)

    def close(self) -> None:
        self._handle.cancel()


class OpenAIClient:
    """Minimal client of vLLM's OpenAI-compatible server, over one shared aiohttp session."""

    def __init__(
        self,
        model: str = "",
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
    ) -> None:
        self._model = model
        self._models: dict[str, str] = {}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        # The decode stream's silence is bounded by a SilenceWatchdog instead of sock_read.
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=None)
        self._read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def model(self, leg: str, endpoint: str) -> str:
        """The served model name: configured, or the first entry of GET /v1/models (cached)."""
        if self._model:
            return self._model
        cached = self._models.get(endpoint)
        if cached:
            return cached
        url = f"{endpoint}/v1/models"
        try:
            async with self._http().get(url) as resp:
                if resp.status != 200:
                    raise _http_error(leg, url, resp.status, await resp.text())
                data = await resp.json(content_type=None)
                name = str(data["data"][0]["id"])
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError(leg, f"GET {url}: {exc!r}", unavailable=True) from exc
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LegError(leg, f"GET {url}: no model listed ({exc!r})", unavailable=False) from exc
        self._models[endpoint] = name
        return name

    async def healthy(self, endpoint: str, timeout_s: float = 2.0) -> bool:
        """True when the server answers ``GET /health`` with 200 (it serves requests)."""
        try:
            async with self._http().get(f"{endpoint}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def _body(
        self, model: str, p: GenerateParams, params: dict[str, Any] | None, stream: bool, max_tokens: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": p.prompt_token_ids,
            "max_tokens": (max_tokens or p.max_tokens) if stream else 1,
            "temperature": p.temperature,
            "ignore_eos": p.ignore_eos,
            # Token ids for the streamed (decode) leg only: the prefill leg's answer is read for
            # its status, and vLLM would echo the whole prompt's ids in it (serialized on the
            # prefill core, right when the first-token hand-off's push needs that core).
            "return_token_ids": stream,
            "stream": stream,
        }
        if params is not None:  # None: a plain request (a decode that prefills it itself)
            body["kv_transfer_params"] = params
        if p.seed is not None:
            body["seed"] = p.seed
        return body

    async def prefill(self, endpoint: str, p: GenerateParams, params: dict[str, Any]) -> None:
        body = self._body(await self.model("prefill", endpoint), p, params, stream=False)
        url = f"{endpoint}/v1/completions"
        try:
            async with self._http().post(url, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise _http_error("prefill", url, resp.status, text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError("prefill", f"POST {url}: {exc!r}", unavailable=True) from exc

    async def decode(
        self, endpoint: str, p: GenerateParams, params: dict[str, Any] | None, max_tokens: int | None = None
    ) -> AsyncIterator[Chunk]:
        """The streamed chunks. Reads whatever has arrived and splits it into lines itself (one
        await per read, not one per line); a stream silent for the read timeout fails the leg."""
        body = self._body(await self.model("decode", endpoint), p, params, stream=True, max_tokens=max_tokens)
        url = f"{endpoint}/v1/completions"
        watchdog = SilenceWatchdog(self._read_timeout_s)
        try:
            async with self._http().post(url, json=body, timeout=self._stream_timeout) as resp:
                if resp.status != 200:
                    raise _http_error("decode", url, resp.status, await resp.text())
                rest = b""
                async for data in resp.content.iter_any():
                    watchdog.heard()
                    *lines, rest = (rest + data).split(b"\n")
                    if len(rest) > MAX_STREAM_LINE:
                        raise LegError("decode", f"{url}: a stream line over {MAX_STREAM_LINE} bytes", False)
                    # The events of one read go on merged (several when the relay fell behind).
                    chunks: list[Chunk] = []
                    end: LegError | None = None  # a bad event: the leg fails after the tokens before it
                    done = False
                    for raw in lines:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        event = line[5:].strip()
                        if event == b"[DONE]":
                            done = True
                            break
                        try:
                            chunks.append(_parse_chunk(url, event))
                        except LegError as exc:
                            end = exc
                            break
                    for chunk in merged_runs(chunks):
                        yield chunk
                    if end is not None:
                        raise end
                    if done:
                        return
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError("decode", f"POST {url}: {exc!r}", unavailable=True) from exc
        except asyncio.CancelledError:
            # Only the watchdog's own cancellation becomes the leg's failure; a caller's stays one.
            if watchdog.fired and self._uncancel() == 0:
                silent = f"POST {url}: nothing read for {watchdog.limit_s:g}s"
                raise LegError("decode", silent, unavailable=True) from None
            raise
        finally:
            watchdog.close()

    @staticmethod
    def _uncancel() -> int:
        task = asyncio.current_task()
        return task.uncancel() if task is not None else 0


def _http_error(leg: str, url: str, status: int, body: str) -> LegError:
    return LegError(leg, f"{url} HTTP {status}: {body[:_MAX_BODY]}", unavailable=status in _UNAVAILABLE_HTTP)


def _parse_chunk(url: str, data: bytes) -> Chunk:
    try:
        obj = json.loads(data)
        if "error" in obj:
            raise LegError("decode", f"{url} stream error: {json.dumps(obj['error'])[:_MAX_BODY]}", False)
        choice = obj["choices"][0]
        return Chunk(
            token_ids=[int(t) for t in choice.get("token_ids") or []],
            finish_reason=choice.get("finish_reason") or "",
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise LegError("decode", f"{url} bad stream chunk {data[:200]!r}: {exc!r}", False) from exc


# With the hand-off, how long a finished decode leg's chunks wait for the relay of prefill's token.
FIRST_TOKEN_AFTER_DECODE_S = 10.0


async def run_legs(
    client: OpenAIClient,
    rec: AssignmentRecord,
    p: GenerateParams,
    lost: asyncio.Future[str],
    signer: LegSealer | None = None,
    on_prefill_failed: Callable[[str, str], object] | None = None,
    first_token: asyncio.Future[SampledToken] | None = None,
    lost_stall_s: float = 0.0,
    first_token_after_decode_s: float = FIRST_TOKEN_AFTER_DECODE_S,
) -> AsyncIterator[Chunk]:
    """Sends both legs at once (signed by ``signer`` when given) and yields the decode chunks (those
    that queued up while the caller wrote the previous one merged: ``merged_runs``). Raises
    LegError when the decode leg fails, AssignmentLost when ``lost`` resolves first. A failed prefill
    leg does not end the request: the decode engine, which holds the reservation, reroutes the
    transfer to another prefill or fails the request itself (then the decode leg says so, and the
    error names the prefill leg's failure too). ``on_prefill_failed(prefill engine id, reason)`` is
    called the moment the prefill leg fails, so decode can fail over at once. Leaving early (cancel,
    error) aborts both legs.

    ``first_token`` (with ``rec.first_token``): resolves with the token prefill sampled; it is
    yielded first, the decode leg asks for one token less, and its chunks follow (a decode chunk
    can only come after decode got the same token, but is held back until it was yielded). Decode
    can even finish before the relay reaches this call (it may have the token from the push's
    completion): the held chunks then wait for the token up to ``first_token_after_decode_s``.

    ``lost_stall_s`` > 0: once the decode leg has streamed (its KV landed, so the request needs
    nothing more of the assignment), losing the assignment (its decode's lease ran out: a decode
    starved of CPU looks like a dead one) does not end the call; decode's own stream decides, and
    the call ends with AssignmentLost only if no chunk comes for ``lost_stall_s`` after it.

    An assignment without a prefill (its decode prefills the request itself) sends one plain request
    to decode, whole, with no kv_transfer_params."""
    prefill_spec = rec.prefill
    prefill_params, decode_params = leg_params(rec, signer) if prefill_spec is not None else ({}, None)
    handoff = rec.first_token and first_token is not None and prefill_spec is not None
    q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def decode_leg() -> None:
        try:
            n = p.max_tokens - 1 if handoff else None
            async for chunk in client.decode(rec.decode.http_endpoint, p, decode_params, max_tokens=n):
                q.put_nowait(("chunk", chunk))
            q.put_nowait(("done", None))
        except LegError as exc:
            q.put_nowait(("error", exc))
        except Exception as exc:  # a bug must end the call, never leave it waiting for its deadline
            q.put_nowait(("error", LegError("decode", f"decode leg crashed: {exc!r}", False)))

    async def prefill_leg() -> None:
        assert prefill_spec is not None  # only sent for an assignment with a prefill
        prefill = prefill_spec.engine_id
        try:
            await client.prefill(prefill_spec.http_endpoint, p, prefill_params)
        except LegError as exc:
            prefill_error.append(exc)
            if on_prefill_failed is not None:
                on_prefill_failed(prefill, exc.message)

    prefill_error: list[LegError] = []

    def on_lost(f: asyncio.Future[str]) -> None:
        if not f.cancelled():
            q.put_nowait(("lost", f.result()))

    def on_first_token(f: asyncio.Future[SampledToken]) -> None:
        if not f.cancelled():
            q.put_nowait(("first", f.result()))

    # With the hand-off the client's first token is prefill's: its leg goes on the wire first. Without
    # it, decode's reservation goes first (the push starts when both it and the prefill are done).
    if prefill_spec is None:
        legs: tuple[Callable[[], Coroutine[Any, Any, None]], ...] = (decode_leg,)
    else:
        legs = (prefill_leg, decode_leg) if handoff else (decode_leg, prefill_leg)
    tasks = [asyncio.create_task(leg()) for leg in legs]
    lost.add_done_callback(on_lost)
    if handoff:
        assert first_token is not None
        first_token.add_done_callback(on_first_token)
    held: list[Chunk] = []  # decode chunks that came before the first token was yielded
    waiting_first = handoff
    decode_streamed = False
    decode_done = False  # the decode leg ended while its chunks wait for the first token
    lost_while_streaming = ""
    deferred: list[tuple[str, Any]] = []  # taken from the queue behind decode chunks, not yet handled
    try:
        while True:
            # Unbounded, except once decode ended without the first token or lost its assignment.
            timeout = first_token_after_decode_s if decode_done else (lost_stall_s if lost_while_streaming else None)
            try:
                kind, value = deferred.pop() if deferred else await asyncio.wait_for(q.get(), timeout)
            except TimeoutError:
                if decode_done:
                    why = f"the decode leg ended and prefill's first token did not come within {timeout:g}s"
                    raise LegError("decode", why, False) from None
                stalled = f"{lost_while_streaming} (and decode streamed nothing for {timeout:g}s after)"
                raise AssignmentLost(stalled) from None
            if kind == "first":
                waiting_first = False
                yield Chunk(token_ids=[int(value.token_id)], finish_reason="stop" if value.stopped else "")
                if value.stopped:
                    return  # EOS: nothing follows it (leaving aborts the decode leg)
                for chunk in merged_runs(held):
                    yield chunk
                held.clear()
                if decode_done:
                    break
            elif kind == "chunk":
                decode_streamed = True
                # Chunks that queued while the previous message was written go out as one message:
                # under load the relay's cost is per message, not per token.
                chunks = [value]
                size = len(value.token_ids)
                while size < MAX_TOKENS_PER_MESSAGE and not q.empty():
                    item = q.get_nowait()
                    if item[0] != "chunk":
                        deferred.append(item)
                        break
                    chunks.append(item[1])
                    size += len(item[1].token_ids)
                if waiting_first:
                    held.extend(chunks)
                else:
                    for chunk in merged_runs(chunks):
                        yield chunk
            elif kind == "done":
                if not waiting_first:
                    break
                if not decode_streamed:
                    raise LegError("decode", "the decode leg ended before the first token came", False)
                # Decode continued from prefill's token (taken from the push's completion) before the
                # scheduler's relay of that token reached this call: it is on its way.
                decode_done = True
            elif kind == "error":
                if prefill_error:
                    why = f"{value.message} (after the prefill leg failed: {prefill_error[0].message})"
                    raise LegError(value.leg, why, value.unavailable)
                raise value
            elif decode_streamed and lost_stall_s > 0:
                if not lost_while_streaming:
                    log.warning("generate_assignment_lost_decode_streaming", transfer_id=rec.transfer_id, reason=value)
                lost_while_streaming = value
            else:
                raise AssignmentLost(value)
        # Decode finished, so prefill's KV arrived; give its HTTP answer a moment, then drop it.
        await asyncio.wait(tasks[1:] or tasks, timeout=5.0)
    finally:
        lost.remove_done_callback(on_lost)
        if first_token is not None:
            first_token.remove_done_callback(on_first_token)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

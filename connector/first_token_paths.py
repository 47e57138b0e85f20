"""The first-token hand-off's token from prefill to decode without the scheduler
(docs/first_token.md).

The scheduler's relay (prefill -> ``ReportFirstTokens`` -> scheduler -> decode's load stream) is
the path every token takes. Two more skip the scheduler, so decode has the token sooner (the push
starts at the forward's end, ``push_after_output=false``, so its KV lands before that relay does)
and whether or not the scheduler is there:

- **prefill's own call**: right after the scheduler's call, the engine thread starts a
  ``DecodeRank.FirstTokens`` call to the decode engine's rank 0 (``DecodeTokenSender``; gRPC's C
  core sends it). The endpoint comes from the reservations stream that decode engine keeps open to
  this process's agent (``DecodeRankDirectory``);
- **the push's completions**: the scheduler half posts the token it sampled
  (``SampledFirstTokens.post``, at ``request_finished``); the rank's agent puts it in each OK
  completion it sends, waiting for it (``first_token_completion_wait_ms``) when the WRITE finished
  before the token was posted.

On decode the rank hands either to the scheduler half (``DecodeTokenInbox.offer``; a completion's
before the release it may cause, so both are seen by the same engine step), which takes it only
from the request's leg prefill and only while the request waits for it.

All of it is process-wide and reaches only within one process: vLLM's ``uni`` executor, where the
scheduler half and the worker share the engine-core process. Under ``mp`` the directory and the
board of the scheduler half's process stay empty and the decode worker's inbox has no taker; the
relay (which runs either way) delivers the token, as before.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable

import grpc

from kvpush.services.common.grpc_util import CHANNEL_OPTIONS
from kvpush.services.common.logs import get_logger
from kvpush.services.common.security import Security
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

log = get_logger("kvpush.connector.first_tokens")
_MAX_CHANNELS = 64  # decode ranks this engine keeps a channel to (least recently used closed first)

_CAPACITY = 4096  # tokens kept, for the newest transfers (oldest dropped first)


class SampledFirstTokens:
    """Prefill: transfer id -> the first token this process's engine sampled for it.

    The scheduler half ``expect``s a hand-off transfer's token when the step that computes its
    last prompt chunk is built (before its push can start) and ``post``s it when the request ends
    (``forget``s it when the request ends without one). A completion whose WRITE finished before
    the post (the push starts at the forward's end; the token is sampled and its request ended on
    the engine thread meanwhile) ``wait``s for it, bounded. Tokens are kept for the newest
    ``capacity`` transfers, not dropped when the transfer's blocks are freed: the agent's loop may
    send a completion only after that (a starved loop thread on a busy core), and a completion
    sent later than ``capacity`` transfers goes without its token, nothing worse."""

    def __init__(self, capacity: int = _CAPACITY) -> None:
        self._lock = threading.Lock()
        self._tokens: OrderedDict[str, int | None] = OrderedDict()  # None: expected, not posted yet
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[int | None]]]] = {}
        self._capacity = capacity

    def expect(self, transfer_id: str) -> None:
        with self._lock:
            self._put(transfer_id, self._tokens.get(transfer_id))

    def post(self, transfer_id: str, token: int) -> None:
        with self._lock:
            self._put(transfer_id, token)
            self._wake(transfer_id, token)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._tokens.pop(transfer_id, None)
            self._wake(transfer_id, None)

    def get(self, transfer_id: str) -> int | None:
        with self._lock:
            return self._tokens.get(transfer_id)

    async def wait(self, transfer_id: str, timeout_s: float) -> int | None:
        """The token, once posted; None at once for a transfer nothing is expected for, or when
        it is forgotten or ``timeout_s`` passes first."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if transfer_id not in self._tokens:
                return None
            token = self._tokens[transfer_id]
            if token is not None:
                return token
            fut: asyncio.Future[int | None] = loop.create_future()
            waiter = (loop, fut)
            self._waiters.setdefault(transfer_id, []).append(waiter)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return None
        finally:
            with self._lock:
                waiting = self._waiters.get(transfer_id)
                if waiting is not None and waiter in waiting:
                    waiting.remove(waiter)
                    if not waiting:
                        del self._waiters[transfer_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)

    def _put(self, transfer_id: str, token: int | None) -> None:
        self._tokens[transfer_id] = token
        self._tokens.move_to_end(transfer_id)
        while len(self._tokens) > self._capacity:
            oldest, _ = self._tokens.popitem(last=False)
            self._wake(oldest, None)

    def _wake(self, transfer_id: str, token: int | None) -> None:
        for loop, fut in self._waiters.pop(transfer_id, []):
            loop.call_soon_threadsafe(_settle, fut, token)


def _settle(fut: asyncio.Future[int | None], token: int | None) -> None:
    if not fut.done():
        fut.set_result(token)


class DecodeTokenInbox:
    """Decode: first tokens that came from prefill without the scheduler (with a completion, or in
    prefill's own ``FirstTokens`` call), for the scheduler half of this process."""

    def __init__(self) -> None:
        self._sink: Callable[[pb.FirstToken, str], None] | None = None

    def bind(self, sink: Callable[[pb.FirstToken, str], None] | None) -> None:
        self._sink = sink

    def offer(self, token: pb.FirstToken, via: str) -> bool:
        """Hands ``token`` on (``via``: "completion" or "prefill_call"); False when no scheduler
        half of this process takes tokens."""
        sink = self._sink
        if sink is None:
            return False
        sink(token, via)
        return True


class DecodeRankDirectory:
    """Prefill: decode engine id -> its rank 0's ``DecodeRank`` endpoint, while a reservations
    stream from that engine is open on this process's agent (the worker registers them; the
    scheduler half looks them up to send first tokens straight to decode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, tuple[str, str]] = {}  # engine id -> (stream key, endpoint)

    def opened(self, engine_id: str, stream_key: str, endpoint: str) -> None:
        with self._lock:
            self._open[engine_id] = (stream_key, endpoint)

    def closed(self, engine_id: str, stream_key: str) -> None:
        """A stream ended; a newer stream of the same engine (a reconnect) keeps its entry."""
        with self._lock:
            if self._open.get(engine_id, ("",))[0] == stream_key:
                del self._open[engine_id]

    def endpoint(self, engine_id: str) -> str | None:
        with self._lock:
            entry = self._open.get(engine_id)
        return entry[1] if entry is not None else None


class DecodeTokenSender:
    """Prefill, the engine thread: starts a ``DecodeRank.FirstTokens`` call for a first token
    (gRPC's C core sends it; nothing waits). A failure is logged and nothing else: the scheduler's
    relay carries the same token."""

    def __init__(self, security: Security, engine_id: str, incarnation: str, timeout_s: float = 2.0) -> None:
        self._security = security
        self._engine_id = engine_id
        self._incarnation = incarnation
        self._timeout_s = timeout_s
        self._stubs: OrderedDict[str, tuple[grpc.Channel, pb_grpc.DecodeRankStub]] = OrderedDict()

    def send(self, endpoint: str, token: pb.FirstToken) -> None:
        try:
            stub = self._stub(endpoint)
            call = stub.FirstTokens.future(
                pb.FirstTokenReport(engine_id=self._engine_id, incarnation=self._incarnation, first_tokens=[token]),
                timeout=self._timeout_s,
            )
        except Exception as exc:  # a channel closed under us
            log.warning("first_token_to_decode_failed", transfer_id=token.transfer_id, reason=repr(exc))
            return
        call.add_done_callback(functools.partial(_sent, token.transfer_id))

    def close(self) -> None:
        for channel, _ in self._stubs.values():
            channel.close()
        self._stubs.clear()

    def _stub(self, endpoint: str) -> pb_grpc.DecodeRankStub:
        entry = self._stubs.get(endpoint)
        if entry is None:
            channel = self._security.sync_channel(endpoint, CHANNEL_OPTIONS)
            entry = self._stubs[endpoint] = (channel, pb_grpc.DecodeRankStub(channel))
            while len(self._stubs) > _MAX_CHANNELS:
                _, (old, _) = self._stubs.popitem(last=False)
                old.close()
        else:
            self._stubs.move_to_end(endpoint)
        return entry[1]


def _sent(transfer_id: str, call: grpc.Future) -> None:
    exc = call.exception()
    if exc is not None:
        log.warning(
            "first_token_to_decode_failed",
            transfer_id=transfer_id,
            code=exc.code().name if isinstance(exc, grpc.Call) else None,
            reason=exc.details() if isinstance(exc, grpc.Call) else repr(exc),
        )


SAMPLED_FIRST_TOKENS = SampledFirstTokens()
DECODE_TOKEN_INBOX = DecodeTokenInbox()
DECODE_RANKS = DecodeRankDirectory()

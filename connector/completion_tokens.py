"""The first-token hand-off's token on the push's own completion (docs/first_token.md).

Without it decode has prefill's first token only through the scheduler's relay (prefill ->
``ReportFirstTokens`` -> scheduler -> decode's load stream). Once a push starts at the forward's
end (``push_after_output=false``) the KV lands before that relay does, and decode waits for the
token. So each ``Completion`` of a hand-off transfer also carries the token when the prefill
engine has sampled it by the time the completion leaves, and decode takes it there:

- prefill: the worker posts the token the moment it samples it (``AwaitedFirstTokens``, from
  ``KvPushWorker.sample_tokens``; ``SampledFirstTokens.post``), and the transfer's push starts
  then (``push_at_sampling``); without that worker class the scheduler half posts it at
  ``request_finished``. The rank's agent puts it in each completion it sends, waiting for it
  (``first_token_completion_wait_ms``) when the WRITE finished before the token was posted; the
  completion notices carry it too, the one the posting thread sends from the board's listener
  right after the post included (services/prefill_agent/notices.py);
- decode: the rank hands the token of an OK completion its barrier accepted to the scheduler half
  (``CompletionTokenInbox.offer``), before the release it may cause, so both are seen by the same
  engine step.

Both ends are process-wide and reach only within one process. The worker's post reaches its rank's
agent under either executor (both live in the worker's process); the scheduler half's post only
under ``uni``, where the scheduler half and the worker share the engine-core process. On decode
the inbox has a taker only under ``uni``; under ``mp`` the relay (which runs either way) delivers
the token, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpush.services.common.logs import get_logger
from kvpush.v1 import kvpush_pb2 as pb

log = get_logger("kvpush.connector.tokens")

_CAPACITY = 4096  # tokens kept, for the newest transfers (oldest dropped first)


class SampledFirstTokens:
    """Prefill: transfer id -> the first token this process's engine sampled for it.

    The scheduler half ``expect``s a hand-off transfer's token when the step that computes its
    last prompt chunk is built (before its push can start), and so does the worker for that step's
    forward; the worker ``post``s it when it is sampled, the scheduler half when the request ends
    if it is not in yet (``forget``s it when the request ends without one). A completion whose
    WRITE finished before the post (a push started before the token was sampled) ``wait``s for it,
    bounded. Tokens are kept for the newest
    ``capacity`` transfers, not dropped when the transfer's blocks are freed: the agent's loop may
    send a completion only after that (a starved loop thread on a busy core), and a completion
    sent later than ``capacity`` transfers goes without its token, nothing worse."""

    def __init__(self, capacity: int = _CAPACITY) -> None:
        self._lock = threading.Lock()
        self._tokens: OrderedDict[str, int | None] = OrderedDict()  # None: expected, not posted yet
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[int | None]]]] = {}
        self._capacity = capacity
        self._listeners: list[Callable[[str, int], None]] = []

    def add_listener(self, listener: Callable[[str, int], None]) -> None:
        """``listener(transfer_id, token)`` runs on the posting (engine) thread after each post: it
        must not block; what it raises is logged and dropped."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[str, int], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def expect(self, transfer_id: str) -> None:
        with self._lock:
            self._put(transfer_id, self._tokens.get(transfer_id))

    def post(self, transfer_id: str, token: int) -> None:
        with self._lock:
            self._put(transfer_id, token)
            self._wake(transfer_id, token)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(transfer_id, token)
            except Exception:  # never into the engine thread
                log.exception("first_token_listener_failed", transfer_id=transfer_id)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._tokens.pop(transfer_id, None)
            self._wake(transfer_id, None)

    def get(self, transfer_id: str) -> int | None:
        with self._lock:
            return self._tokens.get(transfer_id)

    def pending(self, transfer_id: str) -> bool:
        """Expected (a hand-off transfer's) and not posted yet."""
        with self._lock:
            return transfer_id in self._tokens and self._tokens[transfer_id] is None

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
            # The engine thread posts: an agent loop that closed meanwhile must not raise into it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, token)


def _settle(fut: asyncio.Future[int | None], token: int | None) -> None:
    if not fut.done():
        fut.set_result(token)


class CompletionTokenInbox:
    """Decode: first tokens that came with completions, for the scheduler half of this process."""

    def __init__(self) -> None:
        self._sink: Callable[[pb.FirstToken], None] | None = None

    def bind(self, sink: Callable[[pb.FirstToken], None] | None) -> None:
        self._sink = sink

    def offer(self, token: pb.FirstToken) -> bool:
        """Hands ``token`` on; False when no scheduler half of this process takes tokens."""
        sink = self._sink
        if sink is None:
            return False
        sink(token)
        return True


@dataclass(frozen=True)
class AwaitedToken:
    """A hand-off request whose first token the current step samples."""

    transfer_id: str
    # Its push is held until the token is sampled (``push_at_sampling``), then released.
    holds_push: bool = False
    # Set once the writer has handled that push; the engine thread waits for it up to ``wait_s``
    # before it processes the step's output (``push_first_wait_ms``), so the WRITE goes first.
    # None: no wait.
    handled: threading.Event | None = None
    wait_s: float = 0.0


class AwaitedFirstTokens:
    """Prefill worker: the hand-off requests whose first token this process's sampler produces in
    the current step (their last prompt chunk is in its forward), so the token is posted to the
    board the moment it is sampled (``KvPushWorker.sample_tokens``), not when the engine thread
    has processed the step's output and ended the request, which on a busy prefill core comes
    after the push's WRITE (docs/first_token.md). Engine thread only (the uni executor's worker
    runs there; under ``mp`` each worker process has its own board and agent)."""

    def __init__(self, board: SampledFirstTokens) -> None:
        self._board = board
        self._awaited: dict[str, AwaitedToken] = {}  # request id -> its transfer
        self._trace = False

    def await_token(self, request_id: str, awaited: AwaitedToken, trace: bool = False) -> None:
        self._board.expect(awaited.transfer_id)
        self._awaited[request_id] = awaited
        self._trace = trace

    def sampled(self, output: object) -> list[AwaitedToken]:
        """Posts the awaited tokens from a step's ``ModelRunnerOutput``; anything else (an async
        output) leaves them to the request's end, where the scheduler half posts or forgets.
        Returns what was awaited (held pushes start now, with or without the token)."""
        if not self._awaited:
            return []
        # Each was awaited for this step's forward only: one missing from its output (nothing
        # sampled for it) is left to the request's end.
        awaited, self._awaited = self._awaited, {}
        index = getattr(output, "req_id_to_index", None)
        sampled = getattr(output, "sampled_token_ids", None)
        if index is None or sampled is None:
            return list(awaited.values())
        for rid, a in awaited.items():
            i = index.get(rid)
            tokens: Sequence[int] = sampled[i] if i is not None and i < len(sampled) else []
            if not len(tokens):
                continue
            self._board.post(a.transfer_id, int(tokens[0]))
            if self._trace:
                log.info("first_token_sampled", transfer_id=a.transfer_id, request_id=rid)
        return list(awaited.values())

    def __len__(self) -> int:
        return len(self._awaited)


SAMPLED_FIRST_TOKENS = SampledFirstTokens()
COMPLETION_TOKENS = CompletionTokenInbox()
AWAITED_FIRST_TOKENS = AwaitedFirstTokens(SAMPLED_FIRST_TOKENS)

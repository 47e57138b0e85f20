"""A frontend's side of ``Scheduler.AssignStream``: many concurrent ``assign`` calls, few messages.

``AssignStreamClient`` keeps one stream open and coalesces what its callers ask for: every Assign
and Release queued while earlier batches are on the wire leaves in the next batch (at most
``max_batch`` assigns), so an idle frontend pays one round trip per Assign and a busy one a
fraction of a message per Assign, without a timer adding latency. At most ``max_in_flight``
batches are unanswered at once.

Releases leave in the next batch too, alone if no Assign is queued. With ``release_delay_ms`` > 0
a Release waits up to that long for an Assign to ride with (a batch's worth of Releases, or
``close``, sends them at once): at moderate rates that halves the messages, and the CPU both sides
spend per assignment, at the price of an idle-woken round trip for the next Assign (measured in
docs/scheduler.md).

A broken stream fails every unanswered ``assign`` with ``AssignError`` (the stream's code, e.g.
UNAVAILABLE) and the client is closed; the assignments it made stay open on the scheduler until
released (by any client) or their TTL. Releases are sent without waiting for their results; one
that fails is logged.

``compact=True`` asks for ``CompactAssignment`` answers (``assign_compact``): engine ids, HTTP
endpoints and both legs' ``kv_transfer_params`` as JSON text to put into the HTTP bodies as they
are, the cheapest shape for the scheduler to build and for a frontend to use.

``first_tokens=True`` asks the scheduler to deliver, on the same stream, the first token of every
assignment granted the first-token hand-off (docs/first_token.md): ``await first_token(transfer_id)``
answers as ``AwaitFirstToken`` would, without a call per request. The client keeps each result
until ``first_token`` or ``release`` takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc

from kvpush.services.common import limits
from kvpush.services.common.logs import get_logger
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

log = get_logger("kvpush.assign_client")


class AssignError(Exception):
    """An assign (or the stream) ended with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


Answer = pb.Assignment | pb.CompactAssignment

# How long a Release may wait for an Assign to ride with (0: it leaves in the next batch, alone if
# need be). While it waits, its decode's blocks still count as pending on the scheduler.
DEFAULT_RELEASE_DELAY_MS = 0.0
MAX_RELEASE_DELAY_MS = 60_000.0


@dataclass
class _Sent:
    assigns: list[asyncio.Future[Answer]]
    releases: list[pb.ReleaseRequest] = field(default_factory=list)


class AssignStreamClient:
    def __init__(
        self,
        stub: pb_grpc.SchedulerStub,
        *,
        max_batch: int = limits.MAX_ASSIGNS_PER_BATCH,
        max_in_flight: int = 2,
        max_wait_ms: int = 0,
        compact: bool = False,
        release_delay_ms: float = DEFAULT_RELEASE_DELAY_MS,
        first_tokens: bool = False,
    ) -> None:
        if not 1 <= max_batch <= limits.MAX_ASSIGNS_PER_BATCH:
            raise ValueError(f"max_batch must be in 1..{limits.MAX_ASSIGNS_PER_BATCH}")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if not 0 <= release_delay_ms <= MAX_RELEASE_DELAY_MS:
            raise ValueError(f"release_delay_ms must be in 0..{MAX_RELEASE_DELAY_MS}")
        self._stub = stub
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.max_wait_ms = max_wait_ms
        self.compact = compact
        self.first_tokens = first_tokens
        # transfer id -> (the epoch it was assigned, its first token's result), for hand-off assignments
        self._tokens: dict[str, tuple[int, asyncio.Future[pb.FirstTokenResult]]] = {}
        self.release_delay_s = release_delay_ms / 1000
        self._release_window = 0  # counts the times the Release queue went from empty to not
        self._releases_overdue = False  # the queued Releases leave now, with or without an Assign
        self._flushing = False
        self._assigns: list[tuple[pb.AssignRequest, asyncio.Future[Answer]]] = []
        self._releases: list[pb.ReleaseRequest] = []
        self._sent: dict[int, _Sent] = {}
        self._next_id = 1
        self._wake = asyncio.Event()
        self._answered = asyncio.Event()  # set on every answer and when the stream fails
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._error: AssignError | None = None
        self.batches = 0  # batches sent (for benchmarks and tests)

    @property
    def error(self) -> AssignError | None:
        """Why the stream ended (then every call raises it), or None while it is open."""
        return self._error

    async def start(self) -> AssignStreamClient:
        self._call = self._stub.AssignStream()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._read_loop())]
        return self

    async def __aenter__(self) -> AssignStreamClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def assign(self, request: pb.AssignRequest) -> pb.Assignment:
        """The assignment for ``request``; raises AssignError with the code the unary Assign would
        have ended with (or the stream's, when it broke). Only without ``compact``."""
        if self.compact:
            raise ValueError("this client asks for compact answers: use assign_compact")
        answer = await self._assign(request)
        assert isinstance(answer, pb.Assignment)
        return answer

    async def assign_compact(self, request: pb.AssignRequest) -> pb.CompactAssignment:
        """``assign`` for a client made with ``compact=True``: the CompactAssignment."""
        if not self.compact:
            raise ValueError("this client asks for full answers: use assign, or compact=True")
        answer = await self._assign(request)
        assert isinstance(answer, pb.CompactAssignment)
        return answer

    async def _assign(self, request: pb.AssignRequest) -> Answer:
        if self._error is not None:
            raise self._error
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._assigns.append((request, fut))
        self._wake.set()
        return await fut

    async def first_token(self, transfer_id: str) -> pb.AwaitFirstTokenResponse:
        """The first token of an assignment this client got with the hand-off granted (a client made
        with ``first_tokens=True``), once the scheduler has it; raises AssignError with the code
        ``AwaitFirstToken`` would have ended with (or the stream's, when it broke: then
        ``AwaitFirstToken`` can still answer it). Each result is taken once."""
        entry = self._tokens.get(transfer_id)
        if entry is None:
            raise ValueError(f"no first token is expected for {transfer_id!r} on this stream")
        try:
            result = await entry[1]
        finally:
            if self._tokens.get(transfer_id) is entry:
                del self._tokens[transfer_id]
        if result.code != 0:
            raise AssignError(status_code(result.code), result.message)
        return result.token

    def release(self, transfer_id: str, epoch: int, outcome: pb.Outcome.ValueType, reason: str = "") -> None:
        """Queues a Release for the next batch (no result is waited for); drops the transfer's first
        token if ``first_token`` has not taken it."""
        if self._error is not None:
            raise self._error
        self._tokens.pop(transfer_id, None)
        if not self._releases and self.release_delay_s:
            self._release_window += 1
            self._releases_overdue = False
            asyncio.get_running_loop().call_later(self.release_delay_s, self._release_timer, self._release_window)
        self._releases.append(pb.ReleaseRequest(transfer_id=transfer_id, epoch=epoch, outcome=outcome, reason=reason))
        if not self.release_delay_s or len(self._releases) >= limits.MAX_RELEASES_PER_BATCH:
            self._wake.set()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued and waits (up to ``timeout_s``) for the answers, then ends the stream."""
        if self._call is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush(), timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await task
        if self._call is not None:
            self._call.cancel()
        self._fail(AssignError(grpc.StatusCode.CANCELLED, "the client was closed"))

    async def _flush(self) -> None:
        self._flushing = True  # queued Releases leave now
        while self._error is None and (self._assigns or self._releases or self._sent):
            self._wake.set()
            self._answered.clear()
            await self._answered.wait()

    async def _send_loop(self) -> None:
        assert self._call is not None
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while (self._assigns or self._releases_due()) and len(self._sent) < self.max_in_flight:
                    taken, self._assigns = self._assigns[: self.max_batch], self._assigns[self.max_batch :]
                    releases = self._releases[: limits.MAX_RELEASES_PER_BATCH]
                    self._releases = self._releases[limits.MAX_RELEASES_PER_BATCH :]
                    if self._releases:  # the rest of a long queue leaves next
                        self._releases_overdue = True
                    batch_id = self._next_id
                    self._next_id += 1
                    msg = pb.AssignStreamRequest(
                        batch_id=batch_id,
                        max_wait_ms=self.max_wait_ms,
                        releases=releases,
                        compact=self.compact,
                        first_tokens=self.first_tokens,
                    )
                    msg.assigns.extend(req for req, _ in taken)
                    self._sent[batch_id] = _Sent([fut for _, fut in taken], releases)
                    self.batches += 1
                    await self._call.write(msg)
        except grpc.aio.AioRpcError as exc:
            self._fail(AssignError(exc.code(), exc.details() or ""))
        except asyncio.InvalidStateError:  # the call already ended; the reader reports why
            pass

    def _release_timer(self, window: int) -> None:
        if window == self._release_window and self._releases:
            self._releases_overdue = True
            self._wake.set()

    def _releases_due(self) -> bool:
        """Whether the queued Releases leave without an Assign to ride with."""
        return bool(self._releases) and (
            self._releases_overdue
            or self._flushing
            or not self.release_delay_s
            or len(self._releases) >= limits.MAX_RELEASES_PER_BATCH
        )

    async def _read_loop(self) -> None:
        assert self._call is not None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self._fail(AssignError(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the stream"))
                    return
                self._answer(response)
        except grpc.aio.AioRpcError as exc:
            self._fail(AssignError(exc.code(), exc.details() or ""))
        finally:
            # Cancelled (the call or this task): nobody may keep waiting for an answer.
            self._fail(AssignError(grpc.StatusCode.CANCELLED, "the stream was cancelled"))

    def _answer(self, response: pb.AssignStreamResponse) -> None:
        if not response.tokens_only:
            self._answer_batch(response)
        for result in response.first_tokens:
            entry = self._tokens.get(result.transfer_id)
            if entry is not None and entry[0] == result.epoch and not entry[1].done():
                entry[1].set_result(result)

    def _answer_batch(self, response: pb.AssignStreamResponse) -> None:
        sent = self._sent.pop(response.batch_id, None)
        if sent is None:
            log.warning("assign_stream_unknown_batch", batch_id=response.batch_id)
            return
        for fut, result in zip(sent.assigns, response.assigns, strict=False):
            if fut.done():
                continue
            if result.code == 0:
                answer = result.compact if self.compact else result.assignment
                if self.first_tokens and answer.first_token_from_prefill:
                    self._tokens[answer.transfer_id] = (answer.epoch, asyncio.get_running_loop().create_future())
                fut.set_result(answer)
            else:
                fut.set_exception(AssignError(status_code(result.code), result.message))
        for fut in sent.assigns[len(response.assigns) :]:
            if not fut.done():
                fut.set_exception(AssignError(grpc.StatusCode.INTERNAL, "the answer has no result for this assign"))
        for req, res in zip(sent.releases, response.releases, strict=False):
            if res.code != 0:
                log.warning(
                    "release_failed",
                    transfer_id=req.transfer_id,
                    code=status_code(res.code).name,
                    reason=limits.clip(res.message),
                )
        self._answered.set()
        if self._assigns or self._releases_due():
            self._wake.set()

    def _fail(self, error: AssignError) -> None:
        if self._error is None:
            self._error = error
        for sent in self._sent.values():
            for fut in sent.assigns:
                if not fut.done():
                    fut.set_exception(error)
        self._sent.clear()
        for _, fut in self._assigns:
            if not fut.done():
                fut.set_exception(error)
        self._assigns.clear()
        broken = pb.FirstTokenResult(code=error.code.value[0], message=error.message)
        for _, token in self._tokens.values():
            if not token.done():
                token.set_result(broken)
        self._answered.set()

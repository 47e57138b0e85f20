"""The scheduler servicer's shared core: its state, admission (queueing for capacity within the
caller's deadline), shutdown, error statuses, decision and release counters, and telling an
instance that the other leg of its assignment was not delivered. The RPCs build on it:
``generate_rpcs`` (Generate, Reroute), ``first_token_rpcs`` (ReportFirstTokens, AwaitFirstToken)
and ``servicer`` (everything else)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from kvpush.services.common import limits
from kvpush.services.common.logs import get_logger
from kvpush.services.scheduler import convert
from kvpush.services.scheduler.errors import FailedPrecondition, InvalidArgument, NoCapacity, NotFound, SchedulerError
from kvpush.services.scheduler.first_tokens import FirstTokenRelay
from kvpush.services.scheduler.generate import OpenAIClient
from kvpush.services.scheduler.load_stream_push import Outboxes
from kvpush.services.scheduler.metrics import Metrics
from kvpush.services.scheduler.model import (
    AssignmentRecord,
    Demand,
    Event,
    EventKind,
    InstanceSpec,
    Outcome,
    Role,
)
from kvpush.services.scheduler.registry import Registry
from kvpush.v1 import kvpush_pb2 as pb

_CODES: dict[type[SchedulerError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    NoCapacity: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def decision_keys(rec: AssignmentRecord) -> tuple[tuple[str, str], ...]:
    """The (role, engine id) decision counters an assignment adds to: its decode and its prefill,
    or ``prefill_on_decode`` for a decode that prefills the request itself."""
    if rec.prefill is None:
        return (("decode", rec.decode.engine_id), ("prefill_on_decode", rec.decode.engine_id))
    return (("decode", rec.decode.engine_id), ("prefill", rec.prefill.engine_id))


def handoff_granted(rec: AssignmentRecord, asked: bool) -> bool:
    """Whether an assignment gets the first-token hand-off: asked for, a decode that supports it,
    and a prefill leg (a decode that prefills the request samples the first token itself)."""
    return asked and rec.prefill is not None and rec.decode.first_token_handoff


# A finished prefill reported later than this is no sample of the engine's speed (it was starved).
MAX_PREFILL_DONE_AGE_S = 10.0


class ShuttingDown(NoCapacity):
    def __init__(self) -> None:
        super().__init__("shutting_down", "scheduler is shutting down; retry on another scheduler")


@dataclass(frozen=True)
class ServicerConfig:
    max_queue_s: float = 10.0  # longest an Assign waits for capacity (only with a caller deadline)
    max_queued: int = 1024  # Assign calls waiting for capacity at once
    deadline_margin_s: float = 0.02  # answer RESOURCE_EXHAUSTED this long before the caller's deadline
    watch_queue: int = 4096  # events buffered per Watch subscriber before it is cut off
    max_watch_subscribers: int = limits.MAX_WATCH_SUBSCRIBERS  # Watch streams at once
    max_generate: int = limits.MAX_CONCURRENT_GENERATE  # Generate calls in flight at once
    max_first_token_awaits: int = limits.MAX_FIRST_TOKEN_AWAITS  # AwaitFirstToken calls waiting at once
    max_instances: int = limits.MAX_INSTANCES  # registered instances
    max_reroutes: int = 2  # prefill engines one transfer is tried on (Reroute), the first included
    # Generate, once decode streams: an assignment lost under it (decode's lease ran out) ends the
    # call only if decode then streams nothing for this long (a starved decode is not a dead one).
    decode_stall_s: float = 5.0


class _Signal:
    """Wakes every waiter once per notify. Take ``current()`` after checking the condition with no
    await in between (so no notify can be missed), then wait on it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._taken = False

    def current(self) -> asyncio.Event:
        self._taken = True
        return self._event

    def notify(self) -> None:
        if self._taken:  # nobody can be waiting on an event nobody took
            self._event.set()
            self._event = asyncio.Event()
            self._taken = False


class Subscriber:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=size)
        self.overflowed = False

    def put(self, event: Event | None) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)


def _cause(event: Event) -> str:
    if event.reason.startswith("lease expired"):
        return "lease"
    if event.reason.startswith("replaced"):
        return "replaced"
    return "stream"


class ServicerCore:
    """State and helpers shared by every RPC of ``SchedulerServicer``."""

    def __init__(
        self,
        registry: Registry,
        metrics: Metrics,
        client: OpenAIClient | None = None,
        config: ServicerConfig | None = None,
        signer: convert.LegSealer | None = None,
    ) -> None:
        self.registry = registry
        self.signer = signer  # signs or MACs both legs of every assignment; None: unsigned legs (insecure)
        self.metrics = metrics
        self.client = client or OpenAIClient()
        self.config = config or ServicerConfig()
        self.log = get_logger("scheduler")
        self.shutting_down = False
        self._changed = _Signal()
        self._queued = 0
        self._inflight = 0
        self._generating = 0
        self._awaiting_first_token = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._subscribers: set[Subscriber] = set()
        self._lost: dict[str, asyncio.Future[str]] = {}
        self._decision_counters: dict[tuple[str, str], Any] = {}
        self._release_counters: dict[Outcome, Any] = {}
        self._prefill_legs: set[asyncio.Task[None]] = set()  # prefill legs sent by Reroute
        # Per instance with a load stream: leg failures and first tokens to push down it.
        self._outboxes = Outboxes()
        # First tokens from prefill to decode, to Generate calls and to AwaitFirstToken (hand-off).
        self._first_tokens = FirstTokenRelay(registry, self._outboxes, metrics)
        registry.event_listeners.append(self._on_event)
        registry.closed_listeners.append(self._on_closed)
        registry.capacity_listeners.append(self._changed.notify)

    def _on_event(self, event: Event) -> None:
        spec = event.spec
        fields: dict[str, Any] = {
            "engine_id": spec.engine_id,
            "incarnation": spec.incarnation,
            "role": spec.role.value,
        }
        if event.kind is EventKind.REGISTERED:
            self.log.info(
                "instance_registered",
                tp_size=spec.tp_size,
                total_kv_blocks=spec.total_kv_blocks,
                http_endpoint=spec.http_endpoint,
                **fields,
            )
        elif event.kind is EventKind.DEAD:
            self.metrics.lease_expiries.labels(spec.role.value, _cause(event)).inc()
            self.log.warning("instance_dead", reason=event.reason, **fields)
        else:
            self.log.info(f"instance_{event.kind.value}", reason=event.reason, **fields)
        for sub in self._subscribers:
            sub.put(event)

    def _on_closed(self, rec: AssignmentRecord) -> None:
        self.log.warning("assignment_failed", transfer_id=rec.transfer_id, state=rec.state.value, reason=rec.reason)
        fut = self._lost.get(rec.transfer_id)
        if fut is not None and not fut.done():
            fut.set_result(rec.reason)
        self._first_tokens.closed(rec)

    async def _abort(self, context: grpc.aio.ServicerContext, exc: SchedulerError) -> NoReturn:
        if isinstance(exc, ShuttingDown):
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        await context.abort(_CODES.get(type(exc), grpc.StatusCode.INTERNAL), str(exc))
        raise AssertionError("unreachable")

    async def _refuse(
        self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, reason: str
    ) -> NoReturn:
        """A request out of bounds (services/common/limits.py): one warning line, then the status."""
        self.log.warning("request_refused", method=method, code=code.name, reason=reason)
        await context.abort(code, reason)
        raise AssertionError("unreachable")

    def _begin(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def begin_shutdown(self) -> None:
        """New Assign/Generate calls get UNAVAILABLE; queued ones wake and fail; Watch streams and
        AwaitFirstToken calls end."""
        self.shutting_down = True
        self._changed.notify()
        self._first_tokens.close_all()
        for sub in self._subscribers:
            sub.put(None)

    def cancel_background(self) -> None:
        """Cancels the prefill legs Reroute still sends (at shutdown)."""
        for task in list(self._prefill_legs):
            task.cancel()

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no Assign/Generate call is in flight; False when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _admit(self, demand: Demand, transfer_id: str, time_remaining: float | None) -> AssignmentRecord:
        """Assigns now, or queues for capacity within the caller's deadline (never without one)."""
        if self.shutting_down:
            raise ShuttingDown()
        wait_until = None
        if time_remaining is not None:
            budget = min(time_remaining - self.config.deadline_margin_s, self.config.max_queue_s)
            wait_until = time.monotonic() + budget
        waited = False
        while True:
            try:
                return self.registry.assign(demand, transfer_id)
            except NoCapacity as exc:
                # No await since the attempt, so no change can have slipped in between.
                changed = self._changed.current()
                left = (wait_until - time.monotonic()) if wait_until is not None else 0.0
                if exc.reason == "too_large":
                    raise
                if left <= 0:
                    if waited:
                        raise NoCapacity(exc.reason, f"{exc} (queued until the deadline)") from None
                    raise
                if self._queued >= self.config.max_queued:
                    raise NoCapacity("queue_full", f"{exc}; admission queue is full") from None
                self._queued += 1
                waited = True
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except TimeoutError:
                    raise NoCapacity(exc.reason, f"{exc} (queued until the deadline)") from None
                finally:
                    self._queued -= 1
                if self.shutting_down:
                    raise ShuttingDown() from None

    def prefills_done(self, report: pb.LoadReport) -> None:
        """A prefill engine's prefills finished without the hand-off: its own queue estimate (local
        prefill) learns from them; the engine is the report's, authenticated by its stream. Bounded;
        entries with a bad id or older than ``MAX_PREFILL_DONE_AGE_S`` are skipped and counted."""
        inst = self.registry.instances.get(report.engine_id)
        if inst is None or inst.spec.role is not Role.PREFILL:
            self.log.warning("prefills_done_refused", engine_id=report.engine_id, reason="not a prefill engine")
            return
        if len(report.prefills_done) > limits.MAX_EXPECTATIONS_PER_CALL:
            self.log.warning("prefills_done_refused", engine_id=report.engine_id, reason="too many in one report")
            return
        backlog = inst.backlog
        if backlog is None:  # local prefill's wait rule is off, or has not looked at this engine yet
            return
        now = self.registry.clock()
        skipped = 0
        for done in report.prefills_done:
            age_s = done.age_us / 1e6
            if not done.transfer_id or len(done.transfer_id) > limits.MAX_ID_CHARS or age_s > MAX_PREFILL_DONE_AGE_S:
                skipped += 1
                continue
            backlog.finished(done.transfer_id, now - age_s)
        if skipped:
            self.log.warning("prefills_done_skipped", engine_id=report.engine_id, count=skipped)

    def _decided(self, rec: AssignmentRecord) -> None:
        self._count_decisions(dict.fromkeys(decision_keys(rec), 1))

    def _count_decisions(self, counts: dict[tuple[str, str], int]) -> None:
        """Adds (role, engine id) -> assignments to the decision counters (a batch at once)."""
        for key, n in counts.items():
            child = self._decision_counters.get(key)
            if child is None:
                child = self._decision_counters[key] = self.metrics.decisions.labels(*key)
            child.inc(n)

    def _count_releases(self, counts: dict[Outcome, int]) -> None:
        for outcome, n in counts.items():
            counter = self._release_counters.get(outcome)
            if counter is None:
                counter = self._release_counters[outcome] = self.metrics.releases.labels(outcome.value)
            counter.inc(n)

    def leg_failed(self, rec: AssignmentRecord, prefill_engine_id: str, reason: str) -> bool:
        """The prefill leg for ``prefill_engine_id`` was not delivered: tells the assignment's decode
        instance on its load stream (it fails that prefill over at once). False when it has no
        stream right now (decode then fails over at the reservation lease, as before)."""
        return self._push_leg_failure(rec.decode, rec, prefill_engine_id, reason, pb.ROLE_PREFILL)

    def decode_leg_failed(self, rec: AssignmentRecord, reason: str) -> bool:
        """The decode leg was not delivered: tells the assignment's prefill instance, which frees
        the KV it holds (or will hold) for the transfer instead of keeping it for its lease. False,
        and nothing to tell, for a transfer prefilled on its decode."""
        if rec.prefill is None:
            return False
        return self._push_leg_failure(rec.prefill, rec, rec.prefill.engine_id, reason, pb.ROLE_DECODE)

    def _push_leg_failure(
        self, to: InstanceSpec, rec: AssignmentRecord, prefill_engine_id: str, reason: str, leg: pb.Role.ValueType
    ) -> bool:
        failure = pb.LegFailure(
            transfer_id=rec.transfer_id, prefill_engine_id=prefill_engine_id, reason=limits.clip(reason), leg=leg
        )
        delivered = self._outboxes.push(to, failure)
        self.metrics.leg_failures.labels("pushed" if delivered else "undelivered").inc()
        self.log.warning(
            "leg_failed",
            transfer_id=rec.transfer_id,
            leg="decode" if leg == pb.ROLE_DECODE else "prefill",
            prefill=prefill_engine_id,
            told=to.engine_id,
            pushed=delivered,
            reason=limits.clip(reason),
        )
        return delivered

    def _code(self, exc: SchedulerError) -> grpc.StatusCode:
        if isinstance(exc, ShuttingDown):
            return grpc.StatusCode.UNAVAILABLE
        return _CODES.get(type(exc), grpc.StatusCode.INTERNAL)

    def _outside_vocab(self, token_ids: Sequence[int]) -> str | None:
        """Why a prompt cannot go to the engines: a token id outside the model's vocabulary (the
        smallest any registered engine reported). vLLM without a tokenizer does not check and its
        engine dies on it. None when every id is inside, or no engine reported its vocabulary."""
        vocab = self.registry.vocab_size()
        if vocab:
            top = max(token_ids)
            if top >= vocab:
                return f"prompt token id {top} is outside the model's vocabulary (ids 0..{vocab - 1})"
        return None

"""kvpush.v1.Scheduler over grpc.aio: a thin adapter around the pure Registry."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import grpc

from kvpush.services.common import limits
from kvpush.services.common.leg_macs import LegMacer
from kvpush.services.common.logs import get_logger
from kvpush.services.common.security import ROLE_NAMES, claim_problem, peer_identity
from kvpush.services.scheduler import convert
from kvpush.services.scheduler.errors import FailedPrecondition, InvalidArgument, NoCapacity, NotFound, SchedulerError
from kvpush.services.scheduler.generate import AssignmentLost, GenerateParams, LegError, OpenAIClient, run_legs
from kvpush.services.scheduler.load_stream_push import FirstTokenRelay, Outboxes, Pushed, ack_of
from kvpush.services.scheduler.metrics import Metrics
from kvpush.services.scheduler.model import (
    AssignmentRecord,
    Demand,
    Event,
    EventKind,
    InstanceSpec,
    Outcome,
    State,
)
from kvpush.services.scheduler.registry import Registry
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

_CODES: dict[type[SchedulerError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    NoCapacity: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_MAX_PROMPT_TOKENS = limits.MAX_PROMPT_TOKENS


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


class _Subscriber:
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


def _assign_out_of_bounds(request: pb.AssignRequest) -> str | None:
    if request.max_tokens > limits.MAX_MAX_TOKENS:
        return f"max_tokens above {limits.MAX_MAX_TOKENS}"
    if len(request.transfer_id) > limits.MAX_ID_CHARS:
        return f"transfer_id longer than {limits.MAX_ID_CHARS} characters"
    if len(request.prefix_hint) > limits.MAX_PREFIX_HINT_CHARS:
        return f"prefix_hint longer than {limits.MAX_PREFIX_HINT_CHARS} characters"
    return None


def _cause(event: Event) -> str:
    if event.reason.startswith("lease expired"):
        return "lease"
    if event.reason.startswith("replaced"):
        return "replaced"
    return "stream"


class SchedulerServicer(pb_grpc.SchedulerServicer):
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
        self._idle = asyncio.Event()
        self._idle.set()
        self._subscribers: set[_Subscriber] = set()
        self._lost: dict[str, asyncio.Future[str]] = {}
        self._decision_counters: dict[tuple[str, str], Any] = {}
        self._release_counters: dict[Outcome, Any] = {}
        self._prefill_legs: set[asyncio.Task[None]] = set()  # prefill legs sent by Reroute
        # Per instance with a load stream: leg failures and first tokens to push down it.
        self._outboxes = Outboxes()
        # First tokens from prefill to decode and to Generate calls (first-token hand-off).
        self._first_tokens = FirstTokenRelay(registry, self._outboxes, metrics)
        registry.event_listeners.append(self._on_event)
        registry.closed_listeners.append(self._on_closed)
        registry.capacity_listeners.append(self._changed.notify)

    # ---------------------------------------------------------------- plumbing

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
        """New Assign/Generate calls get UNAVAILABLE; queued ones wake and fail; Watch streams end."""
        self.shutting_down = True
        self._changed.notify()
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

    def _decided(self, rec: AssignmentRecord) -> None:
        self._count_decisions({("decode", rec.decode.engine_id): 1, ("prefill", rec.prefill.engine_id): 1})

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

    # ---------------------------------------------------------------- registry RPCs

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        # mTLS: an engine registers only as itself, in its certificate's role.
        inst = request.instance
        peer = peer_identity(context)
        not_peer = claim_problem(peer, inst.engine_id, ROLE_NAMES.get(inst.role, "unspecified"))
        if not_peer is not None:
            self.log.warning("register_refused", engine_id=inst.engine_id, reason=not_peer)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, not_peer)
        if inst.tp_size > limits.MAX_TP:  # before anything is sized by it
            await self._refuse(context, "Register", grpc.StatusCode.INVALID_ARGUMENT, f"tp_size above {limits.MAX_TP}")
        if inst.engine_id not in self.registry.instances and len(self.registry.instances) >= self.config.max_instances:
            await self._refuse(
                context,
                "Register",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_instances} instances are registered already",
            )
        try:
            self.registry.register(convert.spec_from_pb(request.instance))
        except SchedulerError as exc:
            await self._abort(context, exc)
        lease = self.registry.lease
        return pb.RegisterResponse(
            lease_interval_ms=round(lease.interval_s * 1000),
            lease_misses=lease.misses,
            leg_mac_key=self._leg_mac_key(inst.engine_id, peer is not None),
        )

    def _leg_mac_key(self, engine_id: str, authenticated: bool) -> bytes:
        """The engine's leg MAC key when this scheduler MACs legs, for a peer whose certificate
        names the engine (checked above); never to an unauthenticated one (plaintext server)."""
        if not isinstance(self.signer, LegMacer):
            return b""
        if not authenticated:
            self.log.warning("leg_mac_key_withheld", engine_id=engine_id, reason="peer not authenticated")
            return b""
        return self.signer.key_for(engine_id)

    def leg_failed(self, rec: AssignmentRecord, prefill_engine_id: str, reason: str) -> bool:
        """The prefill leg for ``prefill_engine_id`` was not delivered: tells the assignment's decode
        instance on its load stream (it fails that prefill over at once). False when it has no
        stream right now (decode then fails over at the reservation lease, as before)."""
        return self._push_leg_failure(rec.decode, rec, prefill_engine_id, reason, pb.ROLE_PREFILL)

    def decode_leg_failed(self, rec: AssignmentRecord, reason: str) -> bool:
        """The decode leg was not delivered: tells the assignment's prefill instance, which frees
        the KV it holds (or will hold) for the transfer instead of keeping it for its lease."""
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

    async def ReportLoad(
        self, request_iterator: AsyncIterator[pb.LoadReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LoadAck]:
        """Acks each report; between reports, pushes leg failures to the instance at once."""
        ident: tuple[str, str] | None = None
        clean = False
        draining = False
        peer = peer_identity(context)
        reports = aiter(request_iterator)
        next_report: asyncio.Future[pb.LoadReport] = asyncio.ensure_future(anext(reports))
        next_push: asyncio.Future[Pushed] | None = None
        box: asyncio.Queue[Pushed] | None = None
        box_key: tuple[str, str] | None = None
        try:
            while True:
                if box is not None and next_push is None:
                    next_push = asyncio.ensure_future(box.get())
                waiting: set[asyncio.Future[Any]] = {next_report} if next_push is None else {next_report, next_push}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if next_push is not None and next_push in done:
                    assert box is not None
                    ack = ack_of(next_push.result(), box)
                    next_push = None
                    yield ack
                if next_report not in done:
                    continue
                try:
                    report = next_report.result()
                except StopAsyncIteration:
                    break
                next_report = asyncio.ensure_future(anext(reports))
                # mTLS: an engine reports only in its own name (checked before the stream is taken
                # as that engine's, whose loss would end its lease).
                not_peer = claim_problem(peer, report.engine_id)
                if not_peer is not None:
                    self.log.warning("load_report_refused", engine_id=report.engine_id, reason=not_peer)
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, not_peer)
                if max(len(report.engine_id), len(report.incarnation)) > limits.MAX_ID_CHARS:
                    await self._refuse(
                        context, "ReportLoad", grpc.StatusCode.INVALID_ARGUMENT, "engine id or incarnation too long"
                    )
                key = (report.engine_id, report.incarnation)
                if ident is None:
                    ident = key
                elif key != ident:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"one load stream per instance: got {key}, the stream is for {ident}",
                    )
                try:
                    seq = self.registry.report(report.engine_id, report.incarnation, convert.load_from_pb(report))
                except SchedulerError as exc:
                    ident = None  # not ours to close
                    await self._abort(context, exc)
                draining = report.draining
                if report.first_tokens:
                    self._first_tokens.relay(report)
                if box is None:  # a registered instance's stream: it may be pushed to from now on
                    box = self._outboxes.open(key)
                    box_key = key
                yield pb.LoadAck(sequence=seq)
            # A broken or cancelled call can also end the iteration without an error, so only a
            # half-close after a draining report is a goodbye; any other end means the instance is lost.
            clean = draining and not context.cancelled()
        finally:
            for fut in (next_report, next_push):
                if fut is not None:
                    fut.cancel()
            if box_key is not None and box is not None:
                self._outboxes.close(box_key, box)
            if ident is not None and not self.shutting_down:
                self.registry.stream_closed(ident[0], ident[1], clean)

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListInstancesResponse:
        return pb.ListInstancesResponse(instances=[convert.status_to_pb(i) for i in self.registry.snapshot()])

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.InstanceEvent]:
        if len(self._subscribers) >= self.config.max_watch_subscribers:
            await self._refuse(
                context,
                "Watch",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_watch_subscribers} Watch streams are open already",
            )
        sub = _Subscriber(self.config.watch_queue)
        self._subscribers.add(sub)
        try:
            if request.include_current:
                for inst in self.registry.snapshot():
                    yield convert.event_to_pb(Event(EventKind.REGISTERED, inst.spec, "current"))
            while not self.shutting_down:
                event = await sub.queue.get()
                if event is None:
                    if sub.overflowed:
                        await context.abort(
                            grpc.StatusCode.RESOURCE_EXHAUSTED, "watch subscriber fell behind; resubscribe"
                        )
                    return
                yield convert.event_to_pb(event)
        finally:
            self._subscribers.discard(sub)

    # ---------------------------------------------------------------- frontend RPCs

    def _assign_demand(self, request: pb.AssignRequest, method: str) -> Demand:
        """The request's demand, once its sizes are within bounds (else InvalidArgument)."""
        if request.prompt_tokens > _MAX_PROMPT_TOKENS:
            raise InvalidArgument(f"prompt_tokens {request.prompt_tokens} exceeds {_MAX_PROMPT_TOKENS}")
        bound = _assign_out_of_bounds(request)
        if bound is not None:
            self.log.warning("request_refused", method=method, code="INVALID_ARGUMENT", reason=bound)
            raise InvalidArgument(bound)
        return Demand(request.prompt_tokens, request.max_tokens, request.prefix_hint)

    async def Assign(self, request: pb.AssignRequest, context: grpc.aio.ServicerContext) -> pb.Assignment:
        t0 = time.perf_counter()
        self._begin()
        try:
            demand = self._assign_demand(request, "Assign")
            rec = await self._admit(demand, request.transfer_id, context.time_remaining())
            rec.first_token = request.first_token_from_prefill and rec.decode.first_token_handoff
        except SchedulerError as exc:
            if isinstance(exc, NoCapacity):
                self.metrics.rejections.labels(exc.reason).inc()
                self.log.info("assign_rejected", reason=exc.reason, detail=str(exc))
            await self._abort(context, exc)
        finally:
            self._end()
            self.metrics.assign_latency.observe(time.perf_counter() - t0)
        self._decided(rec)
        self.log.debug(
            "assigned",
            transfer_id=rec.transfer_id,
            epoch=rec.epoch,
            decode=rec.decode.engine_id,
            prefill=rec.prefill.engine_id,
            blocks=rec.decode_blocks,
        )
        return convert.assignment_to_pb(rec, self.signer)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        try:
            self._release(request)
        except SchedulerError as exc:
            await self._abort(context, exc)
        return pb.ReleaseResponse()

    def _release(
        self, request: pb.ReleaseRequest, method: str = "Release", counts: dict[Outcome, int] | None = None
    ) -> None:
        """Release's checks and effect (unary or one item of a batch); raises SchedulerError. With
        ``counts``, the release is counted there (the batch adds them to the metric at once)."""
        if not request.transfer_id:
            raise InvalidArgument("transfer_id is required")
        if len(request.transfer_id) > limits.MAX_ID_CHARS:
            self.log.warning("request_refused", method=method, code="INVALID_ARGUMENT", reason="long id")
            raise InvalidArgument(f"transfer_id longer than {limits.MAX_ID_CHARS} characters")
        outcome = convert.outcome_from_pb(request.outcome)
        rec = self.registry.release(request.transfer_id, request.epoch, outcome, limits.clip(request.reason))
        if counts is None:
            self._count_releases({outcome: 1})
        else:
            counts[outcome] = counts.get(outcome, 0) + 1
        self.log.debug(
            "released",
            transfer_id=rec.transfer_id,
            outcome=outcome.value,
            state=rec.state.value,
            reason=limits.clip(request.reason),
        )

    def _code(self, exc: SchedulerError) -> grpc.StatusCode:
        if isinstance(exc, ShuttingDown):
            return grpc.StatusCode.UNAVAILABLE
        return _CODES.get(type(exc), grpc.StatusCode.INTERNAL)

    async def AssignStream(
        self, request_iterator: AsyncIterator[pb.AssignStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AssignStreamResponse]:
        """Batches of Assign and Release, answered in order; the legs of one answer are signed once."""
        async for batch in request_iterator:
            if len(batch.assigns) > limits.MAX_ASSIGNS_PER_BATCH or len(batch.releases) > limits.MAX_RELEASES_PER_BATCH:
                await self._refuse(
                    context,
                    "AssignStream",
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a batch holds at most {limits.MAX_ASSIGNS_PER_BATCH} assigns and "
                    f"{limits.MAX_RELEASES_PER_BATCH} releases",
                )
            self._begin()
            try:
                response = await self._assign_batch(batch, context)
            finally:
                self._end()
            yield response

    async def _assign_batch(
        self, batch: pb.AssignStreamRequest, context: grpc.aio.ServicerContext
    ) -> pb.AssignStreamResponse:
        response = pb.AssignStreamResponse(batch_id=batch.batch_id)
        ok = grpc.StatusCode.OK.value[0]
        released: dict[Outcome, int] = {}
        for release in batch.releases:
            try:
                self._release(release, "AssignStream", released)
                response.releases.add(code=ok)
            except SchedulerError as exc:
                response.releases.add(code=self._code(exc).value[0], message=str(exc))
        self._count_releases(released)
        t0 = time.perf_counter()
        # Queueing for capacity: within max_wait_ms of the batch's start (and the stream's deadline).
        wait_until: float | None = None
        if batch.max_wait_ms:
            wait_until = time.monotonic() + batch.max_wait_ms / 1000
            stream_left = context.time_remaining()
            if stream_left is not None:
                wait_until = min(wait_until, time.monotonic() + stream_left)
        records: list[AssignmentRecord] = []
        slots: list[pb.AssignResult] = []
        decided: dict[tuple[str, str], int] = {}
        for request in batch.assigns:
            result = response.assigns.add()
            try:
                demand = self._assign_demand(request, "AssignStream")
                left = None if wait_until is None else max(0.0, wait_until - time.monotonic())
                rec = await self._admit(demand, request.transfer_id, left)
                rec.first_token = request.first_token_from_prefill and rec.decode.first_token_handoff
            except SchedulerError as exc:
                if isinstance(exc, NoCapacity):
                    self.metrics.rejections.labels(exc.reason).inc()
                    self.log.info("assign_rejected", reason=exc.reason, detail=str(exc))
                result.code, result.message = self._code(exc).value[0], str(exc)
                continue
            finally:
                self.metrics.assign_latency.observe(time.perf_counter() - t0)
            for key in (("decode", rec.decode.engine_id), ("prefill", rec.prefill.engine_id)):
                decided[key] = decided.get(key, 0) + 1
            records.append(rec)
            slots.append(result)
        self._count_decisions(decided)
        # An assignment closed before the answer (a later item of the batch re-assigned its transfer
        # id, or an instance died while a later item queued) is answered FAILED_PRECONDITION.
        live: list[AssignmentRecord] = []
        live_slots: list[pb.AssignResult] = []
        for rec, slot in zip(records, slots, strict=True):
            if rec.state is State.OPEN:
                live.append(rec)
                live_slots.append(slot)
            else:
                slot.code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
                slot.message = f"transfer {rec.transfer_id!r} closed before the batch was answered: {rec.reason}"
        if batch.compact:
            convert.fill_compact([(r, s.compact) for r, s in zip(live, live_slots, strict=True)], self.signer)
        else:
            convert.fill_assignments([(r, s.assignment) for r, s in zip(live, live_slots, strict=True)], self.signer)
        return response

    async def ReportLegFailure(self, request: pb.LegFailure, context: grpc.aio.ServicerContext) -> pb.LegFailureAck:
        if (
            not request.transfer_id
            or max(len(request.transfer_id), len(request.prefill_engine_id)) > limits.MAX_ID_CHARS
        ):
            await self._refuse(context, "ReportLegFailure", grpc.StatusCode.INVALID_ARGUMENT, "missing or too long ids")
        rec = self.registry.open.get(request.transfer_id)
        if rec is None:
            await self._refuse(
                context, "ReportLegFailure", grpc.StatusCode.NOT_FOUND, "no open assignment for this transfer"
            )
        if request.leg not in (pb.ROLE_UNSPECIFIED, pb.ROLE_PREFILL, pb.ROLE_DECODE):
            await self._refuse(context, "ReportLegFailure", grpc.StatusCode.INVALID_ARGUMENT, "leg must be a role")
        if request.prefill_engine_id != rec.prefill.engine_id:
            await self._refuse(
                context,
                "ReportLegFailure",
                grpc.StatusCode.FAILED_PRECONDITION,
                "the assignment's prefill leg is no longer for that engine",
            )
        if request.leg == pb.ROLE_DECODE:
            return pb.LegFailureAck(delivered=self.decode_leg_failed(rec, request.reason))
        return pb.LegFailureAck(delivered=self.leg_failed(rec, rec.prefill.engine_id, request.reason))

    async def Reroute(self, request: pb.RerouteRequest, context: grpc.aio.ServicerContext) -> pb.RerouteResponse:
        # mTLS: only a decode engine, in its own name; the registry checks it is the assignment's.
        not_peer = claim_problem(peer_identity(context), request.decode_engine_id, "decode")
        if not_peer is not None:
            self.log.warning("reroute_refused", transfer_id=request.transfer_id[:64], reason=not_peer)
            self.metrics.reroutes.labels("refused").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, not_peer)
        ids = (request.transfer_id, request.decode_engine_id, request.failed_prefill_engine_id)
        if not request.transfer_id or max(len(i) for i in ids) > limits.MAX_ID_CHARS:
            await self._refuse(context, "Reroute", grpc.StatusCode.INVALID_ARGUMENT, "missing or too long ids")
        if not request.prompt_token_ids or len(request.prompt_token_ids) > _MAX_PROMPT_TOKENS:
            await self._refuse(
                context, "Reroute", grpc.StatusCode.INVALID_ARGUMENT, f"prompt must have 1..{_MAX_PROMPT_TOKENS} tokens"
            )
        outside = self._outside_vocab(request.prompt_token_ids)
        if outside is not None:
            await self._refuse(context, "Reroute", grpc.StatusCode.INVALID_ARGUMENT, outside)
        log = self.log.bind(transfer_id=request.transfer_id)
        try:
            rec, moved = self.registry.reroute(
                request.transfer_id,
                request.decode_engine_id,
                request.failed_prefill_engine_id,
                self.config.max_reroutes,
            )
        except SchedulerError as exc:
            self.metrics.reroutes.labels(exc.reason).inc()
            log.warning("reroute_impossible", reason=str(exc), failed=limits.clip(request.reason))
            await self._abort(context, exc)
        prefill_params, _ = convert.leg_params(rec, self.signer)
        if moved:
            params = GenerateParams(
                prompt_token_ids=list(request.prompt_token_ids),
                max_tokens=1,
                temperature=0.0,
                ignore_eos=False,
                seed=None,
            )
            task = asyncio.get_running_loop().create_task(self._send_prefill_leg(rec, params, prefill_params))
            self._prefill_legs.add(task)
            task.add_done_callback(self._prefill_legs.discard)
        self.metrics.reroutes.labels("moved" if moved else "repeated").inc()
        log.info(
            "transfer_rerouted",
            epoch=rec.epoch,
            failed_prefill=request.failed_prefill_engine_id,
            prefill=rec.prefill.engine_id,
            moved=moved,
            reason=limits.clip(request.reason),
        )
        a = convert.assignment_to_pb(rec, self.signer)
        return pb.RerouteResponse(
            epoch=rec.epoch, prefill=a.prefill, decode_kv_transfer_params=a.decode_kv_transfer_params
        )

    async def _send_prefill_leg(self, rec: AssignmentRecord, p: GenerateParams, params: dict[str, Any]) -> None:
        """The prefill leg of a rerouted transfer; when it cannot be delivered, decode is told at once."""
        prefill = rec.prefill.engine_id
        try:
            await self.client.prefill(rec.prefill.http_endpoint, p, params)
        except LegError as exc:
            self.leg_failed(rec, prefill, f"rerouted prefill leg: {exc.message}")

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

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        t0 = time.perf_counter()
        if self._generating >= self.config.max_generate:
            self.metrics.generate.labels("rejected").inc()
            await self._refuse(
                context,
                "Generate",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_generate} Generate calls are in flight already",
            )
        self._generating += 1
        self._begin()
        try:
            async for msg in self._generate(request, context, t0):
                yield msg
        finally:
            self._generating -= 1
            self._end()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, t0: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if not request.prompt_token_ids:
                raise InvalidArgument("prompt_token_ids must not be empty")
            if len(request.prompt_token_ids) > _MAX_PROMPT_TOKENS:
                raise InvalidArgument(f"prompt has more than {_MAX_PROMPT_TOKENS} tokens")
            if request.max_tokens < 1:
                raise InvalidArgument("max_tokens must be >= 1")
            if request.max_tokens > limits.MAX_MAX_TOKENS or len(request.request_id) > limits.MAX_ID_CHARS:
                bound = f"max_tokens above {limits.MAX_MAX_TOKENS} or request_id above {limits.MAX_ID_CHARS} characters"
                self.log.warning("request_refused", method="Generate", code="INVALID_ARGUMENT", reason=bound)
                raise InvalidArgument(bound)
            if not 0.0 <= request.temperature < math.inf:
                # NaN and infinity too: the leg's JSON would carry them as NaN / Infinity.
                raise InvalidArgument("temperature must be finite and >= 0")
            outside = self._outside_vocab(request.prompt_token_ids)
            if outside is not None:
                self.log.warning("request_refused", method="Generate", code="INVALID_ARGUMENT", reason=outside)
                raise InvalidArgument(outside)
            demand = Demand(len(request.prompt_token_ids), request.max_tokens)
            rec = await self._admit(demand, "", context.time_remaining())
            rec.held = True  # released below, whatever happens
            # The first token is prefill's: streamed the moment it is sampled, decode continues.
            rec.first_token = request.max_tokens >= 2 and rec.decode.first_token_handoff
        except SchedulerError as exc:
            if isinstance(exc, NoCapacity):
                self.metrics.rejections.labels(exc.reason).inc()
            self.metrics.generate.labels("rejected").inc()
            await self._abort(context, exc)
        self._decided(rec)
        log = self.log.bind(transfer_id=rec.transfer_id, request_id=request.request_id)
        log.info("generate_started", decode=rec.decode.engine_id, prefill=rec.prefill.engine_id, epoch=rec.epoch)
        params = GenerateParams(
            prompt_token_ids=list(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            ignore_eos=request.ignore_eos,
            seed=request.seed if request.seed else None,
            request_id=request.request_id,
        )
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._lost[rec.transfer_id] = lost
        first_token: asyncio.Future[pb.FirstToken] | None = None
        if rec.first_token:
            first_token = self._first_tokens.wait_for(rec.transfer_id)
        outcome, reason, tokens = Outcome.FAILED, "", 0
        status: tuple[grpc.StatusCode, str] | None = None
        first = True
        t_legs = t_first = time.perf_counter()
        phase = self.metrics.generate_phase
        phase.labels("assign").observe(t_legs - t0)
        try:
            async for chunk in run_legs(
                self.client,
                rec,
                params,
                lost,
                self.signer,
                on_prefill_failed=partial(self.leg_failed, rec),
                first_token=first_token,
                lost_stall_s=self.config.decode_stall_s,
            ):
                msg = pb.GenerateResponse(
                    transfer_id=rec.transfer_id,
                    token_ids=chunk.token_ids,
                    finished=bool(chunk.finish_reason),
                    finish_reason=chunk.finish_reason,
                    decode_engine_id=rec.decode.engine_id,
                    prefill_engine_id=rec.prefill.engine_id,
                )
                if chunk.token_ids and tokens <= 1:
                    now = time.perf_counter()
                    if tokens == 0:
                        t_first = now
                        phase.labels("first_token").observe(now - t_legs)
                    else:
                        phase.labels("second_token").observe(now - t_first)
                if first and chunk.token_ids:
                    first = False
                    msg.ttft_seconds = time.perf_counter() - t0
                    self.metrics.ttft.observe(msg.ttft_seconds)
                tokens += len(chunk.token_ids)
                yield msg
            outcome = Outcome.OK
        except (asyncio.CancelledError, GeneratorExit):
            outcome, reason = Outcome.CANCELLED, "client cancelled"
            raise
        except LegError as exc:
            reason = str(exc)
            log.warning("generate_leg_failed", leg=exc.leg, reason=reason)
            code = grpc.StatusCode.UNAVAILABLE if exc.unavailable else grpc.StatusCode.INTERNAL
            status = (code, reason)
            if exc.leg == "decode":
                self.decode_leg_failed(rec, reason)  # prefill frees its KV now, not at its lease
        except AssignmentLost as exc:
            reason = str(exc)
            status = (grpc.StatusCode.UNAVAILABLE, f"assignment lost: {reason}")
        finally:
            self._lost.pop(rec.transfer_id, None)
            self._first_tokens.forget(rec.transfer_id)
            self.metrics.generate.labels(outcome.value).inc()
            if rec.state is State.OPEN:
                self.registry.release(rec.transfer_id, rec.epoch, outcome, reason)
                self.metrics.releases.labels(outcome.value).inc()
            log.info(
                "generate_finished",
                outcome=outcome.value,
                tokens=tokens,
                seconds=round(time.perf_counter() - t0, 6),
                reason=reason,
            )
        if status is not None:
            # Only now, with the assignment released: a caller that sees the status sees it closed.
            await context.abort(*status)

"""kvpush.v1.Scheduler over grpc.aio: a thin adapter around the pure Registry. The registry RPCs
(Register, ReportLoad, ListInstances, Watch) and the frontend's Assign, Release, AssignStream and
ReportLegFailure are here; Generate and Reroute in ``generate_rpcs``; ReportFirstTokens and
AwaitFirstToken in ``first_token_rpcs``; the shared state, admission and statuses in
``servicer_core``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvpush.services.common import limits
from kvpush.services.common.leg_macs import LegMacer
from kvpush.services.common.security import ROLE_NAMES, claim_problem, peer_identity
from kvpush.services.scheduler import convert
from kvpush.services.scheduler.errors import InvalidArgument, NoCapacity, SchedulerError
from kvpush.services.scheduler.first_token_rpcs import FirstTokenRpcs
from kvpush.services.scheduler.first_tokens import StreamedFirstTokens
from kvpush.services.scheduler.generate_rpcs import GenerateRpcs
from kvpush.services.scheduler.load_stream_push import Pushed, ack_of
from kvpush.services.scheduler.model import (
    AssignmentRecord,
    Demand,
    Event,
    EventKind,
    Outcome,
    State,
)
from kvpush.services.scheduler.servicer_core import (
    ServicerConfig,
    ShuttingDown,
    Subscriber,
    decision_keys,
    handoff_granted,
)
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

__all__ = ["SchedulerServicer", "ServicerConfig", "ShuttingDown"]

_MAX_PROMPT_TOKENS = limits.MAX_PROMPT_TOKENS


def _assign_out_of_bounds(request: pb.AssignRequest) -> str | None:
    if request.max_tokens > limits.MAX_MAX_TOKENS:
        return f"max_tokens above {limits.MAX_MAX_TOKENS}"
    if len(request.transfer_id) > limits.MAX_ID_CHARS:
        return f"transfer_id longer than {limits.MAX_ID_CHARS} characters"
    if len(request.prefix_hint) > limits.MAX_PREFIX_HINT_CHARS:
        return f"prefix_hint longer than {limits.MAX_PREFIX_HINT_CHARS} characters"
    return None


class SchedulerServicer(GenerateRpcs, FirstTokenRpcs, pb_grpc.SchedulerServicer):
    """kvpush.v1.Scheduler: every RPC (``GenerateRpcs`` brings Generate and Reroute,
    ``FirstTokenRpcs`` ReportFirstTokens and AwaitFirstToken)."""

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
                if report.prefills_done:
                    self.prefills_done(report)
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
        now = self.registry.clock()
        return pb.ListInstancesResponse(instances=[convert.status_to_pb(i, now) for i in self.registry.snapshot()])

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
        sub = Subscriber(self.config.watch_queue)
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
        return Demand(request.prompt_tokens, request.max_tokens, request.prefix_hint, request.allow_prefill_on_decode)

    async def Assign(self, request: pb.AssignRequest, context: grpc.aio.ServicerContext) -> pb.Assignment:
        t0 = time.perf_counter()
        self._begin()
        try:
            demand = self._assign_demand(request, "Assign")
            rec = await self._admit(demand, request.transfer_id, context.time_remaining())
            rec.first_token = handoff_granted(rec, request.first_token_from_prefill)
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
            prefill=rec.prefill.engine_id if rec.prefill is not None else "",
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
        if isinstance(rec, AssignmentRecord):
            self._first_tokens.closed(rec)
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

    async def AssignStream(
        self, request_iterator: AsyncIterator[pb.AssignStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AssignStreamResponse]:
        """Batches of Assign and Release, answered in order; the legs of one answer are signed once.
        First tokens asked for by batches go out with the next answer, or alone as they come: while
        any is awaited, the next batch is read by a task beside the wait (else read directly)."""
        batches = aiter(request_iterator)
        tokens = StreamedFirstTokens()
        reading: asyncio.Future[pb.AssignStreamRequest | None] | None = None
        requests_ended = False
        try:
            while True:
                if tokens.results:
                    yield tokens.take(pb.AssignStreamResponse(tokens_only=True))
                    continue
                if requests_ended:
                    if not tokens.waits:
                        return
                    await tokens.ready()
                    continue
                if reading is None and not tokens.waits:
                    batch = await anext(batches, None)
                else:
                    if reading is None:
                        reading = asyncio.ensure_future(anext(batches, None))
                    ready: set[asyncio.Future[Any]] = {reading, tokens.ready()}
                    await asyncio.wait(ready, return_when=asyncio.FIRST_COMPLETED)
                    if not reading.done():
                        continue
                    batch, reading = reading.result(), None
                if batch is None:
                    requests_ended = True
                    continue
                if (
                    len(batch.assigns) > limits.MAX_ASSIGNS_PER_BATCH
                    or len(batch.releases) > limits.MAX_RELEASES_PER_BATCH
                ):
                    await self._refuse(
                        context,
                        "AssignStream",
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"a batch holds at most {limits.MAX_ASSIGNS_PER_BATCH} assigns and "
                        f"{limits.MAX_RELEASES_PER_BATCH} releases",
                    )
                self._begin()
                try:
                    response = await self._assign_batch(batch, context, tokens if batch.first_tokens else None)
                finally:
                    self._end()
                yield tokens.take(response)
        finally:
            if reading is not None:
                reading.cancel()
            self._end_streamed_first_tokens(tokens)

    async def _assign_batch(
        self,
        batch: pb.AssignStreamRequest,
        context: grpc.aio.ServicerContext,
        tokens: StreamedFirstTokens | None = None,
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
                rec.first_token = handoff_granted(rec, request.first_token_from_prefill)
            except SchedulerError as exc:
                if isinstance(exc, NoCapacity):
                    self.metrics.rejections.labels(exc.reason).inc()
                    self.log.info("assign_rejected", reason=exc.reason, detail=str(exc))
                result.code, result.message = self._code(exc).value[0], str(exc)
                continue
            finally:
                self.metrics.assign_latency.observe(time.perf_counter() - t0)
            for key in decision_keys(rec):
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
        if tokens is not None:
            for rec in live:
                if rec.first_token:
                    self._stream_first_token(tokens, rec)
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
        if rec.prefill is None or request.prefill_engine_id != rec.prefill.engine_id:
            await self._refuse(
                context,
                "ReportLegFailure",
                grpc.StatusCode.FAILED_PRECONDITION,
                "the assignment's prefill leg is no longer for that engine",
            )
        if request.leg == pb.ROLE_DECODE:
            return pb.LegFailureAck(delivered=self.decode_leg_failed(rec, request.reason))
        return pb.LegFailureAck(delivered=self.leg_failed(rec, request.prefill_engine_id, request.reason))

"""The push writer: one background thread per prefill rank.

It owns the rank's NIXL engine and its ``TransferTable``. Every event (peer connected or lost,
reservation, prefill done, cancel) arrives on its inbox; callers never wait on it. For a matched
transfer it plans the descriptors per destination decode rank, posts the WRITEs, polls them to
completion and hands the per-rank completions to the agent's sender. A NIXL exception fails the
transfers it touches, never the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpush.services.common.layout import RankRegions, regions_of
from kvpush.services.common.logs import get_logger
from kvpush.services.common.nixl_engine import NixlEngine, NixlError
from kvpush.services.common.refusal import RefusalCode
from kvpush.services.common.thread_names import name_native_thread
from kvpush.services.common.tp import HeadSlice, slices_from_prefill_rank
from kvpush.services.prefill_agent import metrics
from kvpush.services.prefill_agent.notices import CompletionNotices, NoticeTarget
from kvpush.services.prefill_agent.plan import PlanError, WritePlan, check_block_ids, plan_writes
from kvpush.services.prefill_agent.table import (
    AckCancel,
    Action,
    PrefillDone,
    Reject,
    ReleaseBlocks,
    Reservation,
    StartWrite,
    TransferTable,
)
from kvpush.v1 import kvpush_pb2 as pb

log = get_logger("prefill.writer")

EXPIRY_PERIOD_S = 0.05
IN_FLIGHT_POLL_S = 50e-6  # NIXL state checks while WRITEs are in flight
SLOW_POLL_S = 1e-3


@dataclass
class PeerSession:
    """One decode engine connected over one reservations stream."""

    key: str
    identity: pb.EngineIdentity
    layouts: list[pb.RankLayout]
    send: Callable[[pb.PrefillMessage], None]  # thread-safe: queues onto the stream
    close: Callable[[str], None]  # ends the stream with FAILED_PRECONDITION and a reason
    # Monotonic time until which this rank may post WRITEs for the peer (renewed by Ping/Pong);
    # written only on the writer thread.
    lease_until: float = 0.0
    slices: list[HeadSlice] = field(default_factory=list)
    regions: dict[int, RankRegions] = field(default_factory=dict)
    nixl_names: dict[int, str] = field(default_factory=dict)
    # Transfers ready to write while the lease had run out: posted at the next renewal, refused
    # once they waited ``lease_hold_s`` (writer thread only).
    held: list[_Held] = field(default_factory=list)


@dataclass
class _Held:
    action: StartWrite
    since: float


# ----- inbox events ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Connect:
    session: PeerSession
    result: Future[None]


@dataclass(frozen=True)
class _Disconnect:
    key: str


@dataclass(frozen=True)
class _Renew:
    key: str
    until: float


@dataclass(frozen=True)
class _Reserve:
    reservation: Reservation


@dataclass(frozen=True)
class _Done:
    done: PrefillDone
    # Set once the writer has handled it: its WRITEs posted and, if they finished at once, their
    # notices sent (or it waits for its reservation, or is held for a lease), so a caller may give
    # the writer the core until then.
    handled: threading.Event | None = None


@dataclass(frozen=True)
class _Aborted:
    decode_engine: str
    transfer_id: str


@dataclass(frozen=True)
class _Cancel:
    peer: str
    decode_engine: str  # the engine of the stream the Cancel came on
    transfer_id: str
    epoch: int


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    result: Future[Any]


_STOP = object()


@dataclass
class _Write:
    """One transfer's WRITEs: per decode rank, (ok, reason, plan) once finished."""

    action: StartWrite
    session: PeerSession
    started: float
    results: dict[int, tuple[bool, str, WritePlan | None]] = field(default_factory=dict)
    pending: list[tuple[WritePlan, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class CompletionReport:
    """What the writer asks the agent to deliver to one decode rank."""

    endpoint: str
    completion: pb.Completion
    noticed: bool = False  # a completion notice for it went ahead (notices.py)


class PushWriter:
    def __init__(
        self,
        *,
        rank: int,
        tp_size: int,
        identity: pb.EngineIdentity,
        engine: NixlEngine,
        local: RankRegions,
        deliver: Callable[[CompletionReport], None],
        release: Callable[[ReleaseBlocks], None],
        table: TransferTable | None = None,
        write_timeout_s: float = 30.0,
        lease_hold_s: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
        notices: CompletionNotices | None = None,
    ) -> None:
        """``lease_hold_s``: how long a transfer whose KV is ready waits for the decode stream to
        renew an expired write lease before it is refused (the agent passes two leases: by then
        decode has declared the stream lost and fences the blocks). ``notices``: sends each OK
        completion ahead of its RPC as a NIXL notification (notices.py)."""
        self.rank = rank
        self.tp_size = tp_size
        self.identity = identity
        self.engine = engine
        self.local = local
        self.deliver = deliver
        self.release = release
        self.table = table or TransferTable()
        self.write_timeout_s = write_timeout_s
        self.lease_hold_s = lease_hold_s
        self.clock = clock
        self.notices = notices
        self._sessions: dict[str, PeerSession] = {}
        self._in_flight: list[_Write] = []
        # The ``handled`` of the _Done being handled: set as soon as its notices are out.
        self._handling: threading.Event | None = None
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvpush-writer-{rank}", daemon=True)

    # ----- thread-safe API ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    def connect(self, session: PeerSession) -> Future[None]:
        fut: Future[None] = Future()
        self._inbox.put(_Connect(session, fut))
        return fut

    def disconnect(self, key: str) -> None:
        self._inbox.put(_Disconnect(key))

    def renew(self, key: str, until: float) -> None:
        """The peer granted a write lease lasting until ``until`` (monotonic)."""
        self._inbox.put(_Renew(key, until))

    def reserve(self, reservation: Reservation) -> None:
        self._inbox.put(_Reserve(reservation))

    def prefill_done(self, done: PrefillDone, handled: threading.Event | None = None) -> None:
        """Called from the engine loop when the transfer's KV is computed; never blocks.
        ``handled`` is set once the writer has handled it."""
        self._inbox.put(_Done(done, handled))

    def prefill_aborted(self, decode_engine: str, transfer_id: str) -> None:
        """The prefill request ended without computing its KV (abort, error)."""
        self._inbox.put(_Aborted(decode_engine, transfer_id))

    def cancel(self, peer: str, decode_engine: str, transfer_id: str, epoch: int) -> None:
        """A Cancel from the stream ``peer`` of ``decode_engine``; it reaches that engine's
        transfer ``transfer_id`` only."""
        self._inbox.put(_Cancel(peer, decode_engine, transfer_id, epoch))

    def broadcast(self, msg: pb.PrefillMessage) -> None:
        """Sends ``msg`` on every connected decode engine's stream."""

        def send_all() -> None:
            for session in self._sessions.values():
                session.send(msg)

        self.call(send_all)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Runs ``fn`` on the writer thread (for inspection in tests and benchmarks)."""
        fut: Future[Any] = Future()
        self._inbox.put(_Call(fn, fut))
        return fut

    # ----- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        name_native_thread(f"kv-writer-{self.rank}")
        next_expiry = self.clock() + EXPIRY_PERIOD_S
        while True:
            if self._in_flight:
                try:
                    self._poll_in_flight()
                except Exception:
                    log.exception("writer_poll_failed")
            now = self.clock()
            wait = max(0.0, next_expiry - now)
            if self._in_flight:
                # Tight polling for the first milliseconds (the common case finishes there),
                # then back off so a slow target does not burn the engine's CPU.
                oldest = min(w.started for w in self._in_flight)
                wait = min(wait, IN_FLIGHT_POLL_S if now - oldest < 2e-3 else SLOW_POLL_S)
            try:
                event = self._inbox.get(timeout=wait)
            except queue.Empty:
                event = None
            if event is _STOP:
                return
            try:
                if event is not None:
                    self._handle(event)
                if self.clock() >= next_expiry:
                    # Leases are checked on a period, not per event: the table scan stays off the
                    # path of each reservation.
                    self._execute(self.table.expire(self.clock()))
                    self._refuse_stale_held()
                    next_expiry = self.clock() + EXPIRY_PERIOD_S
            except Exception:  # the writer must outlive any bug in one event
                log.exception("writer_event_failed", event_type=type(event).__name__)

    def _handle(self, event: object) -> None:
        now = self.clock()
        if isinstance(event, _Renew):
            session = self._sessions.get(event.key)
            if session is not None and event.until > session.lease_until:
                session.lease_until = event.until
                if session.held and now < session.lease_until:
                    held, session.held = session.held, []
                    log.info("held_writes_resumed", peer=event.key, count=len(held))
                    for h in held:
                        self._write(h.action)
        elif isinstance(event, _Reserve):
            res = event.reservation
            problem = self._validate(res)
            if problem is not None:
                self._execute([Reject(res.peer, res.transfer_id, res.epoch, RefusalCode.INVALID_ARGUMENT, problem)])
                return
            self._execute(self.table.on_reservation(res, now))
        elif isinstance(event, _Done):
            self._handling = event.handled
            try:
                self._execute(self.table.on_prefill_done(event.done, now))
            finally:
                self._handling = None
                if event.handled is not None:
                    event.handled.set()
        elif isinstance(event, _Aborted):
            self._execute(self.table.on_prefill_aborted(event.decode_engine, event.transfer_id, now))
        elif isinstance(event, _Cancel):
            log.info(
                "cancel_received", transfer_id=event.transfer_id, epoch=event.epoch, decode_engine=event.decode_engine
            )
            self._execute(self.table.on_cancel(event.peer, event.decode_engine, event.transfer_id, event.epoch, now))
            self._drop_held(
                lambda h: (
                    h.action.reservation.decode_engine == event.decode_engine
                    and h.action.reservation.transfer_id == event.transfer_id
                    and h.action.reservation.epoch <= event.epoch
                ),
                "cancelled while waiting for a write lease",
            )
        elif isinstance(event, _Connect):
            try:
                self._connect(event.session)
                event.result.set_result(None)
            except Exception as exc:
                event.result.set_exception(exc)
        elif isinstance(event, _Disconnect):
            self._disconnect(event.key)
        elif isinstance(event, _Call):
            try:
                event.result.set_result(event.fn())
            except Exception as exc:
                event.result.set_exception(exc)

    def _validate(self, res: Reservation) -> str | None:
        session = self._sessions.get(res.peer)
        if session is None:
            return "the stream's session is gone"
        if session.identity.engine_id != res.decode_engine:
            return "reservation does not belong to this stream's decode engine"
        for s in session.slices:
            dst = session.regions[s.decode_rank]
            try:
                for g, ids in enumerate(res.block_ids):
                    held = min((r.num_blocks for r in dst.regions if r.group == g), default=0)
                    if len(ids) > held:
                        return f"group {g} lists {len(ids)} block ids; decode rank {s.decode_rank} holds {held}"
                    check_block_ids(ids, dst.regions, g, f"decode rank {s.decode_rank}")
            except PlanError as exc:
                return str(exc)
        return None

    # ----- peers --------------------------------------------------------------------------

    def _connect(self, session: PeerSession) -> None:
        ident = session.identity
        for key, old in list(self._sessions.items()):
            if old.identity.engine_id == ident.engine_id:
                reason = (
                    "superseded by a new incarnation"
                    if old.identity.incarnation != ident.incarnation
                    else "superseded by a new stream"
                )
                log.info("peer_superseded", peer=key, new_peer=session.key, reason=reason)
                self._disconnect(key)
                old.close(reason)
        session.slices = slices_from_prefill_rank(
            session.layouts[0].total_kv_heads, self.tp_size, ident.tp_size, self.rank
        )
        for s in session.slices:
            layout = session.layouts[s.decode_rank]
            session.regions[s.decode_rank] = regions_of(layout, ident.tp_size)
            try:
                session.nixl_names[s.decode_rank] = self.engine.add_peer(layout.nixl_agent_metadata)
            except Exception as exc:
                for name in session.nixl_names.values():
                    self._remove_nixl_peer(name)
                raise NixlError(f"cannot load NIXL metadata of decode rank {s.decode_rank}: {exc}") from exc
        self._sessions[session.key] = session
        metrics.PEERS.set(len(self._sessions))
        log.info("peer_connected", peer=session.key, decode_ranks=[s.decode_rank for s in session.slices])

    def _disconnect(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is None:
            return
        self.table.on_peer_lost(key, self.clock())
        held, session.held = session.held, []
        for h in held:
            self._finish_unposted(h.action, "decode stream lost before the write")
        for name in session.nixl_names.values():
            self._remove_nixl_peer(name)
        metrics.PEERS.set(len(self._sessions))
        log.info("peer_lost", peer=key)

    def _finish_unposted(self, action: StartWrite, reason: str) -> None:
        res = action.reservation
        log.warning("write_skipped", transfer_id=res.transfer_id, epoch=res.epoch, reason=reason)
        self._execute(
            self.table.on_write_finished(res.decode_engine, res.transfer_id, res.epoch, False, reason, self.clock())
        )

    def _drop_held(self, match: Callable[[_Held], bool], reason: str) -> None:
        for session in self._sessions.values():
            dropped = [h for h in session.held if match(h)]
            if dropped:
                session.held = [h for h in session.held if not match(h)]
                for h in dropped:
                    self._finish_unposted(h.action, reason)

    def _refuse_stale_held(self) -> None:
        """Transfers that waited ``lease_hold_s`` for a renewal are refused: decode has declared
        the stream lost by now and fences their blocks by the bound."""
        now = self.clock()
        for session in list(self._sessions.values()):
            stale = [h for h in session.held if now - h.since >= self.lease_hold_s]
            if not stale:
                continue
            session.held = [h for h in session.held if now - h.since < self.lease_hold_s]
            reason = "write lease expired: no answer on the decode stream"
            for h in stale:
                res = h.action.reservation
                metrics.LEASE_EXPIRED.inc()
                log.warning("write_refused", transfer_id=res.transfer_id, epoch=res.epoch, reason=reason)
                self._execute([Reject(res.peer, res.transfer_id, res.epoch, RefusalCode.ABORTED, reason)])
                self._finish_unposted(h.action, reason)

    def _remove_nixl_peer(self, name: str) -> None:
        try:
            self.engine.remove_peer(name)
        except NixlError as exc:
            log.warning("nixl_remove_peer_failed", nixl_peer=name, error=str(exc))

    # ----- actions ------------------------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, StartWrite):
                self._write(action)
            elif isinstance(action, Reject):
                code = grpc.StatusCode[action.code.name]  # the pure table's code, as gRPC's
                metrics.REJECTED.labels(code=code.name).inc()
                log.warning(
                    "reservation_rejected",
                    transfer_id=action.transfer_id,
                    epoch=action.epoch,
                    code=action.code.name,
                    reason=action.message,
                )
                self._send(
                    action.peer,
                    pb.PrefillMessage(
                        rejected=pb.ReservationRejected(
                            transfer_id=action.transfer_id,
                            epoch=action.epoch,
                            code=code.value[0],
                            message=action.message,
                        )
                    ),
                )
            elif isinstance(action, AckCancel):
                self._send(
                    action.peer,
                    pb.PrefillMessage(
                        cancel_ack=pb.CancelAck(
                            transfer_id=action.transfer_id, epoch=action.epoch, data_written=action.data_written
                        )
                    ),
                )
            elif isinstance(action, ReleaseBlocks):
                self.release(action)

    def _send(self, peer: str, msg: pb.PrefillMessage) -> None:
        session = self._sessions.get(peer)
        if session is not None:
            session.send(msg)

    def _write(self, action: StartWrite) -> None:
        """Plans and posts the transfer's WRITEs; the ones NIXL does not finish in the post are
        polled from the main loop, so one slow target never holds up the other transfers."""
        res = action.reservation
        tid = res.transfer_id
        metrics.MATCH_WAIT_SECONDS.observe(action.match_wait_s)
        session = self._sessions.get(res.peer)
        if session is None:
            reason = "decode stream lost before the write"
            log.warning("write_skipped", transfer_id=tid, reason=reason)
            self._execute(self.table.on_write_finished(res.decode_engine, tid, res.epoch, False, reason, self.clock()))
            return
        if self.clock() >= session.lease_until:
            # No fresh lease: decode may be fencing these blocks on its timeline (docs/fence.md),
            # so nothing is posted now. A busy decode loop answers the Ping late, not never: the
            # transfer waits for the next renewal, up to ``lease_hold_s``.
            metrics.WRITES_HELD.inc()
            log.info("write_held", transfer_id=tid, epoch=res.epoch, reason="write lease expired")
            session.held.append(_Held(action, self.clock()))
            return
        w = _Write(action, session, started=self.clock())
        for s in session.slices:
            try:
                plan = plan_writes(self.local, session.regions[s.decode_rank], action.src_block_ids, res.block_ids, s)
            except PlanError as exc:
                w.results[s.decode_rank] = (False, f"plan: {exc}", None)
                continue
            if plan.num_descriptors == 0:
                w.results[plan.decode_rank] = (True, "", plan)
                continue
            try:
                handle, state = self.engine.post_write(plan.local, plan.remote, session.nixl_names[plan.decode_rank])
            except NixlError as exc:
                w.results[plan.decode_rank] = (False, str(exc), plan)
                continue
            if state == "DONE":
                self.engine.release(handle)
                w.results[plan.decode_rank] = (True, "", plan)
            else:
                w.pending.append((plan, handle))
        if w.pending:
            self._in_flight.append(w)
        else:
            self._finish(w)

    def _poll_in_flight(self) -> None:
        now = self.clock()
        still: list[_Write] = []
        stuck = False
        for w in self._in_flight:
            waiting: list[tuple[WritePlan, Any]] = []
            for plan, handle in w.pending:
                try:
                    state = self.engine.check(handle)
                except NixlError as exc:
                    self.engine.release(handle)
                    w.results[plan.decode_rank] = (False, str(exc), plan)
                    continue
                if state == "DONE":
                    self.engine.release(handle)
                    w.results[plan.decode_rank] = (True, "", plan)
                elif state == "PROC":
                    waiting.append((plan, handle))
                    stuck = stuck or now >= w.started + self.write_timeout_s
                else:
                    self.engine.release(handle)
                    w.results[plan.decode_rank] = (False, f"WRITE ended in state {state}", plan)
            w.pending = waiting
            if waiting:
                still.append(w)
            else:
                self._finish(w)
        self._in_flight = still
        if stuck:
            self._reset_data_plane(
                f"a WRITE was still in flight after {self.write_timeout_s:g}s: NIXL connections torn down"
            )

    def _reset_data_plane(self, reason: str) -> None:
        """A WRITE that NIXL cannot confirm ended must never land later (docs/fence.md). Neither
        releasing its handle nor removing the peer stops data UCX has queued, so the rank's NIXL
        agent is destroyed and recreated: every WRITE in flight fails, every decode stream is
        closed (decode fences its transfers by the lease bound and reconnects with a fresh Hello)."""
        metrics.TEARDOWNS.inc()
        log.error("data_plane_reset", reason=reason, peers=len(self._sessions), writes_in_flight=len(self._in_flight))
        writes, self._in_flight = self._in_flight, []
        for w in writes:
            for plan, handle in w.pending:
                self.engine.cancel(handle)
                w.results[plan.decode_rank] = (False, reason, plan)
            w.pending = []
        for session in list(self._sessions.values()):
            self._disconnect(session.key)
            session.close(reason)
        self.engine.reset()
        for w in writes:
            self._finish(w)

    def _finish(self, w: _Write) -> None:
        res, session, results, started = w.action.reservation, w.session, w.results, w.started
        tid = res.transfer_id
        elapsed = self.clock() - started
        ok = all(r[0] for r in results.values())
        total_bytes = sum(p.num_bytes for _, _, p in results.values() if p is not None)
        total_desc = sum(p.num_descriptors for _, _, p in results.values() if p is not None)
        metrics.WRITES.labels(outcome="ok" if ok else "failed").inc()
        metrics.WRITE_SECONDS.observe(elapsed)
        metrics.DESCRIPTORS.observe(total_desc)
        if ok:
            metrics.BYTES.inc(total_bytes)
        noticed: set[int] = set()
        if self.notices is not None and res.notice_key:
            # Ahead of the RPCs: from this thread, now, not from the agent's loop once it runs.
            noticed = self.notices.written(
                tid,
                res.epoch,
                res.notice_key,
                [
                    NoticeTarget(d, session.nixl_names[d])
                    for d, (rank_ok, _, _) in sorted(results.items())
                    if rank_ok and d in session.nixl_names
                ],
            )
        if self._handling is not None:
            self._handling.set()  # posted and noticed: the engine thread may go on (the rest is bookkeeping)
        for decode_rank, (rank_ok, reason, plan) in sorted(results.items()):
            self.deliver(
                CompletionReport(
                    endpoint=session.layouts[decode_rank].completion_endpoint,
                    completion=pb.Completion(
                        transfer_id=tid,
                        epoch=res.epoch,
                        prefill_rank=self.rank,
                        decode_rank=decode_rank,
                        status=pb.TRANSFER_STATUS_OK if rank_ok else pb.TRANSFER_STATUS_FAILED,
                        reason=reason,
                        prefill=self.identity,
                        bytes_written=plan.num_bytes if plan is not None else 0,
                        descriptors=plan.num_descriptors if plan is not None else 0,
                        write_seconds=elapsed,
                    ),
                    noticed=decode_rank in noticed,
                )
            )
        reason = "; ".join(f"decode rank {d}: {r[1]}" for d, r in sorted(results.items()) if not r[0])
        log.info(
            "write_finished",
            transfer_id=tid,
            epoch=res.epoch,
            ok=ok,
            bytes=total_bytes,
            descriptors=total_desc,
            write_ms=round(elapsed * 1e3, 3),
            reason=reason or None,
        )
        if not ok:
            # Tell the decode agent at once so it fences the other prefill ranks now, instead of
            # its rank barriers waiting for every rank to report.
            self._execute([Reject(res.peer, tid, res.epoch, RefusalCode.ABORTED, f"WRITE failed: {reason}")])
        self._execute(self.table.on_write_finished(res.decode_engine, tid, res.epoch, ok, reason, self.clock()))

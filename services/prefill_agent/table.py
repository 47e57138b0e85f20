"""Prefill-side transfer state (pure): matches reservations with "prefill done", in either order.

All events of one prefill rank go through one ``TransferTable`` owned by the writer thread, so
nothing here locks. Every method returns the actions the caller must carry out.

Transfers are keyed by (decode engine, transfer id). A reservation's decode engine is the engine
of the stream it came on (the stream's Hello identity, bound to the peer's certificate with
mTLS); a "prefill done" names the decode engine of the request's prefill leg. So a reservation
from engine E only ever matches KV meant for E, and a Cancel or a newer epoch from one engine
never touches another engine's transfer. A second "prefill done" for a key already taken is a
duplicate: its blocks are released at once and the first stands.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.services.common import limits
from kvpush.services.common.refusal import RefusalCode


class PrefillState(enum.Enum):
    WAITING_RESERVATION = "waiting_reservation"  # prefill done, decode blocks not known yet
    WAITING_PREFILL = "waiting_prefill"  # reservation known, KV not computed yet
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({PrefillState.DONE, PrefillState.FAILED, PrefillState.CANCELLED})


Key = tuple[str, str]  # (decode engine id, transfer id)


@dataclass(frozen=True)
class Reservation:
    peer: str  # session key of the stream that published it
    transfer_id: str
    epoch: int
    block_ids: tuple[tuple[int, ...], ...]  # decode block ids per KV-cache group
    num_tokens: int
    num_skip_blocks: int
    lease_s: float
    decode_engine: str  # engine id of that stream's (authenticated) Hello
    notice_key: bytes = b""  # MACs this epoch's completion notices (empty: send none)

    @property
    def key(self) -> Key:
        return (self.decode_engine, self.transfer_id)


@dataclass(frozen=True)
class PrefillDone:
    transfer_id: str
    request_id: str  # the prefill engine's own id; its blocks are released under it
    block_ids: tuple[tuple[int, ...], ...]  # local block ids per KV-cache group, whole prompt
    num_tokens: int
    decode_engine: str  # the decode engine the request's prefill leg names

    @property
    def key(self) -> Key:
        return (self.decode_engine, self.transfer_id)


# ----- actions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartWrite:
    reservation: Reservation
    done: PrefillDone
    src_block_ids: tuple[tuple[int, ...], ...]  # local blocks aligned with reservation.block_ids
    match_wait_s: float = 0.0  # from the first of (reservation, prefill done) to the second


@dataclass(frozen=True)
class Reject:
    peer: str
    transfer_id: str
    epoch: int
    code: RefusalCode
    message: str


@dataclass(frozen=True)
class AckCancel:
    peer: str
    transfer_id: str
    epoch: int
    data_written: bool


@dataclass(frozen=True)
class ReleaseBlocks:
    """The prefill engine may free the request's blocks (vLLM: report ``finished_sending``)."""

    transfer_id: str
    request_id: str
    reason: str


Action = StartWrite | Reject | AckCancel | ReleaseBlocks


@dataclass
class _Entry:
    key: Key
    state: PrefillState
    deadline: float
    reservation: Reservation | None = None
    done: PrefillDone | None = None
    next_reservation: Reservation | None = None  # a newer epoch that arrived while writing
    cancel_waiters: list[tuple[str, int]] = field(default_factory=list)
    reason: str = ""
    cancelled_epoch: int = 0  # newest epoch a Cancel named
    created: float = 0.0

    @property
    def transfer_id(self) -> str:
        return self.key[1]


class TransferTable:
    def __init__(
        self,
        prefill_lease_s: float = 30.0,
        tombstone_s: float = 60.0,
        max_open_per_decode: int = limits.MAX_OPEN_TRANSFERS_PER_DECODE,
        max_entries_per_decode: int = limits.MAX_ENTRIES_PER_DECODE,
    ) -> None:
        self.prefill_lease_s = prefill_lease_s
        self.tombstone_s = tombstone_s
        self.max_open_per_decode = max_open_per_decode
        self.max_entries_per_decode = max_entries_per_decode
        self._entries: dict[Key, _Entry] = {}
        self._open: dict[str, int] = {}  # decode engine -> entries not in a terminal state
        self._count: dict[str, int] = {}  # decode engine -> entries, tombstones included

    # ----- queries ------------------------------------------------------------------------

    def state(self, decode_engine: str, transfer_id: str) -> PrefillState | None:
        e = self._entries.get((decode_engine, transfer_id))
        return e.state if e else None

    def reservation_epoch(self, decode_engine: str, transfer_id: str) -> int | None:
        """Epoch of the reservation the transfer waits for or writes, if any."""
        e = self._entries.get((decode_engine, transfer_id))
        if e is None or e.state in TERMINAL or e.reservation is None:
            return None
        return (e.next_reservation or e.reservation).epoch

    def active_count(self) -> int:
        return sum(self._open.values())

    def open_count(self, decode_engine: str) -> int:
        return self._open.get(decode_engine, 0)

    def entry_count(self, decode_engine: str | None = None) -> int:
        """Entries (tombstones included), of one decode engine or of all."""
        return len(self._entries) if decode_engine is None else self._count.get(decode_engine, 0)

    # ----- bookkeeping ----------------------------------------------------------------------

    def _new(self, key: Key, state: PrefillState, deadline: float, **kw: object) -> _Entry:
        e = _Entry(key, state, deadline, **kw)  # type: ignore[arg-type]
        self._entries[key] = e
        engine = key[0]
        self._count[engine] = self._count.get(engine, 0) + 1
        if state not in TERMINAL:
            self._open[engine] = self._open.get(engine, 0) + 1
        return e

    def _set(self, e: _Entry, state: PrefillState, reason: str | None = None, deadline: float | None = None) -> None:
        was_open, now_open = e.state not in TERMINAL, state not in TERMINAL
        if was_open != now_open:
            engine = e.key[0]
            n = self._open.get(engine, 0) + (1 if now_open else -1)
            if n:
                self._open[engine] = n
            else:
                self._open.pop(engine, None)
        e.state = state
        if reason is not None:
            e.reason = reason
        if deadline is not None:
            e.deadline = deadline

    def _delete(self, key: Key) -> None:
        e = self._entries.pop(key)
        self._set(e, PrefillState.DONE)  # leaves the open count
        engine = key[0]
        n = self._count.get(engine, 0) - 1
        if n > 0:
            self._count[engine] = n
        else:
            self._count.pop(engine, None)

    def _full(self, engine: str) -> str | None:
        if self._open.get(engine, 0) >= self.max_open_per_decode:
            return f"too many open transfers for this decode engine (at most {self.max_open_per_decode})"
        if self._count.get(engine, 0) >= self.max_entries_per_decode:
            return f"too many transfers remembered for this decode engine (at most {self.max_entries_per_decode})"
        return None

    # ----- events -------------------------------------------------------------------------

    def on_reservation(self, res: Reservation, now: float) -> list[Action]:
        e = self._entries.get(res.key)
        if e is None:
            full = self._full(res.decode_engine)
            if full is not None:
                return [self._reject(res, RefusalCode.RESOURCE_EXHAUSTED, full)]
            self._new(res.key, PrefillState.WAITING_PREFILL, now + res.lease_s, reservation=res, created=now)
            return []
        current = e.next_reservation or e.reservation
        if res.epoch <= e.cancelled_epoch:
            return [self._reject(res, RefusalCode.FAILED_PRECONDITION, f"epoch {res.epoch} was cancelled")]
        if current is not None and res.epoch < current.epoch:
            return [self._reject(res, RefusalCode.FAILED_PRECONDITION, f"stale epoch {res.epoch} < {current.epoch}")]
        if current is not None and res.epoch == current.epoch:
            return []  # duplicate publish: idempotent
        if e.state is PrefillState.WAITING_RESERVATION:
            assert e.done is not None
            e.reservation = res
            return self._start(e, now)
        if e.state is PrefillState.WAITING_PREFILL:
            e.reservation = res  # a newer epoch of the same engine supersedes its unmatched older one
            e.deadline = now + res.lease_s
            return []
        if e.state is PrefillState.WRITING:
            e.next_reservation = res
            return []
        if e.state is PrefillState.CANCELLED and e.done is None:
            # The KV is not computed yet: a newer epoch reopens the transfer.
            if self._open.get(res.decode_engine, 0) >= self.max_open_per_decode:
                return [self._reject(res, RefusalCode.RESOURCE_EXHAUSTED, "too many open transfers")]
            e.reservation = res
            self._set(e, PrefillState.WAITING_PREFILL, "", now + res.lease_s)
            return []
        return [self._reject(res, RefusalCode.FAILED_PRECONDITION, f"transfer already {e.state.value}: {e.reason}")]

    def on_prefill_done(self, done: PrefillDone, now: float) -> list[Action]:
        e = self._entries.get(done.key)
        if e is None:
            self._new(done.key, PrefillState.WAITING_RESERVATION, now + self.prefill_lease_s, done=done, created=now)
            return []
        if e.state is PrefillState.WAITING_PREFILL:
            e.done = done
            return self._start(e, now)
        if e.done is not None:
            if e.done.request_id == done.request_id:
                return []  # the same request reported twice: the first report stands
            # Another request claims a transfer id already taken: never written, freed now.
            return [ReleaseBlocks(done.transfer_id, done.request_id, "duplicate transfer id")]
        # Cancelled, aborted or expired before the KV existed: nobody will ever want these blocks.
        e.done = done  # consumed: a later epoch can no longer be served
        return [ReleaseBlocks(done.transfer_id, done.request_id, f"transfer already {e.state.value}")]

    def on_prefill_aborted(self, decode_engine: str, transfer_id: str, now: float) -> list[Action]:
        """The prefill request ended before its KV was computed: decode must not wait for it."""
        key = (decode_engine, transfer_id)
        e = self._entries.get(key)
        if e is None:
            self._new(key, PrefillState.FAILED, now + self.tombstone_s, reason="prefill aborted")
            return []
        if e.state is PrefillState.WAITING_PREFILL and e.reservation is not None:
            self._set(e, PrefillState.FAILED, "prefill aborted", now + self.tombstone_s)
            return [self._reject(e.reservation, RefusalCode.ABORTED, "prefill request aborted")]
        return []

    def on_cancel(self, peer: str, decode_engine: str, transfer_id: str, epoch: int, now: float) -> list[Action]:
        """A Cancel from ``peer``, a stream of ``decode_engine``: it only ever names that engine's
        transfers (another engine's transfer with the same id is a different key)."""
        key = (decode_engine, transfer_id)
        e = self._entries.get(key)
        if e is None:
            # Nothing was ever written; remember the cancel so a late prefill-done frees at once
            # (unless this engine already has too much remembered: then that KV waits for its lease).
            if self._count.get(decode_engine, 0) < self.max_entries_per_decode:
                self._new(
                    key, PrefillState.CANCELLED, now + self.tombstone_s, reason="cancelled", cancelled_epoch=epoch
                )
            return [AckCancel(peer, transfer_id, epoch, data_written=False)]
        e.cancelled_epoch = max(e.cancelled_epoch, epoch)
        if e.state is PrefillState.WRITING:
            if e.next_reservation is not None and e.next_reservation.epoch == epoch:
                e.next_reservation = None
                return [AckCancel(peer, transfer_id, epoch, data_written=False)]
            if e.reservation is not None and e.reservation.epoch == epoch:
                e.cancel_waiters.append((peer, epoch))
                return []  # acked when the WRITEs in flight have finished
            return [AckCancel(peer, transfer_id, epoch, data_written=False)]
        if e.state is PrefillState.WAITING_PREFILL and e.reservation is not None and e.reservation.epoch <= epoch:
            self._set(e, PrefillState.CANCELLED, "cancelled", now + self.tombstone_s)
            return [AckCancel(peer, transfer_id, epoch, data_written=False)]
        written = e.state is PrefillState.DONE and e.reservation is not None and e.reservation.epoch == epoch
        actions: list[Action] = [AckCancel(peer, transfer_id, epoch, data_written=written)]
        if e.state is PrefillState.WAITING_RESERVATION and e.done is not None:
            # Decode gave up before its reservation reached us; free the prefill blocks now.
            self._set(e, PrefillState.CANCELLED, "cancelled", now + self.tombstone_s)
            actions.append(ReleaseBlocks(transfer_id, e.done.request_id, "cancelled before reservation"))
        return actions

    def on_write_finished(
        self, decode_engine: str, transfer_id: str, epoch: int, ok: bool, reason: str, now: float
    ) -> list[Action]:
        e = self._entries.get((decode_engine, transfer_id))
        if e is None or e.state is not PrefillState.WRITING or e.reservation is None or e.reservation.epoch != epoch:
            return []
        actions: list[Action] = [AckCancel(peer, transfer_id, ep, data_written=ok) for peer, ep in e.cancel_waiters]
        cancelled = bool(e.cancel_waiters)
        e.cancel_waiters = []
        if e.next_reservation is not None:
            e.reservation, e.next_reservation = e.next_reservation, None
            return actions + self._start(e, now)
        state = PrefillState.DONE if ok else (PrefillState.CANCELLED if cancelled else PrefillState.FAILED)
        self._set(e, state, reason, now + self.tombstone_s)
        assert e.done is not None
        actions.append(ReleaseBlocks(transfer_id, e.done.request_id, reason or e.state.value))
        return actions

    def on_peer_lost(self, peer: str, now: float) -> None:
        """The decode stream ``peer`` ended: none of its reservations is written from now on. Nothing
        is released here: a WRITE already posted ends (or is torn down) in the writer, and KV still
        waiting for a reservation keeps its lease, since the decode engine may reconnect."""
        for e in self._entries.values():
            if e.state is PrefillState.WAITING_PREFILL and e.reservation is not None and e.reservation.peer == peer:
                self._set(e, PrefillState.CANCELLED, "decode stream lost", now + self.tombstone_s)
            elif e.state is PrefillState.WRITING:
                if e.next_reservation is not None and e.next_reservation.peer == peer:
                    e.next_reservation = None
                e.cancel_waiters = [(p, ep) for p, ep in e.cancel_waiters if p != peer]

    def expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key in [k for k, e in self._entries.items() if e.deadline <= now]:
            e = self._entries[key]
            if e.state in TERMINAL:
                self._delete(key)
            elif e.state is PrefillState.WAITING_PREFILL:
                assert e.reservation is not None
                actions.append(
                    self._reject(
                        e.reservation, RefusalCode.DEADLINE_EXCEEDED, "reservation lease expired before prefill"
                    )
                )
                self._set(e, PrefillState.FAILED, "reservation lease expired", now + self.tombstone_s)
            elif e.state is PrefillState.WAITING_RESERVATION:
                assert e.done is not None
                actions.append(
                    ReleaseBlocks(e.transfer_id, e.done.request_id, "prefill lease expired without reservation")
                )
                self._set(e, PrefillState.FAILED, "prefill lease expired", now + self.tombstone_s)
            # WRITING is bounded by the writer itself.
        return actions

    # ----- helpers ------------------------------------------------------------------------

    def _start(self, e: _Entry, now: float) -> list[Action]:
        res, done = e.reservation, e.done
        assert res is not None and done is not None
        try:
            src = align_blocks(done, res)
        except ValueError as exc:
            self._set(e, PrefillState.FAILED, str(exc), now + self.tombstone_s)
            return [
                self._reject(res, RefusalCode.INVALID_ARGUMENT, str(exc)),
                ReleaseBlocks(e.transfer_id, done.request_id, f"rejected: {exc}"),
            ]
        self._set(e, PrefillState.WRITING, deadline=float("inf"))
        return [StartWrite(res, done, src, now - e.created)]

    @staticmethod
    def _reject(res: Reservation, code: RefusalCode, message: str) -> Reject:
        return Reject(res.peer, res.transfer_id, res.epoch, code, message)


def align_blocks(done: PrefillDone, res: Reservation) -> tuple[tuple[int, ...], ...]:
    """Local blocks that pair with the reservation's blocks: decode's first ``num_skip_blocks``
    blocks are already there (prefix hit), so prefill writes only the blocks after them."""
    if done.num_tokens != res.num_tokens:
        raise ValueError(f"token count mismatch: prefill computed {done.num_tokens}, decode expects {res.num_tokens}")
    if len(done.block_ids) != len(res.block_ids):
        raise ValueError(f"group count mismatch: {len(done.block_ids)} local vs {len(res.block_ids)} reserved")
    out = []
    for g, (local, remote) in enumerate(zip(done.block_ids, res.block_ids, strict=True)):
        if len(local) - res.num_skip_blocks != len(remote):
            raise ValueError(
                f"block count mismatch in group {g}: prefill has {len(local)} blocks, decode skips "
                f"{res.num_skip_blocks} and reserved {len(remote)}"
            )
        out.append(tuple(local[res.num_skip_blocks :]))
    return tuple(out)

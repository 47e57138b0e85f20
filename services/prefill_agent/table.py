"""Prefill-side transfer state (pure): matches reservations with "prefill done", in either order.

All events of one prefill rank go through one ``TransferTable`` owned by the writer thread, so
nothing here locks. Every method returns the actions the caller must carry out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc


class PrefillState(enum.Enum):
    WAITING_RESERVATION = "waiting_reservation"  # prefill done, decode blocks not known yet
    WAITING_PREFILL = "waiting_prefill"  # reservation known, KV not computed yet
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({PrefillState.DONE, PrefillState.FAILED, PrefillState.CANCELLED})


@dataclass(frozen=True)
class Reservation:
    peer: str  # session key of the decode engine that published it
    transfer_id: str
    epoch: int
    block_ids: tuple[tuple[int, ...], ...]  # decode block ids per KV-cache group
    num_tokens: int
    num_skip_blocks: int
    lease_s: float


@dataclass(frozen=True)
class PrefillDone:
    transfer_id: str
    request_id: str  # the prefill engine's own id; its blocks are released under it
    block_ids: tuple[tuple[int, ...], ...]  # local block ids per KV-cache group, whole prompt
    num_tokens: int


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
    code: grpc.StatusCode
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
    transfer_id: str
    state: PrefillState
    deadline: float
    reservation: Reservation | None = None
    done: PrefillDone | None = None
    next_reservation: Reservation | None = None  # a newer epoch that arrived while writing
    cancel_waiters: list[tuple[str, int]] = field(default_factory=list)
    reason: str = ""
    cancelled_epoch: int = 0  # newest epoch a Cancel named
    created: float = 0.0


class TransferTable:
    def __init__(self, prefill_lease_s: float = 30.0, tombstone_s: float = 60.0) -> None:
        self.prefill_lease_s = prefill_lease_s
        self.tombstone_s = tombstone_s
        self._entries: dict[str, _Entry] = {}

    # ----- queries ------------------------------------------------------------------------

    def state(self, transfer_id: str) -> PrefillState | None:
        e = self._entries.get(transfer_id)
        return e.state if e else None

    def reservation_epoch(self, transfer_id: str) -> int | None:
        """Epoch of the reservation the transfer waits for or writes, if any."""
        e = self._entries.get(transfer_id)
        if e is None or e.state in TERMINAL or e.reservation is None:
            return None
        return (e.next_reservation or e.reservation).epoch

    def active_count(self) -> int:
        return sum(1 for e in self._entries.values() if e.state not in TERMINAL)

    def next_deadline(self) -> float | None:
        return min((e.deadline for e in self._entries.values()), default=None)

    # ----- events -------------------------------------------------------------------------

    def on_reservation(self, res: Reservation, now: float) -> list[Action]:
        e = self._entries.get(res.transfer_id)
        if e is None:
            self._entries[res.transfer_id] = _Entry(
                res.transfer_id, PrefillState.WAITING_PREFILL, now + res.lease_s, reservation=res, created=now
            )
            return []
        current = e.next_reservation or e.reservation
        if res.epoch <= e.cancelled_epoch:
            return [self._reject(res, grpc.StatusCode.FAILED_PRECONDITION, f"epoch {res.epoch} was cancelled")]
        if current is not None and res.epoch < current.epoch:
            return [
                self._reject(res, grpc.StatusCode.FAILED_PRECONDITION, f"stale epoch {res.epoch} < {current.epoch}")
            ]
        if current is not None and res.epoch == current.epoch:
            return []  # duplicate publish: idempotent
        if e.state is PrefillState.WAITING_RESERVATION:
            assert e.done is not None
            e.reservation = res
            return self._start(e, now)
        if e.state is PrefillState.WAITING_PREFILL:
            e.reservation = res  # a newer epoch supersedes the unmatched older one
            e.deadline = now + res.lease_s
            return []
        if e.state is PrefillState.WRITING:
            e.next_reservation = res
            return []
        if e.state is PrefillState.CANCELLED and e.done is None:
            # The KV is not computed yet: a newer epoch reopens the transfer.
            e.state, e.reservation, e.reason, e.deadline = PrefillState.WAITING_PREFILL, res, "", now + res.lease_s
            return []
        return [self._reject(res, grpc.StatusCode.FAILED_PRECONDITION, f"transfer already {e.state.value}: {e.reason}")]

    def on_prefill_done(self, done: PrefillDone, now: float) -> list[Action]:
        e = self._entries.get(done.transfer_id)
        if e is None:
            self._entries[done.transfer_id] = _Entry(
                done.transfer_id, PrefillState.WAITING_RESERVATION, now + self.prefill_lease_s, done=done, created=now
            )
            return []
        if e.state is PrefillState.WAITING_PREFILL:
            e.done = done
            return self._start(e, now)
        if e.state in TERMINAL:
            # Cancelled or expired before the KV existed: nobody will ever want these blocks.
            e.done = done  # consumed: a later epoch can no longer be served
            return [ReleaseBlocks(done.transfer_id, done.request_id, f"transfer already {e.state.value}")]
        # A second "done" for a transfer in flight is a caller bug; keep the first.
        return []

    def on_prefill_aborted(self, transfer_id: str, now: float) -> list[Action]:
        """The prefill request ended before its KV was computed: decode must not wait for it."""
        e = self._entries.get(transfer_id)
        if e is None:
            self._entries[transfer_id] = _Entry(
                transfer_id, PrefillState.FAILED, now + self.tombstone_s, reason="prefill aborted"
            )
            return []
        if e.state is PrefillState.WAITING_PREFILL and e.reservation is not None:
            e.state, e.reason, e.deadline = PrefillState.FAILED, "prefill aborted", now + self.tombstone_s
            return [self._reject(e.reservation, grpc.StatusCode.ABORTED, "prefill request aborted")]
        return []

    def on_cancel(self, peer: str, transfer_id: str, epoch: int, now: float) -> list[Action]:
        e = self._entries.get(transfer_id)
        if e is None:
            # Nothing was ever written; remember the cancel so a late prefill-done frees at once.
            self._entries[transfer_id] = _Entry(
                transfer_id, PrefillState.CANCELLED, now + self.tombstone_s, reason="cancelled", cancelled_epoch=epoch
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
            e.state, e.reason, e.deadline = PrefillState.CANCELLED, "cancelled", now + self.tombstone_s
            return [AckCancel(peer, transfer_id, epoch, data_written=False)]
        written = e.state is PrefillState.DONE and e.reservation is not None and e.reservation.epoch == epoch
        actions: list[Action] = [AckCancel(peer, transfer_id, epoch, data_written=written)]
        if e.state is PrefillState.WAITING_RESERVATION and e.done is not None:
            # Decode gave up before its reservation reached us; free the prefill blocks now.
            e.state, e.reason, e.deadline = PrefillState.CANCELLED, "cancelled", now + self.tombstone_s
            actions.append(ReleaseBlocks(transfer_id, e.done.request_id, "cancelled before reservation"))
        return actions

    def on_write_finished(self, transfer_id: str, epoch: int, ok: bool, reason: str, now: float) -> list[Action]:
        e = self._entries.get(transfer_id)
        if e is None or e.state is not PrefillState.WRITING or e.reservation is None or e.reservation.epoch != epoch:
            return []
        actions: list[Action] = [AckCancel(peer, transfer_id, ep, data_written=ok) for peer, ep in e.cancel_waiters]
        cancelled = bool(e.cancel_waiters)
        e.cancel_waiters = []
        if e.next_reservation is not None:
            e.reservation, e.next_reservation = e.next_reservation, None
            return actions + self._start(e, now)
        e.state = PrefillState.DONE if ok else (PrefillState.CANCELLED if cancelled else PrefillState.FAILED)
        e.reason = reason
        e.deadline = now + self.tombstone_s
        assert e.done is not None
        actions.append(ReleaseBlocks(transfer_id, e.done.request_id, reason or e.state.value))
        return actions

    def on_peer_lost(self, peer: str, now: float) -> list[Action]:
        """The decode engine's stream ended: none of its reservations is written from now on."""
        actions: list[Action] = []
        for e in self._entries.values():
            if e.state is PrefillState.WAITING_PREFILL and e.reservation is not None and e.reservation.peer == peer:
                e.state, e.reason, e.deadline = PrefillState.CANCELLED, "decode stream lost", now + self.tombstone_s
            elif e.state is PrefillState.WRITING:
                if e.next_reservation is not None and e.next_reservation.peer == peer:
                    e.next_reservation = None
                e.cancel_waiters = [(p, ep) for p, ep in e.cancel_waiters if p != peer]
        return actions

    def expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for tid in [t for t, e in self._entries.items() if e.deadline <= now]:
            e = self._entries[tid]
            if e.state in TERMINAL:
                del self._entries[tid]
            elif e.state is PrefillState.WAITING_PREFILL:
                assert e.reservation is not None
                actions.append(
                    self._reject(
                        e.reservation, grpc.StatusCode.DEADLINE_EXCEEDED, "reservation lease expired before prefill"
                    )
                )
                e.state, e.reason, e.deadline = PrefillState.FAILED, "reservation lease expired", now + self.tombstone_s
            elif e.state is PrefillState.WAITING_RESERVATION:
                assert e.done is not None
                actions.append(ReleaseBlocks(tid, e.done.request_id, "prefill lease expired without reservation"))
                e.state, e.reason, e.deadline = PrefillState.FAILED, "prefill lease expired", now + self.tombstone_s
            # WRITING is bounded by the writer itself.
        return actions

    # ----- helpers ------------------------------------------------------------------------

    def _start(self, e: _Entry, now: float) -> list[Action]:
        res, done = e.reservation, e.done
        assert res is not None and done is not None
        try:
            src = align_blocks(done, res)
        except ValueError as exc:
            e.state, e.reason, e.deadline = PrefillState.FAILED, str(exc), now + self.tombstone_s
            return [
                self._reject(res, grpc.StatusCode.INVALID_ARGUMENT, str(exc)),
                ReleaseBlocks(e.transfer_id, done.request_id, f"rejected: {exc}"),
            ]
        e.state = PrefillState.WRITING
        e.deadline = float("inf")
        return [StartWrite(res, done, src, now - e.created)]

    @staticmethod
    def _reject(res: Reservation, code: grpc.StatusCode, message: str) -> Reject:
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

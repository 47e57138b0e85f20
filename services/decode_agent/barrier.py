"""Per-rank completion barrier (pure).

A decode rank learns from its agent which prefill ranks will write a transfer (``expect``), then
collects one completion per prefill rank. It releases the transfer:
- OK when every expected rank reported OK;
- FAILED as soon as a rank reported a failure and every other expected rank has reported too
  (a failed rank stops writing; the others finish their WRITEs within milliseconds), or
- on the agent's ``settle``, which it sends only once no WRITE for the epoch can still land.
Duplicates are idempotent; unknown transfers, stale epochs and unexpected ranks are errors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc


class BarrierState(enum.Enum):
    WAITING = "waiting"
    FAILING = "failing"  # a rank failed; waiting for the others to stop
    RELEASED = "released"


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"


class CompletionError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Released:
    transfer_id: str
    epoch: int
    request_id: str
    outcome: Outcome
    reason: str


@dataclass
class CompletionBarrier:
    transfer_id: str
    epoch: int
    request_id: str
    expected: frozenset[int]
    prefill_engine_id: str
    created: float
    state: BarrierState = BarrierState.WAITING
    ok: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)
    outcome: Outcome | None = None
    released_at: float | None = None

    def reported(self) -> set[int]:
        return self.ok | set(self.failed)


class BarrierTable:
    def __init__(self, tombstone_s: float = 60.0) -> None:
        self.tombstone_s = tombstone_s
        self._barriers: dict[str, CompletionBarrier] = {}
        self._pending = 0

    def pending_count(self) -> int:
        return self._pending

    def get(self, transfer_id: str) -> CompletionBarrier | None:
        return self._barriers.get(transfer_id)

    def expect(
        self,
        transfer_id: str,
        epoch: int,
        request_id: str,
        prefill_ranks: list[int],
        prefill_engine_id: str,
        now: float,
    ) -> None:
        if not prefill_ranks:
            raise CompletionError(grpc.StatusCode.INVALID_ARGUMENT, "an expectation needs at least one prefill rank")
        b = self._barriers.get(transfer_id)
        if b is not None and epoch < b.epoch:
            raise CompletionError(grpc.StatusCode.FAILED_PRECONDITION, f"stale epoch {epoch} < {b.epoch}")
        if b is not None and epoch == b.epoch:
            return
        if b is not None and b.state is not BarrierState.RELEASED:
            raise CompletionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"epoch {b.epoch} of {transfer_id} is still open; settle it before a new epoch",
            )
        self._barriers[transfer_id] = CompletionBarrier(
            transfer_id, epoch, request_id, frozenset(prefill_ranks), prefill_engine_id, now
        )
        self._pending += 1

    def complete(
        self,
        transfer_id: str,
        epoch: int,
        prefill_rank: int,
        prefill_engine_id: str,
        ok: bool,
        reason: str,
        now: float,
    ) -> Released | None:
        """Records one rank's completion; returns the release it caused, if any."""
        b = self._barriers.get(transfer_id)
        if b is None:
            raise CompletionError(grpc.StatusCode.NOT_FOUND, f"unknown transfer {transfer_id!r}")
        if epoch != b.epoch:
            raise CompletionError(
                grpc.StatusCode.FAILED_PRECONDITION, f"stale epoch {epoch} for {transfer_id} (current {b.epoch})"
            )
        if prefill_engine_id != b.prefill_engine_id:
            raise CompletionError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"engine {prefill_engine_id!r} is not the prefill engine of {transfer_id}",
            )
        if prefill_rank not in b.expected:
            raise CompletionError(
                grpc.StatusCode.INVALID_ARGUMENT, f"prefill rank {prefill_rank} does not write {transfer_id}"
            )
        if b.state is BarrierState.RELEASED:
            if prefill_rank in b.reported():
                return None  # duplicate after release: idempotent
            raise CompletionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{transfer_id} epoch {epoch} was already settled ({b.outcome.value if b.outcome else '?'})",
            )
        if prefill_rank in b.reported():
            return None  # duplicate: the first report stands
        if ok:
            b.ok.add(prefill_rank)
        else:
            b.failed[prefill_rank] = reason or "failed"
            b.state = BarrierState.FAILING
        if b.reported() != b.expected:
            return None
        if b.failed:
            return self._release(
                b, Outcome.FAILED, "; ".join(f"rank {r}: {m}" for r, m in sorted(b.failed.items())), now
            )
        return self._release(b, Outcome.OK, "", now)

    def settle(self, transfer_id: str, epoch: int, outcome: Outcome, reason: str, now: float) -> Released | None:
        b = self._barriers.get(transfer_id)
        if b is None:
            raise CompletionError(grpc.StatusCode.NOT_FOUND, f"unknown transfer {transfer_id!r}")
        if epoch != b.epoch:
            raise CompletionError(
                grpc.StatusCode.FAILED_PRECONDITION, f"stale epoch {epoch} for {transfer_id} (current {b.epoch})"
            )
        if b.state is BarrierState.RELEASED:
            return None
        return self._release(b, outcome, reason, now)

    def expire(self, now: float) -> None:
        for tid in [
            t
            for t, b in self._barriers.items()
            if b.released_at is not None and b.released_at + self.tombstone_s <= now
        ]:
            del self._barriers[tid]

    def _release(self, b: CompletionBarrier, outcome: Outcome, reason: str, now: float) -> Released:
        b.state, b.outcome, b.released_at = BarrierState.RELEASED, outcome, now
        self._pending -= 1
        return Released(b.transfer_id, b.epoch, b.request_id, outcome, reason)

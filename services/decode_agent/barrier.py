"""Per-rank completion barrier (pure).

A decode rank learns from its agent which prefill ranks will write a transfer (``expect``), then
collects one completion per prefill rank. It releases the transfer:
- OK when every expected rank reported OK, or
- on the agent's ``settle``, which it sends only once no WRITE for the epoch can still land.
A failed completion only marks the barrier FAILING: the agent (told by the prefill rank on its
stream) fences the epoch and then either settles it, or sends the expectation of a newer epoch of
the same request, written by another prefill engine (retry elsewhere), which replaces this one.
Duplicates are idempotent; unknown transfers, stale epochs and unexpected ranks are errors.

A transfer id belongs to one decode request: an expectation for it from another request, while
the first is open or remembered, is refused with ALREADY_EXISTS (never replaces the first). Every
refused expectation is remembered, so the agent's ``settle`` for it still releases its request as
FAILED: a request is always released, and never as a success it was not.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from kvpush.services.common import limits
from kvpush.services.common.refusal import RefusalCode


class BarrierState(enum.Enum):
    WAITING = "waiting"
    FAILING = "failing"  # a rank failed; waiting for the others to stop
    RELEASED = "released"


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"


class CompletionError(Exception):
    def __init__(self, code: RefusalCode, message: str) -> None:
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
    notice_key: bytes = b""  # MACs this epoch's completion notices (empty: none taken)

    def reported(self) -> set[int]:
        return self.ok | set(self.failed)


class BarrierTable:
    def __init__(
        self,
        tombstone_s: float = 60.0,
        max_pending: int = limits.MAX_PENDING_BARRIERS,
        max_refused: int = limits.MAX_REFUSED_REMEMBERED,
    ) -> None:
        self.tombstone_s = tombstone_s
        self.max_pending = max_pending
        self.max_refused = max_refused
        self._barriers: dict[str, CompletionBarrier] = {}
        self._pending = 0
        # (transfer id, epoch) of refused expectations -> (request id, when): their settle fails them.
        self._refused: OrderedDict[tuple[str, int], tuple[str, float]] = OrderedDict()

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
        notice_key: bytes = b"",
    ) -> None:
        try:
            self._check_expect(transfer_id, epoch, request_id, prefill_ranks)
        except CompletionError:
            self._remember_refused(transfer_id, epoch, request_id, now)
            raise
        b = self._barriers.get(transfer_id)
        if b is not None and epoch == b.epoch:
            return
        self._refused.pop((transfer_id, epoch), None)  # this (transfer, epoch) is a barrier's now
        if b is None or b.state is BarrierState.RELEASED:
            self._pending += 1  # else a retry of the same request replaces its open barrier
        self._barriers[transfer_id] = CompletionBarrier(
            transfer_id, epoch, request_id, frozenset(prefill_ranks), prefill_engine_id, now, notice_key=notice_key
        )

    def _check_expect(self, transfer_id: str, epoch: int, request_id: str, prefill_ranks: list[int]) -> None:
        if not prefill_ranks:
            raise CompletionError(RefusalCode.INVALID_ARGUMENT, "an expectation needs at least one prefill rank")
        b = self._barriers.get(transfer_id)
        if b is not None and b.request_id != request_id:
            raise CompletionError(RefusalCode.ALREADY_EXISTS, "duplicate transfer id: another request holds it")
        if b is not None and epoch < b.epoch:
            raise CompletionError(RefusalCode.FAILED_PRECONDITION, f"stale epoch {epoch} < {b.epoch}")
        if b is not None and epoch == b.epoch:
            return
        if b is not None and b.outcome is Outcome.OK:
            # This rank already handed the request to the engine: a retry cannot be written here.
            raise CompletionError(RefusalCode.FAILED_PRECONDITION, f"epoch {b.epoch} of {transfer_id} completed here")
        if b is not None and b.state is not BarrierState.RELEASED:
            return  # a retry (newer epoch, same request): the agent fenced the open epoch first
        if self._pending >= self.max_pending:
            raise CompletionError(RefusalCode.RESOURCE_EXHAUSTED, f"more than {self.max_pending} transfers pending")

    def _remember_refused(self, transfer_id: str, epoch: int, request_id: str, now: float) -> None:
        key = (transfer_id, epoch)
        b = self._barriers.get(transfer_id)
        if key in self._refused or (b is not None and (b.epoch == epoch or b.request_id == request_id)):
            return  # the first word on a (transfer, epoch) stands; the request's own barrier releases it
        self._refused[key] = (request_id, now)
        while len(self._refused) > self.max_refused:
            self._refused.popitem(last=False)

    def refused_count(self) -> int:
        return len(self._refused)

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
            raise CompletionError(RefusalCode.NOT_FOUND, "unknown transfer")
        if epoch != b.epoch:
            raise CompletionError(RefusalCode.FAILED_PRECONDITION, f"stale epoch {epoch} (current {b.epoch})")
        if prefill_engine_id != b.prefill_engine_id:
            raise CompletionError(RefusalCode.PERMISSION_DENIED, "not the prefill engine of this transfer")
        if prefill_rank not in b.expected:
            raise CompletionError(RefusalCode.INVALID_ARGUMENT, f"prefill rank {prefill_rank} does not write it")
        if b.state is BarrierState.RELEASED:
            if prefill_rank in b.reported():
                return None  # duplicate after release: idempotent
            raise CompletionError(
                RefusalCode.FAILED_PRECONDITION,
                f"{transfer_id} epoch {epoch} was already settled ({b.outcome.value if b.outcome else '?'})",
            )
        if prefill_rank in b.reported():
            return None  # duplicate: the first report stands
        if ok:
            b.ok.add(prefill_rank)
        else:
            b.failed[prefill_rank] = reason or "failed"
            b.state = BarrierState.FAILING
        if b.failed or b.reported() != b.expected:
            return None  # a failure waits for the agent: settle, or a retry's newer epoch
        return self._release(b, Outcome.OK, "", now)

    def settle(self, transfer_id: str, epoch: int, outcome: Outcome, reason: str, now: float) -> Released | None:
        b = self._barriers.get(transfer_id)
        if b is None or epoch != b.epoch:
            refused = self._refused.pop((transfer_id, epoch), None)
            if refused is not None:
                # Its expectation was refused, so nothing was ever written for it: the request fails.
                return Released(transfer_id, epoch, refused[0], Outcome.FAILED, reason or "expectation refused")
        if b is None:
            raise CompletionError(RefusalCode.NOT_FOUND, "unknown transfer")
        if epoch != b.epoch:
            raise CompletionError(RefusalCode.FAILED_PRECONDITION, f"stale epoch {epoch} (current {b.epoch})")
        if b.state is BarrierState.RELEASED:
            return None
        if b.failed:  # the prefill ranks' own words first: they say what went wrong
            failures = "; ".join(f"rank {r}: {m}" for r, m in sorted(b.failed.items()))
            reason = f"{failures} ({reason})" if reason else failures
        return self._release(b, outcome, reason, now)

    def expire(self, now: float) -> None:
        for tid in [
            t
            for t, b in self._barriers.items()
            if b.released_at is not None and b.released_at + self.tombstone_s <= now
        ]:
            del self._barriers[tid]
        while self._refused:
            key, (_, at) = next(iter(self._refused.items()))
            if at + self.tombstone_s > now:
                break
            del self._refused[key]

    def _release(self, b: CompletionBarrier, outcome: Outcome, reason: str, now: float) -> Released:
        b.state, b.outcome, b.released_at = BarrierState.RELEASED, outcome, now
        self._pending -= 1
        return Released(b.transfer_id, b.epoch, b.request_id, outcome, reason)

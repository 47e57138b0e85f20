"""The last N closed assignments, kept where the garbage collector does not look.

A repeated or late Release of a closed assignment must still be answered (idempotently, or as a
stale epoch), so the registry remembers up to ``capacity`` closed assignments. Kept as
``AssignmentRecord`` objects they were the largest set of GC-tracked objects in the scheduler, and
every full collection walked all of them (17 ms for 65,536 records, in the tail of Assign). Here
each entry is an exact tuple of ints and strings, which CPython's collector untracks after its
first pass, so a full collection costs the same with an empty history as with a full one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

from kvpush.services.scheduler.model import AssignmentRecord, ClosedAssignment, State

# epoch, earlier epochs, state value, reason: atomic items only, so the tuple can be untracked.
_Entry = tuple[int, tuple[int, ...], str, str]


class ClosedHistory(Mapping[str, ClosedAssignment]):
    """transfer id -> ClosedAssignment, oldest evicted first once ``capacity`` is reached."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def add(self, rec: AssignmentRecord) -> None:
        """Remembers ``rec`` as it is now (its state must not be OPEN)."""
        self._entries[rec.transfer_id] = (rec.epoch, tuple(sorted(rec.earlier_epochs)), rec.state.value, rec.reason)
        self._entries.move_to_end(rec.transfer_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def discard(self, transfer_id: str) -> None:
        self._entries.pop(transfer_id, None)

    def __getitem__(self, transfer_id: str) -> ClosedAssignment:
        epoch, earlier, state, reason = self._entries[transfer_id]
        return ClosedAssignment(transfer_id, epoch, earlier, State(state), reason)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

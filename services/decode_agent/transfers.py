"""Decode-agent transfer state (pure): reservation lifecycle and the reuse fence.

``RESERVED -> PUBLISHED -> COMPLETE``, or ``-> CANCELLING -> CANCELLED | FAILED``.
A transfer that leaves PUBLISHED other than by completing is fenced: every prefill link that got
the reservation must ack a Cancel (no WRITE for the epoch in flight or to come), or its stream
must have been lost for a grace period (the prefill side drops a lost stream's reservations).
Only then is the transfer settled and may decode reuse the blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class DecodeState(enum.Enum):
    RESERVED = "reserved"
    PUBLISHED = "published"
    COMPLETE = "complete"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    FAILED = "failed"


SETTLED = frozenset({DecodeState.COMPLETE, DecodeState.CANCELLED, DecodeState.FAILED})


@dataclass
class DecodeTransfer:
    transfer_id: str
    epoch: int
    request_id: str
    prefill_engine_id: str
    links: tuple[str, ...]  # prefill-rank links the reservation goes to
    num_blocks: int
    reserved_at: float
    state: DecodeState = DecodeState.RESERVED
    published_at: float | None = None
    fence_outcome: DecodeState | None = None  # CANCELLED or FAILED once fencing started
    reason: str = ""
    awaiting_ack: set[str] = field(default_factory=set)
    lost_until: dict[str, float] = field(default_factory=dict)  # link -> grace deadline

    @property
    def settled(self) -> bool:
        return self.state in SETTLED

    def mark_published(self, now: float) -> None:
        if self.state is DecodeState.RESERVED:
            self.state, self.published_at = DecodeState.PUBLISHED, now

    def complete(self) -> bool:
        """The ranks' barriers released OK. Returns False when the transfer was already fenced."""
        if self.state in (DecodeState.RESERVED, DecodeState.PUBLISHED):
            self.state = DecodeState.COMPLETE
            return True
        return False

    def start_fence(self, outcome: DecodeState, reason: str, lost_links: dict[str, float]) -> list[str]:
        """Begins cancelling or failing; returns the links to send Cancel to.

        ``lost_links`` maps links whose stream is already gone to their grace deadline.
        """
        assert outcome in (DecodeState.CANCELLED, DecodeState.FAILED)
        if self.state is DecodeState.CANCELLING:
            if outcome is DecodeState.FAILED:
                self.fence_outcome = outcome
            return []
        if self.settled:
            return []
        published = self.state is DecodeState.PUBLISHED
        self.state, self.fence_outcome, self.reason = DecodeState.CANCELLING, outcome, reason
        if not published:
            return []  # nothing went out: nobody can write
        to_cancel = []
        for link in self.links:
            if link in lost_links:
                self.lost_until[link] = lost_links[link]
            else:
                self.awaiting_ack.add(link)
                to_cancel.append(link)
        return to_cancel

    def on_cancel_ack(self, link: str) -> None:
        self.awaiting_ack.discard(link)

    def on_link_lost(self, link: str, deadline: float) -> None:
        if link in self.awaiting_ack:
            self.awaiting_ack.discard(link)
            self.lost_until[link] = deadline

    def fenced(self, now: float) -> bool:
        """No WRITE for this epoch can still land."""
        return (
            self.state is DecodeState.CANCELLING
            and not self.awaiting_ack
            and all(d <= now for d in self.lost_until.values())
        )

    def settle(self) -> DecodeState:
        assert self.fence_outcome is not None
        self.state = self.fence_outcome
        return self.state

    def next_deadline(self) -> float | None:
        return max(self.lost_until.values(), default=None) if self.state is DecodeState.CANCELLING else None

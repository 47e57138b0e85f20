"""What the scheduler pushes to an instance between its load reports, on its ``ReportLoad`` stream:
leg failures (a leg of one of its transfers was not delivered) and first tokens (a prefill's first
token, relayed to the transfer's decode engine: ``first_tokens``)."""

from __future__ import annotations

import asyncio

from kvpush.services.scheduler.model import InstanceSpec
from kvpush.v1 import kvpush_pb2 as pb

Pushed = pb.LegFailure | pb.FirstToken
Key = tuple[str, str]  # (engine id, incarnation)

MAX_QUEUED = 1024  # messages waiting for one instance's load stream; more are dropped
MAX_PER_ACK = 256  # messages per LoadAck


class Outboxes:
    """One bounded queue per instance (engine id, incarnation) with an open load stream."""

    def __init__(self, size: int = MAX_QUEUED) -> None:
        self._size = size
        self._boxes: dict[Key, asyncio.Queue[Pushed]] = {}

    def __len__(self) -> int:
        return len(self._boxes)

    def open(self, key: Key) -> asyncio.Queue[Pushed]:
        """The queue of the instance's new load stream (it replaces an older stream's)."""
        box: asyncio.Queue[Pushed] = asyncio.Queue(maxsize=self._size)
        self._boxes[key] = box
        return box

    def close(self, key: Key, box: asyncio.Queue[Pushed]) -> None:
        """The stream that opened ``box`` ended (a newer stream's queue stays)."""
        if self._boxes.get(key) is box:
            del self._boxes[key]

    def push(self, to: InstanceSpec, msg: Pushed) -> bool:
        """Queues ``msg`` for the instance's current load stream; False when it has none or its
        queue is full."""
        box = self._boxes.get((to.engine_id, to.incarnation))
        if box is None:
            return False
        try:
            box.put_nowait(msg)
        except asyncio.QueueFull:
            return False
        return True


def ack_of(first: Pushed, box: asyncio.Queue[Pushed]) -> pb.LoadAck:
    """A LoadAck carrying ``first`` and what else is queued (at most ``MAX_PER_ACK`` in all)."""
    pushed = [first]
    while not box.empty() and len(pushed) < MAX_PER_ACK:
        pushed.append(box.get_nowait())
    return pb.LoadAck(
        leg_failures=[m for m in pushed if isinstance(m, pb.LegFailure)],
        first_tokens=[m for m in pushed if isinstance(m, pb.FirstToken)],
    )

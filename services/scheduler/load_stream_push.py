"""What the scheduler pushes to an instance between its load reports, on its ``ReportLoad`` stream:
leg failures (a leg of one of its transfers was not delivered) and first tokens (a prefill's first
token, relayed to the transfer's decode engine and to a ``Generate`` call waiting for it)."""

from __future__ import annotations

import asyncio

from kvpush.services.common import limits
from kvpush.services.common.logs import get_logger
from kvpush.services.scheduler.metrics import Metrics
from kvpush.services.scheduler.model import InstanceSpec, Role
from kvpush.services.scheduler.registry import Registry
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


class FirstTokenRelay:
    """First tokens a prefill engine reports on its load stream: each goes to the decode engine it
    names (its current incarnation's load stream) and to the ``Generate`` call of that transfer, if
    one waits (docs/first_token.md)."""

    def __init__(self, registry: Registry, outboxes: Outboxes, metrics: Metrics) -> None:
        self.registry = registry
        self.outboxes = outboxes
        self.metrics = metrics
        self.log = get_logger("scheduler")
        self.waiters: dict[str, asyncio.Future[pb.FirstToken]] = {}

    def wait_for(self, transfer_id: str) -> asyncio.Future[pb.FirstToken]:
        """A future for the transfer's first token (``forget`` it when the call ends)."""
        fut: asyncio.Future[pb.FirstToken] = asyncio.get_running_loop().create_future()
        self.waiters[transfer_id] = fut
        return fut

    def forget(self, transfer_id: str) -> None:
        self.waiters.pop(transfer_id, None)

    def relay(self, report: pb.LoadReport | pb.FirstTokenReport) -> str | None:
        """The report's first tokens; why none was taken, or None. The prefill is named by the
        scheduler (the report's authenticated engine), never by the report; decode takes a token
        only from a prefill its transfer was published to."""
        inst = self.registry.instances.get(report.engine_id)
        if inst is None or inst.spec.role is not Role.PREFILL:
            self.log.warning("first_tokens_refused", engine_id=report.engine_id, reason="not a prefill engine")
            return "not a registered prefill engine"
        if len(report.first_tokens) > limits.MAX_EXPECTATIONS_PER_CALL:
            self.log.warning("first_tokens_refused", engine_id=report.engine_id, reason="too many in one report")
            return f"at most {limits.MAX_EXPECTATIONS_PER_CALL} first tokens in one report"
        for ft in report.first_tokens:
            if max(len(ft.transfer_id), len(ft.decode_engine_id)) > limits.MAX_ID_CHARS or not ft.transfer_id:
                self.log.warning("first_token_refused", engine_id=report.engine_id, reason="bad ids")
                continue
            relayed = pb.FirstToken(
                transfer_id=ft.transfer_id,
                decode_engine_id=ft.decode_engine_id,
                prefill_engine_id=report.engine_id,
                token_id=ft.token_id,
                stopped=ft.stopped,
            )
            waiter = self.waiters.get(ft.transfer_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(relayed)
            decode = self.registry.instances.get(ft.decode_engine_id)
            delivered = decode is not None and self.outboxes.push(decode.spec, relayed)
            self.metrics.first_tokens.labels("relayed" if delivered else "undelivered").inc()
            if not delivered:
                self.log.warning(
                    "first_token_undelivered",
                    transfer_id=ft.transfer_id,
                    decode=ft.decode_engine_id,
                    prefill=report.engine_id,
                )
        return None

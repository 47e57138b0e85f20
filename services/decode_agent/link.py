"""The reservations stream from a decode agent to one prefill rank (``PrefillAgent.Reservations``):
the Hello and the HelloAck's fence bounds checked, then the decode agent's messages written from a
bounded outbox while the rank's messages are handed to the agent as they come. A rank silent for
two leases is taken as lost, as is any error; the agent then fences the link's transfers
(docs/fence.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvpush.services.common import limits
from kvpush.services.common.grpc_util import CHANNEL_OPTIONS
from kvpush.services.common.logs import get_logger
from kvpush.services.common.security import Security
from kvpush.services.decode_agent import metrics
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

log = get_logger("decode.agent")


@dataclass
class PrefillLink:
    """The reservations stream to one prefill rank."""

    endpoint: str
    prefill_engine_id: str
    prefill_incarnation: str
    # Bounded: a prefill rank that stops reading ends its link (its transfers are then fenced).
    outbox: asyncio.Queue[pb.DecodeMessage] = field(default_factory=lambda: asyncio.Queue(maxsize=limits.MAX_OUTBOX))
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    error: str = ""
    task: asyncio.Task[None] | None = None
    # Fence bounds (docs/fence.md): the last time this side granted the prefill rank its write
    # lease (the Hello, then every Pong), and the rank's announced lease and write timeout.
    granted_at: float = 0.0
    lease_s: float = 0.0
    write_timeout_s: float = 0.0

    def fenced_after(self, margin_s: float) -> float:
        """Monotonic time after which nothing this prefill rank posted can still land."""
        return self.granted_at + self.lease_s + self.write_timeout_s + margin_s


async def run_link(
    link: PrefillLink,
    hello: pb.Hello,
    security: Security,
    max_fence_s: float,
    on_message: Callable[[PrefillLink, pb.PrefillMessage], None],
) -> None:
    """Runs ``link`` until it ends (its error in ``link.error``; ``closed`` when cancelled):
    sends ``hello`` (the first write lease grant), checks the HelloAck's lease and write timeout
    against ``max_fence_s``, then writes ``link.outbox`` and passes every message the rank sends
    to ``on_message`` (on this loop). Never raises but for a cancellation while closing."""
    channel = security.aio_channel(link.endpoint, CHANNEL_OPTIONS)
    call = pb_grpc.PrefillAgentStub(channel).Reservations()
    sender: asyncio.Task[None] | None = None
    try:
        link.granted_at = time.monotonic()  # the Hello is the first grant
        await call.write(pb.DecodeMessage(hello=hello))
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "hello_ack":
            raise ConnectionError("stream ended before HelloAck")
        ack = first.hello_ack
        link.lease_s, link.write_timeout_s = ack.lease_ms / 1e3, ack.write_timeout_ms / 1e3
        if not ack.lease_ms or not ack.write_timeout_ms:
            raise ConnectionError("prefill rank announced no lease or write timeout")
        if link.lease_s + link.write_timeout_s > max_fence_s:
            raise ConnectionError(
                f"prefill rank's lease {link.lease_s:g}s + write timeout {link.write_timeout_s:g}s exceed "
                f"max_fence_s {max_fence_s:g}s"
            )
        link.prefill_incarnation = ack.prefill.incarnation
        link.ready.set()
        metrics.LINKS.inc()
        log.info("prefill_link_ready", endpoint=link.endpoint, prefill_incarnation=link.prefill_incarnation)
        sender = asyncio.get_running_loop().create_task(_send_loop(link, call))
        # The prefill rank pings every lease / 4: a stream silent for two leases is dead even
        # if neither socket says so (a partition); its transfers then go through the fence.
        silence_s = max(2 * link.lease_s, 1.0)
        while True:
            try:
                msg = await asyncio.wait_for(call.read(), silence_s)
            except TimeoutError:
                raise ConnectionError(f"prefill rank silent for {silence_s:g}s") from None
            if msg is grpc.aio.EOF:
                raise ConnectionError("prefill closed the stream")
            on_message(link, msg)
    except asyncio.CancelledError:
        link.error = "closed"
    except grpc.aio.AioRpcError as exc:
        link.error = f"{exc.code().name}: {exc.details()}"
    except Exception as exc:
        link.error = f"{type(exc).__name__}: {exc}"
    finally:
        if sender is not None:
            sender.cancel()
        call.cancel()
        await channel.close()
        if link.ready.is_set():
            metrics.LINKS.dec()


async def _send_loop(link: PrefillLink, call: grpc.aio.StreamStreamCall) -> None:
    while True:
        msg = await link.outbox.get()
        await call.write(msg)

"""Prefill agent: one per prefill worker rank.

Serves ``PrefillAgent.Reservations`` (one stream per decode engine) on a gRPC aio server running
on its own loop thread, feeds the push writer, and delivers the writer's per-rank completions to
the decode ranks. The host (vLLM's worker, or a test process) calls :meth:`prefill_done` when a
transfer's KV is computed and collects :meth:`take_released` to free its blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from kvpush.services.common import completion_notice, limits
from kvpush.services.common.aio_thread import LoopThread
from kvpush.services.common.grpc_util import CHANNEL_OPTIONS, start_aio_server
from kvpush.services.common.handoff import Handoff
from kvpush.services.common.layout import ModelShape, RankRegions, engine_identity
from kvpush.services.common.logs import get_logger
from kvpush.services.common.nixl_engine import NixlEngine
from kvpush.services.common.security import (
    DECODE,
    PREFILL_AGENT_POLICY,
    PeerIdentity,
    Security,
    claim_problem,
    peer_identity,
)
from kvpush.services.common.tp import TopologyError, head_slices
from kvpush.services.prefill_agent.notices import CompletionNotices
from kvpush.services.prefill_agent.table import PrefillDone, ReleaseBlocks, Reservation, TransferTable
from kvpush.services.prefill_agent.writer import CompletionReport, PeerSession, PushWriter
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

log = get_logger("prefill.agent")

COMPLETION_TIMEOUT_S = 5.0  # one Complete call
COMPLETION_RETRY_S = 60.0  # a completion is retried with backoff for this long
# Retried: the decode rank is unreachable for now, or has not registered the expectation yet.
COMPLETION_RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND}
)
MAX_COMPLETION_CHANNELS = 256  # channels to decode ranks kept open (least recently used closed)


@dataclass
class PrefillAgentConfig:
    engine_id: str
    rank: int
    tp_size: int
    shape: ModelShape
    host: str = "127.0.0.1"
    port: int = 0
    auth_token: str = ""
    prefill_lease_s: float = 30.0
    default_reservation_lease_s: float = 30.0
    hello_timeout_s: float = 10.0
    # The fence bounds announced in HelloAck (docs/fence.md): WRITEs are posted only while the
    # decode stream's lease (renewed by Ping/Pong every lease_s / 4) is fresh, and a WRITE still in
    # flight write_timeout_s after its post makes the rank recreate its NIXL agent.
    lease_s: float = 2.0
    write_timeout_s: float = 10.0
    outbox_depth: int = limits.MAX_OUTBOX  # messages queued towards one stream it does not read
    max_open_transfers_per_decode: int = limits.MAX_OPEN_TRANSFERS_PER_DECODE
    max_entries_per_decode: int = limits.MAX_ENTRIES_PER_DECODE
    # mTLS for the agent's server and its completion channels; None: plaintext (tests, logged).
    security: Security | None = None


class FirstTokenSource(Protocol):
    """The first tokens this prefill engine sampled for hand-off transfers, by transfer id
    (connector/completion_tokens.py's ``SampledFirstTokens``)."""

    def get(self, transfer_id: str) -> int | None: ...

    def pending(self, transfer_id: str) -> bool: ...

    async def wait(self, transfer_id: str, timeout_s: float) -> int | None: ...

    def add_listener(self, listener: Callable[[str, int], None]) -> None: ...

    def remove_listener(self, listener: Callable[[str, int], None]) -> None: ...


class _Outbox:
    """Messages towards one decode stream, bounded: a stream that stops reading is ended with
    RESOURCE_EXHAUSTED instead of growing the queue; ``end`` ends it with any code."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.queue: asyncio.Queue[pb.PrefillMessage] = asyncio.Queue(maxsize=depth)
        self.ended = asyncio.Event()
        self.code = grpc.StatusCode.OK
        self.reason = ""

    def put(self, msg: pb.PrefillMessage) -> None:
        if self.ended.is_set():
            return
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.end(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {self.depth} messages unread: stream closed")

    def end(self, code: grpc.StatusCode, reason: str) -> None:
        if not self.ended.is_set():
            self.code, self.reason = code, reason
            self.ended.set()


def _discard(_: object) -> None:
    """Drops a value (the handle call_soon_threadsafe returns), keeping a callback's type None."""


def _hello_out_of_bounds(hello: pb.Hello) -> str | None:
    """The first bound a Hello breaks (checked before anything is sized by its fields)."""
    d = hello.decode
    if d.tp_size > limits.MAX_TP:
        return f"decode TP size above {limits.MAX_TP}"
    if len(hello.decode_ranks) != d.tp_size:
        return "hello must carry one layout per decode rank"
    for value in (d.engine_id, d.incarnation, hello.expected_prefill_engine_id, hello.expected_prefill_incarnation):
        if len(value) > limits.MAX_ID_CHARS:
            return f"an id or incarnation is longer than {limits.MAX_ID_CHARS} characters"
    if len(d.compatibility_hash) > limits.MAX_HASH_CHARS:
        return "compatibility hash too long"
    for r in hello.decode_ranks:
        if len(r.regions) > limits.MAX_REGIONS_PER_RANK:
            return f"decode rank layout has more than {limits.MAX_REGIONS_PER_RANK} regions"
        if len(r.completion_endpoint) > limits.MAX_ENDPOINT_CHARS or len(r.nixl_agent_name) > limits.MAX_ID_CHARS:
            return "decode rank endpoint or NIXL agent name too long"
    return None


def _reservation_out_of_bounds(r: pb.Reservation) -> str | None:
    if len(r.transfer_id) > limits.MAX_ID_CHARS:
        return f"transfer_id longer than {limits.MAX_ID_CHARS} characters"
    if len(r.block_ids) > limits.MAX_KV_GROUPS:
        return f"more than {limits.MAX_KV_GROUPS} KV-cache groups"
    if any(len(g.ids) > limits.MAX_BLOCK_IDS_PER_GROUP for g in r.block_ids):
        return f"more than {limits.MAX_BLOCK_IDS_PER_GROUP} block ids in a group"
    if r.num_skip_blocks > limits.MAX_BLOCK_IDS_PER_GROUP:
        return f"num_skip_blocks above {limits.MAX_BLOCK_IDS_PER_GROUP}"
    if r.lease_ms > limits.MAX_LEASE_MS:
        return f"lease_ms above {limits.MAX_LEASE_MS}"
    if not completion_notice.valid_key(r.completion_key):
        return f"completion_key must be empty or {completion_notice.KEY_BYTES} bytes"
    return None


class PrefillAgent(pb_grpc.PrefillAgentServicer):
    def __init__(
        self,
        config: PrefillAgentConfig,
        engine: NixlEngine,
        local: RankRegions,
        incarnation: str | None = None,
        on_release: Callable[[ReleaseBlocks], None] | None = None,
        first_tokens: FirstTokenSource | None = None,
        first_token_wait_s: float = 0.0,
        completion_notices: bool = True,
        completion_rpc_delay_s: float = 0.0,
    ) -> None:
        """``first_tokens``: the first tokens this engine sampled for hand-off transfers; an OK
        completion carries its transfer's, waiting up to ``first_token_wait_s`` for it when the
        WRITE finished first (connector/completion_tokens.py). ``completion_notices``: each OK
        completion is also sent ahead as a NIXL notification when its reservation carries a key
        (notices.py); its first token goes in it, or after it from the engine thread.
        ``completion_rpc_delay_s``: how long the RPC of a completion whose notice went waits
        before it is sent (it only confirms then: off the path of decode's next steps)."""
        self.config = config
        self.security = config.security or Security.insecure(f"prefill-agent {config.engine_id}/{config.rank}")
        self.identity = engine_identity(config.engine_id, pb.ROLE_PREFILL, config.tp_size, config.shape, incarnation)
        self._on_release = on_release
        self._first_tokens = first_tokens
        self._first_token_wait_s = first_token_wait_s
        self._completion_rpc_delay_s = completion_rpc_delay_s
        self._released: Handoff[ReleaseBlocks] = Handoff()
        self._draining = False
        self._streams = itertools.count(1)
        self._loop = LoopThread(f"kvpush-prefill-{config.rank}", f"kv-prefill-{config.rank}")
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self.notices = CompletionNotices(engine, config.rank, first_tokens) if completion_notices else None
        if self.notices is not None and first_tokens is not None:
            first_tokens.add_listener(self.notices.token_posted)
        self.writer = PushWriter(
            rank=config.rank,
            tp_size=config.tp_size,
            identity=self.identity,
            engine=engine,
            local=local,
            deliver=self._deliver,
            release=self._release,
            table=TransferTable(
                prefill_lease_s=config.prefill_lease_s,
                max_open_per_decode=config.max_open_transfers_per_decode,
                max_entries_per_decode=config.max_entries_per_decode,
            ),
            write_timeout_s=config.write_timeout_s,
            # Decode declares a stream lost after two silent leases; until then a late Pong
            # renews the lease and the held transfer is written.
            lease_hold_s=2 * config.lease_s,
            notices=self.notices,
        )

    # ----- lifecycle ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> PrefillAgent:
        self.writer.start()
        self._loop.start()
        self._loop.run(self._start_server())
        log.info("prefill_agent_started", endpoint=self.endpoint, incarnation=self.identity.incarnation)
        return self

    async def _start_server(self) -> None:
        self._server, self.port = await start_aio_server(
            pb_grpc.add_PrefillAgentServicer_to_server,
            self,
            "PrefillAgent",
            self.config.host,
            self.config.port,
            self.security,
            PREFILL_AGENT_POLICY,
        )

    def stop(self, grace_s: float = 1.0) -> None:
        if self.notices is not None and self._first_tokens is not None:
            self._first_tokens.remove_listener(self.notices.token_posted)
        if self._server is not None:
            self._loop.run(self._stop_server(grace_s), timeout=grace_s + 5)
        self._loop.stop()
        self.writer.stop()

    async def _stop_server(self, grace_s: float) -> None:
        assert self._server is not None
        await self._server.stop(grace_s)
        for ch in self._channels.values():
            await ch.close()

    def drain(self, reason: str = "draining") -> None:
        """Refuses new streams; tells connected decode engines to send no new reservations."""
        self._draining = True
        self.writer.broadcast(pb.PrefillMessage(drain=pb.Drain(reason=reason)))

    # ----- host-facing API (thread-safe, non-blocking) -----------------------------------

    def prefill_done(
        self,
        transfer_id: str,
        request_id: str,
        block_ids: list[list[int]] | tuple[tuple[int, ...], ...],
        num_tokens: int,
        *,
        decode_engine_id: str,
        handled: threading.Event | None = None,
    ) -> None:
        """The KV of ``request_id`` is computed; only a reservation from ``decode_engine_id`` (the
        engine its prefill leg names) can ever be matched with it. ``handled``: set once the
        writer has handled it (its WRITEs posted)."""
        self.writer.prefill_done(
            PrefillDone(
                transfer_id,
                request_id,
                tuple(tuple(int(b) for b in g) for g in block_ids),
                num_tokens,
                decode_engine_id,
            ),
            handled,
        )

    def prefill_aborted(self, transfer_id: str, *, decode_engine_id: str) -> None:
        self.writer.prefill_aborted(decode_engine_id, transfer_id)

    def no_reservation(self, transfer_id: str, *, decode_engine_id: str) -> None:
        """No reservation will come for the transfer (its decode leg was not delivered): its KV is
        released now, or as soon as it is done, instead of at the prefill lease. The same as a
        decode engine's "release prefill KV" cancel (epoch 0): it never touches a reservation."""
        self.writer.cancel("", decode_engine_id, transfer_id, 0)

    def take_released(self, timeout_s: float = 0.0) -> list[ReleaseBlocks]:
        """Drains the released transfers, waiting up to ``timeout_s`` for at least one."""
        return self._released.take(timeout_s)

    def _release(self, rel: ReleaseBlocks) -> None:
        log.info("prefill_blocks_released", transfer_id=rel.transfer_id, request_id=rel.request_id, reason=rel.reason)
        if self._on_release is not None:
            self._on_release(rel)
        else:
            self._released.put(rel)

    # ----- completions --------------------------------------------------------------------

    def _deliver(self, report: CompletionReport) -> None:
        """The writer thread: a token already posted is taken now (the board keeps it only for the
        newest transfers, and the agent's loop may run the send much later on a busy core)."""
        c = report.completion
        if self._first_tokens is not None and c.status == pb.TRANSFER_STATUS_OK:
            token = self._first_tokens.get(c.transfer_id)
            if token is not None:
                c.first_token = token
        self._loop.submit(self._send_completion(report))

    async def _add_first_token(self, c: pb.Completion) -> None:
        """An OK completion of a hand-off transfer whose WRITE finished before the engine posted
        its token waits for it (bounded; the engine posts it when the step's request ends)."""
        if self._first_tokens is None or c.status != pb.TRANSFER_STATUS_OK or c.HasField("first_token"):
            return
        token = await self._first_tokens.wait(c.transfer_id, self._first_token_wait_s)
        if token is not None:
            c.first_token = token

    def _rpc_delay_s(self, report: CompletionReport) -> float:
        """An OK completion whose notice went is confirmed ``completion_rpc_delay_s`` later: the
        notice released decode already, and the RPC landing now would take decode's CPU from the
        steps it runs next (measured, docs/bench_phases.md). Anything else goes at once."""
        ok = report.completion.status == pb.TRANSFER_STATUS_OK
        return self._completion_rpc_delay_s if report.noticed and ok else 0.0

    async def _send_completion(self, report: CompletionReport) -> None:
        """Delivers one completion, retrying with backoff while the decode rank is unreachable or
        does not know the transfer yet (its expectation may arrive late)."""
        c = report.completion
        delay = self._rpc_delay_s(report)
        if delay > 0:
            await asyncio.sleep(delay)
        await self._add_first_token(c)
        deadline = time.monotonic() + COMPLETION_RETRY_S
        backoff = 0.05
        attempt = 0
        while True:
            attempt += 1
            try:
                await pb_grpc.DecodeRankStub(self._channel(report.endpoint)).Complete(c, timeout=COMPLETION_TIMEOUT_S)
                if attempt > 1:
                    log.info("completion_delivered", transfer_id=c.transfer_id, epoch=c.epoch, attempts=attempt)
                return
            except grpc.aio.AioRpcError as exc:
                retry = exc.code() in COMPLETION_RETRY_CODES and time.monotonic() + backoff < deadline
                log.warning(
                    "completion_send_failed",
                    transfer_id=c.transfer_id,
                    epoch=c.epoch,
                    decode_rank=c.decode_rank,
                    code=exc.code().name,
                    detail=exc.details(),
                    attempt=attempt,
                    final=not retry,
                )
                if not retry:
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = self.security.aio_channel(endpoint, CHANNEL_OPTIONS)
            while len(self._channels) > MAX_COMPLETION_CHANNELS:
                _, old = self._channels.popitem(last=False)
                asyncio.get_running_loop().create_task(old.close())
        else:
            self._channels.move_to_end(endpoint)
        return ch

    # ----- the reservations stream -------------------------------------------------------

    def _check_hello(self, hello: pb.Hello, peer: PeerIdentity | None = None) -> tuple[grpc.StatusCode, str] | None:
        cfg, me = self.config, self.identity
        d = hello.decode
        not_peer = claim_problem(peer, d.engine_id, DECODE)
        if not_peer is not None:
            return grpc.StatusCode.PERMISSION_DENIED, not_peer
        if cfg.auth_token and not hmac.compare_digest(hello.auth_token.encode(), cfg.auth_token.encode()):
            return grpc.StatusCode.UNAUTHENTICATED, "bad or missing auth token"
        if self._draining:
            return grpc.StatusCode.UNAVAILABLE, "prefill agent is draining"
        if d.role != pb.ROLE_DECODE or not d.engine_id or not d.incarnation or d.tp_size == 0:
            return grpc.StatusCode.INVALID_ARGUMENT, "hello needs a decode engine id, incarnation and TP size"
        out_of_bounds = _hello_out_of_bounds(hello)
        if out_of_bounds is not None:
            return grpc.StatusCode.INVALID_ARGUMENT, out_of_bounds
        # Refusals name what differs, never the values: no hash or incarnation goes to the peer.
        if hello.expected_prefill_engine_id and hello.expected_prefill_engine_id != me.engine_id:
            return grpc.StatusCode.FAILED_PRECONDITION, "the stream reached another prefill engine than expected"
        if hello.expected_prefill_incarnation and hello.expected_prefill_incarnation != me.incarnation:
            log.debug("hello_incarnation_mismatch", expected=hello.expected_prefill_incarnation, own=me.incarnation)
            return grpc.StatusCode.FAILED_PRECONDITION, "prefill incarnation changed since the assignment"
        if d.compatibility_hash != me.compatibility_hash:
            log.debug("hello_hash_mismatch", peer_hash=d.compatibility_hash, own_hash=me.compatibility_hash)
            return grpc.StatusCode.FAILED_PRECONDITION, (
                "incompatible KV layout (model, dtype, layers, heads, head or block size differ)"
            )
        if [r.tp_rank for r in hello.decode_ranks] != list(range(d.tp_size)):
            return grpc.StatusCode.INVALID_ARGUMENT, f"hello must carry decode ranks 0..{d.tp_size - 1} in order"
        shape = cfg.shape
        for r in hello.decode_ranks:
            heads = shape.total_kv_heads // d.tp_size if shape.total_kv_heads % d.tp_size == 0 else 0
            if (
                r.layout != shape.layout
                or r.tokens_per_block != shape.tokens_per_block
                or r.total_kv_heads != shape.total_kv_heads
                or r.dtype != shape.dtype
                or len(r.regions) != shape.num_layers
                or heads == 0
                or r.block_bytes != heads * shape.head_bytes
            ):
                return grpc.StatusCode.FAILED_PRECONDITION, f"layout mismatch on decode rank {r.tp_rank}"
            if not r.nixl_agent_metadata or not r.completion_endpoint:
                return grpc.StatusCode.INVALID_ARGUMENT, f"decode rank {r.tp_rank} lacks NIXL metadata or endpoint"
        try:
            head_slices(shape.total_kv_heads, cfg.tp_size, d.tp_size)
        except TopologyError as exc:
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        return None

    async def Reservations(  # type: ignore[override]  # noqa: N802 - gRPC method name; writes via context
        self, request_iterator: AsyncIterator[pb.DecodeMessage], context: grpc.aio.ServicerContext
    ) -> None:
        try:
            first = await asyncio.wait_for(anext(request_iterator), self.config.hello_timeout_s)
        except (StopAsyncIteration, TimeoutError):
            return
        if first.WhichOneof("body") != "hello":
            log.warning("stream_refused", reason="first message is not a Hello")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Hello")
        hello = first.hello
        problem = self._check_hello(hello, peer_identity(context))
        if problem is not None:
            log.warning(
                "stream_refused",
                decode_engine=hello.decode.engine_id[: limits.MAX_ID_CHARS],
                code=problem[0].name,
                reason=problem[1],
            )
            await context.abort(*problem)
        loop = asyncio.get_running_loop()
        # The Hello is the stream's first lease grant: decode counts it from its send, we from now.
        lease_until = time.monotonic() + self.config.lease_s
        outbox = _Outbox(self.config.outbox_depth)
        # One key per stream: a reconnect of the same incarnation must not be torn down by the
        # clean-up of the stream it replaces.
        key = f"{hello.decode.engine_id}/{hello.decode.incarnation}/{next(self._streams)}"
        session = PeerSession(
            key=key,
            identity=hello.decode,
            layouts=list(hello.decode_ranks),
            send=lambda msg: _discard(loop.call_soon_threadsafe(outbox.put, msg)),
            close=lambda reason: _discard(
                loop.call_soon_threadsafe(outbox.end, grpc.StatusCode.FAILED_PRECONDITION, reason)
            ),
            lease_until=lease_until,
        )
        try:
            await asyncio.wrap_future(self.writer.connect(session))
        except Exception as exc:
            log.warning("stream_refused", decode_engine=hello.decode.engine_id[: limits.MAX_ID_CHARS], reason=str(exc))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        await context.write(
            pb.PrefillMessage(
                hello_ack=pb.HelloAck(
                    prefill=self.identity,
                    prefill_rank=self.config.rank,
                    lease_ms=round(self.config.lease_s * 1e3),
                    write_timeout_ms=round(self.config.write_timeout_s * 1e3),
                )
            )
        )
        pings: OrderedDict[int, float] = OrderedDict()  # seq -> our send time
        reader = asyncio.create_task(self._read(request_iterator, session, pings))
        pinger = asyncio.create_task(self._ping(outbox, pings))
        ended = asyncio.create_task(outbox.ended.wait())
        getter: asyncio.Task[pb.PrefillMessage] | None = None
        try:
            while True:
                getter = asyncio.create_task(outbox.queue.get())
                done, _ = await asyncio.wait({getter, reader, ended}, return_when=asyncio.FIRST_COMPLETED)
                if ended in done:
                    break
                if getter not in done:
                    return
                # A write waits for the peer to read (flow control); the outbox may overflow meanwhile.
                write = asyncio.create_task(context.write(getter.result()))
                done, _ = await asyncio.wait({write, ended}, return_when=asyncio.FIRST_COMPLETED)
                if write not in done:
                    write.cancel()
                    break
                write.result()
            log.warning("stream_closed", peer=key, code=outbox.code.name, reason=outbox.reason)
            await context.abort(outbox.code, outbox.reason)
        finally:
            if getter is not None:
                getter.cancel()
            ended.cancel()
            reader.cancel()
            pinger.cancel()
            self.writer.disconnect(key)

    async def _ping(self, outbox: _Outbox, pings: OrderedDict[int, float]) -> None:
        """Asks for a lease renewal every lease_s / 4; the lease runs from the Ping's send time."""
        for seq in itertools.count(1):
            await asyncio.sleep(self.config.lease_s / 4)
            pings[seq] = time.monotonic()
            while len(pings) > 16:  # unanswered pings are useless once newer ones exist
                pings.popitem(last=False)
            outbox.put(pb.PrefillMessage(ping=pb.Ping(seq=seq)))

    async def _read(
        self,
        request_iterator: AsyncIterator[pb.DecodeMessage],
        session: PeerSession,
        pings: OrderedDict[int, float],
    ) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("body")
                if kind == "pong":
                    sent = pings.pop(msg.pong.seq, None)
                    if sent is not None:
                        self.writer.renew(session.key, sent + self.config.lease_s)
                elif kind == "reservation":
                    self._on_reservation(msg.reservation, session)
                elif kind == "cancel":
                    # Scoped to this stream's engine: another engine's transfer is out of reach.
                    self.writer.cancel(
                        session.key, session.identity.engine_id, msg.cancel.transfer_id, msg.cancel.epoch
                    )
                elif kind == "drain":
                    log.info("peer_draining", peer=session.key, reason=msg.drain.reason)
                else:
                    log.warning("unexpected_message", peer=session.key, kind=kind)
        except grpc.aio.AioRpcError as exc:
            log.info("stream_ended", peer=session.key, code=exc.code().name)
        except asyncio.CancelledError:
            pass

    def _on_reservation(self, r: pb.Reservation, session: PeerSession) -> None:
        problem = None
        if not r.transfer_id:
            problem = "reservation without transfer_id"
        elif r.epoch == 0:
            problem = "reservation epoch must be positive"
        elif r.num_tokens == 0 or not r.block_ids:
            problem = "reservation needs num_tokens and block ids"
        else:
            problem = _reservation_out_of_bounds(r)
        if problem is not None:
            tid = r.transfer_id[: limits.MAX_ID_CHARS]
            log.warning(
                "reservation_rejected", transfer_id=tid, peer=session.key, code="INVALID_ARGUMENT", reason=problem
            )
            session.send(
                pb.PrefillMessage(
                    rejected=pb.ReservationRejected(
                        transfer_id=tid,
                        epoch=r.epoch,
                        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        message=problem,
                    )
                )
            )
            return
        lease_s = r.lease_ms / 1e3 if r.lease_ms else self.config.default_reservation_lease_s
        self.writer.reserve(
            Reservation(
                peer=session.key,
                transfer_id=r.transfer_id,
                epoch=r.epoch,
                block_ids=tuple(tuple(g.ids) for g in r.block_ids),
                num_tokens=r.num_tokens,
                num_skip_blocks=r.num_skip_blocks,
                lease_s=lease_s,
                decode_engine=session.identity.engine_id,
                notice_key=r.completion_key,
            )
        )

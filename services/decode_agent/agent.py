"""Decode agent: one per decode engine (in vLLM, next to the scheduler in the EngineCore).

``reserve`` mints an epoch and returns at once; a loop thread then registers the expectation
with every decode rank and publishes the reservation on one long-lived stream per prefill rank
(many transfers multiplexed). ``cancel`` and failures (a rejection, a lost stream) run the fence:
Cancel to every prefill rank that got the reservation, and settle the decode ranks only after
each acked or its stream stayed lost for the grace period.

Retry elsewhere: a transfer that failed before decode started (its prefill died or is cut off, a
WRITE failed, the prefill refused it) asks the scheduler for another prefill (``Rerouter``) while
its fence runs. Once fenced, the same blocks are published under a new epoch to the new prefill and
the request never notices; with no other prefill the ranks are settled FAILED as before, and vLLM's
``kv_load_failure_policy`` decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpush.services.common import completion_notice, limits
from kvpush.services.common.aio_thread import LoopThread
from kvpush.services.common.grpc_util import CHANNEL_OPTIONS
from kvpush.services.common.layout import ModelShape, engine_identity
from kvpush.services.common.logs import get_logger
from kvpush.services.common.security import Security
from kvpush.services.common.tp import prefill_ranks_into
from kvpush.services.common.transfer_params import DecodeLeg
from kvpush.services.decode_agent import metrics
from kvpush.services.decode_agent.link import PrefillLink, run_link
from kvpush.services.decode_agent.reroute import RerouteAsk, Rerouter, RerouteRefused
from kvpush.services.decode_agent.transfers import DecodeState, DecodeTransfer
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

log = get_logger("decode.agent")

UNDELIVERED_KEEP_S = 30.0  # how long a leg failure waits for its reservation

# Rejections no other prefill would answer differently: the request's own leg or id is at fault.
_FINAL_REJECTIONS = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED}
)


@dataclass
class DecodeAgentConfig:
    engine_id: str
    tp_size: int
    shape: ModelShape
    auth_token: str = ""
    # Margin on top of a prefill rank's announced lease + write timeout before a lost stream's
    # reservations count as fenced (clock drift, scheduling delays; docs/fence.md).
    grace_s: float = 0.5
    # A prefill rank whose lease + write timeout exceeds this is refused: decode would hold blocks
    # of a lost stream for longer than it accepts.
    max_fence_s: float = 60.0
    reservation_lease_ms: int = 30_000
    # A published transfer whose KV has not arrived after this long is failed (then fenced).
    transfer_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    rpc_timeout_s: float = 5.0
    settle_retry_s: float = 30.0  # a Settle the rank did not take is retried with backoff this long
    # Times one request's transfer is moved to another prefill after a failure (needs a Rerouter).
    max_reroutes: int = 1
    # mTLS for the channels to this engine's decode ranks and to the prefill agents (with this
    # engine's decode certificate). None: plaintext (tests, logged).
    security: Security | None = None
    # Each published epoch carries a fresh completion key, so its prefill ranks can report their
    # WRITEs done with a MACed NIXL notification ahead of the Completion RPC
    # (services/common/completion_notice.py); false: RPCs only.
    completion_notices: bool = True


class ExpectationRefused(Exception):
    """A decode rank refused (or could not take) an expectation."""


@dataclass(frozen=True)
class Settled:
    transfer_id: str
    epoch: int
    request_id: str
    state: DecodeState
    reason: str


@dataclass
class _Pending:
    transfer: DecodeTransfer
    leg: DecodeLeg
    block_ids: list[list[int]]
    num_tokens: int
    num_skip_blocks: int
    reserve_called: float
    task: asyncio.Task[None] | None = None
    after: asyncio.Event | None = None  # an older epoch whose fence must settle first
    expected: asyncio.Future[Any] | None = None  # the ranks' Expect calls
    deadline: asyncio.TimerHandle | None = None  # transfer_timeout_s after publishing
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when forgotten
    prompt_token_ids: Sequence[int] = ()  # for a retry elsewhere
    attempt: int = 0  # reroutes before this epoch
    reroute: asyncio.Task[DecodeLeg | None] | None = None  # asked while the fence runs
    cancelled: str = ""  # the host cancelled while a reroute was pending: settle, do not retry


class DecodeAgent:
    def __init__(
        self,
        config: DecodeAgentConfig,
        rank_layouts: list[pb.RankLayout],
        incarnation: str | None = None,
        on_settled: Callable[[Settled], None] | None = None,
        rerouter: Rerouter | None = None,
    ) -> None:
        if [r.tp_rank for r in rank_layouts] != list(range(config.tp_size)):
            raise ValueError(f"need the layouts of decode ranks 0..{config.tp_size - 1}")
        self.config = config
        self.security = config.security or Security.insecure(f"decode-agent {config.engine_id}")
        self.identity = engine_identity(config.engine_id, pb.ROLE_DECODE, config.tp_size, config.shape, incarnation)
        self.rank_layouts = rank_layouts
        self.on_settled = on_settled
        self.rerouter = rerouter
        self._epochs = itertools.count(1)
        self._loop = LoopThread("kvpush-decode-agent", "kv-dagent")
        # Keyed by (transfer_id, epoch): a superseded epoch stays here until its fence settles.
        self._transfers: dict[tuple[str, int], _Pending] = {}
        self._latest: dict[str, int] = {}  # transfer_id -> newest epoch
        # (transfer_id, epoch) of a rerouted transfer -> the epoch that took over (the host keeps
        # naming the epoch reserve() returned); entries go when the successor is forgotten.
        self._moved: dict[str, dict[int, int]] = {}
        self._links: dict[str, PrefillLink] = {}
        self._lost: dict[str, float] = {}  # endpoint -> grace deadline of its last lost stream
        # transfer_id -> (prefill engine, reason, keep until): undelivered prefill legs reported
        # before their reservation (bounded, expiring)
        self._undelivered: dict[str, tuple[str, str, float]] = {}
        self._rank_channels: list[grpc.aio.Channel] = []
        self._rank_stubs: list[pb_grpc.DecodeRankStub] = []
        self._expect_batches: list[list[tuple[pb.Expectation, asyncio.Future[None]]]] = [
            [] for _ in range(config.tp_size)
        ]

    # ----- lifecycle ----------------------------------------------------------------------

    def start(self) -> DecodeAgent:
        self._loop.start()
        self._loop.run(self._open_rank_channels())
        log.info("decode_agent_started", engine_id=self.config.engine_id, incarnation=self.identity.incarnation)
        return self

    async def _open_rank_channels(self) -> None:
        for layout in self.rank_layouts:
            ch = self.security.aio_channel(layout.completion_endpoint, CHANNEL_OPTIONS)
            self._rank_channels.append(ch)
            self._rank_stubs.append(pb_grpc.DecodeRankStub(ch))

    def stop(self) -> None:
        try:
            self._loop.run(self._close(), timeout=10)
        finally:
            self._loop.stop()

    async def _close(self) -> None:
        for link in self._links.values():
            if link.task is not None:
                link.task.cancel()
        for ch in self._rank_channels:
            await ch.close()
        if self.rerouter is not None:
            await self.rerouter.close()

    # ----- host-facing API (thread-safe, non-blocking) -----------------------------------

    def reserve(
        self,
        transfer_id: str,
        request_id: str,
        leg: DecodeLeg,
        block_ids: list[list[int]],
        num_tokens: int,
        num_skip_blocks: int = 0,
        prompt_token_ids: Sequence[int] = (),
    ) -> int:
        """Publishes decode blocks reserved for ``transfer_id``; returns the epoch at once.
        ``prompt_token_ids`` (read only if the transfer fails) lets it be retried elsewhere."""
        epoch = next(self._epochs)
        transfer = DecodeTransfer(
            transfer_id=transfer_id,
            epoch=epoch,
            request_id=request_id,
            prefill_engine_id=leg.prefill_engine_id,
            links=(),
            num_blocks=sum(len(g) for g in block_ids),
            reserved_at=time.monotonic(),
        )
        pending = _Pending(transfer, leg, block_ids, num_tokens, num_skip_blocks, time.monotonic())
        pending.prompt_token_ids = tuple(prompt_token_ids)  # the caller's list may change later
        self._loop.call_soon(self._start_publish, pending)
        return epoch

    def cancel(self, transfer_id: str, reason: str = "cancelled", epoch: int | None = None) -> None:
        """Fences the transfer's reservation ``epoch`` (the newest when None)."""
        self._loop.call_soon(self._fence_by_id, transfer_id, epoch, DecodeState.CANCELLED, reason)

    def prefill_leg_failed(self, transfer_id: str, prefill_engine_id: str, reason: str) -> None:
        """The frontend could not deliver the transfer's prefill leg to ``prefill_engine_id`` (the
        scheduler says so on the load stream): that prefill's KV will never come, so the transfer
        fails now (fence, then retry elsewhere) instead of at the reservation lease. Arriving before
        the reservation (the two legs race), it is kept for a while for the reserve to come."""
        self._loop.call_soon(
            self._prefill_leg_failed,
            transfer_id[: limits.MAX_ID_CHARS],
            prefill_engine_id[: limits.MAX_ID_CHARS],
            limits.clip(reason),
        )

    def _prefill_leg_failed(self, transfer_id: str, prefill_engine_id: str, reason: str) -> None:
        why = f"prefill leg not delivered: {reason}"
        p = self._current(transfer_id)
        if p is None or p.transfer.settled:
            now = time.monotonic()
            for tid in [k for k, (_, _, until) in self._undelivered.items() if until <= now]:
                del self._undelivered[tid]
            if len(self._undelivered) < limits.MAX_PENDING_BARRIERS:
                self._undelivered[transfer_id] = (prefill_engine_id, why, now + UNDELIVERED_KEEP_S)
            return
        if p.leg.prefill_engine_id != prefill_engine_id or p.transfer.state not in (
            DecodeState.RESERVED,
            DecodeState.PUBLISHED,
        ):
            return  # already moved to another prefill, or past the point where it matters
        self._fail_undelivered(p, why)

    def _fail_undelivered(self, p: _Pending, why: str) -> None:
        log.warning("prefill_leg_failed", transfer_id=p.transfer.transfer_id, epoch=p.transfer.epoch, reason=why)
        self._fence(p, DecodeState.FAILED, why, retry=True)

    def release_prefill(self, transfer_id: str, leg: DecodeLeg, reason: str) -> None:
        """Nothing will be reserved for ``transfer_id`` (aborted early, or decode already holds the
        whole prompt): tell the prefill ranks so they free its KV now instead of at lease expiry."""
        self._loop.call_soon(self._release_prefill, transfer_id, leg, reason)

    def _release_prefill(self, transfer_id: str, leg: DecodeLeg, reason: str) -> None:
        incarnations = leg.prefill_rank_incarnations or [""] * len(leg.prefill_agent_endpoints)
        for endpoint, incarnation in zip(leg.prefill_agent_endpoints, incarnations, strict=False):
            link = self._link(endpoint, leg.prefill_engine_id, incarnation)
            self._send(link, pb.DecodeMessage(cancel=pb.Cancel(transfer_id=transfer_id, epoch=0, reason=reason)))
        log.info("prefill_release_requested", transfer_id=transfer_id, reason=reason)

    def finished(self, transfer_id: str, epoch: int | None = None) -> None:
        """The decode ranks released the transfer on their own (every prefill rank reported)."""
        self._loop.call_soon(self._finished, transfer_id, epoch)

    def prefill_of(self, transfer_id: str) -> str | None:
        """The prefill engine the transfer's newest epoch is published to (after a reroute, the new
        one); None once it is forgotten. A snapshot read, safe from any thread."""
        p = self._current(transfer_id)
        return p.leg.prefill_engine_id if p is not None else None

    def state(self, transfer_id: str) -> DecodeState | None:
        """For tests and tools: the transfer's state, None once it is forgotten."""

        async def get() -> DecodeState | None:
            p = self._current(transfer_id)
            return p.transfer.state if p else None

        return self._loop.run(get())

    def open_transfers(self) -> int:
        async def get() -> int:
            return len(self._transfers)

        return self._loop.run(get())

    # ----- publishing (loop thread) ------------------------------------------------------

    def _current(self, transfer_id: str) -> _Pending | None:
        epoch = self._latest.get(transfer_id)
        return None if epoch is None else self._transfers.get((transfer_id, epoch))

    def _start_publish(self, p: _Pending) -> None:
        t = p.transfer
        old = self._current(t.transfer_id)
        if old is not None and not old.transfer.settled and old.transfer.request_id != t.request_id:
            # Another request holds this transfer id: refused, never superseding it (only a new
            # epoch of the same request does).
            self._refuse(p, old)
            return
        self._transfers[(t.transfer_id, t.epoch)] = p
        self._latest[t.transfer_id] = t.epoch
        if old is not None and not old.transfer.settled:
            # A new epoch of a transfer still open: fence the old one, publish once it settled.
            self._fence(old, DecodeState.CANCELLED, "superseded by a new epoch")
            p.after = old.gone
        p.task = asyncio.get_running_loop().create_task(self._publish(p))
        undelivered = self._undelivered.pop(t.transfer_id, None)
        if undelivered is not None and undelivered[0] == p.leg.prefill_engine_id and undelivered[2] > time.monotonic():
            self._fail_undelivered(p, undelivered[1])

    def _refuse(self, p: _Pending, holder: _Pending) -> None:
        """Fails ``p`` without publishing anything: its ranks get an expectation that names no
        prefill rank (always refused, and remembered), then the FAILED settlement that releases
        the request as failed. The holder's transfer is not touched."""
        t = p.transfer
        self._transfers[(t.transfer_id, t.epoch)] = p  # never the transfer id's current epoch
        log.warning(
            "duplicate_transfer_id",
            transfer_id=t.transfer_id,
            epoch=t.epoch,
            request_id=t.request_id,
            holder_request_id=holder.transfer.request_id,
        )
        nobody = pb.Expectation(
            transfer_id=t.transfer_id, epoch=t.epoch, request_id=t.request_id, prefill_engine_id=p.leg.prefill_engine_id
        )

        async def register() -> None:
            p.expected = asyncio.gather(*(self._expect(rank, nobody) for rank in range(self.config.tp_size)))
            with contextlib.suppress(ExpectationRefused):
                await p.expected

        p.task = asyncio.get_running_loop().create_task(register())
        self._fence(p, DecodeState.FAILED, "duplicate transfer id: another request holds it")

    def _send(self, link: PrefillLink, msg: pb.DecodeMessage) -> bool:
        """Queues ``msg`` on the link; a full outbox ends the link (its transfers are fenced)."""
        try:
            link.outbox.put_nowait(msg)
            return True
        except asyncio.QueueFull:
            if not link.lost.is_set() and link.task is not None and not link.task.done():
                log.warning("prefill_link_overflow", endpoint=link.endpoint, depth=link.outbox.maxsize)
                link.error = f"more than {link.outbox.maxsize} messages unsent"
                link.task.cancel()
            return False

    async def _publish(self, p: _Pending) -> None:
        t, leg = p.transfer, p.leg
        if p.after is not None:
            await p.after.wait()
            if t.state is not DecodeState.RESERVED:
                return
        if len(leg.prefill_agent_endpoints) != leg.prefill_tp_size or len(leg.prefill_rank_incarnations) not in (
            0,
            leg.prefill_tp_size,
        ):
            self._fence(p, DecodeState.FAILED, "prefill endpoints or incarnations do not match its TP size")
            return
        key = completion_notice.new_key() if self.config.completion_notices else b""
        try:
            expectations = [
                pb.Expectation(
                    transfer_id=t.transfer_id,
                    epoch=t.epoch,
                    request_id=t.request_id,
                    prefill_ranks=prefill_ranks_into(
                        self.config.shape.total_kv_heads, leg.prefill_tp_size, self.config.tp_size, d
                    ),
                    prefill_engine_id=leg.prefill_engine_id,
                    completion_key=key,
                )
                for d in range(self.config.tp_size)
            ]
        except ValueError as exc:
            self._fence(p, DecodeState.FAILED, f"cannot map prefill TP {leg.prefill_tp_size}: {exc}")
            return
        # The ranks learn the expectation while the reservation travels: a completion that
        # overtakes its expectation waits for it at the rank, so neither sits on the other's path.
        p.expected = asyncio.gather(*(self._expect(rank, e) for rank, e in enumerate(expectations)))
        msg = pb.DecodeMessage(
            reservation=pb.Reservation(
                transfer_id=t.transfer_id,
                epoch=t.epoch,
                block_ids=[pb.BlockIds(ids=g) for g in p.block_ids],
                num_tokens=p.num_tokens,
                num_skip_blocks=p.num_skip_blocks,
                lease_ms=self.config.reservation_lease_ms,
                completion_key=key,
            )
        )
        incarnations = leg.prefill_rank_incarnations or [""] * len(leg.prefill_agent_endpoints)
        for endpoint, incarnation in zip(leg.prefill_agent_endpoints, incarnations, strict=False):
            link = self._link(endpoint, leg.prefill_engine_id, incarnation)
            if not link.ready.is_set():
                try:
                    await asyncio.wait_for(self._wait_ready(link), self.config.connect_timeout_s)
                except TimeoutError:
                    link.error = link.error or f"no HelloAck from {endpoint} within {self.config.connect_timeout_s}s"
            if not link.ready.is_set() or link.lost.is_set():
                self._fence(p, DecodeState.FAILED, f"prefill rank {endpoint} unreachable: {link.error}", retry=True)
                return
            if t.state is not DecodeState.RESERVED and t.state is not DecodeState.PUBLISHED:
                return
            if not self._send(link, msg):
                self._fence(p, DecodeState.FAILED, f"prefill rank {endpoint} does not read its stream", retry=True)
                return
            t.links = (*t.links, endpoint)
            t.mark_published(time.monotonic())
        p.deadline = asyncio.get_running_loop().call_later(self.config.transfer_timeout_s, self._on_deadline, p)
        metrics.RESERVATIONS.inc()
        metrics.PUBLISH_SECONDS.observe(time.monotonic() - p.reserve_called)
        log.debug("reservation_published", transfer_id=t.transfer_id, epoch=t.epoch, links=len(t.links))
        try:
            await p.expected
        except ExpectationRefused as exc:
            self._fence(p, DecodeState.FAILED, f"decode rank refused the expectation: {exc}")

    def _on_deadline(self, p: _Pending) -> None:
        if p.transfer.state is DecodeState.PUBLISHED:
            metrics.DEADLINES.inc()
            self._fence(
                p,
                DecodeState.FAILED,
                f"KV did not arrive within the transfer timeout ({self.config.transfer_timeout_s:g}s)",
            )

    def _expect(self, rank: int, expectation: pb.Expectation) -> asyncio.Future[None]:
        """Queues an expectation for a rank; everything queued in one loop turn goes in one call."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch = self._expect_batches[rank]
        batch.append((expectation, fut))
        if len(batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush_expectations, rank)
        return fut

    def _flush_expectations(self, rank: int) -> None:
        batch, self._expect_batches[rank] = self._expect_batches[rank], []
        if batch:
            asyncio.get_running_loop().create_task(self._send_expectations(rank, batch))

    async def _send_expectations(self, rank: int, batch: list[tuple[pb.Expectation, asyncio.Future[None]]]) -> None:
        try:
            resp = await self._rank_stubs[rank].Expect(
                pb.ExpectRequest(expectations=[e for e, _ in batch]), timeout=self.config.rpc_timeout_s
            )
            results = list(resp.results)
        except grpc.aio.AioRpcError as exc:
            results = [pb.ExpectResult(code=exc.code().value[0], message=exc.details() or "")] * len(batch)
        for (_, fut), result in zip(batch, results, strict=False):
            if fut.done():
                continue
            if result.code:
                fut.set_exception(ExpectationRefused(f"rank {rank}: {result.message}"))
            else:
                fut.set_result(None)
        for _, fut in batch[len(results) :]:
            if not fut.done():
                fut.set_exception(ExpectationRefused(f"rank {rank}: short Expect response"))

    @staticmethod
    async def _wait_ready(link: PrefillLink) -> None:
        ready = asyncio.ensure_future(link.ready.wait())
        lost = asyncio.ensure_future(link.lost.wait())
        try:
            await asyncio.wait({ready, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            lost.cancel()

    # ----- links --------------------------------------------------------------------------

    def _link(self, endpoint: str, engine_id: str, incarnation: str) -> PrefillLink:
        link = self._links.get(endpoint)
        if link is not None and not link.lost.is_set():
            same = link.prefill_engine_id == engine_id and (
                not incarnation or link.prefill_incarnation in ("", incarnation)
            )
            if same:
                return link
            if link.task is not None:
                link.task.cancel()  # the prefill side at this address changed: reconnect
        link = PrefillLink(endpoint, engine_id, incarnation)
        self._links[endpoint] = link
        link.task = asyncio.get_running_loop().create_task(self._run_link(link))
        return link

    async def _run_link(self, link: PrefillLink) -> None:
        hello = pb.Hello(
            decode=self.identity,
            decode_ranks=self.rank_layouts,
            expected_prefill_engine_id=link.prefill_engine_id,
            expected_prefill_incarnation=link.prefill_incarnation,
            auth_token=self.config.auth_token,
        )
        try:
            await run_link(link, hello, self.security, self.config.max_fence_s, self._on_prefill_message)
        finally:
            self._on_link_lost(link)  # its transfers go through the fence, however the link ended

    def _on_prefill_message(self, link: PrefillLink, msg: pb.PrefillMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "ping":
            # Grant first, then answer: the bound decode uses is never earlier than the grant.
            link.granted_at = time.monotonic()
            self._send(link, pb.DecodeMessage(pong=pb.Pong(seq=msg.ping.seq)))
        elif kind == "cancel_ack":
            a = msg.cancel_ack
            p = self._transfers.get((a.transfer_id, a.epoch))
            if p is None:
                return  # already settled, or a release of prefill KV (epoch 0)
            if link.endpoint not in p.transfer.links:
                log.warning("cancel_ack_ignored", endpoint=link.endpoint, transfer_id=a.transfer_id, epoch=a.epoch)
                return
            p.transfer.on_cancel_ack(link.endpoint)
            self._maybe_settle(p)
        elif kind == "rejected":
            r = msg.rejected
            code = grpc.StatusCode.UNKNOWN
            for c in grpc.StatusCode:
                if c.value[0] == r.code:
                    code = c
            tid, message = r.transfer_id[: limits.MAX_ID_CHARS], limits.clip(r.message)
            p = self._transfers.get((r.transfer_id, r.epoch))
            if p is None or link.endpoint not in p.transfer.links:
                # Only a prefill rank the reservation went to can reject it.
                log.warning("rejection_ignored", endpoint=link.endpoint, transfer_id=tid, epoch=r.epoch, code=code.name)
                return
            log.warning("reservation_rejected", transfer_id=tid, epoch=r.epoch, code=code.name, reason=message)
            self._fence(p, DecodeState.FAILED, f"{code.name}: {message}", retry=code not in _FINAL_REJECTIONS)
        elif kind == "drain":
            log.info("prefill_draining", endpoint=link.endpoint, reason=msg.drain.reason)

    def _on_link_lost(self, link: PrefillLink) -> None:
        link.lost.set()
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        now = time.monotonic()
        deadline = max(now, link.fenced_after(self.config.grace_s))
        for endpoint in [e for e, d in self._lost.items() if d <= now]:
            del self._lost[endpoint]  # bounded: only links whose fence is still running stay
        self._lost[link.endpoint] = max(deadline, self._lost.get(link.endpoint, 0.0))
        metrics.LINK_LOSSES.inc()
        log.warning("prefill_link_lost", endpoint=link.endpoint, error=link.error)
        for p in list(self._transfers.values()):
            t = p.transfer
            if link.endpoint not in t.links or t.settled:
                continue
            if t.state is DecodeState.CANCELLING:
                t.on_link_lost(link.endpoint, deadline)
                self._maybe_settle(p)
            else:
                reason = f"stream to prefill rank {link.endpoint} lost: {link.error}"
                self._fence(p, DecodeState.FAILED, reason, retry=True)

    # ----- fence --------------------------------------------------------------------------

    def _resolve(self, transfer_id: str, epoch: int | None) -> _Pending | None:
        """The transfer the host means by (transfer_id, epoch): after a retry elsewhere, the epoch
        that took over from the one reserve() returned."""
        if epoch is None:
            return self._current(transfer_id)
        moved = self._moved.get(transfer_id, {})
        while (transfer_id, epoch) not in self._transfers and epoch in moved:
            epoch = moved[epoch]
        return self._transfers.get((transfer_id, epoch))

    def _fence_by_id(self, transfer_id: str, epoch: int | None, outcome: DecodeState, reason: str) -> None:
        p = self._resolve(transfer_id, epoch)
        if p is None:
            return
        if outcome is DecodeState.CANCELLED:
            p.cancelled = reason  # the request ended: never retried from here on
        self._fence(p, outcome, reason)

    def _fence(self, p: _Pending, outcome: DecodeState, reason: str, retry: bool = False) -> None:
        t = p.transfer
        if t.settled:
            return
        if p.task is not None and not p.task.done() and t.state is DecodeState.RESERVED:
            # Still registering with the ranks: fence once that finished, so a settlement never
            # overtakes its expectation.
            p.task.add_done_callback(lambda _: self._fence(p, outcome, reason, retry))
            if t.fence_outcome is None:
                t.reason = reason
            return
        now = time.monotonic()
        lost = {ep: d for ep, d in self._lost.items() if ep not in self._links}
        first = t.state is not DecodeState.CANCELLING
        for endpoint in t.start_fence(outcome, reason, lost):
            link = self._links.get(endpoint)
            cancel = pb.DecodeMessage(cancel=pb.Cancel(transfer_id=t.transfer_id, epoch=t.epoch, reason=reason))
            if link is None:
                # Lost before its bound was recorded: the longest bound decode accepts.
                t.on_link_lost(endpoint, now + self.config.max_fence_s + self.config.grace_s)
            elif not self._send(link, cancel):
                # The link is being closed for overflowing: its lease bound applies.
                t.on_link_lost(endpoint, max(now, link.fenced_after(self.config.grace_s)))
        if first:
            log.info("fence_started", transfer_id=t.transfer_id, epoch=t.epoch, outcome=outcome.value, reason=reason)
            if retry and outcome is DecodeState.FAILED and self._may_reroute(p):
                # Asked now, so the new prefill computes while the failed one is fenced.
                p.reroute = asyncio.get_running_loop().create_task(self._ask_reroute(p, reason))
        p.reserve_called = now if first else p.reserve_called
        self._maybe_settle(p)

    def _may_reroute(self, p: _Pending) -> bool:
        return (
            self.rerouter is not None
            and p.reroute is None
            and not p.cancelled
            and p.attempt < self.config.max_reroutes
            and len(p.prompt_token_ids) > 0
        )

    async def _ask_reroute(self, p: _Pending, reason: str) -> DecodeLeg | None:
        t = p.transfer
        assert self.rerouter is not None
        ask = RerouteAsk(t.transfer_id, p.leg.prefill_engine_id, reason, p.prompt_token_ids)
        try:
            return await self.rerouter.reroute(ask)
        except RerouteRefused as exc:
            metrics.REROUTES.labels(result="refused").inc()
            log.warning("reroute_refused", transfer_id=t.transfer_id, epoch=t.epoch, reason=str(exc))
        except Exception as exc:  # the fence must conclude whatever the scheduler does
            metrics.REROUTES.labels(result="error").inc()
            log.error("reroute_error", transfer_id=t.transfer_id, epoch=t.epoch, error=f"{type(exc).__name__}: {exc}")
        return None

    async def _conclude(self, p: _Pending, state: DecodeState) -> None:
        """The epoch is fenced: publish the same blocks to the new prefill, or settle the ranks."""
        leg = await p.reroute if p.reroute is not None else None
        if leg is not None and state is DecodeState.FAILED and not p.cancelled:
            self._retry(p, leg)
            return
        if leg is not None:
            metrics.REROUTES.labels(result="dropped").inc()  # cancelled meanwhile
        await self._settle_ranks(p, state)

    def _retry(self, old: _Pending, leg: DecodeLeg) -> None:
        t = old.transfer
        transfer = DecodeTransfer(
            transfer_id=t.transfer_id,
            epoch=next(self._epochs),
            request_id=t.request_id,
            prefill_engine_id=leg.prefill_engine_id,
            links=(),
            num_blocks=t.num_blocks,
            reserved_at=t.reserved_at,
        )
        new = _Pending(transfer, leg, old.block_ids, old.num_tokens, old.num_skip_blocks, time.monotonic())
        new.prompt_token_ids, new.attempt = old.prompt_token_ids, old.attempt + 1
        self._forget(old, retried=True)
        self._moved.setdefault(t.transfer_id, {})[t.epoch] = transfer.epoch
        metrics.REROUTES.labels(result="retried").inc()
        log.info(
            "transfer_retried",
            transfer_id=t.transfer_id,
            epoch=t.epoch,
            new_epoch=transfer.epoch,
            failed_prefill=old.leg.prefill_engine_id,
            prefill=leg.prefill_engine_id,
            reason=t.reason,
        )
        self._start_publish(new)

    def _maybe_settle(self, p: _Pending) -> None:
        t = p.transfer
        if t.state is not DecodeState.CANCELLING:
            return
        now = time.monotonic()
        if not t.fenced(now):
            deadline = t.next_deadline()
            if deadline is not None and not t.awaiting_ack:
                asyncio.get_running_loop().call_later(max(0.0, deadline - now) + 1e-3, self._maybe_settle, p)
            return
        state = t.settle()
        metrics.FENCE_SECONDS.observe(now - p.reserve_called)
        asyncio.get_running_loop().create_task(self._conclude(p, state))

    async def _settle_ranks(self, p: _Pending, state: DecodeState) -> None:
        t = p.transfer
        if p.expected is not None:
            with contextlib.suppress(Exception):
                await p.expected  # a settlement never overtakes its expectation
        status = pb.TRANSFER_STATUS_CANCELLED if state is DecodeState.CANCELLED else pb.TRANSFER_STATUS_FAILED
        settlement = pb.Settlement(transfer_id=t.transfer_id, epoch=t.epoch, status=status, reason=t.reason)
        await asyncio.gather(*(self._settle_rank(rank, settlement) for rank in range(len(self._rank_stubs))))
        self._forget(p)
        metrics.SETTLED.labels(outcome=state.value).inc()
        log.info("transfer_settled", transfer_id=t.transfer_id, epoch=t.epoch, outcome=state.value, reason=t.reason)
        if self.on_settled is not None:
            self.on_settled(Settled(t.transfer_id, t.epoch, t.request_id, state, t.reason))

    async def _settle_rank(self, rank: int, settlement: pb.Settlement) -> None:
        """Tells one rank the transfer is fenced; retried with backoff, since the request stays
        stuck in vLLM until every rank released it."""
        deadline = time.monotonic() + self.config.settle_retry_s
        backoff = 0.05
        while True:
            try:
                await self._rank_stubs[rank].Settle(settlement, timeout=self.config.rpc_timeout_s)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.NOT_FOUND:
                    return  # the rank never heard of it: nothing to release there
                final = exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or (
                    time.monotonic() + backoff >= deadline
                )
                (log.error if final else log.warning)(
                    "settle_failed",
                    transfer_id=settlement.transfer_id,
                    epoch=settlement.epoch,
                    rank=rank,
                    code=exc.code().name,
                    detail=exc.details(),
                    final=final,
                )
                if final:
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _finished(self, transfer_id: str, epoch: int | None) -> None:
        p = self._resolve(transfer_id, epoch)
        if p is None:
            return
        if p.transfer.complete():
            metrics.SETTLED.labels(outcome="complete").inc()
            self._forget(p)
        # A transfer being fenced finishes through its fence (the acks follow within milliseconds).

    def _forget(self, p: _Pending, retried: bool = False) -> None:
        t = p.transfer
        if p.deadline is not None:
            p.deadline.cancel()
        self._transfers.pop((t.transfer_id, t.epoch), None)
        if self._latest.get(t.transfer_id) == t.epoch:
            del self._latest[t.transfer_id]
            if not retried:
                self._moved.pop(t.transfer_id, None)
        p.gone.set()

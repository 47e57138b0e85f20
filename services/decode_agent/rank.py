"""Decode rank: one per decode worker rank.

Owns the rank's NIXL engine (KV regions registered once, DRAM or VRAM), keeps it progressing from a poller
thread while transfers are expected (WRITEs over some transports only finish when the target
calls into NIXL), and serves ``DecodeRank``: expectations from the agent, completions from the
prefill ranks, settlements from the agent. Released transfers are handed to the host (vLLM's
worker reports them from ``get_finished``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvpush.services.common import completion_notice, limits
from kvpush.services.common.aio_thread import LoopThread
from kvpush.services.common.grpc_util import start_aio_server
from kvpush.services.common.handoff import Handoff
from kvpush.services.common.layout import ModelShape, RankRegions, layout_message, register_spans
from kvpush.services.common.logs import get_logger
from kvpush.services.common.nixl_engine import NixlEngine
from kvpush.services.common.refusal import RefusalCode
from kvpush.services.common.security import DECODE_RANK_POLICY, PREFILL, Security, claim_problem, peer_identity
from kvpush.services.common.thread_names import name_native_thread
from kvpush.services.decode_agent import metrics
from kvpush.services.decode_agent.barrier import BarrierTable, CompletionError, Outcome, Released
from kvpush.services.decode_agent.cadence import PollCadence
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

log = get_logger("decode.rank")

MAX_EARLY_NOTICES = 4096  # notices waiting for their expectation at once, all transfers
_OUTCOME = {pb.TRANSFER_STATUS_FAILED: Outcome.FAILED, pb.TRANSFER_STATUS_CANCELLED: Outcome.CANCELLED}


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _status(exc: CompletionError) -> grpc.StatusCode:
    """The barrier's pure refusal code, as gRPC's (this module is the barrier's gRPC edge)."""
    return grpc.StatusCode[exc.code.name]


def _expectation_out_of_bounds(e: pb.Expectation) -> str | None:
    if max(len(e.transfer_id), len(e.request_id), len(e.prefill_engine_id)) > limits.MAX_ID_CHARS:
        return f"an id is longer than {limits.MAX_ID_CHARS} characters"
    if len(e.prefill_ranks) > limits.MAX_TP or any(r >= limits.MAX_TP for r in e.prefill_ranks):
        return f"prefill ranks beyond TP {limits.MAX_TP}"
    if len(set(e.prefill_ranks)) != len(e.prefill_ranks):
        return "prefill ranks repeat"
    if not completion_notice.valid_key(e.completion_key):
        return f"completion_key must be empty or {completion_notice.KEY_BYTES} bytes"
    return None


@dataclass
class DecodeRankConfig:
    engine_id: str
    rank: int
    tp_size: int
    shape: ModelShape
    host: str = "127.0.0.1"
    port: int = 0
    # NIXL progress cadence (cadence.py): while transfers are expected, with the engine idle
    # and while it runs forwards; and otherwise.
    poll_interval_s: float = 100e-6
    busy_poll_s: float = 5e-3  # the engine thread also progresses at each step's end
    idle_poll_s: float = 20e-3
    tombstone_s: float = 60.0
    # The agent publishes a reservation and registers it here concurrently; a completion that
    # overtakes its expectation waits this long for it before it is refused as unknown.
    expect_wait_s: float = 2.0
    max_pending_barriers: int = limits.MAX_PENDING_BARRIERS  # transfers waited for at once
    # mTLS: Complete only from prefill identities (each in its own name), Expect and Settle only
    # from this engine's decode agent. None: plaintext (tests, logged).
    security: Security | None = None
    # Before a transfer that did not complete is released, NIXL is progressed for this long, so
    # bytes of a torn-down WRITE that already reached this host land before the blocks are
    # reused, not after (docs/fence.md).
    drain_s: float = 0.05


class DecodeRank(pb_grpc.DecodeRankServicer):
    def __init__(
        self,
        config: DecodeRankConfig,
        engine: NixlEngine,
        local: RankRegions,
        on_release: Callable[[Released], None] | None = None,
        on_queued: Callable[[], None] | None = None,
        on_first_token: Callable[[pb.FirstToken], object] | None = None,
    ) -> None:
        """Releases go to ``on_release`` when given, else to ``take_released``'s queue, after
        which ``on_queued`` is called (the connector wakes vLLM's engine loop with it).
        ``on_first_token`` takes the first token an accepted OK completion carried, before the
        release that completion may cause (connector/completion_tokens.py)."""
        self.config = config
        self.security = config.security or Security.insecure(f"decode-rank {config.engine_id}/{config.rank}")
        self.engine = engine
        self.local = local
        self.table = BarrierTable(tombstone_s=config.tombstone_s, max_pending=config.max_pending_barriers)
        self._on_release = on_release
        self._on_queued = on_queued
        self._on_first_token = on_first_token
        self._released: Handoff[Released] = Handoff()
        self._loop = LoopThread(f"kvpush-decode-rank-{config.rank}", f"kv-drank-{config.rank}")
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self._active = threading.Event()  # set while any barrier waits, or a first token
        self._active_lock = threading.Lock()  # set or cleared from fresh reads, one thread at a time
        # The barrier table changes on the rank's loop (Expect, Complete, Settle) and on the thread
        # that drained completion notices: one change at a time.
        self._table_lock = threading.Lock()
        # Notices that overtook their expectation, by (transfer id, epoch): taken when it comes,
        # dropped after expect_wait_s or past the bound (oldest first). Under _table_lock.
        self._early: OrderedDict[tuple[str, int], tuple[float, list[pb.CompletionNotice]]] = OrderedDict()
        self._early_count = 0
        self._tokens_awaited = False
        self.cadence = PollCadence(config.poll_interval_s, config.busy_poll_s, config.idle_poll_s)
        self._expected: dict[str, asyncio.Event] = {}  # completions waiting for their expectation
        self._next_expiry = 0.0
        self._stopping = threading.Event()
        self._progress_lock = threading.Lock()  # one thread drives the NIXL agent at a time
        self._drain_lock = threading.Lock()
        self._drain_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._refusal_log_lock = threading.Lock()
        self._refusals_logged_at = -math.inf  # refused notices are logged at most once a second
        self._refusals_unlogged = 0
        self._poller = threading.Thread(target=self._poll, name=f"kvpush-nixl-poller-{config.rank}", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self.port}"

    def layout(self) -> pb.RankLayout:
        return layout_message(
            self.local,
            self.config.shape,
            self.config.rank,
            self.engine.name,
            self.engine.metadata(),
            self.endpoint,
        )

    def start(self) -> DecodeRank:
        self._loop.start()
        self._loop.run(self._start_server())
        self._poller.start()
        log.info("decode_rank_started", endpoint=self.endpoint, rank=self.config.rank)
        return self

    async def _start_server(self) -> None:
        self._server, self.port = await start_aio_server(
            pb_grpc.add_DecodeRankServicer_to_server,
            self,
            "DecodeRank",
            self.config.host,
            self.config.port,
            self.security,
            DECODE_RANK_POLICY,
            own_name=self.config.engine_id,
        )

    def stop(self, grace_s: float = 1.0) -> None:
        self._stopping.set()
        self._active.set()
        if self._server is not None:
            self._loop.run(self._server.stop(grace_s), timeout=grace_s + 5)
        self._loop.stop()
        self._poller.join(5)

    # ----- host-facing -------------------------------------------------------------------

    def take_released(self, timeout_s: float = 0.0) -> list[Released]:
        """Drains the released transfers, waiting up to ``timeout_s`` for at least one."""
        return self._released.take(timeout_s)

    # ----- NIXL progress -----------------------------------------------------------------

    def _poll(self) -> None:
        """Fast while a transfer is expected (less so while the engine runs forwards on the same
        core: cadence.py); slow otherwise, so a WRITE that arrives before its expectation (or
        for a transfer already settled) still completes instead of hanging."""
        name_native_thread(f"kv-poller-{self.config.rank}")
        while not self._stopping.is_set():
            if self._active.is_set():
                time.sleep(self.cadence.nap(True, time.monotonic()))
            else:
                self._active.wait(self.cadence.idle_s)
            self._progress()
            with self._drain_lock:
                waiters, self._drain_waiters = self._drain_waiters, []
            if waiters:
                self._drain_now()
                for loop, fut in waiters:
                    loop.call_soon_threadsafe(_resolve, fut)

    def _drain_now(self) -> None:
        end = time.monotonic() + self.config.drain_s
        while time.monotonic() < end:
            self._progress()
            time.sleep(self.config.poll_interval_s)

    def _progress(self, wait: bool = True) -> None:
        if not self._progress_lock.acquire(blocking=wait):
            return  # the poller is progressing right now
        try:
            notifs = self.engine.progress()
        except Exception:
            log.exception("nixl_progress_failed")
            notifs = {}
        finally:
            self._progress_lock.release()
        if notifs:
            # Taken here, on the thread that drained them (the poller, or the engine thread at a
            # step's end): a hop to the rank's loop thread cost up to 2 ms on a busy core.
            self._on_notices([m for msgs in notifs.values() for m in msgs])

    def forward_started(self) -> None:
        """Called by the engine thread when it binds a step that runs a forward."""
        self.cadence.forward_started()

    def step_ended(self, now: float) -> None:
        """Called by the engine thread at the end of each step. While a transfer is expected it
        progresses NIXL here (about a microsecond, no thread wake-up): with the engine running
        forwards the poller naps ``busy_poll_s``, so a WRITE that lands mid-step completes at the
        step's end, before the engine looks for released transfers again."""
        self.cadence.step_ended(now)
        if self._active.is_set():
            self._progress(wait=False)

    async def _drain(self) -> None:
        """Returns once the poller progressed NIXL for ``drain_s`` after this call."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._drain_lock:
            self._drain_waiters.append((asyncio.get_running_loop(), fut))
        self._active.set()
        try:
            await asyncio.wait_for(fut, self.config.drain_s + 5.0)
        except TimeoutError:
            log.error("nixl_drain_timeout", rank=self.config.rank)

    def awaiting_first_tokens(self, awaited: bool) -> None:
        """The engine thread: whether a request of this engine waits for its first token. Its
        KV may be released by the writer's completion notice before the engine sampled that
        token, which then comes in a notice of its own: NIXL is progressed at the expecting
        cadence until it is in, as while a barrier waits (cadence.py)."""
        if awaited != self._tokens_awaited:
            self._tokens_awaited = awaited
            self._update_active()

    def _update_active(self) -> None:
        with self._active_lock:  # each caller reads the state after the change it reports
            if self.table.pending_count() or self._drain_waiters or self._tokens_awaited:
                self._active.set()
            else:
                self._active.clear()

    # ----- releases ----------------------------------------------------------------------

    def _released_now(self, rel: Released) -> None:
        b = self.table.get(rel.transfer_id)
        waited = (time.monotonic() - b.created) if b and b.request_id == rel.request_id else 0.0
        metrics.RELEASED.labels(outcome=rel.outcome.value).inc()
        metrics.BARRIER_SECONDS.observe(waited)
        log.info(
            "transfer_released",
            transfer_id=rel.transfer_id,
            epoch=rel.epoch,
            rank=self.config.rank,
            outcome=rel.outcome.value,
            reason=rel.reason or None,
            waited_ms=round(waited * 1e3, 3),
        )
        if self._on_release is not None:
            self._on_release(rel)
        else:
            self._released.put(rel)
            if self._on_queued is not None:
                self._on_queued()

    # ----- gRPC ---------------------------------------------------------------------------

    async def Expect(self, request: pb.ExpectRequest, context: grpc.aio.ServicerContext) -> pb.ExpectResponse:  # noqa: N802
        if len(request.expectations) > limits.MAX_EXPECTATIONS_PER_CALL:
            log.warning("expect_refused", count=len(request.expectations), reason="too many expectations in one call")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"more than {limits.MAX_EXPECTATIONS_PER_CALL} expectations"
            )
        now = time.monotonic()
        if now >= self._next_expiry:
            with self._table_lock:
                self.table.expire(now)
                self._expire_early(now)
            self._next_expiry = now + 1.0
        results = []
        early: list[pb.CompletionNotice] = []
        for e in request.expectations:
            problem = _expectation_out_of_bounds(e)
            if problem is not None:
                log.warning("expect_refused", transfer_id=e.transfer_id[: limits.MAX_ID_CHARS], reason=problem)
                results.append(pb.ExpectResult(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=problem))
                continue
            try:
                with self._table_lock:
                    self.table.expect(
                        e.transfer_id,
                        e.epoch,
                        e.request_id,
                        list(e.prefill_ranks),
                        e.prefill_engine_id,
                        now,
                        notice_key=e.completion_key,
                    )
                    early.extend(self._pop_early((e.transfer_id, e.epoch)))
                results.append(pb.ExpectResult())
            except CompletionError as exc:
                code = _status(exc)
                log.warning("expect_refused", transfer_id=e.transfer_id, code=code.name, reason=exc.message)
                results.append(pb.ExpectResult(code=code.value[0], message=exc.message))
            waiter = self._expected.pop(e.transfer_id, None)
            if waiter is not None:
                waiter.set()
        self._update_active()
        if early:
            self._take_notices(early)
        return pb.ExpectResponse(results=results)

    async def _await_expectation(self, transfer_id: str, epoch: int) -> None:
        b = self.table.get(transfer_id)
        if b is not None and b.epoch >= epoch:
            return
        if transfer_id not in self._expected and len(self._expected) >= limits.MAX_PENDING_BARRIERS:
            return  # too many completions already wait: this one is answered now
        waiter = self._expected.setdefault(transfer_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), self.config.expect_wait_s)
        if self._expected.get(transfer_id) is waiter and not waiter.is_set():
            del self._expected[transfer_id]

    # ----- completion notices (NIXL notifications; services/common/completion_notice.py) -----

    def _on_notices(self, raw: list[bytes]) -> None:
        """The thread that drained them (the poller, or the engine thread at a step's end)."""
        notices = []
        for msg in raw:
            n = completion_notice.decode(bytes(msg))
            if isinstance(n, str):
                self._notice_refused(n, None)
            else:
                notices.append(n)
        if notices:
            self._take_notices(notices)

    def _take_notices(self, notices: list[pb.CompletionNotice]) -> None:
        """Records each notice whose MAC verifies as the OK completion it reports, as ``Complete``
        would. One that overtook its expectation (no barrier for its transfer yet, or an older
        epoch's) waits for it, bounded; any other this rank expects no notices for cannot be
        verified and is dropped (the Completion RPC that follows every notice decides)."""
        for n in notices:
            prefill_engine_id = ""
            rel: Released | None = None
            with self._table_lock:
                b = self.table.get(n.transfer_id)
                if b is None or b.epoch < n.epoch:
                    self._hold_early(n)
                    continue
                if b.epoch != n.epoch or not b.notice_key:
                    problem, outcome = "no expectation with notices for this transfer and epoch", "unknown"
                elif not completion_notice.verify(b.notice_key, n):
                    problem, outcome = "bad MAC", "refused"
                elif n.decode_rank != self.config.rank:
                    problem, outcome = f"notice for decode rank {n.decode_rank}", "refused"
                else:
                    prefill_engine_id = b.prefill_engine_id
                    try:
                        rel = self.table.complete(
                            n.transfer_id, n.epoch, n.prefill_rank, prefill_engine_id, True, "", time.monotonic()
                        )
                        problem, outcome = "", "accepted"
                    except CompletionError as exc:
                        # Authentic: a prefill rank the expectation does not list, or a settled epoch.
                        problem = exc.message
                        outcome = "refused" if exc.code is RefusalCode.INVALID_ARGUMENT else "unknown"
            if problem:
                self._notice_refused(problem, n, outcome)
                continue
            metrics.COMPLETION_NOTICES.labels(outcome="accepted").inc()
            log.debug(
                "completion_notice_accepted",
                transfer_id=n.transfer_id,
                epoch=n.epoch,
                prefill_rank=n.prefill_rank,
                first_token=n.HasField("first_token"),
                released=rel is not None,
            )
            if n.HasField("first_token"):
                self._hand_on_first_token(n.transfer_id, prefill_engine_id, n.first_token)
            if rel is not None:
                self._released_now(rel)
                self._update_active()

    def _hold_early(self, n: pb.CompletionNotice) -> None:
        """Under _table_lock: keeps a notice for the expectation it overtook; at most
        MAX_EARLY_NOTICES in all, the oldest transfer's dropped first (counted as unknown)."""
        key = (n.transfer_id, n.epoch)
        held = self._early.get(key)
        if held is None:
            held = self._early[key] = (time.monotonic(), [])
        held[1].append(n)
        self._early_count += 1
        metrics.COMPLETION_NOTICES.labels(outcome="early").inc()
        while self._early_count > MAX_EARLY_NOTICES:
            dropped = self._pop_early(next(iter(self._early)))
            metrics.COMPLETION_NOTICES.labels(outcome="unknown").inc(len(dropped))

    def _pop_early(self, key: tuple[str, int]) -> list[pb.CompletionNotice]:
        """Under _table_lock: the notices held for ``key`` (none: empty), no longer held."""
        held = self._early.pop(key, None)
        if held is None:
            return []
        self._early_count -= len(held[1])
        return held[1]

    def _expire_early(self, now: float) -> None:
        """Under _table_lock: notices whose expectation did not come within expect_wait_s."""
        while self._early:
            key, (since, _) = next(iter(self._early.items()))
            if since + self.config.expect_wait_s > now:
                break
            dropped = self._pop_early(key)
            metrics.COMPLETION_NOTICES.labels(outcome="unknown").inc(len(dropped))
            log.debug("completion_notice_unknown", transfer_id=key[0], reason="its expectation never came")

    def _notice_refused(self, reason: str, n: pb.CompletionNotice | None, outcome: str = "refused") -> None:
        """Counts a notice not taken. ``unknown``: nothing to verify it against (logged at debug: a
        notice can overtake its expectation, or come after a cancel settled its epoch);
        ``refused``: malformed, forged or misdirected, logged as a warning at most once a second,
        with how many were not."""
        metrics.COMPLETION_NOTICES.labels(outcome=outcome).inc()
        tid = n.transfer_id if n is not None else None
        if outcome == "unknown":
            log.debug("completion_notice_unknown", transfer_id=tid, reason=reason)
            return
        now = time.monotonic()
        with self._refusal_log_lock:
            if now - self._refusals_logged_at < 1.0:
                self._refusals_unlogged += 1
                return
            unlogged, self._refusals_logged_at, self._refusals_unlogged = self._refusals_unlogged, now, 0
        log.warning(
            "completion_notice_refused",
            transfer_id=tid,
            reason=reason,
            rank=self.config.rank,
            unlogged_before=unlogged or None,
        )

    def _hand_on_first_token(self, transfer_id: str, prefill_engine_id: str, token_id: int) -> None:
        """Gives an accepted OK completion's first token to the scheduler half, before the
        release that completion may cause."""
        if self._on_first_token is None:
            return
        token = pb.FirstToken(
            transfer_id=transfer_id,
            decode_engine_id=self.config.engine_id,
            prefill_engine_id=prefill_engine_id,
            token_id=token_id,
        )
        try:
            self._on_first_token(token)
        except Exception:  # the completion is answered as without it; the relay has it too
            log.exception("first_token_not_handed_on", transfer_id=transfer_id)

    async def Complete(self, request: pb.Completion, context: grpc.aio.ServicerContext) -> pb.CompletionAck:  # noqa: N802
        not_peer = claim_problem(peer_identity(context), request.prefill.engine_id, PREFILL)
        if not_peer is not None:
            log.warning("completion_refused", transfer_id=request.transfer_id, reason=not_peer)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, not_peer)
        if request.decode_rank != self.config.rank:
            log.warning(
                "completion_refused", transfer_id=request.transfer_id[: limits.MAX_ID_CHARS], reason="wrong decode rank"
            )
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"completion for rank {request.decode_rank} sent to {self.config.rank}",
            )
        if request.status not in (pb.TRANSFER_STATUS_OK, pb.TRANSFER_STATUS_FAILED):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "completion status must be OK or FAILED")
        if len(request.transfer_id) > limits.MAX_ID_CHARS or len(request.prefill.engine_id) > limits.MAX_ID_CHARS:
            log.warning("completion_refused", reason="id too long")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ids are at most {limits.MAX_ID_CHARS} characters")
        await self._await_expectation(request.transfer_id, request.epoch)
        try:
            with self._table_lock:
                rel = self.table.complete(
                    request.transfer_id,
                    request.epoch,
                    request.prefill_rank,
                    request.prefill.engine_id,
                    request.status == pb.TRANSFER_STATUS_OK,
                    limits.clip(request.reason),
                    time.monotonic(),
                )
        except CompletionError as exc:
            log.warning(
                "completion_refused",
                transfer_id=request.transfer_id,
                epoch=request.epoch,
                prefill_rank=request.prefill_rank,
                code=_status(exc).name,
                reason=exc.message,
            )
            await context.abort(_status(exc), exc.message)
        if request.status == pb.TRANSFER_STATUS_OK:
            metrics.BYTES.inc(request.bytes_written)
            if request.HasField("first_token"):
                # The barrier accepted it: it comes from the transfer's prefill, for its epoch.
                self._hand_on_first_token(request.transfer_id, request.prefill.engine_id, request.first_token)
        if rel is not None:
            if rel.outcome is not Outcome.OK:
                await self._drain()
            self._released_now(rel)
            self._update_active()
        return pb.CompletionAck(released=rel is not None)

    async def Settle(self, request: pb.Settlement, context: grpc.aio.ServicerContext) -> pb.SettleAck:  # noqa: N802
        outcome = _OUTCOME.get(request.status)
        if outcome is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "settlement status must be FAILED or CANCELLED")
            raise AssertionError("unreachable")
        if len(request.transfer_id) > limits.MAX_ID_CHARS:
            log.warning("settle_refused", reason="transfer id too long")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ids are at most {limits.MAX_ID_CHARS} characters")
        try:
            with self._table_lock:
                rel = self.table.settle(
                    request.transfer_id, request.epoch, outcome, limits.clip(request.reason), time.monotonic()
                )
        except CompletionError as exc:
            log.warning("settle_refused", transfer_id=request.transfer_id, code=_status(exc).name, reason=exc.message)
            await context.abort(_status(exc), exc.message)
        if rel is not None:
            await self._drain()
            self._released_now(rel)
            self._update_active()
        return pb.SettleAck()


def create_rank(
    config: DecodeRankConfig,
    engine: NixlEngine,
    local: RankRegions,
    on_release: Callable[[Released], None] | None = None,
    on_queued: Callable[[], None] | None = None,
    on_first_token: Callable[[pb.FirstToken], object] | None = None,
) -> DecodeRank:
    """Registers the rank's regions with NIXL (once: memory the engine already registered is
    skipped) and starts its server."""
    engine.register(register_spans(local), *local.memory())
    return DecodeRank(config, engine, local, on_release, on_queued, on_first_token).start()

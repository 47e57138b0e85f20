"""First tokens of hand-off transfers (docs/first_token.md). A prefill engine reports each one it
samples; the scheduler relays it to the decode engine the report names, keeps it on the open
assignment when one of that assignment's prefill engines sampled it (the first such token wins),
and answers whatever waits for it: the transfer's ``Generate`` call or a frontend's
``AwaitFirstToken`` or an ``AssignStream`` batch that asked for it. Pure bookkeeping around the
registry; the RPCs are in ``first_token_rpcs``."""

from __future__ import annotations

import asyncio

from kvpush.services.common import limits
from kvpush.services.common.logs import get_logger
from kvpush.services.scheduler.load_stream_push import Outboxes
from kvpush.services.scheduler.metrics import Metrics
from kvpush.services.scheduler.model import AssignmentRecord, Role, SampledToken, State
from kvpush.services.scheduler.registry import Registry
from kvpush.v1 import kvpush_pb2 as pb


class FirstTokenRelay:
    """Relays first tokens and resolves the futures waiting for them. A frontend's future is
    cancelled when its assignment closes (or is replaced) before a token came."""

    def __init__(self, registry: Registry, outboxes: Outboxes, metrics: Metrics) -> None:
        self.registry = registry
        self.outboxes = outboxes
        self.metrics = metrics
        self.log = get_logger("scheduler")
        # transfer id -> (the assignment waited on, its future), in arrival order
        self.waiters: dict[str, list[tuple[AssignmentRecord, asyncio.Future[SampledToken]]]] = {}

    def wait_for(self, rec: AssignmentRecord) -> asyncio.Future[SampledToken]:
        """A future for the assignment's first token, already done when it has one; ``forget`` it
        when the call that waits ends."""
        fut: asyncio.Future[SampledToken] = asyncio.get_running_loop().create_future()
        if rec.sampled is not None:
            fut.set_result(rec.sampled)
        else:
            self.waiters.setdefault(rec.transfer_id, []).append((rec, fut))
        return fut

    def forget(self, transfer_id: str, fut: asyncio.Future[SampledToken]) -> None:
        entries = self.waiters.get(transfer_id)
        if entries is None:
            return
        entries[:] = [e for e in entries if e[1] is not fut]
        if not entries:
            del self.waiters[transfer_id]

    def closed(self, rec: AssignmentRecord) -> None:
        """The assignment closed: the futures of the frontends waiting on it, and on assignments it
        replaced, are cancelled (the call answers why). A ``Generate`` call's future stays: that
        call learns of the closing itself, and still takes a token that comes after."""
        self._end_frontend_waits(rec.transfer_id, closed_only=True)

    def close_all(self) -> None:
        """Shutdown: every frontend's future is cancelled (``Generate`` calls end on their own)."""
        for transfer_id in list(self.waiters):
            self._end_frontend_waits(transfer_id, closed_only=False)

    def _end_frontend_waits(self, transfer_id: str, closed_only: bool) -> None:
        """Cancels the transfer's frontend futures (those of closed assignments only, with
        ``closed_only``); ``Generate`` calls' futures (held assignments) stay."""
        kept = []
        for owner, fut in self.waiters.pop(transfer_id, []):
            if owner.held or (closed_only and owner.state is State.OPEN):
                kept.append((owner, fut))
            else:
                fut.cancel()
        if kept:
            self.waiters[transfer_id] = kept

    def relay(self, report: pb.LoadReport | pb.FirstTokenReport) -> str | None:
        """The report's first tokens; why none was taken, or None. The prefill is named by the
        scheduler (the report's authenticated engine), never by the report; decode takes a token
        only from a prefill its transfer was published to, and so does the assignment."""
        inst = self.registry.instances.get(report.engine_id)
        if inst is None or inst.spec.role is not Role.PREFILL:
            self.log.warning("first_tokens_refused", engine_id=report.engine_id, reason="not a prefill engine")
            return "not a registered prefill engine"
        if len(report.first_tokens) > limits.MAX_EXPECTATIONS_PER_CALL:
            self.log.warning("first_tokens_refused", engine_id=report.engine_id, reason="too many in one report")
            return f"at most {limits.MAX_EXPECTATIONS_PER_CALL} first tokens in one report"
        backlog = inst.backlog  # local prefill's queue estimate: this engine's prefills are done
        now = self.registry.clock() if backlog is not None else 0.0
        for ft in report.first_tokens:
            if max(len(ft.transfer_id), len(ft.decode_engine_id)) > limits.MAX_ID_CHARS or not ft.transfer_id:
                self.log.warning("first_token_refused", engine_id=report.engine_id, reason="bad ids")
                continue
            if backlog is not None:
                backlog.finished(ft.transfer_id, now)
            relayed = pb.FirstToken(
                transfer_id=ft.transfer_id,
                decode_engine_id=ft.decode_engine_id,
                prefill_engine_id=report.engine_id,
                token_id=ft.token_id,
                stopped=ft.stopped,
            )
            self._keep(ft, report.engine_id)
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

    def _keep(self, ft: pb.FirstToken, prefill: str) -> None:
        """Keeps the token on its open hand-off assignment, and on the held (``Generate``) ones the
        waiters hold, where ``prefill`` is one of that assignment's prefill engines and no token
        came before; answers the waiters whose assignment has it. A frontend's wait on an
        assignment that closed meanwhile (replaced by a new one of the same transfer id) ends."""
        self._end_frontend_waits(ft.transfer_id, closed_only=True)
        live = self.waiters.pop(ft.transfer_id, [])
        owners = [owner for owner, _ in live]
        rec = self.registry.open.get(ft.transfer_id)
        if rec is not None and all(o is not rec for o in owners):  # identity: records compare by value
            owners.append(rec)
        for owner in owners:
            if not owner.first_token or owner.sampled is not None:
                continue
            if (owner.prefill is not None and prefill == owner.prefill.engine_id) or prefill in owner.tried_prefills:
                owner.sampled = SampledToken(int(ft.token_id), bool(ft.stopped), prefill)
            else:
                self.log.warning(
                    "first_token_not_kept",
                    transfer_id=ft.transfer_id,
                    prefill=prefill,
                    reason="not a prefill of this transfer",
                )
        waiting = []
        for owner, fut in live:
            if owner.sampled is None:
                waiting.append((owner, fut))
            elif not fut.done():
                fut.set_result(owner.sampled)
        if waiting:
            self.waiters[ft.transfer_id] = waiting


class StreamedFirstTokens:
    """The first tokens one ``AssignStream`` waits for (its batches with ``first_tokens``), and the
    results ready to go out on it. A wait belongs to the stream while its future is in ``waits``:
    whichever comes first, the future's end or the stream's, takes it out and settles it."""

    def __init__(self) -> None:
        self.waits: dict[asyncio.Future[SampledToken], str] = {}  # future -> transfer id
        self.results: list[pb.FirstTokenResult] = []
        self._ready: asyncio.Future[None] | None = None

    def push(self, result: pb.FirstTokenResult) -> None:
        self.results.append(result)
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def ready(self) -> asyncio.Future[None]:
        """A future done once a result is ready to go out."""
        if self._ready is None or self._ready.done():
            self._ready = asyncio.get_running_loop().create_future()
            if self.results:
                self._ready.set_result(None)
        return self._ready

    def take(self, into: pb.AssignStreamResponse) -> pb.AssignStreamResponse:
        """``into`` with every ready result added (they leave with it)."""
        if self.results:
            into.first_tokens.extend(self.results)
            self.results.clear()
        return into

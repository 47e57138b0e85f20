"""Scheduler.ReportFirstTokens (a prefill engine's first tokens, straight from the thread that
sampled them), Scheduler.AwaitFirstToken (a frontend's wait for one) and the first tokens an
``AssignStream`` batch asks for (delivered on that stream): the first-token hand-off's RPCs
(docs/first_token.md); the bookkeeping is ``first_tokens.FirstTokenRelay`` and
``first_tokens.StreamedFirstTokens``."""

from __future__ import annotations

import asyncio
from functools import partial

import grpc

from kvpush.services.common import limits
from kvpush.services.common.security import claim_problem, peer_identity
from kvpush.services.scheduler.first_tokens import StreamedFirstTokens
from kvpush.services.scheduler.model import AssignmentRecord, Role, SampledToken
from kvpush.services.scheduler.servicer_core import ServicerCore
from kvpush.v1 import kvpush_pb2 as pb


class FirstTokenRpcs(ServicerCore):
    """ReportFirstTokens and AwaitFirstToken, on the servicer's shared core."""

    async def ReportFirstTokens(  # noqa: N802
        self, request: pb.FirstTokenReport, context: grpc.aio.ServicerContext
    ) -> pb.FirstTokenAck:
        """First tokens straight from a prefill engine's thread (the load stream's first_tokens
        without its wake-ups); relayed exactly as those are."""
        not_peer = claim_problem(peer_identity(context), request.engine_id, "prefill")
        if not_peer is not None:
            self.log.warning(
                "first_tokens_refused", engine_id=request.engine_id[: limits.MAX_ID_CHARS], reason=not_peer
            )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, not_peer)
        if max(len(request.engine_id), len(request.incarnation)) > limits.MAX_ID_CHARS:
            await self._refuse(
                context, "ReportFirstTokens", grpc.StatusCode.INVALID_ARGUMENT, "engine id or incarnation too long"
            )
        inst = self.registry.instances.get(request.engine_id)
        if inst is None or inst.spec.incarnation != request.incarnation:
            await self._refuse(
                context, "ReportFirstTokens", grpc.StatusCode.FAILED_PRECONDITION, "not a registered incarnation"
            )
        if inst.spec.role is not Role.PREFILL:
            await self._refuse(context, "ReportFirstTokens", grpc.StatusCode.PERMISSION_DENIED, "not a prefill engine")
        problem = self._first_tokens.relay(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        return pb.FirstTokenAck()

    async def AwaitFirstToken(  # noqa: N802
        self, request: pb.AwaitFirstTokenRequest, context: grpc.aio.ServicerContext
    ) -> pb.AwaitFirstTokenResponse:
        """The first token of an open ``Assign`` hand-off assignment: at once when the scheduler has
        it, else the moment one of the assignment's prefill engines reports it. The wait ends with
        the caller's deadline or the assignment (which expires without a Release)."""
        counted = self.metrics.first_token_awaits
        if not request.transfer_id or len(request.transfer_id) > limits.MAX_ID_CHARS:
            counted.labels("refused").inc()
            await self._refuse(context, "AwaitFirstToken", grpc.StatusCode.INVALID_ARGUMENT, "missing or too long id")
        rec = self.registry.open.get(request.transfer_id)
        problem: tuple[grpc.StatusCode, str] | None = None
        if rec is None:
            problem = grpc.StatusCode.NOT_FOUND, "no open assignment for this transfer"
        elif rec.epoch != request.epoch and request.epoch not in rec.earlier_epochs:
            problem = grpc.StatusCode.FAILED_PRECONDITION, f"epoch {request.epoch} is not this assignment's"
        elif rec.held:
            problem = grpc.StatusCode.FAILED_PRECONDITION, "a Generate call's assignment: Generate streams its token"
        elif not rec.first_token:
            problem = grpc.StatusCode.FAILED_PRECONDITION, "the assignment was not granted the first-token hand-off"
        elif (full := self._awaits_full(rec)) is not None:
            problem = grpc.StatusCode.RESOURCE_EXHAUSTED, full
        if problem is not None:
            counted.labels("refused").inc()
            await self._refuse(context, "AwaitFirstToken", *problem)
        assert rec is not None
        fut = self._begin_wait(rec)
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            counted.labels("cancelled").inc()
            raise
        finally:
            self._end_wait(rec.transfer_id, fut)
        answer = self._waited(rec, fut)
        if isinstance(answer, tuple):
            await context.abort(*answer)
            raise AssertionError("unreachable")
        return answer

    # ---------------------------------------------------------------- one wait, either RPC

    def _awaits_full(self, rec: AssignmentRecord) -> str | None:
        """Why no more waits for ``rec``'s token may start (the shared bound), or None."""
        limit = self.config.max_first_token_awaits
        if rec.sampled is None and self._awaiting_first_token >= limit:
            return f"{limit} first-token waits are pending already"
        return None

    def _begin_wait(self, rec: AssignmentRecord) -> asyncio.Future[SampledToken]:
        self._awaiting_first_token += 1
        return self._first_tokens.wait_for(rec)

    def _end_wait(self, transfer_id: str, fut: asyncio.Future[SampledToken]) -> None:
        self._awaiting_first_token -= 1
        self._first_tokens.forget(transfer_id, fut)

    def _waited(
        self, rec: AssignmentRecord, fut: asyncio.Future[SampledToken]
    ) -> pb.AwaitFirstTokenResponse | tuple[grpc.StatusCode, str]:
        """A settled wait's answer: the token, or the status it ends with (its assignment closed
        first, or the scheduler is shutting down); counted."""
        counted = self.metrics.first_token_awaits
        if not fut.cancelled():
            token = fut.result()
            counted.labels("answered").inc()
            return pb.AwaitFirstTokenResponse(
                token_id=token.token_id, stopped=token.stopped, prefill_engine_id=token.prefill_engine_id
            )
        counted.labels("closed").inc()
        if self.shutting_down:
            return grpc.StatusCode.UNAVAILABLE, "scheduler is shutting down"
        self.log.info("first_token_await_closed", transfer_id=rec.transfer_id, reason=rec.reason)
        return (
            grpc.StatusCode.ABORTED,
            f"the assignment closed before its first token came: {rec.reason or rec.state.value}",
        )

    # ---------------------------------------------------------------- first tokens on AssignStream

    def _stream_first_token(self, stream: StreamedFirstTokens, rec: AssignmentRecord) -> None:
        """An ``AssignStream`` batch asked for the first token of ``rec`` (just assigned, granted
        the hand-off): its result goes out on that stream when it comes, as ``AwaitFirstToken``
        would answer it; the same bound on waits applies."""
        reason = self._awaits_full(rec)
        if reason is not None:
            self.metrics.first_token_awaits.labels("refused").inc()
            self.log.warning("request_refused", method="AssignStream", code="RESOURCE_EXHAUSTED", reason=reason)
            code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            stream.push(pb.FirstTokenResult(transfer_id=rec.transfer_id, epoch=rec.epoch, code=code, message=reason))
            return
        fut = self._begin_wait(rec)
        stream.waits[fut] = rec.transfer_id
        fut.add_done_callback(partial(self._streamed_first_token, stream, rec, rec.epoch))

    def _streamed_first_token(
        self, stream: StreamedFirstTokens, rec: AssignmentRecord, epoch: int, fut: asyncio.Future[SampledToken]
    ) -> None:
        if stream.waits.pop(fut, None) is None:  # the stream ended first
            return
        self._end_wait(rec.transfer_id, fut)
        result = pb.FirstTokenResult(transfer_id=rec.transfer_id, epoch=epoch)
        answer = self._waited(rec, fut)
        if isinstance(answer, tuple):
            result.code, result.message = answer[0].value[0], answer[1]
        else:
            result.token.CopyFrom(answer)
        stream.push(result)

    def _end_streamed_first_tokens(self, stream: StreamedFirstTokens) -> None:
        """The stream ended: its waits end with it (the tokens stay kept on their assignments, so
        ``AwaitFirstToken`` still answers them)."""
        waits, stream.waits = stream.waits, {}
        for fut, transfer_id in waits.items():
            self._end_wait(transfer_id, fut)
            fut.cancel()
            self.metrics.first_token_awaits.labels("cancelled").inc()

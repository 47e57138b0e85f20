"""Scheduler.Generate (assign, send both legs, stream the tokens, release) and Scheduler.Reroute
(a decode engine asks for its transfer's prefill leg on another engine): the RPCs that drive the
engines' HTTP legs themselves (``generate``)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import grpc

from kvpush.services.common import limits
from kvpush.services.common.security import claim_problem, peer_identity
from kvpush.services.scheduler import convert
from kvpush.services.scheduler.errors import InvalidArgument, NoCapacity, SchedulerError
from kvpush.services.scheduler.generate import AssignmentLost, GenerateParams, LegError, run_legs
from kvpush.services.scheduler.model import AssignmentRecord, Demand, InstanceSpec, Outcome, SampledToken, State
from kvpush.services.scheduler.servicer_core import ServicerCore, handoff_granted
from kvpush.v1 import kvpush_pb2 as pb

_MAX_PROMPT_TOKENS = limits.MAX_PROMPT_TOKENS


class GenerateRpcs(ServicerCore):
    """Generate and Reroute, on the servicer's shared core."""

    async def Reroute(self, request: pb.RerouteRequest, context: grpc.aio.ServicerContext) -> pb.RerouteResponse:
        # mTLS: only a decode engine, in its own name; the registry checks it is the assignment's.
        not_peer = claim_problem(peer_identity(context), request.decode_engine_id, "decode")
        if not_peer is not None:
            self.log.warning("reroute_refused", transfer_id=request.transfer_id[:64], reason=not_peer)
            self.metrics.reroutes.labels("refused").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, not_peer)
        ids = (request.transfer_id, request.decode_engine_id, request.failed_prefill_engine_id)
        if not request.transfer_id or max(len(i) for i in ids) > limits.MAX_ID_CHARS:
            await self._refuse(context, "Reroute", grpc.StatusCode.INVALID_ARGUMENT, "missing or too long ids")
        if not request.prompt_token_ids or len(request.prompt_token_ids) > _MAX_PROMPT_TOKENS:
            await self._refuse(
                context, "Reroute", grpc.StatusCode.INVALID_ARGUMENT, f"prompt must have 1..{_MAX_PROMPT_TOKENS} tokens"
            )
        outside = self._outside_vocab(request.prompt_token_ids)
        if outside is not None:
            await self._refuse(context, "Reroute", grpc.StatusCode.INVALID_ARGUMENT, outside)
        log = self.log.bind(transfer_id=request.transfer_id)
        try:
            rec, moved = self.registry.reroute(
                request.transfer_id,
                request.decode_engine_id,
                request.failed_prefill_engine_id,
                self.config.max_reroutes,
            )
        except SchedulerError as exc:
            self.metrics.reroutes.labels(exc.reason).inc()
            log.warning("reroute_impossible", reason=str(exc), failed=limits.clip(request.reason))
            await self._abort(context, exc)
        prefill_spec = rec.prefill
        if prefill_spec is None:  # not reached: reroute refuses an assignment prefilled on its decode
            await self._refuse(context, "Reroute", grpc.StatusCode.FAILED_PRECONDITION, "no prefill leg")
        prefill_params, _ = convert.leg_params(rec, self.signer)
        if moved:
            params = GenerateParams(
                prompt_token_ids=list(request.prompt_token_ids),
                max_tokens=1,
                temperature=0.0,
                ignore_eos=False,
                seed=None,
            )
            task = asyncio.get_running_loop().create_task(
                self._send_prefill_leg(rec, prefill_spec, params, prefill_params)
            )
            self._prefill_legs.add(task)
            task.add_done_callback(self._prefill_legs.discard)
        self.metrics.reroutes.labels("moved" if moved else "repeated").inc()
        log.info(
            "transfer_rerouted",
            epoch=rec.epoch,
            failed_prefill=request.failed_prefill_engine_id,
            prefill=prefill_spec.engine_id,
            moved=moved,
            reason=limits.clip(request.reason),
        )
        a = convert.assignment_to_pb(rec, self.signer)
        return pb.RerouteResponse(
            epoch=rec.epoch, prefill=a.prefill, decode_kv_transfer_params=a.decode_kv_transfer_params
        )

    async def _send_prefill_leg(
        self, rec: AssignmentRecord, prefill: InstanceSpec, p: GenerateParams, params: dict[str, Any]
    ) -> None:
        """The prefill leg of a rerouted transfer; when it cannot be delivered, decode is told at once."""
        try:
            await self.client.prefill(prefill.http_endpoint, p, params)
        except LegError as exc:
            self.leg_failed(rec, prefill.engine_id, f"rerouted prefill leg: {exc.message}")

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        t0 = time.perf_counter()
        if self._generating >= self.config.max_generate:
            self.metrics.generate.labels("rejected").inc()
            await self._refuse(
                context,
                "Generate",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_generate} Generate calls are in flight already",
            )
        self._generating += 1
        self._begin()
        try:
            async for msg in self._generate(request, context, t0):
                yield msg
        finally:
            self._generating -= 1
            self._end()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, t0: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if not request.prompt_token_ids:
                raise InvalidArgument("prompt_token_ids must not be empty")
            if len(request.prompt_token_ids) > _MAX_PROMPT_TOKENS:
                raise InvalidArgument(f"prompt has more than {_MAX_PROMPT_TOKENS} tokens")
            if request.max_tokens < 1:
                raise InvalidArgument("max_tokens must be >= 1")
            if request.max_tokens > limits.MAX_MAX_TOKENS or len(request.request_id) > limits.MAX_ID_CHARS:
                bound = f"max_tokens above {limits.MAX_MAX_TOKENS} or request_id above {limits.MAX_ID_CHARS} characters"
                self.log.warning("request_refused", method="Generate", code="INVALID_ARGUMENT", reason=bound)
                raise InvalidArgument(bound)
            if not 0.0 <= request.temperature < math.inf:
                # NaN and infinity too: the leg's JSON would carry them as NaN / Infinity.
                raise InvalidArgument("temperature must be finite and >= 0")
            outside = self._outside_vocab(request.prompt_token_ids)
            if outside is not None:
                self.log.warning("request_refused", method="Generate", code="INVALID_ARGUMENT", reason=outside)
                raise InvalidArgument(outside)
            # Generate sends the legs itself, so its decode may prefill the request (local prefill).
            demand = Demand(len(request.prompt_token_ids), request.max_tokens, local_ok=True)
            rec = await self._admit(demand, "", context.time_remaining())
            rec.held = True  # released below, whatever happens
            # The first token is prefill's: streamed the moment it is sampled, decode continues.
            rec.first_token = handoff_granted(rec, request.max_tokens >= 2)
        except SchedulerError as exc:
            if isinstance(exc, NoCapacity):
                self.metrics.rejections.labels(exc.reason).inc()
            self.metrics.generate.labels("rejected").inc()
            await self._abort(context, exc)
        self._decided(rec)
        log = self.log.bind(transfer_id=rec.transfer_id, request_id=request.request_id)
        prefill_engine_id = rec.prefill.engine_id if rec.prefill is not None else ""
        log.info("generate_started", decode=rec.decode.engine_id, prefill=prefill_engine_id, epoch=rec.epoch)
        params = GenerateParams(
            prompt_token_ids=list(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            ignore_eos=request.ignore_eos,
            seed=request.seed if request.seed else None,
            request_id=request.request_id,
        )
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._lost[rec.transfer_id] = lost
        first_token: asyncio.Future[SampledToken] | None = None
        if rec.first_token:
            first_token = self._first_tokens.wait_for(rec)
        outcome, reason, tokens = Outcome.FAILED, "", 0
        status: tuple[grpc.StatusCode, str] | None = None
        first = True
        t_legs = t_first = time.perf_counter()
        phase = self.metrics.generate_phase
        phase.labels("assign").observe(t_legs - t0)
        try:
            async for chunk in run_legs(
                self.client,
                rec,
                params,
                lost,
                self.signer,
                on_prefill_failed=partial(self.leg_failed, rec),
                first_token=first_token,
                lost_stall_s=self.config.decode_stall_s,
            ):
                msg = pb.GenerateResponse(
                    transfer_id=rec.transfer_id,
                    token_ids=chunk.token_ids,
                    finished=bool(chunk.finish_reason),
                    finish_reason=chunk.finish_reason,
                    decode_engine_id=rec.decode.engine_id,
                    prefill_engine_id=prefill_engine_id,
                )
                if chunk.token_ids and tokens <= 1:
                    now = time.perf_counter()
                    if tokens == 0:
                        t_first = now
                        phase.labels("first_token").observe(now - t_legs)
                        if len(chunk.token_ids) > 1:  # both in one message (they queued up)
                            phase.labels("second_token").observe(0.0)
                    else:
                        phase.labels("second_token").observe(now - t_first)
                if first and chunk.token_ids:
                    first = False
                    msg.ttft_seconds = time.perf_counter() - t0
                    self.metrics.ttft.observe(msg.ttft_seconds)
                tokens += len(chunk.token_ids)
                yield msg
            outcome = Outcome.OK
        except (asyncio.CancelledError, GeneratorExit):
            outcome, reason = Outcome.CANCELLED, "client cancelled"
            raise
        except LegError as exc:
            reason = str(exc)
            log.warning("generate_leg_failed", leg=exc.leg, reason=reason)
            code = grpc.StatusCode.UNAVAILABLE if exc.unavailable else grpc.StatusCode.INTERNAL
            status = (code, reason)
            if exc.leg == "decode":
                self.decode_leg_failed(rec, reason)  # prefill frees its KV now, not at its lease
        except AssignmentLost as exc:
            reason = str(exc)
            status = (grpc.StatusCode.UNAVAILABLE, f"assignment lost: {reason}")
        finally:
            self._lost.pop(rec.transfer_id, None)
            if first_token is not None:
                self._first_tokens.forget(rec.transfer_id, first_token)
            self.metrics.generate.labels(outcome.value).inc()
            if rec.state is State.OPEN:
                self.registry.release(rec.transfer_id, rec.epoch, outcome, reason)
                self.metrics.releases.labels(outcome.value).inc()
            log.info(
                "generate_finished",
                outcome=outcome.value,
                tokens=tokens,
                seconds=round(time.perf_counter() - t0, 6),
                reason=reason,
            )
        if status is not None:
            # Only now, with the assignment released: a caller that sees the status sees it closed.
            await context.abort(*status)

"""Retry elsewhere, decode side: asks the scheduler to move a failed transfer's prefill leg to
another prefill engine (``Scheduler.Reroute``) and checks the decode leg it answers with, exactly as
the connector checks a request's own leg (well formed, for this engine, signed and not expired)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import json_format

from kvpush.services.common.grpc_util import CHANNEL_OPTIONS
from kvpush.services.common.leg_signing import LegRefused, LegVerifier, check_leg
from kvpush.services.common.security import Security
from kvpush.services.common.transfer_params import DecodeLeg, LegError, parse
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc


class RerouteRefused(Exception):
    """No other prefill takes the transfer (or the answer could not be trusted)."""


@dataclass(frozen=True)
class RerouteAsk:
    transfer_id: str
    failed_prefill_engine_id: str
    reason: str
    prompt_token_ids: Sequence[int]


class Rerouter:
    """One per decode engine; used from the decode agent's event loop only."""

    def __init__(
        self,
        scheduler_address: str,
        engine_id: str,
        security: Security,
        verifier: LegVerifier | None,
        rpc_timeout_s: float = 5.0,
    ) -> None:
        self.scheduler_address = scheduler_address
        self.engine_id = engine_id
        self.security = security
        self.verifier = verifier
        self.rpc_timeout_s = rpc_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerStub | None = None

    async def reroute(self, ask: RerouteAsk) -> DecodeLeg:
        if self._stub is None:
            self._channel = self.security.aio_channel(self.scheduler_address, CHANNEL_OPTIONS)
            self._stub = pb_grpc.SchedulerStub(self._channel)
        request = pb.RerouteRequest(
            transfer_id=ask.transfer_id,
            decode_engine_id=self.engine_id,
            failed_prefill_engine_id=ask.failed_prefill_engine_id,
            reason=ask.reason[:500],
            prompt_token_ids=list(ask.prompt_token_ids),
        )
        try:
            resp = await self._stub.Reroute(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise RerouteRefused(f"{exc.code().name}: {exc.details()}") from None
        try:
            leg = parse(json_format.MessageToDict(resp.decode_kv_transfer_params))
            if not isinstance(leg, DecodeLeg) or leg.transfer_id != ask.transfer_id:
                raise RerouteRefused("the scheduler answered with a leg for another transfer or role")
            check_leg(leg, self.engine_id, "decode", self.verifier)
        except (LegError, LegRefused) as exc:
            raise RerouteRefused(f"the scheduler's new leg was refused: {exc}") from None
        if leg.prefill_engine_id == ask.failed_prefill_engine_id:
            raise RerouteRefused("the scheduler named the failed prefill engine again")
        return leg

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

"""The soak's fleet-rate frontend: requests through one ``AssignStream`` whose batches ask for first
tokens (docs/first_token.md, "Custom frontends"), as a frontend at fleet rates sends them.

Each request: an assign asking for the hand-off (compact answer, legs as JSON text), both legs at
once (the prefill leg first; the decode leg for one token less), ``ReportLegFailure`` when the
prefill leg is not delivered, the first token from the stream, or from the prefill leg's answer
where the stream cannot give it (it broke: the scheduler restarted), then the Release on the
stream (unary when the stream is gone). A broken stream is replaced by a new one for the next
request. Every request runs within its deadline (``TimeoutError`` past it)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc

from kvpush.services.common.aio_thread import LoopThread
from kvpush.services.common.vllm_server import VllmServerError, complete
from kvpush.services.scheduler.assign_client import AssignError, AssignStreamClient
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from scripts.cluster.pd import PDCluster

# Where the stream cannot give the first token, the prefill leg's answer does.
CANNOT_ANSWER = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,
)


class StreamFrontend:
    """One stream shared by every thread that calls ``request``, on a loop thread of its own."""

    def __init__(self, c: PDCluster) -> None:
        self.c = c
        self.loop = LoopThread("soak-stream-frontend")
        self.loop.start()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerStub | None = None
        self._client: AssignStreamClient | None = None
        self._opening = asyncio.Lock()
        self.streams_opened = 0
        self.streamed_tokens = 0  # first tokens taken from the stream
        self.answered_tokens = 0  # first tokens taken from the prefill leg's answer (the stream could not)

    def request(self, prompt: list[int], max_tokens: int, deadline_s: float) -> list[int]:
        """The request's tokens; raises AssignError, grpc.RpcError, VllmServerError, OSError, or
        TimeoutError past ``deadline_s``."""
        return self.loop.run(asyncio.wait_for(self._request(prompt, max_tokens, deadline_s), deadline_s), None)

    def counts(self) -> dict[str, int]:
        return {
            "streams_opened": self.streams_opened,
            "first_tokens_from_the_stream": self.streamed_tokens,
            "first_tokens_from_the_prefill_answer": self.answered_tokens,
        }

    def close(self) -> None:
        async def close() -> None:
            if self._client is not None:
                await self._client.close()
            if self._channel is not None:
                await self._channel.close()

        with contextlib.suppress(Exception):
            self.loop.run(close(), 10)
        self.loop.stop()

    async def _stream(self) -> tuple[AssignStreamClient, pb_grpc.SchedulerStub]:
        async with self._opening:  # one replacement for a broken stream, however many requests saw it
            return await self._open_stream()

    async def _open_stream(self) -> tuple[AssignStreamClient, pb_grpc.SchedulerStub]:
        if self._client is None or self._client.error is not None:
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.close(timeout_s=0)
            if self._channel is None:
                self._channel = self.c.scheduler.security().aio_channel(self.c.scheduler.address)
                self._stub = pb_grpc.SchedulerStub(self._channel)
            assert self._stub is not None
            self._client = await AssignStreamClient(self._stub, compact=True, first_tokens=True).start()
            self.streams_opened += 1
        assert self._stub is not None
        return self._client, self._stub

    async def _request(self, prompt: list[int], max_tokens: int, deadline_s: float) -> list[int]:
        client, stub = await self._stream()
        req = pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=max_tokens, first_token_from_prefill=True)
        a = await client.assign_compact(req)
        handoff = a.first_token_from_prefill
        outcome = pb.OUTCOME_FAILED
        first_token = asyncio.ensure_future(client.first_token(a.transfer_id)) if handoff else None
        prefill_params = json.loads(a.prefill_kv_transfer_params_json)
        decode_params = json.loads(a.decode_kv_transfer_params_json)
        # The prefill leg goes first (the first token is its), then the decode leg.
        prefill = asyncio.ensure_future(
            asyncio.to_thread(complete, a.prefill_http_endpoint, prompt, 1, prefill_params, timeout=deadline_s)
        )
        n = max_tokens - 1 if handoff else max_tokens
        decode = asyncio.ensure_future(
            asyncio.to_thread(complete, a.decode_http_endpoint, prompt, n, decode_params, timeout=deadline_s)
        )
        try:
            answered: list[int] = []
            try:
                answered = (await prefill)[0]
            except (VllmServerError, OSError) as exc:
                failure = pb.LegFailure(
                    transfer_id=a.transfer_id, prefill_engine_id=a.prefill_engine_id, reason=str(exc)[:200]
                )
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.ReportLegFailure(failure, timeout=10)
            rest = (await decode)[0]
            first: list[int] = []
            if first_token is not None:
                try:
                    first = [(await first_token).token_id]
                    self.streamed_tokens += 1
                except AssignError as exc:
                    if exc.code not in CANNOT_ANSWER or not answered:
                        raise
                    first = answered
                    self.answered_tokens += 1
            outcome = pb.OUTCOME_OK
            return first + rest
        finally:
            for task in (first_token, prefill, decode):
                if task is not None and not task.done():
                    task.cancel()
            if client.error is None:
                client.release(a.transfer_id, a.epoch, outcome)
            else:
                release = pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=outcome)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Release(release, timeout=10)

"""The first-token hand-off at fleet rates (``python -m benchmarks.scheduler --handoff-rates``).

Each arrival is a request as a custom frontend sends it with the hand-off (docs/first_token.md):
an assign asking for it through ``AssignStreamClient``, then the request's first token, either on
the same stream (``AssignStreamClient(first_tokens=True)``) or by one unary ``AwaitFirstToken``
call per request, then its Release on the stream. The fake prefill engines sample each token
``prefill_ms`` after its assign was answered and report what they sampled as a prefill engine does:
one ``ReportFirstTokens`` with every token sampled since its last report, one report in flight per
engine, over the engine's own mTLS identity.

Measured per request: the assign's latency from its scheduled arrival, and the token's delivery
latency from the moment prefill sampled it to the moment the frontend has it (what the hand-off
adds to time to first token beyond prefill's own work)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from kvpush.services.scheduler.assign_client import AssignError, AssignStreamClient
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc


class PrefillReporters:
    """The fake prefill engines' first-token reports: per engine, everything sampled since its last
    report leaves in its next one, with at most one report in flight."""

    def __init__(self, stubs: dict[str, pb_grpc.SchedulerStub]) -> None:
        self.stubs = stubs
        self.queued: dict[str, list[pb.FirstToken]] = {name: [] for name in stubs}
        self.wake = {name: asyncio.Event() for name in stubs}
        self.reports = 0
        self.errors = 0
        self._tasks = [asyncio.create_task(self._report_loop(name)) for name in stubs]

    def sampled(self, prefill: str, decode: str, transfer_id: str) -> None:
        self.queued[prefill].append(pb.FirstToken(transfer_id=transfer_id, decode_engine_id=decode, token_id=7))
        self.wake[prefill].set()

    async def _report_loop(self, name: str) -> None:
        stub, wake = self.stubs[name], self.wake[name]
        while True:
            await wake.wait()
            wake.clear()
            tokens, self.queued[name] = self.queued[name], []
            if not tokens:
                continue
            report = pb.FirstTokenReport(engine_id=name, incarnation="bench", first_tokens=tokens)
            try:
                await stub.ReportFirstTokens(report, timeout=5)
                self.reports += 1
            except grpc.aio.AioRpcError:
                self.errors += 1

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class HandoffPhase:
    """One open-loop phase of hand-off requests over ``clients`` (one stream each; made with
    ``first_tokens=True`` when the tokens come on the stream, ``via="stream"``)."""

    def __init__(
        self,
        clients: list[AssignStreamClient],
        stubs: list[pb_grpc.SchedulerStub],
        reporters: PrefillReporters,
        via: str,
        prefill_ms: float,
    ) -> None:
        if via not in ("stream", "unary"):
            raise ValueError("via must be 'stream' or 'unary'")
        self.clients, self.stubs, self.reporters = clients, stubs, reporters
        self.via, self.prefill_s = via, prefill_ms / 1000
        self.assign_lat: list[float] = []
        self.token_lat: list[float] = []
        self.errors = 0
        self._n = 0

    async def one(self, arrival: float) -> None:
        self._n += 1
        client = self.clients[self._n % len(self.clients)]
        request = pb.AssignRequest(prompt_tokens=512, max_tokens=128, first_token_from_prefill=True)
        try:
            a = await client.assign_compact(request)
        except AssignError:
            self.errors += 1
            return
        self.assign_lat.append(time.perf_counter() - arrival)
        sampled_at: list[float] = []

        def sample() -> None:
            sampled_at.append(time.perf_counter())
            self.reporters.sampled(a.prefill_engine_id, a.decode_engine_id, a.transfer_id)

        asyncio.get_running_loop().call_later(self.prefill_s, sample)
        try:
            if self.via == "stream":
                token = await client.first_token(a.transfer_id)
            else:
                stub = self.stubs[self._n % len(self.stubs)]
                req = pb.AwaitFirstTokenRequest(transfer_id=a.transfer_id, epoch=a.epoch)
                token = await stub.AwaitFirstToken(req, timeout=5)
        except (AssignError, grpc.aio.AioRpcError):
            self.errors += 1
            client.release(a.transfer_id, a.epoch, pb.OUTCOME_FAILED)
            return
        if token.token_id != 7 or token.prefill_engine_id != a.prefill_engine_id:
            raise RuntimeError(f"wrong first token for {a.transfer_id}: {token}")
        self.token_lat.append(time.perf_counter() - sampled_at[0])
        client.release(a.transfer_id, a.epoch, pb.OUTCOME_OK)

    async def open_loop(self, rate: float, seconds: float) -> dict[str, Any]:
        from benchmarks.scheduler import _pct, _summary

        tasks: set[asyncio.Task[None]] = set()
        n = int(rate * seconds)
        batches0 = sum(c.batches for c in self.clients)
        reports0 = self.reporters.reports
        start = time.perf_counter()
        i = 0
        while i < n:
            due = min(n, int((time.perf_counter() - start) * rate) + 1)
            while i < due:
                t = asyncio.create_task(self.one(start + i / rate))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        await asyncio.gather(*tasks)
        res = _summary(
            f"hand-off: AssignStream + first token {'on the stream' if self.via == 'stream' else 'by AwaitFirstToken'}",
            self.assign_lat,
            self.errors,
            time.perf_counter() - start,
            rate,
        )
        lat = sorted(self.token_lat)
        res["first_token_p50_ms"] = _pct(lat, 0.5) * 1e3
        res["first_token_p99_ms"] = _pct(lat, 0.99) * 1e3
        res["first_tokens"] = len(lat)
        res["batches"] = sum(c.batches for c in self.clients) - batches0
        res["prefill_reports"] = self.reporters.reports - reports0
        res["prefill_ms"] = self.prefill_s * 1e3
        return res

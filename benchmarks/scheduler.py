"""Scheduler benchmark: Assign latency and throughput over real gRPC.

Starts ``kvpush-scheduler`` as a subprocess on 127.0.0.1, registers fake decode and prefill
instances that keep load streams open, then measures from many concurrent clients:

* open loop: Assign at a fixed offered rate (default 1,000 req/s), with the Releases sent after the
  phase, then again with each Release right after its Assign, and at half the rate;
* closed loop: N workers doing Assign+Release back to back (maximum throughput), with the CPU each
  side spends per pair, then the same against a servicer without any logic (the gRPC floor);
* AssignStream (``--stream-rates``): the same open loop through one ``AssignStreamClient`` per
  channel (each Assign and its Release coalesced with the others in flight; legs MACed per engine,
  or with ``--legs sign`` signed once per batch), at each rate, then a closed loop of ``--stream-workers`` callers for the maximum;
* the first-token hand-off (``--handoff-rates``): each request an assign asking for the hand-off, its
  first token reported by a fake prefill ``--prefill-ms`` later and delivered on the stream or by
  one ``AwaitFirstToken`` call per request (``--handoff-via``), then its Release
  (benchmarks/scheduler_handoff.py).

Latency is the client-observed Assign round trip; in the AssignStream open loop it counts from each
arrival's scheduled time, so a client that falls behind its schedule shows in it. Prints a markdown table and writes JSON to
bench-results/scheduler.json. Usage: ``python -m benchmarks.scheduler [--rate 1000 --seconds 10]``;
only the streamed phases: ``--unary 0 --stream-rates 5000``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.calibration import cpu_calibration_ms
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _summary(name: str, lat: list[float], errors: int, seconds: float, offered: float | None) -> dict[str, Any]:
    lat = sorted(lat)
    return {
        "phase": name,
        "offered_rps": offered,
        "completed": len(lat),
        "errors": errors,
        "achieved_rps": len(lat) / seconds if seconds else 0.0,
        "p50_ms": _pct(lat, 0.50) * 1e3,
        "p90_ms": _pct(lat, 0.90) * 1e3,
        "p99_ms": _pct(lat, 0.99) * 1e3,
        "p999_ms": _pct(lat, 0.999) * 1e3,
        "max_ms": (lat[-1] if lat else float("nan")) * 1e3,
    }


def _instance_names(decodes: int, prefills: int) -> list[tuple[str, str]]:
    """(role, engine id) of the fake instances: d0.. then p<decodes>.."""
    return [("decode", f"d{i}") if i < decodes else ("prefill", f"p{i}") for i in range(decodes + prefills)]


def _security(certs: Path, name: str) -> Any:
    from kvpush.services.common.security import Security, TlsFiles

    return Security.mtls(TlsFiles.in_dir(certs, name))


class Bench:
    """Clients hold the frontend certificate; each fake instance registers with its own (mTLS, as
    deployed)."""

    def __init__(self, address: str, channels: int, certs: Path) -> None:
        self.address, self.certs = address, certs
        frontend = _security(certs, "frontend")
        self.channels = [frontend.aio_channel(address) for _ in range(channels)]
        self.stubs = [pb_grpc.SchedulerStub(c) for c in self.channels]
        self._n = 0
        self._streams: list[Any] = []
        self._stop = asyncio.Event()
        self.clients: list[Any] = []  # AssignStreamClient, one per stream
        self.prefill_stubs: dict[str, pb_grpc.SchedulerStub] = {}  # each over its engine's identity

    def stub(self) -> pb_grpc.SchedulerStub:
        self._n += 1
        return self.stubs[self._n % len(self.stubs)]

    async def register(
        self, decodes: int, prefills: int, http_endpoint: str = "http://127.0.0.1:1", handoff: bool = False
    ) -> None:
        """``http_endpoint``: the OpenAI server every fake instance names (none answers by default);
        ``handoff``: the decodes take the first-token hand-off (then a ``Generate`` through them
        waits for a token the fake prefills never report)."""
        for i, (_, name) in enumerate(_instance_names(decodes, prefills)):
            role = pb.ROLE_DECODE if i < decodes else pb.ROLE_PREFILL
            self.channels.append(_security(self.certs, name).aio_channel(self.address))
            stub = pb_grpc.SchedulerStub(self.channels[-1])
            info = pb.InstanceInfo(
                engine_id=name,
                role=role,
                incarnation="bench",
                tp_size=2,
                agent_endpoints=["127.0.0.1:1", "127.0.0.1:2"],
                total_kv_blocks=4_000_000,
                tokens_per_block=16,
                http_endpoint=http_endpoint,
                first_token_handoff=handoff and role == pb.ROLE_DECODE,
            )
            if role == pb.ROLE_PREFILL:
                self.prefill_stubs[name] = stub
            resp = await stub.Register(pb.RegisterRequest(instance=info), timeout=5)
            interval = resp.lease_interval_ms / 1000 / 2

            async def reports(name: str = name, interval: float = interval) -> Any:
                while not self._stop.is_set():
                    yield pb.LoadReport(engine_id=name, incarnation="bench", free_blocks=4_000_000)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), interval)
                # Goodbye (draining, then half-close): a clean deregistration.
                yield pb.LoadReport(engine_id=name, incarnation="bench", free_blocks=4_000_000, draining=True)

            call = stub.ReportLoad(reports())
            self._streams.append(call)
            self._streams.append(asyncio.create_task(self._drain(call)))

    @staticmethod
    async def _drain(call: Any) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for _ in call:
                pass

    async def one(self, lat: list[float], errs: list[int], later: list[pb.Assignment] | None = None) -> None:
        """One Assign (timed), then its Release now, or later when ``later`` collects it."""
        stub = self.stub()
        t0 = time.perf_counter()
        try:
            a = await stub.Assign(pb.AssignRequest(prompt_tokens=512, max_tokens=128), timeout=5)
        except grpc.aio.AioRpcError:
            errs[0] += 1
            return
        lat.append(time.perf_counter() - t0)
        if later is not None:
            later.append(a)
            return
        try:
            await stub.Release(
                pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=5
            )
        except grpc.aio.AioRpcError:
            errs[0] += 1

    async def open_loop(self, rate: float, seconds: float, release: str) -> dict[str, Any]:
        """``release``: "inline" (each Assign's task releases it right after) or "after" (all
        assignments are released once the timed phase is over)."""
        lat: list[float] = []
        errs = [0]
        later: list[pb.Assignment] | None = [] if release == "after" else None
        tasks: set[asyncio.Task[None]] = set()
        n = int(rate * seconds)
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.create_task(self.one(lat, errs, later))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        # Achieved: completions over the time until the last one (a backlog stretches it).
        res = _summary(f"open loop, release {release}", lat, errs[0], time.perf_counter() - start, rate)
        for k in range(0, len(later or []), 200):
            await asyncio.gather(
                *(
                    self.stub().Release(
                        pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=10
                    )
                    for a in (later or [])[k : k + 200]
                )
            )
        return res

    async def closed_loop(self, workers: int, seconds: float) -> dict[str, Any]:
        lat: list[float] = []
        errs = [0]
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                await self.one(lat, errs)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workers)))
        res = _summary(f"closed loop, {workers} workers", lat, errs[0], time.perf_counter() - start, None)
        return res

    async def open_streams(
        self,
        streams: int,
        max_batch: int,
        in_flight: int,
        compact: bool = True,
        release_delay_ms: float = 0.0,
        first_tokens: bool = False,
    ) -> None:
        from kvpush.services.scheduler.assign_client import AssignStreamClient

        self.clients = [
            await AssignStreamClient(
                self.stubs[i % len(self.stubs)],
                max_batch=max_batch,
                max_in_flight=in_flight,
                compact=compact,
                release_delay_ms=release_delay_ms,
                first_tokens=first_tokens,
            ).start()
            for i in range(streams)
        ]

    async def close_streams(self) -> None:
        for c in self.clients:
            await c.close()
        self.clients = []

    async def streamed(
        self, lat: list[float], errs: list[int], arrival: float | None = None, lags: list[float] | None = None
    ) -> None:
        """One Assign through a stream client (timed from ``arrival``, its scheduled arrival in an
        open loop, so a late start counts too; else from now), then its Release queued on the same
        stream."""
        from kvpush.services.scheduler.assign_client import AssignError

        self._n += 1
        client = self.clients[self._n % len(self.clients)]
        t0 = time.perf_counter() if arrival is None else arrival
        if lags is not None:
            lags.append(time.perf_counter() - t0)
        request = pb.AssignRequest(prompt_tokens=512, max_tokens=128)
        try:
            a = await (client.assign_compact(request) if client.compact else client.assign(request))
        except AssignError:
            errs[0] += 1
            return
        lat.append(time.perf_counter() - t0)
        _leg_bodies(a)
        client.release(a.transfer_id, a.epoch, pb.OUTCOME_OK)

    async def stream_open_loop(self, rate: float, seconds: float) -> dict[str, Any]:
        lat: list[float] = []
        lags: list[float] = []
        errs = [0]
        tasks: set[asyncio.Task[None]] = set()
        n = int(rate * seconds)
        batches0 = sum(c.batches for c in self.clients)
        start = time.perf_counter()
        i = 0
        while i < n:
            now = time.perf_counter()
            # Every arrival due by now starts now (the loop wakes about every 0.2 ms).
            due = min(n, int((now - start) * rate) + 1)
            while i < due:
                t = asyncio.create_task(self.streamed(lat, errs, start + i / rate, lags))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        await asyncio.gather(*tasks)
        res = _summary("AssignStream open loop, release inline", lat, errs[0], time.perf_counter() - start, rate)
        res["batches"] = sum(c.batches for c in self.clients) - batches0
        lags.sort()
        res["arrival_lag_p50_ms"], res["arrival_lag_p99_ms"] = _pct(lags, 0.5) * 1e3, _pct(lags, 0.99) * 1e3
        return res

    async def stream_closed_loop(self, workers: int, seconds: float) -> dict[str, Any]:
        lat: list[float] = []
        errs = [0]
        end = time.perf_counter() + seconds
        batches0 = sum(c.batches for c in self.clients)

        async def worker() -> None:
            while time.perf_counter() < end:
                await self.streamed(lat, errs)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workers)))
        res = _summary(f"AssignStream closed loop, {workers} callers", lat, errs[0], time.perf_counter() - start, None)
        res["batches"] = sum(c.batches for c in self.clients) - batches0
        return res

    async def close(self) -> None:
        self._stop.set()
        for s in self._streams:
            if isinstance(s, asyncio.Task):
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(s, 2)
        for c in self.channels:
            await c.close()


async def _wait_serving(address: str, proc: subprocess.Popen[bytes], certs: Path, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    async with _security(certs, "frontend").aio_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"scheduler exited with {proc.returncode}")
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > end:
                raise RuntimeError("scheduler did not become ready")
            await asyncio.sleep(0.1)


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _leg_bodies(a: pb.Assignment | pb.CompactAssignment) -> tuple[str, str]:
    """What a frontend does with an assignment before it sends the legs: their kv_transfer_params
    as JSON in each HTTP body (the prompt left out; it costs the same either way). From a full
    answer: Struct to dict to JSON; from a compact one: the legs' JSON text spliced in."""
    if isinstance(a, pb.CompactAssignment):
        return (
            '{"kv_transfer_params":' + a.prefill_kv_transfer_params_json + "}",
            '{"kv_transfer_params":' + a.decode_kv_transfer_params_json + "}",
        )
    return (
        json.dumps({"kv_transfer_params": MessageToDict(a.prefill_kv_transfer_params)}),
        json.dumps({"kv_transfer_params": MessageToDict(a.decode_kv_transfer_params)}),
    )


class _EchoScheduler(pb_grpc.SchedulerServicer):
    """The gRPC floor: same service and messages, no scheduling logic."""

    def __init__(self) -> None:
        self._n = 0
        self._reply = pb.Assignment(epoch=1)

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        return pb.RegisterResponse(lease_interval_ms=1000, lease_misses=10)

    async def ReportLoad(self, request_iterator: Any, context: Any) -> Any:
        async for _ in request_iterator:
            yield pb.LoadAck()

    async def Assign(self, request: pb.AssignRequest, context: Any) -> pb.Assignment:
        self._n += 1
        return pb.Assignment(transfer_id=str(self._n), epoch=1)

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        return pb.ReleaseResponse()

    async def AssignStream(self, request_iterator: Any, context: Any) -> Any:
        """One answer per batch, one empty OK result per item: the stream's own cost."""
        async for batch in request_iterator:
            resp = pb.AssignStreamResponse(batch_id=batch.batch_id)
            for _ in batch.assigns:
                self._n += 1
                result = resp.assigns.add()
                (result.compact if batch.compact else result.assignment).transfer_id = str(self._n)
            for _ in batch.releases:
                resp.releases.add()
            yield resp


async def _serve_echo(address: str, certs: Path) -> None:
    """The same transport as the scheduler (mTLS), no logic and no per-method authorization."""
    from kvpush.services.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection

    server = grpc.aio.server(options=SERVER_OPTIONS, migration_thread_pool=ThreadPoolExecutor(2))
    pb_grpc.add_SchedulerServicer_to_server(_EchoScheduler(), server)
    add_health_and_reflection(server, ["Scheduler"])
    _security(certs, "scheduler").add_port(server, address)
    await server.start()
    await server.wait_for_termination()


async def _closed_loop_cpu(bench: Bench, pid: int, workers: int, seconds: float) -> dict[str, Any]:
    return await _with_cpu(bench.closed_loop(workers, seconds), pid)


async def _with_cpu(phase: Any, pid: int) -> dict[str, Any]:
    """The phase's result with the CPU each side spent per Assign+Release pair."""
    s0, c0 = _proc_cpu_s(pid), _self_cpu_s()
    res: dict[str, Any] = await phase
    n = max(1, res["completed"])
    res["server_cpu_us_per_pair"] = (_proc_cpu_s(pid) - s0) / n * 1e6
    res["client_cpu_us_per_pair"] = (_self_cpu_s() - c0) / n * 1e6
    return res


async def _handoff_phases(
    bench: Bench, args: argparse.Namespace, via: str, pid: int, metrics_port: int
) -> list[dict[str, Any]]:
    """The hand-off open loop at each of ``--handoff-rates``, the tokens delivered ``via``."""
    from benchmarks.scheduler_handoff import HandoffPhase, PrefillReporters

    await bench.open_streams(
        args.streams, args.max_batch, args.max_in_flight, True, args.release_delay_ms, first_tokens=via == "stream"
    )
    reporters = PrefillReporters(bench.prefill_stubs)

    def phase() -> HandoffPhase:
        return HandoffPhase(bench.clients, bench.stubs, reporters, via, args.prefill_ms)

    rates = [float(r) for r in args.handoff_rates.split(",") if r]
    await phase().open_loop(min(rates), 1.0)  # warm-up
    results = []
    for rate in rates:
        gc_before = _gc_pauses(metrics_port)
        results.append(await _with_cpu(phase().open_loop(rate, args.seconds), pid))
        results[-1]["server_gc"] = _gc_delta(gc_before, _gc_pauses(metrics_port))
        results[-1]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    await reporters.close()
    await bench.close_streams()
    return results


def _cpus(spec: str) -> set[int]:
    """'0', '0,2' or '0-3' as a CPU set; '' for none."""
    cpus: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _start(argv: list[str], cpus: str = "") -> subprocess.Popen[bytes]:
    # This checkout first, then whatever the caller set (a checkout's own import path for kvpush).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    if cpus:
        os.sched_setaffinity(proc.pid, _cpus(cpus))  # before it serves; its threads inherit it
    return proc


def scheduler_argv(address: str, metrics_port: int, certs: Path, leg_flags: list[str]) -> list[str]:
    """``kvpush-scheduler`` as a benchmark runs it: as deployed (mTLS with the certificates in
    ``certs``, ``leg_flags``' legs), but for leases and the readiness probe."""
    from kvpush.services.common.security import TlsFiles

    tls = TlsFiles.in_dir(certs, "scheduler")
    return [
        "-m",
        "kvpush.services.scheduler.main",
        "--listen",
        address,
        "--metrics-port",
        str(metrics_port),
        "--metrics-addr",
        "127.0.0.1",
        # Leases long enough that a saturated client process cannot starve its own load streams.
        "--lease-interval-ms",
        "1000",
        "--lease-misses",
        "10",
        "--log-level",
        "WARNING",
        # The fake instances have no OpenAI server to probe (or theirs is up before the scheduler).
        "--readiness-probe",
        "0",
        *leg_flags,
        "--tls-ca",
        tls.ca_file,
        "--tls-cert",
        tls.cert_file,
        "--tls-key",
        tls.key_file,
    ]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvpush.services.common.leg_macs import write_master
    from kvpush.services.common.leg_signing import write_keypair
    from scripts.make_certs import make_certs

    port, metrics_port = _free_port(), _free_port()
    address = f"127.0.0.1:{port}"
    # Measured as deployed: every leg MACed for its engine (--legs mac) or signed (Ed25519, --legs
    # sign), with a throwaway key.
    keys = tempfile.TemporaryDirectory(prefix="kvpush-bench-leg-keys-")
    if args.legs == "mac":
        leg_flags = ["--leg-mac-key", str(write_master(keys.name))]
    else:
        leg_flags = ["--leg-signing-key", str(write_keypair(keys.name)[0])]
    # And with mTLS on every call: a throwaway CA, the scheduler's, a frontend's and each instance's certificate.
    pki = tempfile.TemporaryDirectory(prefix="kvpush-bench-certs-")
    certs = make_certs(pki.name, engines=[f"{r}/{n}" for r, n in _instance_names(args.decodes, args.prefills)])
    proc = _start(scheduler_argv(address, metrics_port, certs, leg_flags), args.server_cpus)
    try:
        await _wait_serving(address, proc, certs)
        bench = Bench(address, args.channels, certs)
        await bench.register(args.decodes, args.prefills, handoff=bool(args.handoff_rates))
        await bench.open_loop(min(args.rate, 500), 1.0, "inline")  # warm-up
        load_before = os.getloadavg()
        calibration_before = cpu_calibration_ms()
        results = []
        for rate, release in ((args.rate, "after"), (args.rate, "inline"), (args.rate / 2, "inline")):
            if not args.unary:
                break
            before = _server_histogram(metrics_port)
            results.append(await _with_cpu(bench.open_loop(rate, args.seconds, release), proc.pid))
            results[-1]["server_side"] = _histogram_delta(before, _server_histogram(metrics_port))
            results[-1]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        if args.workers and args.unary:
            before = _server_histogram(metrics_port)
            results.append(await _closed_loop_cpu(bench, proc.pid, args.workers, args.seconds))
            results[-1]["server_side"] = _histogram_delta(before, _server_histogram(metrics_port))
            results[-1]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        stream_rates = [float(r) for r in args.stream_rates.split(",") if r]
        if stream_rates or args.stream_workers:
            await bench.open_streams(
                args.streams, args.max_batch, args.max_in_flight, bool(args.compact), args.release_delay_ms
            )
            await bench.stream_open_loop(min(stream_rates or [1000.0]), 1.0)  # warm-up
            for rate in stream_rates:
                gc_before = _gc_pauses(metrics_port)
                results.append(await _with_cpu(bench.stream_open_loop(rate, args.seconds), proc.pid))
                results[-1]["server_gc"] = _gc_delta(gc_before, _gc_pauses(metrics_port))
                results[-1]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
            if args.stream_workers:
                gc_before = _gc_pauses(metrics_port)
                results.append(await _with_cpu(bench.stream_closed_loop(args.stream_workers, args.seconds), proc.pid))
                results[-1]["server_gc"] = _gc_delta(gc_before, _gc_pauses(metrics_port))
                results[-1]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
            await bench.close_streams()
        for via in [v for v in args.handoff_via.split(",") if v] if args.handoff_rates else []:
            results.extend(await _handoff_phases(bench, args, via, proc.pid, metrics_port))
        await bench.close()
    finally:
        _stop(proc)
        keys.cleanup()
    floors = []
    if args.workers and args.unary:
        floors.append("unary")
    if args.stream_workers:
        floors.append("stream")
    if stream_rates:
        floors.append("stream_open")
    if args.baseline and floors:
        address = f"127.0.0.1:{_free_port()}"
        proc = _start(
            ["-m", "benchmarks.scheduler", "--serve-echo", address, "--echo-certs", str(certs)], args.server_cpus
        )
        try:
            await _wait_serving(address, proc, certs)
            bench = Bench(address, args.channels, certs)
            await bench.register(args.decodes, args.prefills)
            if "unary" in floors:
                await bench.closed_loop(args.workers, 1.0)  # warm-up
                floor = await _closed_loop_cpu(bench, proc.pid, args.workers, args.seconds)
                floor["phase"] = f"gRPC floor (echo servicer), {args.workers} workers"
                floor["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
                results.append(floor)
            if "stream" in floors or "stream_open" in floors:
                await bench.open_streams(
                    args.streams, args.max_batch, args.max_in_flight, bool(args.compact), args.release_delay_ms
                )
            if "stream_open" in floors:
                await bench.stream_open_loop(min(stream_rates), 1.0)  # warm-up
                for rate in stream_rates:
                    floor = await _with_cpu(bench.stream_open_loop(rate, args.seconds), proc.pid)
                    floor["phase"] = "AssignStream gRPC floor (echo servicer), open loop"
                    floor["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
                    results.append(floor)
            if "stream" in floors:
                for workers in sorted({1, args.stream_workers}):
                    await bench.stream_closed_loop(workers, 1.0)  # warm-up
                    floor = await _with_cpu(bench.stream_closed_loop(workers, args.seconds), proc.pid)
                    floor["phase"] = f"AssignStream gRPC floor (echo servicer), {workers} callers"
                    floor["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
                    results.append(floor)
            if "stream" in floors or "stream_open" in floors:
                await bench.close_streams()
            await bench.close()
        finally:
            _stop(proc)
    pki.cleanup()
    return {
        "benchmark": "scheduler Assign",
        "host": host_report(load_before, calibration_before),
        "setup": {
            "decodes": args.decodes,
            "prefills": args.prefills,
            "channels": args.channels,
            "seconds": args.seconds,
            "streams": args.streams,
            "max_batch": args.max_batch,
            "max_in_flight": args.max_in_flight,
            "compact": bool(args.compact),
            "legs": args.legs,
            "release_delay_ms": args.release_delay_ms,
            "handoff_via": args.handoff_via if args.handoff_rates else "",
            "prefill_ms": args.prefill_ms,
            "server_cpus": args.server_cpus or "any",
            "client_cpus": args.client_cpus or "any",
            "note": "client-observed Assign round trip (Releases not timed: 'inline' = sent by the same task "
            "right after its Assign, 'after' = all sent once the phase ends); scheduler in its own process, "
            "clients in this one, same host; CPU per Assign+Release pair from /proc and getrusage; the "
            "gRPC floor is the same load against a servicer without any logic",
        },
        "results": results,
        "goal": {"rate_rps": 1000, "p99_ms": 2.0, "stream_rate_rps": 5000},
    }


def host_report(load_before: tuple[float, float, float], calibration_before: float) -> dict[str, Any]:
    """The machine a run measured: CPUs, load averages and the speed calibration before and now."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load_before[0], 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "cpu_calibration_ms_before": round(calibration_before, 2),
        "cpu_calibration_ms_after": round(cpu_calibration_ms(), 2),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


def _samples(port: int, family: str) -> list[Any]:
    """The samples of one metric family on the scheduler's /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [s for f in text_string_to_metric_families(text) if f.name == family for s in f.samples]


def _server_histogram(port: int) -> dict[float, float]:
    """Cumulative bucket counts of the scheduler's own Assign handling time (seconds)."""
    return {
        float(s.labels["le"]): s.value
        for s in _samples(port, "kvpush_scheduler_assign_seconds")
        if s.name.endswith("_bucket")
    }


def _gc_pauses(port: int) -> dict[str, tuple[float, float]]:
    """The scheduler's garbage-collection pauses so far: generation -> (count, seconds)."""
    count: dict[str, float] = {}
    total: dict[str, float] = {}
    for s in _samples(port, "kvpush_scheduler_gc_pause_seconds"):
        if s.name.endswith("_count"):
            count[s.labels["generation"]] = s.value
        elif s.name.endswith("_sum"):
            total[s.labels["generation"]] = s.value
    return {g: (count.get(g, 0.0), total.get(g, 0.0)) for g in ("0", "1", "2")}


def _gc_delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Collections and their total pause (ms) per generation during one phase."""
    out: dict[str, float] = {}
    for g in ("0", "1", "2"):
        out[f"gen{g}_collections"] = after[g][0] - before[g][0]
        out[f"gen{g}_pause_ms"] = (after[g][1] - before[g][1]) * 1e3
    return out


def _gc_cell(r: dict[str, Any]) -> str:
    gc_ = r.get("server_gc")
    if not gc_:
        return "–"
    young = gc_["gen0_pause_ms"] + gc_["gen1_pause_ms"]
    return f"{gc_['gen2_collections']:.0f} / {gc_['gen2_pause_ms']:.1f} ms; {young:.1f} ms"


def _histogram_delta(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    res = {"assigns": total}
    for le in (0.00025, 0.0005, 0.001, 0.002):
        res[f"share_le_{le * 1e3:g}ms"] = (after[le] - before.get(le, 0.0)) / total if total else float("nan")
    return res


def _share(r: dict[str, Any], key: str) -> str:
    return f"{r['server_side'][key]:.1%}" if "server_side" in r else "–"


def _num(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.0f}" if key in r else "–"


def _first_token_cell(r: dict[str, Any]) -> str:
    if "first_token_p50_ms" not in r:
        return "–"
    return f"{r['first_token_p50_ms']:.3f} / {r['first_token_p99_ms']:.3f}"


def _table(report: dict[str, Any]) -> str:
    rows = [
        "| phase | offered req/s | achieved req/s | completed | errors | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms "
        "| server-side ≤ 0.25 ms | server-side ≤ 1 ms | server CPU µs/pair | client CPU µs/pair | batches "
        "| server GC: full collections / their pause; younger ones' pause | first token p50 / p99 ms "
        "| load avg after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        offered = f"{r['offered_rps']:.0f}" if r["offered_rps"] else "max"
        rows.append(
            f"| {r['phase']} | {offered} | {r['achieved_rps']:.0f} | {r['completed']} | {r['errors']} | "
            f"{r['p50_ms']:.3f} | {r['p90_ms']:.3f} | {r['p99_ms']:.3f} | {r['p999_ms']:.3f} | {r['max_ms']:.3f} | "
            f"{_share(r, 'share_le_0.25ms')} | {_share(r, 'share_le_1ms')} | "
            f"{_num(r, 'server_cpu_us_per_pair')} | {_num(r, 'client_cpu_us_per_pair')} | {_num(r, 'batches')} | "
            f"{_gc_cell(r)} | {_first_token_cell(r)} | {r.get('loadavg_1m_after', '–')} |"
        )
    host = report["host"]
    rows.append(
        f"\nlegs: {report.get('setup', {}).get('legs', '–')}; "
        f"{host['cpus']} CPUs, load average {host['loadavg_1m_before']} before / {host['loadavg_1m_after']} after; "
        f"CPU calibration (fixed Python work, lower is faster) {host.get('cpu_calibration_ms_before', '–')} ms before / "
        f"{host.get('cpu_calibration_ms_after', '–')} ms after; "
        "latency: client-observed Assign round trip (AssignStream open loop: from the scheduled arrival); server-side: the scheduler's own Assign handling time "
        "(share of calls within the bound, from its Prometheus histogram)."
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0, help="open-loop offered Assign rate, req/s")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each phase")
    p.add_argument("--workers", type=int, default=32, help="closed-loop concurrent clients (0: skip)")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels the clients share")
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--prefills", type=int, default=4)
    p.add_argument("--unary", type=int, choices=(0, 1), default=1, help="0: skip the unary Assign phases")
    p.add_argument("--stream-rates", default="5000", help="AssignStream open-loop rates, comma-separated ('' to skip)")
    p.add_argument("--stream-workers", type=int, default=256, help="AssignStream closed-loop callers (0: skip)")
    p.add_argument("--streams", type=int, default=1, help="AssignStream streams (one client each)")
    p.add_argument(
        "--handoff-rates", default="", help="first-token hand-off open-loop rates, comma-separated ('' to skip)"
    )
    p.add_argument(
        "--handoff-via",
        default="stream,unary",
        help="how the hand-off phases' frontends get each first token: stream (AssignStream first_tokens), "
        "unary (one AwaitFirstToken call per request), or both, comma-separated",
    )
    p.add_argument(
        "--prefill-ms", type=float, default=20.0, help="hand-off phases: when the fake prefill samples each token"
    )
    p.add_argument("--max-batch", type=int, default=256, help="assigns per AssignStream batch at most")
    p.add_argument("--max-in-flight", type=int, default=2, help="unanswered batches per stream at most")
    p.add_argument(
        "--release-delay-ms",
        type=float,
        default=0.0,
        help="how long a Release waits for an Assign to ride with (AssignStreamClient's release_delay_ms)",
    )
    p.add_argument(
        "--compact",
        type=int,
        choices=(0, 1),
        default=1,
        help="AssignStream answers: 1 CompactAssignment (legs as JSON text), 0 Assignment (legs as Struct)",
    )
    p.add_argument(
        "--legs",
        choices=("mac", "sign"),
        default="mac",
        help="how the scheduler authenticates legs: mac (--leg-mac-key, an HMAC per leg) or sign "
        "(--leg-signing-key, Ed25519; one signature per AssignStream batch)",
    )
    p.add_argument("--server-cpus", default="", help="CPUs the scheduler process runs on (e.g. '0'; default: any)")
    p.add_argument("--client-cpus", default="", help="CPUs this client process runs on (e.g. '1'; default: any)")
    p.add_argument("--out", default=str(ROOT / "bench-results/scheduler.json"))
    p.add_argument(
        "--baseline",
        type=int,
        choices=(0, 1),
        default=1,
        help="1: repeat the closed loops and the AssignStream open loops against a servicer without logic "
        "(the gRPC floor)",
    )
    p.add_argument("--serve-echo", metavar="ADDR", help=argparse.SUPPRESS)
    p.add_argument("--echo-certs", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_echo:
        asyncio.run(_serve_echo(args.serve_echo, args.echo_certs))
        return
    if args.client_cpus:
        os.sched_setaffinity(0, _cpus(args.client_cpus))
    # Fewer, shorter collector pauses in the client: its own tail latency is part of what we measure.
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    report = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(_table(report) + f"\n\nJSON: {out}\n")


if __name__ == "__main__":
    main()

"""Generate's token relay: what the scheduler spends per relayed token, and how many tokens one
scheduler process relays (``make bench-relay``).

``Generate`` reads the decode leg's SSE stream from vLLM's OpenAI server and forwards its tokens to
the caller as ``GenerateResponse`` messages. This benchmark measures that relay alone, without
engines: it starts ``kvpush-scheduler`` as deployed (mTLS on every call, MACed legs) and a fake
engine, an OpenAI-compatible server that answers both legs like vLLM (the prefill leg at once, the
decode leg as one vLLM-shaped SSE event per token; every open stream gets its token at the same
"engine step", one every ``--step-ms``). One decode and one prefill instance register with the
scheduler, both naming that server. Then:

* light load: ``--rounds`` sequential ``Generate`` calls of ``--short`` and of ``--long`` tokens,
  interleaved: the scheduler's CPU per request at each length, so the per-token slope (the relay)
  and the per-request rest (admission, both legs' bodies, the release); the client's inter-token
  gap against the step;
* under load: ``--streams`` concurrent callers, each sending ``Generate`` calls of ``--long``
  tokens back to back for ``--seconds``: relayed tokens per second, the scheduler's CPU per token
  and share of its core, tokens per message, the inter-token gap's p50 and p99.

The scheduler runs alone on ``--server-cpus``; the fake engine and this client share
``--client-cpus``. Writes bench-results/relay.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.calibration import cpu_calibration_ms
from benchmarks.process_cpu import tree_cpu_s
from benchmarks.scheduler import (
    Bench,
    _cpus,
    _free_port,
    _self_cpu_s,
    _start,
    _stop,
    _wait_serving,
    host_report,
    scheduler_argv,
)
from kvpush.v1 import kvpush_pb2 as pb

MODEL = "fake-model"


# ----- the fake engine ------------------------------------------------------------------------


class EngineSteps:
    """One future per engine step: every stream waiting for a token gets it at the same step, as
    vLLM's batch does. No timer runs while no stream waits."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._next: asyncio.Future[None] | None = None

    async def next(self) -> None:
        if self._next is None:
            loop = asyncio.get_running_loop()
            self._next = loop.create_future()
            loop.call_later(self.step_s, self._tick)
        await asyncio.shield(self._next)

    def _tick(self) -> None:
        fut, self._next = self._next, None
        if fut is not None:
            fut.set_result(None)


def _event(token: int, finish: str | None) -> bytes:
    """One SSE event as vLLM's completions endpoint sends it with ``return_token_ids``."""
    chunk = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": [token],
                "prompt_token_ids": None,
            }
        ],
        "usage": None,
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def serve_engine(port: int, step_s: float) -> None:
    from aiohttp import web

    steps = EngineSteps(step_s)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            await steps.next()  # the prefill leg's forward
            return web.json_response({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for i in range(n):
            await steps.next()
            await resp.write(_event(1000 + i, "length" if i == n - 1 else None))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def _wait_engine(url: str, proc: Any, timeout_s: float = 30.0) -> None:
    import aiohttp

    end = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fake engine exited with {proc.returncode}")
            try:
                async with http.get(f"{url}/v1/models") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > end:
                raise RuntimeError("fake engine did not come up")
            await asyncio.sleep(0.1)


# ----- the client -----------------------------------------------------------------------------


class Stream:
    """What the client saw of ``Generate`` calls: tokens, messages and the gaps between tokens."""

    def __init__(self) -> None:
        self.tokens = 0
        self.messages = 0
        self.calls = 0
        self.errors = 0
        self.gaps: list[float] = []

    async def generate(self, bench: Bench, max_tokens: int) -> None:
        last: float | None = None
        try:
            async for msg in bench.stub().Generate(
                pb.GenerateRequest(prompt_token_ids=list(range(1, 65)), max_tokens=max_tokens, ignore_eos=True),
                timeout=120,
            ):
                now = time.perf_counter()
                if msg.token_ids:
                    self.messages += 1
                    self.tokens += len(msg.token_ids)
                    if last is not None:
                        # A message of k tokens: its gap spread over them, as a token stream's TPOT.
                        self.gaps.extend([(now - last) / len(msg.token_ids)] * len(msg.token_ids))
                    last = now
            self.calls += 1
        except grpc.aio.AioRpcError:
            self.errors += 1


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def light_load(bench: Bench, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """Sequential calls, short and long interleaved, each length's scheduler CPU summed apart."""
    cpu = {args.short: 0.0, args.long: 0.0}
    seen = {args.short: Stream(), args.long: Stream()}
    for _ in range(args.rounds):
        for n in (args.short, args.long):
            c0 = tree_cpu_s(pid)
            await seen[n].generate(bench, n)
            cpu[n] += tree_cpu_s(pid) - c0
    per_request = {n: cpu[n] / args.rounds * 1e3 for n in cpu}
    slope_us = (per_request[args.long] - per_request[args.short]) / (args.long - args.short) * 1e3
    long = seen[args.long]
    return {
        "phase": "light load",
        "rounds": args.rounds,
        "cpu_ms_per_request": {str(n): round(v, 2) for n, v in per_request.items()},
        "cpu_us_per_token": round(slope_us, 1),
        "cpu_ms_per_request_besides": round(per_request[args.short] - slope_us * args.short / 1e3, 2),
        "tokens_per_message": round(long.tokens / max(1, long.messages), 3),
        "gap_p50_ms": round(_pct(long.gaps, 0.5) * 1e3, 3),
        "gap_p99_ms": round(_pct(long.gaps, 0.99) * 1e3, 3),
        "errors": sum(s.errors for s in seen.values()),
    }


async def under_load(bench: Bench, pid: int, engine_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    seen = [Stream() for _ in range(args.streams)]
    end = time.perf_counter() + args.seconds

    async def caller(s: Stream) -> None:
        while time.perf_counter() < end:
            await s.generate(bench, args.long)

    c0, e0, s0, t0 = tree_cpu_s(pid), tree_cpu_s(engine_pid), _self_cpu_s(), time.perf_counter()
    await asyncio.gather(*(caller(s) for s in seen))
    cpu, wall = tree_cpu_s(pid) - c0, time.perf_counter() - t0
    engine_cpu, client_cpu = tree_cpu_s(engine_pid) - e0, _self_cpu_s() - s0
    tokens = sum(s.tokens for s in seen)
    messages = sum(s.messages for s in seen)
    gaps = [g for s in seen for g in s.gaps]
    return {
        "phase": f"{args.streams} streams",
        "streams": args.streams,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall),
        "offered_tokens_per_s": round(args.streams / (args.step_ms / 1e3)),
        "cpu_us_per_token": round(cpu / max(1, tokens) * 1e6, 1),
        "scheduler_core_share": round(cpu / wall, 3),
        # The fake engine and this client share their CPUs: near 1.0 together, they bound the rate.
        "engine_and_client_core_share": round((engine_cpu + client_cpu) / wall, 3),
        "tokens_per_message": round(tokens / max(1, messages), 3),
        "gap_p50_ms": round(_pct(gaps, 0.5) * 1e3, 3),
        "gap_p99_ms": round(_pct(gaps, 0.99) * 1e3, 3),
        "calls": sum(s.calls for s in seen),
        "errors": sum(s.errors for s in seen),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvpush.services.common.leg_macs import write_master
    from scripts.make_certs import make_certs

    if args.client_cpus:
        os.sched_setaffinity(0, _cpus(args.client_cpus))
    engine_port, port, metrics_port = _free_port(), _free_port(), _free_port()
    engine_url, address = f"http://127.0.0.1:{engine_port}", f"127.0.0.1:{port}"
    engine = _start(
        ["-m", "benchmarks.relay", "--serve-engine", str(engine_port), "--step-ms", str(args.step_ms)],
        args.client_cpus,
    )
    keys = tempfile.TemporaryDirectory(prefix="kvpush-bench-leg-keys-")
    pki = tempfile.TemporaryDirectory(prefix="kvpush-bench-certs-")
    certs = make_certs(pki.name, engines=["decode/d0", "prefill/p1"])
    leg_flags = ["--leg-mac-key", str(write_master(keys.name))]
    scheduler = _start(scheduler_argv(address, metrics_port, certs, leg_flags), args.server_cpus)
    results: list[dict[str, Any]] = []
    try:
        await _wait_engine(engine_url, engine)
        await _wait_serving(address, scheduler, certs)
        bench = Bench(address, args.channels, certs)
        await bench.register(1, 1, http_endpoint=engine_url)
        warm = Stream()
        for _ in range(5):
            await warm.generate(bench, args.long)
        if warm.errors:
            raise RuntimeError("Generate failed during the warm-up")
        load_before = os.getloadavg()
        calibration_before = cpu_calibration_ms()
        if args.rounds:
            results.append(await light_load(bench, scheduler.pid, args))
        if args.streams:
            results.append(await under_load(bench, scheduler.pid, engine.pid, args))
        await bench.close()
    finally:
        _stop(scheduler)
        _stop(engine)
        keys.cleanup()
        pki.cleanup()
    return {
        "benchmark": "Generate's token relay",
        "host": host_report(load_before, calibration_before),
        "setup": {
            "step_ms": args.step_ms,
            "short": args.short,
            "long": args.long,
            "channels": args.channels,
            "server_cpus": args.server_cpus or "any",
            "client_cpus": args.client_cpus or "any",
        },
        "results": results,
    }


def markdown(report: dict[str, Any]) -> str:
    s = report["setup"]
    rows = [
        "| phase | tokens/s | scheduler CPU µs/token | per request besides, ms | scheduler core share "
        "| engine + client core share | tokens/message | gap p50 ms | gap p99 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        rows.append(
            f"| {r['phase']} | {r.get('tokens_per_s', '–')} | {r['cpu_us_per_token']} "
            f"| {r.get('cpu_ms_per_request_besides', '–')} | {r.get('scheduler_core_share', '–')} "
            f"| {r.get('engine_and_client_core_share', '–')} | {r['tokens_per_message']} | {r['gap_p50_ms']} | {r['gap_p99_ms']} | {r['errors']} |"
        )
    h = report["host"]
    rows.append(
        f"\nengine step {s['step_ms']} ms; light load: {s['short']} and {s['long']} tokens per call; "
        f"scheduler on CPUs {s['server_cpus']}, fake engine and client on {s['client_cpus']}; "
        f"load average {h['loadavg_1m_before']} before / {h['loadavg_1m_after']} after; CPU calibration "
        f"{h['cpu_calibration_ms_before']} / {h['cpu_calibration_ms_after']} ms."
    )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=3.0, help="the fake engine's step: one token per stream")
    p.add_argument("--rounds", type=int, default=20, help="light load: calls per length (0: skip)")
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=128)
    p.add_argument("--streams", type=int, default=32, help="under load: concurrent callers (0: skip)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--channels", type=int, default=1, help="gRPC channels the callers share")
    p.add_argument("--server-cpus", default="0" if (os.cpu_count() or 1) > 1 else "")
    p.add_argument("--client-cpus", default="1" if (os.cpu_count() or 1) > 1 else "")
    p.add_argument("--output", default="bench-results/relay.json")
    p.add_argument("--serve-engine", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_engine:
        asyncio.run(serve_engine(args.serve_engine, args.step_ms / 1e3))
        return 0
    report = asyncio.run(run(args))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    md = markdown(report)
    out.with_suffix(".md").write_text(md + "\n")
    sys.stdout.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

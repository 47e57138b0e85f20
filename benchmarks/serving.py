"""Serving benchmark: kvpush against vLLM's own NIXL connectors and one plain instance.

Setups, one after another on the same machine, with the same token-id prompts:

* ``single``: one plain vLLM (reference); also run with ``max_tokens=1`` for the prefill-only TTFT,
  and with a few sequential requests per prompt length for the unloaded latency the SLOs derive from.
* ``two_plain``: two plain vLLM instances, one per core (P's and D's), behind a round-robin proxy:
  the honest alternative to 1P1D on the same two cores.
* ``pull``: vLLM's ``NixlConnector`` behind a sequential proxy (P with ``max_tokens=1`` and
  ``do_remote_decode``, then D with P's returned ``kv_transfer_params``; vLLM's toy proxy).
* ``push``: vLLM's ``NixlPushConnector`` behind a concurrent proxy (both legs at once with P's
  coordinates; vLLM's ``disagg_proxy_pushconnector_demo.py``).
* ``ours``: ``KvPushConnector`` behind the same kind of concurrent proxy, with the legs' parameters
  from our scheduler's ``Assign`` (then ``Release``); ``ours_grpc``: the same pair through the
  scheduler's ``Generate`` stream.

The proxies are asyncio functions in this process (one aiohttp session), so every setup pays the
same client overhead. Arrivals are Poisson; every request has a fresh random prompt; prefix caching
is off; outputs are ``max_tokens`` greedy tokens with ``ignore_eos``. Prefill and decode get one
core each (their process trees are pinned after start-up); the single instance runs alone.

Every prompt length and rate is swept once per output length (``--output-lens``, default short
16 and long 128 tokens) on the same servers.

Per setup and point: TTFT and TPOT p50/p99, request throughput, and the hand-off overhead
``TTFT p50 - prefill-only TTFT p50 - single-instance TPOT p50``, beside the KV bytes per request and
the time of one single-descriptor NIXL WRITE of those bytes (measured in the same run). Goodput
(DistServe's measure): the requests per second that meet both SLOs (TTFT <= ``--slo-ttft-ms`` and
the request's mean TPOT <= ``--slo-tpot-ms``; by default ``--slo-scale`` times the single instance's
unloaded TTFT / TPOT p50 at that prompt length), the fraction that meets them, and per setup the
highest rate up to which >= 90 % of requests meet them. Writes ``bench-results/serving.json``,
``serving.md`` (also printed) and PNG plots.

Usage: ``python -m benchmarks.serving [--quick] [--prompt-lens 512,1024,2048] [--output-lens 16,128]
[--rates ...] [--setups ...] [--slo-scale 3 | --slo-ttft-ms T --slo-tpot-ms T]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SETUPS = ("single", "two_plain", "pull", "push", "ours", "ours_ft", "ours_grpc")  # result names, report order
PAIRS = ("pull", "push", "ours")  # P/D pairs to start; ``ours`` serves ``ours``, ``ours_ft`` and ``ours_grpc``
KINDS = ("single", "two_plain", *PAIRS)  # what ``--setups`` names
LABELS = {
    "single": "single instance",
    "two_plain": "two plain instances (one per core), round-robin proxy",
    "prefill_only": "single, max_tokens=1",
    "pull": "vLLM NixlConnector (pull), sequential proxy",
    "push": "vLLM NixlPushConnector, concurrent proxy",
    "ours": "kvpush, Assign + concurrent proxy",
    "ours_ft": "kvpush, Assign + concurrent proxy, first token from prefill",
    "ours_grpc": "kvpush, scheduler Generate (gRPC)",
}
GOAL_TTFT_VS_PUSH = 0.7
GOAL_TTFT_VS_PULL = 0.4
GOAL_TPOT_VS_PUSH = 1.0
GOAL_HANDOFF_VS_NIXL = 1.2
SUSTAINED = 0.9  # a point is sustained when throughput >= 0.9 x offered rate and nothing failed
SLO_ATTAINMENT = 0.9  # goodput summary: the highest rate up to which >= 90 % of requests meet the SLOs

_KV_RE = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s]+)")


# ----- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    vocab: int
    max_positions: int

    @classmethod
    def load(cls, model_dir: Path) -> ModelInfo:
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return cls(
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            dtype_bytes=4 if "32" in dtype else 2,
            vocab=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings") or 4096),
        )

    def kv_bytes(self, tokens: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes * tokens


@dataclass(frozen=True)
class Point:
    prompt_len: int
    rate: float  # offered requests per second (Poisson)
    requests: int
    max_tokens: int = 16  # output tokens per request

    @property
    def key(self) -> str:
        return f"L{self.prompt_len}_o{self.max_tokens}_r{self.rate:g}"


@dataclass
class Sample:
    ok: bool
    sent: float  # monotonic seconds
    ttft: float = math.nan
    tpot: float = math.nan
    # The gap between the first and the second token, and the mean TPOT after the second: with the
    # first-token hand-off, decode's part of the hand-off moves from TTFT into that first gap.
    gap2: float = math.nan
    tpot_rest: float = math.nan
    done: float = math.nan
    tokens: int = 0
    error: str = ""
    transfer_id: str = ""  # ours: joins the request to our agents' log events
    sent_wall: float = math.nan  # time.time() at send, to compare with log timestamps


@dataclass
class PointResult:
    setup: str
    prompt_len: int
    rate: float
    requests: int
    ok: int
    errors: list[str]
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    throughput_rps: float
    duration_s: float
    sustained: bool
    phases: dict[str, Any] = field(default_factory=dict)
    load1: float = math.nan  # 1-minute load average at the end of the point
    foreign_vllm: int = 0  # vLLM processes on this machine that are not ours (shared machine)
    max_tokens: int = 16
    # Per request, in arrival order (NaN: failed; TPOT NaN also for one-token outputs): goodput input.
    req_ttft_ms: list[float] = field(default_factory=list)
    req_tpot_ms: list[float] = field(default_factory=list)
    gap2_p50_ms: float = math.nan  # first -> second token
    tpot_rest_p50_ms: float = math.nan  # mean TPOT from the second token on
    # Filled by ``apply_slo`` once the SLOs are known (NaN: no SLO, e.g. no ``single`` run).
    slo_ttft_ms: float = math.nan
    slo_tpot_ms: float = math.nan
    slo_met: int = 0  # requests that met both SLOs
    slo_attainment: float = math.nan  # slo_met / requests (failed requests count as missed)
    goodput_rps: float = math.nan  # slo_met / (duration_s * share)
    # The share of the point's arrivals this setup got: 1 unless setups were interleaved in one
    # arrival stream (``--interleave``), where throughput and goodput are scaled by 1 / share.
    share: float = 1.0

    @property
    def goodput_duration_s(self) -> float:
        """The duration goodput divides by: the point's, times this setup's share of its arrivals."""
        return self.duration_s * self.share


def _pct(values: Sequence[float], q: float) -> float:
    v = [x for x in values if not math.isnan(x)]
    return float(np.percentile(np.asarray(v), q)) * 1e3 if v else math.nan


def summarize(setup: str, point: Point, samples: list[Sample], share: float = 1.0) -> PointResult:
    """``share``: the fraction of the point's arrivals ``samples`` are (interleaved setups)."""
    good = [s for s in samples if s.ok]
    errors = sorted({s.error for s in samples if not s.ok})[:5]
    duration = (max(s.done for s in good) - min(s.sent for s in samples)) if good else math.nan
    tput = len(good) / (duration * share) if good and duration > 0 else 0.0
    return PointResult(
        setup=setup,
        prompt_len=point.prompt_len,
        rate=point.rate,
        requests=len(samples),
        ok=len(good),
        errors=errors,
        ttft_p50_ms=_pct([s.ttft for s in good], 50),
        ttft_p99_ms=_pct([s.ttft for s in good], 99),
        tpot_p50_ms=_pct([s.tpot for s in good], 50),
        tpot_p99_ms=_pct([s.tpot for s in good], 99),
        throughput_rps=tput,
        duration_s=duration,
        sustained=len(good) == len(samples) and tput >= SUSTAINED * point.rate,
        max_tokens=point.max_tokens,
        req_ttft_ms=[s.ttft * 1e3 if s.ok else math.nan for s in samples],
        req_tpot_ms=[s.tpot * 1e3 if s.ok else math.nan for s in samples],
        gap2_p50_ms=_pct([s.gap2 for s in good], 50),
        tpot_rest_p50_ms=_pct([s.tpot_rest for s in good], 50),
        share=share,
    )


# ----- goodput -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives: TTFT and the request's mean TPOT, both in ms."""

    ttft_ms: float
    tpot_ms: float


def meets_slo(ttft_ms: float | None, tpot_ms: float | None, slo: Slo) -> bool:
    """One request: TTFT <= the TTFT target and its mean TPOT <= the TPOT target. A failed request
    (TTFT NaN or None) misses; a one-token output (no TPOT) is judged on its TTFT alone."""
    if ttft_ms is None or math.isnan(ttft_ms) or ttft_ms > slo.ttft_ms:
        return False
    return tpot_ms is None or math.isnan(tpot_ms) or tpot_ms <= slo.tpot_ms


def goodput(
    req_ttft_ms: Sequence[float | None], req_tpot_ms: Sequence[float | None], duration_s: float, slo: Slo
) -> tuple[int, float, float]:
    """(requests meeting both SLOs, their fraction of all requests, their number per second of the
    point's duration). Failed requests count in the denominator of the fraction."""
    if len(req_ttft_ms) != len(req_tpot_ms):
        raise ValueError("one TTFT and one TPOT per request")
    met = sum(meets_slo(a, b, slo) for a, b in zip(req_ttft_ms, req_tpot_ms, strict=True))
    fraction = met / len(req_ttft_ms) if req_ttft_ms else math.nan
    rps = met / duration_s if met and duration_s > 0 else 0.0  # NaN duration (nothing ok): 0
    return met, fraction, rps


def max_rate_meeting(points: Sequence[tuple[float, float]], target: float = SLO_ATTAINMENT) -> float | None:
    """DistServe's goodput over a rate sweep: the highest offered rate up to which every measured
    rate kept SLO attainment >= ``target`` (a pass above a failing rate is noise, not capacity).
    ``points``: (rate, attainment); None when even the lowest rate missed."""
    best = None
    for rate, attainment in sorted(points):
        if math.isnan(attainment) or attainment < target:
            break
        best = rate
    return best


def slos_for(
    lengths: Sequence[int],
    unloaded: dict[int, dict[str, float]],
    scale: float,
    ttft_ms: float = 0.0,
    tpot_ms: float = 0.0,
) -> dict[int, Slo | None]:
    """Per prompt length: a fixed target where given (> 0), else ``scale`` x the single instance's
    unloaded p50 at that length; None where neither is known."""
    out: dict[int, Slo | None] = {}
    for length in lengths:
        base = unloaded.get(length, {})
        t = ttft_ms if ttft_ms > 0 else scale * base.get("ttft_ms", math.nan)
        p = tpot_ms if tpot_ms > 0 else scale * base.get("tpot_ms", math.nan)
        out[length] = None if math.isnan(t) or math.isnan(p) else Slo(t, p)
    return out


def apply_slo(results: dict[str, list[PointResult]], slos: dict[int, Slo | None]) -> None:
    """Fills each point's SLO fields (not the prefill-only reference, which has no decode)."""
    for name, rs in results.items():
        if name == "prefill_only":
            continue
        for r in rs:
            slo = slos.get(r.prompt_len)
            if slo is None:
                continue
            r.slo_ttft_ms, r.slo_tpot_ms = slo.ttft_ms, slo.tpot_ms
            r.slo_met, r.slo_attainment, r.goodput_rps = goodput(
                r.req_ttft_ms, r.req_tpot_ms, r.goodput_duration_s, slo
            )


def _judged_lengths(results: dict[str, list[PointResult]]) -> list[tuple[int, int]]:
    """The (prompt length, output length) pairs measured, the prefill-only reference left out."""
    return sorted({(r.prompt_len, r.max_tokens) for n, rs in results.items() if n != "prefill_only" for r in rs})


TPOT_SLO_FACTORS = (1.25, 1.5, 2.0, 3.0)  # the sweep's TPOT targets, x the single instance's unloaded p50


def tpot_slo_sweep(
    results: dict[str, list[PointResult]],
    slos: dict[int, Slo | None],
    unloaded: dict[int, dict[str, float]],
    factors: Sequence[float] = TPOT_SLO_FACTORS,
    target: float = SLO_ATTAINMENT,
) -> list[dict[str, Any]]:
    """Where each setup wins: per prompt and output length, and per TPOT target (``factors`` x the
    single instance's unloaded TPOT p50, the TTFT target kept), each setup's highest rate with
    >= ``target`` attainment and its goodput there. The points' own SLO fields are not touched."""
    rows = []
    keys = _judged_lengths(results)
    for length, out in keys:
        slo = slos.get(length)
        base = unloaded.get(length, {}).get("tpot_ms", math.nan)
        if slo is None or math.isnan(base):
            continue
        for factor in factors:
            tight = Slo(slo.ttft_ms, factor * base)
            row: dict[str, Any] = {
                "prompt_len": length,
                "max_tokens": out,
                "slo_ttft_ms": tight.ttft_ms,
                "tpot_factor": factor,
                "slo_tpot_ms": tight.tpot_ms,
                "setups": {},
            }
            for name in SETUPS:
                rs = [r for r in results.get(name, []) if (r.prompt_len, r.max_tokens) == (length, out)]
                if not rs:
                    continue
                judged = {r.rate: goodput(r.req_ttft_ms, r.req_tpot_ms, r.goodput_duration_s, tight) for r in rs}
                best = max_rate_meeting([(rate, g[1]) for rate, g in judged.items()], target)
                row["setups"][name] = {
                    "max_rate": best,
                    "goodput_rps_at_max_rate": judged[best][2] if best is not None else math.nan,
                    "best_goodput_rps": max(g[2] for g in judged.values()),
                    "rates": sorted(judged),
                }
            rows.append(row)
    return rows


def goodput_summary(results: dict[str, list[PointResult]], target: float = SLO_ATTAINMENT) -> list[dict[str, Any]]:
    """Per prompt length and output length: each setup's highest rate at >= ``target`` attainment,
    its goodput there, and its best goodput over the sweep."""
    rows = []
    keys = _judged_lengths(results)
    for length, out in keys:
        row: dict[str, Any] = {"prompt_len": length, "max_tokens": out, "attainment_target": target, "setups": {}}
        for name in SETUPS:
            rs = sorted(
                (r for r in results.get(name, []) if (r.prompt_len, r.max_tokens) == (length, out)),
                key=lambda r: r.rate,
            )
            if not rs or math.isnan(rs[0].slo_ttft_ms):
                continue
            row["slo_ttft_ms"], row["slo_tpot_ms"] = rs[0].slo_ttft_ms, rs[0].slo_tpot_ms
            best = max_rate_meeting([(r.rate, r.slo_attainment) for r in rs], target)
            at = next((r for r in rs if r.rate == best), None)
            row["setups"][name] = {
                "max_rate": best,
                "goodput_rps_at_max_rate": at.goodput_rps if at else math.nan,
                "best_goodput_rps": max(r.goodput_rps for r in rs),
                "rates": [r.rate for r in rs],
                "attainment": [r.slo_attainment for r in rs],
            }
        rows.append(row)
    return rows


def prompts_for(point: Point, vocab: int, seed: int) -> list[list[int]]:
    """Fresh random prompts, identical in every setup (seeded by the point)."""
    rng = np.random.default_rng([seed, point.prompt_len, int(point.rate * 1000)])
    arr = rng.integers(10, vocab - 10, size=(point.requests, point.prompt_len))
    return [[int(t) for t in row] for row in arr]


def arrivals_for(point: Point, seed: int) -> list[float]:
    rng = np.random.default_rng([seed, point.prompt_len, int(point.rate * 1000), 1])
    gaps = rng.exponential(1.0 / point.rate, size=point.requests)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


# ----- HTTP clients and proxies ------------------------------------------------------------------


class Client:
    """One aiohttp session for every setup, and the streaming completion that takes the timings."""

    def __init__(self, request_timeout_s: float) -> None:
        import aiohttp

        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=10)
        self.session = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0))
        self.models: dict[str, str] = {}

    async def close(self) -> None:
        await self.session.close()

    async def model(self, url: str) -> str:
        if url not in self.models:
            async with self.session.get(f"{url}/v1/models") as resp:
                resp.raise_for_status()
                self.models[url] = str((await resp.json())["data"][0]["id"])
        return self.models[url]

    async def body(
        self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": await self.model(url),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    async def once(
        self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, rid: str
    ) -> dict[str, Any]:
        """Non-streaming completion; returns the response JSON."""
        body = await self.body(url, prompt, max_tokens, params, stream=False)
        async with self.session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            out: dict[str, Any] = await resp.json()
            return out

    async def token_times(
        self,
        url: str,
        prompt: list[int],
        max_tokens: int,
        params: dict[str, Any] | None,
        rid: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> list[float]:
        """Streaming completion; the ``clock`` time each token arrived, one entry per token."""
        body = await self.body(url, prompt, max_tokens, params, stream=True)
        times: list[float] = []
        async with self.session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"{url}: stream error {obj['error']}")
                got = len(obj["choices"][0].get("token_ids") or [])
                if got:
                    times.extend([clock()] * got)
        return times

    async def stream(
        self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, rid: str, s: Sample
    ) -> None:
        """Streaming completion; fills TTFT (from ``s.sent``), TPOT and ``done`` into ``s``."""
        times = await self.token_times(url, prompt, max_tokens, params, rid)
        record(s, times[0] if times else 0.0, times[-1] if times else 0.0, len(times), max_tokens, _second(times))


def _second(times: Sequence[float]) -> float:
    return times[1] if len(times) > 1 else math.nan


def record(s: Sample, first: float, last: float, n: int, want: int, second: float = math.nan) -> None:
    if n != want:
        raise RuntimeError(f"got {n} tokens, expected {want}")
    s.ttft = first - s.sent
    s.tpot = (last - first) / (n - 1) if n > 1 else math.nan
    s.gap2 = second - first
    s.tpot_rest = (last - second) / (n - 2) if n > 2 else math.nan
    s.done = time.monotonic()
    s.tokens = n
    s.ok = True


Proxy = Callable[[list[int], int, Sample], Awaitable[None]]  # (prompt, max_tokens, sample)


def single_proxy(c: Client, url: str) -> Proxy:
    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        await c.stream(url, prompt, max_tokens, None, uuid.uuid4().hex, s)

    return run


class RoundRobin:
    """Backend selection of the ``two_plain`` proxy: 0, 1, ..., n-1, 0, ... in request order."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("round robin over no backends")
        self.n = n
        self._next = 0

    def pick(self) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


def round_robin_proxy(c: Client, urls: Sequence[str]) -> Proxy:
    """Each request streams from the next plain instance in turn (picked when it is sent)."""
    rr = RoundRobin(len(urls))

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        await c.stream(urls[rr.pick()], prompt, max_tokens, None, uuid.uuid4().hex, s)

    return run


def pull_proxy(c: Client, p_url: str, d_url: str) -> Proxy:
    """vLLM's toy proxy: P (max_tokens=1, do_remote_decode) first, then D with P's params."""

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        rid = uuid.uuid4().hex
        p_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        resp = await c.once(p_url, prompt, 1, p_params, rid)
        params = resp.get("kv_transfer_params")
        if not params:
            raise RuntimeError("prefill returned no kv_transfer_params")
        await c.stream(d_url, prompt, max_tokens, params, rid, s)

    return run


def push_proxy(c: Client, p_url: str, d_url: str, p_engine: str, p_host: str, p_port: int, tp: int) -> Proxy:
    """vLLM's push demo proxy: both legs at once, D told P's coordinates, the same X-Request-Id."""

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        rid = uuid.uuid4().hex
        p_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        d_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": p_engine,
            "remote_request_id": rid,
            "remote_host": p_host,
            "remote_port": p_port,
            "tp_size": tp,
            "pp_size": 1,
            "remote_block_ids": None,
        }
        await both_legs(c, p_url, d_url, prompt, max_tokens, p_params, d_params, rid, s)

    return run


async def both_legs(
    c: Client,
    p_url: str,
    d_url: str,
    prompt: list[int],
    max_tokens: int,
    p_params: dict[str, Any],
    d_params: dict[str, Any],
    rid: str,
    s: Sample,
) -> None:
    prefill = asyncio.create_task(c.once(p_url, prompt, 1, p_params, rid))
    try:
        await c.stream(d_url, prompt, max_tokens, d_params, rid, s)
        await prefill
    finally:
        if not prefill.done():
            prefill.cancel()
        with contextlib.suppress(BaseException):
            await prefill  # also retrieves a failure of P when D failed first


async def _release(stub: Any, a: Any, outcome: int) -> None:
    """Releases an Assign's assignment, best effort (it expires by TTL otherwise)."""
    from kvpush.v1 import kvpush_pb2 as pb

    with contextlib.suppress(Exception):
        await stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=outcome), timeout=10)


def ours_proxy(c: Client, stub: Any) -> Proxy:
    """Our scheduler's Assign, then both legs at once with its parameters, then Release."""
    from google.protobuf.json_format import MessageToDict

    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        rid = uuid.uuid4().hex
        a = await stub.Assign(pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=max_tokens), timeout=30)
        s.transfer_id = a.transfer_id
        outcome = pb.OUTCOME_FAILED
        try:
            await both_legs(
                c,
                a.prefill.http_endpoint,
                a.decode.http_endpoint,
                prompt,
                max_tokens,
                MessageToDict(a.prefill_kv_transfer_params),
                MessageToDict(a.decode_kv_transfer_params),
                rid,
                s,
            )
            outcome = pb.OUTCOME_OK
        finally:
            await _release(stub, a, outcome)

    return run


def ours_ft_proxy(c: Client, stub: Any) -> Proxy:
    """``ours`` with the first-token hand-off, as a custom frontend does it (docs/first_token.md):
    Assign asking for it, both legs at once, decode asked for one token less; the first token is
    prefill's answer, then decode's tokens follow."""
    from google.protobuf.json_format import MessageToDict

    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        if max_tokens < 2:
            raise RuntimeError("ours_ft needs max_tokens >= 2")
        rid = uuid.uuid4().hex
        req = pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=max_tokens, first_token_from_prefill=True)
        a = await stub.Assign(req, timeout=30)
        s.transfer_id = a.transfer_id
        outcome = pb.OUTCOME_FAILED
        first_at: list[float] = []

        async def prefill() -> None:
            answer = await c.once(a.prefill.http_endpoint, prompt, 1, MessageToDict(a.prefill_kv_transfer_params), rid)
            if not answer["choices"][0].get("token_ids"):
                raise RuntimeError("prefill answered no token")
            first_at.append(time.monotonic())

        try:
            if not a.first_token_from_prefill:
                raise RuntimeError("the scheduler did not grant the first-token hand-off")
            task = asyncio.create_task(prefill())
            try:
                params = MessageToDict(a.decode_kv_transfer_params)
                decoded = await c.token_times(a.decode.http_endpoint, prompt, max_tokens - 1, params, rid)
                await task
            finally:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            times = sorted([first_at[0], *decoded])
            record(s, times[0], times[-1], len(times), max_tokens, _second(times))
            outcome = pb.OUTCOME_OK
        finally:
            await _release(stub, a, outcome)

    return run


def grpc_proxy(stub: Any) -> Proxy:
    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        times: list[float] = []
        async for msg in stub.Generate(req, timeout=120):
            s.transfer_id = s.transfer_id or msg.transfer_id
            if msg.token_ids:
                times.extend([time.monotonic()] * len(msg.token_ids))
        record(s, times[0] if times else 0.0, times[-1] if times else 0.0, len(times), max_tokens, _second(times))

    return run


async def run_point(
    proxy: Proxy, prompts: list[list[int]], arrivals: list[float], max_tokens: int, timeout_s: float
) -> list[Sample]:
    """Poisson-timed requests; each bounded by ``timeout_s``."""
    samples = [Sample(ok=False, sent=math.nan) for _ in prompts]
    t0 = time.monotonic() + 0.05

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
        s = samples[i]
        s.sent = time.monotonic()
        s.sent_wall = time.time()
        try:
            await asyncio.wait_for(proxy(prompts[i], max_tokens, s), timeout_s)
        except Exception as exc:  # recorded per request; the point goes on
            s.ok = False
            s.error = f"{type(exc).__name__}: {exc}"[:300]

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return samples


# ----- servers -----------------------------------------------------------------------------------


@dataclass
class Pair:
    prefill: Any  # VllmServer
    decode: Any
    p_side_port: int = 0
    scheduler: Any = None  # SchedulerProcess for ``ours``


def _env_pairs(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = v
    return out


def affinity_shim(run_dir: Path) -> Path | None:
    """A ``sitecustomize`` that clips ``os.sched_setaffinity`` masks to the allowed cpuset.

    vLLM's NIXL worker on CPU reserves the last core of every NUMA node for KV transfer with
    ``os.sched_setaffinity(0, ...)``; in a container whose cpuset lacks that core this raises
    EINVAL and the engine dies. Returns the directory to prepend to PYTHONPATH, or None when every
    NUMA core is allowed here (no shim needed).
    """
    allowed = os.sched_getaffinity(0)
    numa: set[int] = set()
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            for part in (node / "cpulist").read_text().strip().split(","):
                lo, _, hi = part.partition("-")
                numa.update(range(int(lo), int(hi or lo) + 1))
    if not numa or numa <= allowed:
        return None
    shim = run_dir / "affinity_shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import os\n"
        "_allowed = frozenset(os.sched_getaffinity(0))\n"
        "_orig = os.sched_setaffinity\n"
        "def _clipped(pid, mask):\n"
        "    m = set(mask) & _allowed\n"
        "    _orig(pid, m or _allowed)\n"
        "os.sched_setaffinity = _clipped\n"
    )
    return shim


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        from scripts.cluster.vllm import cores

        self.args = args
        self.model = ModelInfo.load(args.model_dir)
        self.run_dir: Path = args.log_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        on = cores()
        self.p_core = args.prefill_core if args.prefill_core is not None else on[0]
        self.d_core = args.decode_core if args.decode_core is not None else on[-1]
        self.shim = affinity_shim(self.run_dir)
        from kvpush.services.common.vllm_server import default_executor

        # The vLLM executor of every one-rank server of the run (services/common/vllm_server.py).
        self.executor: str = getattr(args, "executor", None) or default_executor()
        self.log = sys.stderr
        # The single instance's unloaded latency per prompt length (``unloaded``): the SLOs' base.
        self.unloaded: dict[int, dict[str, float]] = {}

    def note(self, msg: str) -> None:
        self.log.write(f"[serving {time.strftime('%H:%M:%S')}] {msg}\n")
        self.log.flush()

    def server(self, name: str, core: int, kv: dict[str, Any] | None, env: dict[str, str]) -> Any:
        from kvpush.services.common.vllm_server import VllmServer
        from scripts.cluster.vllm import omp_bind

        a = self.args
        pythonpath = [str(ROOT)]
        if self.shim is not None:
            pythonpath.insert(0, str(self.shim))
        if os.environ.get("PYTHONPATH"):
            pythonpath.append(os.environ["PYTHONPATH"])
        base_env = {
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "KVPUSH_LOG_LEVEL": "INFO",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            **(omp_bind(core) if a.pin else {}),
        }
        return VllmServer(
            a.model_dir,
            max_model_len=a.max_model_len,
            max_num_seqs=a.max_num_seqs,
            kv_cache_memory_bytes=a.kv_cache_bytes,
            kv_transfer_config=kv,
            env={**base_env, **env},
            extra_args=["--no-enable-prefix-caching", *a.vllm_arg],
            log_path=self.run_dir / f"{name}.log",
            ready_timeout=None,
            executor=self.executor,
        )

    def start(self, servers: list[tuple[Any, int | None]]) -> None:
        from scripts.cluster.vllm import start_side_by_side

        start_side_by_side(servers, self.args.ready_timeout, pin=self.args.pin)

    @contextlib.contextmanager
    def single(self) -> Iterator[Any]:
        srv = self.server("single", self.p_core, None, _env_pairs(self.args.prefill_env))
        try:
            self.start([(srv, self.p_core)])
            yield srv
        finally:
            srv.stop()

    @contextlib.contextmanager
    def two_plain(self) -> Iterator[list[Any]]:
        """Two plain instances started side by side, one on P's core (with P's environment) and one
        on D's (with D's)."""
        servers = [
            (self.server("two_plain-0", self.p_core, None, _env_pairs(self.args.prefill_env)), self.p_core),
            (self.server("two_plain-1", self.d_core, None, _env_pairs(self.args.decode_env)), self.d_core),
        ]
        try:
            self.start(servers)
            yield [srv for srv, _ in servers]
        finally:
            for srv, _ in servers:
                srv.stop()

    @contextlib.contextmanager
    def pair(self, kind: str) -> Iterator[Pair]:
        from kvpush.services.common.vllm_server import free_port
        from scripts.cluster.scheduler import start_scheduler
        from scripts.cluster.vllm import connector_config

        a = self.args
        sched = None
        servers: list[tuple[Any, int | None]] = []
        try:
            p_side, d_side = free_port(), free_port()
            if kind == "ours":
                (self.run_dir / "ours").mkdir(parents=True, exist_ok=True)
                sched = start_scheduler(self.run_dir / "ours")
            for role, core, side, extra_env in (
                ("prefill", self.p_core, p_side, a.prefill_env),
                ("decode", self.d_core, d_side, a.decode_env),
            ):
                env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), **_env_pairs(extra_env)}
                engine = f"{kind}-{role}-{uuid.uuid4().hex[:6]}"
                if kind == "ours":
                    assert sched is not None
                    port = free_port()
                    kv = connector_config(
                        role,
                        engine,
                        sched.address,
                        f"http://127.0.0.1:{port}",
                        **sched.connector_extra(role, engine),
                        **_env_pairs(a.connector_extra),
                    )
                    kv["kv_buffer_device"] = a.kv_buffer_device
                    srv = self.server(f"{kind}-{role}", core, kv, env)
                    srv.port = port
                else:
                    kv = {
                        "kv_connector": "NixlConnector" if kind == "pull" else "NixlPushConnector",
                        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                        "kv_buffer_device": a.kv_buffer_device,
                        "engine_id": engine,
                    }
                    srv = self.server(f"{kind}-{role}", core, kv, env)
                servers.append((srv, core))
            self.start(servers)
            pair = Pair(servers[0][0], servers[1][0], p_side, sched)
            if sched is not None:
                sched.wait_registered(timeout_s=120.0)
                if a.scheduler_core is not None:
                    from kvpush.services.common.vllm_server import pin_process_tree

                    pin_process_tree(sched.proc.pid, a.scheduler_core)
            yield pair
        finally:
            for srv, _ in servers:
                srv.stop()
            if sched is not None:
                sched.stop()


# ----- our agents' log events --------------------------------------------------------------------


def parse_events(path: Path, start: int, event: str) -> list[dict[str, str]]:
    """key=value (or JSON) log lines of ``event`` written after byte offset ``start``."""
    out: list[dict[str, str]] = []
    with contextlib.suppress(OSError), path.open("rb") as f:
        f.seek(start)
        for raw in f:
            line = raw.decode(errors="replace")
            if event not in line:
                continue
            if line.lstrip().startswith("{"):
                with contextlib.suppress(ValueError):
                    obj = json.loads(line)
                    if obj.get("event") == event:
                        out.append({k: str(v) for k, v in obj.items()})
                continue
            kv = {k: v.strip("'\"") for k, v in _KV_RE.findall(line)}
            if kv.get("event") == event:
                out.append(kv)
    return out


def foreign_vllm_processes() -> int:
    """vLLM processes running here that this harness did not start (others sharing the machine)."""
    import psutil

    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    n = 0
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
            if p.info["pid"] not in ours and ("vllm.entrypoints" in text or "VLLM::" in text):
                n += 1
    return n


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _ts(row: dict[str, str]) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(row["timestamp"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        return math.nan


def phase_stats(p_log: Path, d_log: Path, p_off: int, d_off: int, samples: list[Sample]) -> dict[str, Any]:
    """Our agents' events for the point, and per request (joined on the transfer id) the phases
    sent -> WRITE start (Assign, P queue, prefill, wait_for_save) -> D rank release (WRITE plus
    the completion to the decode rank) -> first token at the client (D step + HTTP streaming).
    ``write_finished`` is logged after the completion is sent, so WRITE start = its time - write_ms."""
    writes = parse_events(p_log, p_off, "write_finished")
    released = parse_events(d_log, d_off, "transfer_released")
    w_by = {r.get("transfer_id", ""): r for r in writes}
    r_by = {r.get("transfer_id", ""): r for r in released}
    phases: dict[str, list[float]] = {
        "to_write_start": [],
        "write": [],
        "write_start_to_release": [],
        "release_to_first": [],
    }
    for smp in samples:
        w, rel = w_by.get(smp.transfer_id), r_by.get(smp.transfer_id)
        if not smp.ok or w is None or rel is None:
            continue
        with contextlib.suppress(KeyError, ValueError):
            w_end, r_t = _ts(w), _ts(rel)
            w_ms = float(w["write_ms"])
            first_wall = smp.sent_wall + smp.ttft
            phases["to_write_start"].append((w_end - w_ms / 1e3 - smp.sent_wall) * 1e3)
            phases["write"].append(w_ms)
            phases["write_start_to_release"].append((r_t - w_end) * 1e3 + w_ms)
            phases["release_to_first"].append((first_wall - r_t) * 1e3)

    def floats(rows: list[dict[str, str]], key: str) -> list[float]:
        vals = []
        for r in rows:
            with contextlib.suppress(KeyError, ValueError):
                vals.append(float(r[key]))
        return vals

    w_ms, b, waited = floats(writes, "write_ms"), floats(writes, "bytes"), floats(released, "waited_ms")
    return {
        "writes": len(writes),
        "write_ms_p50": statistics.median(w_ms) if w_ms else math.nan,
        "write_ms_p99": float(np.percentile(w_ms, 99)) if w_ms else math.nan,
        "bytes_p50": statistics.median(b) if b else math.nan,
        "released": len(released),
        "released_waited_ms_p50": statistics.median(waited) if waited else math.nan,
        "released_waited_ms_p99": float(np.percentile(waited, 99)) if waited else math.nan,
        "joined": len(phases["write"]),
        **{f"{k}_ms_p50": (statistics.median(v) if v else math.nan) for k, v in phases.items()},
    }


# ----- raw NIXL ----------------------------------------------------------------------------------


def _nixl_child(conn: Any, sizes: list[int], reps: int, core: int | None) -> None:
    """Two NIXL agents (UCX, no progress thread) in one process (on ``core``, if given); sends the
    median single-descriptor WRITE per size, or the error."""
    if core is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {core})
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        sys.path.insert(0, str(ROOT))
        from kvpush.services.common.nixl_engine import NixlEngine

        biggest = max(sizes)
        src = np.ones(biggest, dtype=np.uint8)
        dst = np.zeros(biggest, dtype=np.uint8)
        a, b = NixlEngine(f"bench-serving-src-{os.getpid()}"), NixlEngine(f"bench-serving-dst-{os.getpid()}")
        a.register([(src.ctypes.data, src.nbytes)])
        b.register([(dst.ctypes.data, dst.nbytes)])
        peer = a.add_peer(b.metadata())
        out: dict[int, dict[str, float]] = {}
        for n in sizes:
            local = np.array([[src.ctypes.data, n, 0]], dtype=np.uint64)
            remote = np.array([[dst.ctypes.data, n, 0]], dtype=np.uint64)
            times = []
            for _ in range(reps + 2):
                t0 = time.perf_counter()
                h, state = a.post_write(local, remote, peer)
                deadline = t0 + 10
                while state == "PROC" and time.perf_counter() < deadline:
                    b.progress()
                    state = a.check(h)
                a.release(h)
                if state != "DONE":
                    raise RuntimeError(f"WRITE of {n} bytes ended {state}")
                times.append(time.perf_counter() - t0)
            t = sorted(times[2:])
            out[n] = {
                "p50_ms": statistics.median(t) * 1e3,
                "min_ms": t[0] * 1e3,
                "gbps": n / statistics.median(t) / 1e9,
            }
        a.close()
        b.close()
        conn.send(out)
    except Exception as exc:
        conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))


def raw_nixl_times(sizes: list[int], reps: int, core: int | None) -> dict[int, dict[str, float]]:
    """Measured in a spawned child whose only message is its result (a ``Node``'s info)."""
    from scripts.cluster.node import Node

    node = Node(_nixl_child, sizes, reps, core, start_timeout_s=180.0, raise_errors=True)
    node.stop()
    return {int(k): v for k, v in node.info.items()}


# ----- the run -----------------------------------------------------------------------------------


def points(args: argparse.Namespace) -> list[Point]:
    """Every prompt length x rate, once per output length (shortest output first)."""
    out = []
    for max_tokens in args.output_lens:
        for length in args.prompt_lens:
            rates = args.rates or [r * args.rate_scale / length for r in args.rate_units]
            for rate in rates:
                n = max(args.min_requests, min(args.requests, int(round(rate * args.max_point_s))))
                out.append(Point(length, round(rate, 3), n, max_tokens))
    return out


def prefill_only_points(pts: Sequence[Point]) -> list[Point]:
    """One ``max_tokens=1`` point per prompt length and rate (same prompts and arrivals)."""
    seen: dict[tuple[int, float], Point] = {}
    for pt in pts:
        seen.setdefault((pt.prompt_len, pt.rate), replace(pt, max_tokens=1))
    return list(seen.values())


async def measure(
    name: str, proxy: Proxy, pts: list[Point], h: Harness, logs: tuple[Path, Path] | None = None
) -> list[PointResult]:
    """Each point as one Poisson stream through one setup."""
    return (await measure_interleaved([(name, proxy)], pts, h, logs))[name]


def interleaving(n: int, k: int, seed: int) -> list[int]:
    """Which of ``k`` setups each of ``n`` arrivals goes to: every run of ``k`` consecutive
    arrivals covers each setup once, in a seeded random order (no setup always first after a gap)."""
    rng = np.random.default_rng([seed, n, k, 2])
    return [int(x) for _ in range((n + k - 1) // k) for x in rng.permutation(k)][:n]


def _router(proxies: Sequence[tuple[str, Proxy]], prompts: list[list[int]], which: list[int]) -> Proxy:
    """A proxy that sends ``prompts[i]`` through setup ``which[i]``."""
    setup_of = {id(p): proxies[j][1] for p, j in zip(prompts, which, strict=True)}

    async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
        await setup_of[id(prompt)](prompt, max_tokens, s)

    return run


async def measure_interleaved(
    proxies: Sequence[tuple[str, Proxy]], pts: list[Point], h: Harness, logs: tuple[Path, Path] | None = None
) -> dict[str, list[PointResult]]:
    """Each point once, as one Poisson stream at the point's rate with ``k`` times its requests,
    every arrival sent through one of the ``k`` setups (``interleaving``): the setups share the
    same moments of the machine, so their ratios do not carry the drift between back-to-back runs.
    Each setup's result holds its own ``requests`` samples (share 1/k). ``logs`` (P's and D's):
    our agents' events, split into per-request phases."""
    a = h.args
    k = len(proxies)
    res: dict[str, list[PointResult]] = {name: [] for name, _ in proxies}
    for pt in pts:
        offs = (_size(logs[0]), _size(logs[1])) if logs else (0, 0)
        t0 = time.monotonic()
        total = replace(pt, requests=pt.requests * k)
        prompts = prompts_for(total, h.model.vocab, a.seed)
        which = interleaving(len(prompts), k, a.seed)
        samples = await run_point(
            _router(proxies, prompts, which), prompts, arrivals_for(total, a.seed), pt.max_tokens, a.timeout
        )
        load1, foreign = os.getloadavg()[0], foreign_vllm_processes()
        if logs:
            await asyncio.sleep(0.3)  # let the log lines of the last transfers land
        for j, (name, _) in enumerate(proxies):
            mine = [s for i, s in enumerate(samples) if which[i] == j]
            r = summarize(name, pt, mine, share=1.0 / k)
            r.load1, r.foreign_vllm = load1, foreign
            if logs:
                r.phases = phase_stats(logs[0], logs[1], *offs, mine)
            res[name].append(r)
            h.note(
                f"{name:>12} L={pt.prompt_len} out={pt.max_tokens} rate={pt.rate:g}/s n={r.requests}"
                + (f" (interleaved with {k - 1} more)" if k > 1 else "")
                + f": ok={r.ok} TTFT p50={r.ttft_p50_ms:.1f} p99={r.ttft_p99_ms:.1f} ms TPOT p50={r.tpot_p50_ms:.2f} ms "
                f"{r.throughput_rps:.2f} req/s ({time.monotonic() - t0:.0f} s, load {load1:.1f}, "
                f"foreign vLLM procs {foreign}){' ' + r.errors[0] if r.errors else ''}"
            )
        await asyncio.sleep(a.settle_s)
    return res


async def warm_up(proxy: Proxy, h: Harness) -> None:
    """A few sequential then concurrent requests: handshakes, first-call allocations."""
    rng = np.random.default_rng(h.args.seed + 99)
    length = min(h.args.prompt_lens)
    out = min(h.args.output_lens)
    for i in range(h.args.warmup):
        prompt = [int(t) for t in rng.integers(10, h.model.vocab - 10, size=length)]
        s = Sample(ok=False, sent=time.monotonic())
        try:
            await asyncio.wait_for(proxy(prompt, out, s), h.args.timeout * (3 if i == 0 else 1))
        except Exception as exc:
            h.note(f"warm-up request {i} failed: {type(exc).__name__}: {exc}")
    prompts = [[int(t) for t in rng.integers(10, h.model.vocab - 10, size=length)] for _ in range(4)]
    await run_point(proxy, prompts, [0.0, 0.01, 0.02, 0.03], out, h.args.timeout)


async def unloaded(proxy: Proxy, h: Harness) -> None:
    """``--slo-base-n`` sequential requests per prompt length (the longest output) on the single
    instance: its unloaded TTFT and TPOT p50, the base of the default SLOs (``h.unloaded``)."""
    a = h.args
    rng = np.random.default_rng(a.seed + 7)
    out = max(a.output_lens)
    for length in a.prompt_lens:
        samples = []
        for _ in range(a.slo_base_n):
            s = Sample(ok=False, sent=time.monotonic())
            prompt = [int(t) for t in rng.integers(10, h.model.vocab - 10, size=length)]
            try:
                await asyncio.wait_for(proxy(prompt, out, s), a.timeout)
            except Exception as exc:
                h.note(f"unloaded request at L={length} failed: {type(exc).__name__}: {exc}")
            samples.append(s)
        ok = [x for x in samples if x.ok]
        h.unloaded[length] = {
            "ttft_ms": _pct([x.ttft for x in ok], 50),
            "tpot_ms": _pct([x.tpot for x in ok], 50),
            "n": len(ok),
            "max_tokens": out,
            "load1": os.getloadavg()[0],
        }
        h.note(
            f"unloaded single L={length} out={out}: TTFT p50 {h.unloaded[length]['ttft_ms']:.1f} ms, "
            f"TPOT p50 {h.unloaded[length]['tpot_ms']:.2f} ms (n={len(ok)}, load {h.unloaded[length]['load1']:.1f})"
        )


async def run_setup(kind: str, h: Harness, pts: list[Point]) -> dict[str, list[PointResult]]:
    a = h.args
    client = Client(a.timeout)
    out: dict[str, list[PointResult]] = {}
    try:
        if kind == "single":
            with h.single() as srv:
                full = single_proxy(client, srv.base_url)
                await warm_up(full, h)
                await unloaded(full, h)
                out["single"] = await measure("single", full, pts, h)
                out["prefill_only"] = await measure("prefill_only", full, prefill_only_points(pts), h)
            return out
        if kind == "two_plain":
            with h.two_plain() as servers:
                rr = round_robin_proxy(client, [srv.base_url for srv in servers])
                await warm_up(rr, h)
                out["two_plain"] = await measure("two_plain", rr, pts, h)
            return out
        with h.pair(kind) as pair:
            p_url, d_url = pair.prefill.base_url, pair.decode.base_url
            if kind == "pull":
                proxy = pull_proxy(client, p_url, d_url)
                await warm_up(proxy, h)
                out["pull"] = await measure("pull", proxy, pts, h)
            elif kind == "push":
                engine = pair.prefill.kv_transfer_config["engine_id"]
                proxy = push_proxy(client, p_url, d_url, engine, "127.0.0.1", pair.p_side_port, 1)
                await warm_up(proxy, h)
                out["push"] = await measure("push", proxy, pts, h)
            else:
                from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

                logs = (pair.prefill.log_path, pair.decode.log_path)
                async with pair.scheduler.security().aio_channel(pair.scheduler.address) as ch:
                    stub = pb_grpc.SchedulerStub(ch)
                    ours = [("ours", ours_proxy(client, stub)), ("ours_ft", ours_ft_proxy(client, stub))]
                    if not a.no_grpc:
                        ours.append(("ours_grpc", grpc_proxy(stub)))
                    if a.interleave:
                        for _, proxy in ours:
                            await warm_up(proxy, h)
                        out.update(await measure_interleaved(ours, pts, h, logs))
                    else:
                        for name, proxy in ours:
                            await warm_up(proxy, h)
                            out[name] = await measure(name, proxy, pts, h, logs)
        return out
    finally:
        await client.close()


def derive(results: dict[str, list[PointResult]], raw: dict[int, dict[str, float]], model: ModelInfo) -> list[dict]:
    """Per point: hand-off overhead of each P/D setup and the ratios of ours to upstream."""
    by = {name: {(r.prompt_len, r.max_tokens, r.rate): r for r in rs} for name, rs in results.items()}
    pre_by = {(r.prompt_len, r.rate): r for r in results.get("prefill_only", [])}
    rows = []
    for (length, out, rate), single in by.get("single", {}).items():
        pre = pre_by.get((length, rate))
        kv = model.kv_bytes(length)
        row: dict[str, Any] = {
            "prompt_len": length,
            "max_tokens": out,
            "rate": rate,
            "kv_bytes": kv,
            "raw_nixl_ms": raw.get(kv, {}).get("p50_ms", math.nan),
            "prefill_only_ttft_p50_ms": pre.ttft_p50_ms if pre else math.nan,
            "single_tpot_p50_ms": single.tpot_p50_ms,
        }
        for name in ("pull", "push", "ours", "ours_ft", "ours_grpc"):
            r = by.get(name, {}).get((length, out, rate))
            if r is None:
                continue
            handoff = r.ttft_p50_ms - row["prefill_only_ttft_p50_ms"] - single.tpot_p50_ms
            row[f"handoff_{name}_ms"] = handoff
            row[f"sustained_{name}"] = r.sustained
        for ours in ("ours", "ours_ft", "ours_grpc"):
            o = by.get(ours, {}).get((length, out, rate))
            for up in ("push", "pull"):
                u = by.get(up, {}).get((length, out, rate))
                if o and u:
                    row[f"ttft_{ours}/{up}"] = o.ttft_p50_ms / u.ttft_p50_ms
                    row[f"tpot_{ours}/{up}"] = o.tpot_p50_ms / u.tpot_p50_ms
            if f"handoff_{ours}_ms" in row:
                row[f"handoff_{ours}/nixl"] = row[f"handoff_{ours}_ms"] / row["raw_nixl_ms"]
        rows.append(row)
    return rows


def goals(results: dict[str, list[PointResult]], derived: list[dict]) -> list[dict]:
    """Per prompt length and output length, at the highest rate that ours, push and pull all sustained."""
    by = {name: {(r.prompt_len, r.max_tokens, r.rate): r for r in rs} for name, rs in results.items()}
    out = []
    for length, mt in sorted({(d["prompt_len"], d["max_tokens"]) for d in derived}):
        rows = [d for d in derived if (d["prompt_len"], d["max_tokens"]) == (length, mt)]
        ok = [
            d
            for d in rows
            if all(
                by.get(n, {}).get((length, mt, d["rate"])) is not None and by[n][(length, mt, d["rate"])].sustained
                for n in ("ours", "push", "pull")
            )
        ]
        if not ok:
            out.append(
                {
                    "prompt_len": length,
                    "max_tokens": mt,
                    "rate": None,
                    "note": "no rate sustained by ours, push and pull",
                }
            )
            continue
        d = max(ok, key=lambda x: x["rate"])
        light = min(rows, key=lambda x: x["rate"])
        g = {
            "prompt_len": length,
            "max_tokens": mt,
            "rate": d["rate"],
            "ttft_ours/push": d.get("ttft_ours/push"),
            "ttft_ours/pull": d.get("ttft_ours/pull"),
            "tpot_ours/push": d.get("tpot_ours/push"),
            "handoff_ours/nixl_light": light.get("handoff_ours/nixl"),
            "light_rate": light["rate"],
        }
        g["pass_ttft_push"] = (g["ttft_ours/push"] or math.inf) <= GOAL_TTFT_VS_PUSH
        g["pass_ttft_pull"] = (g["ttft_ours/pull"] or math.inf) <= GOAL_TTFT_VS_PULL
        g["pass_tpot_push"] = (g["tpot_ours/push"] or math.inf) <= GOAL_TPOT_VS_PUSH
        g["pass_handoff"] = (g["handoff_ours/nixl_light"] or math.inf) <= GOAL_HANDOFF_VS_NIXL
        out.append(g)
    return out


# ----- report ------------------------------------------------------------------------------------


def _f(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    return f"{x:.{nd}f}"


def _rate_cell(g: dict[str, Any] | None) -> str:
    """A goodput-summary cell: the highest rate at >= target attainment and the goodput there."""
    if not g:
        return "–"
    if g.get("max_rate") is None:
        lowest = min(g.get("rates") or [math.nan])
        return f"< {lowest:g} (best {_f(g.get('best_goodput_rps'), 2)})"
    return f"{g['max_rate']:g} ({_f(g.get('goodput_rps_at_max_rate'), 2)})"


def _slo_line(res: dict[str, Any]) -> str:
    slo = res.get("slo") or {}
    per = slo.get("per_prompt_len") or {}
    known = {k: v for k, v in per.items() if v}
    if not known:
        return (
            "SLOs unknown (no `single` run for the unloaded base and no `--slo-ttft-ms`/`--slo-tpot-ms`): no goodput."
        )
    parts = ", ".join(f"L={k}: TTFT ≤ {v['ttft_ms']:.0f} ms, TPOT ≤ {v['tpot_ms']:.1f} ms" for k, v in known.items())
    return f"SLOs ({slo.get('source', '')}): {parts}."


def markdown(res: dict[str, Any]) -> str:
    results: dict[str, list[dict]] = res["results"]
    cfg = res["config"]
    outs = cfg.get("output_lens") or [cfg["max_tokens"]]
    target = res.get("slo", {}).get("attainment_target", SLO_ATTAINMENT)
    lines = [
        f"Model `{cfg['model_dir']}` ({cfg['model']['layers']} layers, {cfg['model']['kv_heads']} KV heads × "
        f"{cfg['model']['head_dim']}), {' and '.join(str(o) for o in outs)} output tokens, P on core "
        f"{cfg['prefill_core']}, D on core {cfg['decode_core']}, single instance on core {cfg['prefill_core']}, "
        f"two_plain on both; vLLM executor `{cfg.get('vllm_executor', 'mp')}`; {res['host']}."
        + (
            " Our setups interleaved: one arrival stream per point at its rate, each arrival through one of "
            "them, each with the point's request count (throughput and goodput scaled to the whole rate)."
            if cfg.get("interleave")
            else ""
        ),
        "",
        _slo_line(res),
        "",
        "### Latency and throughput per setup",
        "",
        "| prompt | out | rate /s | n | setup | ok | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
        "1st → 2nd token p50 ms | TPOT from 2nd p50 ms | req/s | SLO met | goodput req/s | hand-off p50 ms | "
        "load1 / foreign vLLMs |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dmap = {(d["prompt_len"], d["max_tokens"], d["rate"]): d for d in res["derived"]}
    keys = sorted(
        {(r["max_tokens"], r["prompt_len"], r["rate"]) for n, rs in results.items() if n != "prefill_only" for r in rs}
    )
    first_out = min((k[0] for k in keys), default=None)
    by = {
        name: {(x["prompt_len"], x["max_tokens"], x["rate"]): x for x in rs}
        for name, rs in results.items()
        if name != "prefill_only"
    }
    pre = {(x["prompt_len"], x["rate"]): x for x in results.get("prefill_only", [])}
    for out, length, rate in keys:
        for name in ("single", "prefill_only", *SETUPS[1:]):
            if name == "prefill_only":
                # One max_tokens=1 reference per prompt length and rate, shown with the first output length.
                r = pre.get((length, rate)) if out == first_out else None
            else:
                r = by.get(name, {}).get((length, out, rate))
            if r is None:
                continue
            handoff = dmap.get((length, out, rate), {}).get(f"handoff_{name}_ms")
            sus = "" if r["sustained"] else " †"
            met = "–" if r.get("slo_attainment") is None else f"{r['slo_attainment'] * 100:.0f} %"
            lines.append(
                f"| {length} | {r.get('max_tokens')} | {rate:g} | {r['requests']} | {name} | {r['ok']} | "
                f"{_f(r['ttft_p50_ms'])} | {_f(r['ttft_p99_ms'])} | {_f(r['tpot_p50_ms'], 2)} | "
                f"{_f(r['tpot_p99_ms'], 2)} | {_f(r.get('gap2_p50_ms'), 2)} | {_f(r.get('tpot_rest_p50_ms'), 2)} | "
                f"{_f(r['throughput_rps'], 2)}{sus} | {met} | "
                f"{_f(r.get('goodput_rps'), 2)} | {_f(handoff)} | {_f(r.get('load1'))} / {r.get('foreign_vllm', 0)} |"
            )
    lines += [
        "",
        "† not sustained (throughput < 0.9 × offered rate, or failures). SLO met: requests with TTFT and "
        "their own mean TPOT both within the SLOs, of all requests (failures miss); goodput = those per second.",
        "",
        f"### Goodput: highest rate with ≥ {target * 100:.0f} % SLO attainment (goodput there, req/s)",
        "",
        _slo_line(res),
        "",
        "| prompt | out | SLO TTFT ms | SLO TPOT ms | " + " | ".join(SETUPS) + " |",
        "|---:|---:|---:|---:|" + "---|" * len(SETUPS),
    ]
    for g in res.get("goodput", []):
        cells = " | ".join(_rate_cell(g["setups"].get(n)) for n in SETUPS)
        lines.append(
            f"| {g['prompt_len']} | {g['max_tokens']} | {_f(g.get('slo_ttft_ms'), 0)} | {_f(g.get('slo_tpot_ms'), 1)} "
            f"| {cells} |"
        )
    lines += [
        "",
        f"Each rate up to the one shown kept ≥ {target * 100:.0f} % of requests within both SLOs; "
        "`< r (best g)`: the lowest rate r already missed (g: the best goodput measured); –: not run.",
        "",
    ]
    if res.get("goodput_by_tpot_slo"):
        lines += [
            "#### The same, across TPOT targets (TTFT target as above)",
            "",
            "| prompt | out | TPOT target | SLO TPOT ms | " + " | ".join(SETUPS) + " |",
            "|---:|---:|---:|---:|" + "---|" * len(SETUPS),
        ]
        for g in res["goodput_by_tpot_slo"]:
            cells = " | ".join(_rate_cell(g["setups"].get(n)) for n in SETUPS)
            lines.append(
                f"| {g['prompt_len']} | {g['max_tokens']} | {g['tpot_factor']:g} × unloaded | "
                f"{_f(g['slo_tpot_ms'], 1)} | {cells} |"
            )
        lines.append("")
    lines += [
        "### Ratios (p50), hand-off and raw NIXL",
        "",
        "| prompt | out | rate /s | KV bytes/req | raw NIXL WRITE ms | TTFT ours/push | TTFT ours/pull | "
        "TPOT ours/push | TPOT ours/pull | hand-off ours ms | hand-off ours/NIXL | TTFT grpc/push | "
        "our write_ms p50 | our released waited_ms p50 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ours = {(r["prompt_len"], r["max_tokens"], r["rate"]): r for r in results.get("ours", [])}
    for d in sorted(res["derived"], key=lambda x: (x["max_tokens"], x["prompt_len"], x["rate"])):
        ph = ours.get((d["prompt_len"], d["max_tokens"], d["rate"]), {}).get("phases", {})
        lines.append(
            f"| {d['prompt_len']} | {d.get('max_tokens')} | {d['rate']:g} | {d['kv_bytes']} | "
            f"{_f(d['raw_nixl_ms'], 3)} | {_f(d.get('ttft_ours/push'), 2)} | {_f(d.get('ttft_ours/pull'), 2)} | "
            f"{_f(d.get('tpot_ours/push'), 2)} | {_f(d.get('tpot_ours/pull'), 2)} | {_f(d.get('handoff_ours_ms'))} | "
            f"{_f(d.get('handoff_ours/nixl'), 0)} | {_f(d.get('ttft_ours_grpc/push'), 2)} | "
            f"{_f(ph.get('write_ms_p50'), 3)} | {_f(ph.get('released_waited_ms_p50'), 1)} |"
        )
    lines += [
        "",
        "### Where our TTFT goes (p50 per phase, joined per request on the transfer id; ms)",
        "",
        "| prompt | out | rate /s | setup | TTFT | sent → WRITE start | WRITE (write_ms) | WRITE start → D release | "
        "D release → first token |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("ours", "ours_ft", "ours_grpc"):
        for r in results.get(name, []):
            ph = r.get("phases") or {}
            lines.append(
                f"| {r['prompt_len']} | {r.get('max_tokens')} | {r['rate']:g} | {name} | {_f(r['ttft_p50_ms'])} | "
                f"{_f(ph.get('to_write_start_ms_p50'))} | {_f(ph.get('write_ms_p50'), 2)} | "
                f"{_f(ph.get('write_start_to_release_ms_p50'), 2)} | {_f(ph.get('release_to_first_ms_p50'), 1)} |"
            )
    lines += [
        "",
        "### Goals (at the highest rate that ours, push and pull all sustained; hand-off at the lightest rate)",
        "",
        f"| prompt | out | rate /s | TTFT ours/push (≤ {GOAL_TTFT_VS_PUSH}) | TTFT ours/pull (≤ {GOAL_TTFT_VS_PULL}) | "
        f"TPOT ours/push (≤ {GOAL_TPOT_VS_PUSH}) | hand-off/NIXL at light load (≤ {GOAL_HANDOFF_VS_NIXL}) |",
        "|---:|---:|---:|---|---|---|---|",
    ]
    for g in res["goals"]:
        if g.get("rate") is None:
            lines.append(f"| {g['prompt_len']} | {g.get('max_tokens')} | – | {g['note']} | | | |")
            continue
        lines.append(
            f"| {g['prompt_len']} | {g.get('max_tokens')} | {g['rate']:g} | {_f(g['ttft_ours/push'], 2)} "
            f"{_f(g['pass_ttft_push'])} | {_f(g['ttft_ours/pull'], 2)} {_f(g['pass_ttft_pull'])} | "
            f"{_f(g['tpot_ours/push'], 2)} {_f(g['pass_tpot_push'])} | {_f(g['handoff_ours/nixl_light'], 0)} "
            f"{_f(g['pass_handoff'])} |"
        )
    lines += [
        "",
        "Hand-off = TTFT p50 − prefill-only TTFT p50 (single instance, max_tokens=1, same prompts and arrivals) − "
        "single-instance TPOT p50. Raw NIXL = median single-descriptor NIXL WRITE of the KV bytes (UCX, loopback).",
    ]
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out_dir: Path, stem: str = "serving") -> list[str]:
    """``<stem>_ttft.png``, ``<stem>_tpot.png`` (p50 and p99 vs rate) and ``<stem>_goodput.png``
    (goodput and SLO attainment vs rate); one column per prompt length and output length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, list[dict]] = res["results"]
    cols = sorted(
        {(r["prompt_len"], r["max_tokens"]) for n, rs in results.items() if n != "prefill_only" for r in rs},
        key=lambda k: (k[1], k[0]),
    )
    if not cols:
        return []

    def series(name: str, length: int, out: int) -> list[dict[str, Any]]:
        rs = (r for r in results.get(name, []) if (r["prompt_len"], r["max_tokens"]) == (length, out))
        return sorted(rs, key=lambda r: r["rate"])

    def series_all(length: int, out: int) -> list[dict[str, Any]]:
        return [r for name in SETUPS for r in series(name, length, out)]

    def num(x: Any) -> float:
        return math.nan if x is None else float(x)

    written = []
    for metric, title in (("ttft", "TTFT"), ("tpot", "TPOT")):
        fig, axes = plt.subplots(1, len(cols), figsize=(5 * len(cols), 4), squeeze=False)
        for ax, (length, out) in zip(axes[0], cols, strict=True):
            for name in SETUPS:
                rs = series(name, length, out)
                if not rs:
                    continue
                x = [r["rate"] for r in rs]
                (line,) = ax.plot(x, [num(r[f"{metric}_p50_ms"]) for r in rs], marker="o", label=f"{name} p50")
                ax.plot(x, [num(r[f"{metric}_p99_ms"]) for r in rs], ls="--", color=line.get_color(), alpha=0.6)
            ax.set_title(f"{title}, prompt {length}, {out} out (dashed: p99)", fontsize=9)
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel(f"{title} (ms)")
            if metric == "ttft":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stem}_{metric}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    target = res.get("slo", {}).get("attainment_target", SLO_ATTAINMENT)
    fig, axes = plt.subplots(2, len(cols), figsize=(5 * len(cols), 7), squeeze=False)
    for j, (length, out) in enumerate(cols):
        top, bottom = axes[0][j], axes[1][j]
        for name in SETUPS:
            rs = series(name, length, out)
            if not rs or rs[0].get("slo_attainment") is None:
                continue
            x = [r["rate"] for r in rs]
            (line,) = top.plot(x, [num(r.get("goodput_rps")) for r in rs], marker="o", label=name)
            bottom.plot(x, [num(r.get("slo_attainment")) * 100 for r in rs], marker="o", color=line.get_color())
        top_rate = max(r["rate"] for r in series_all(length, out))
        top.plot([0, top_rate], [0, top_rate], ls=":", color="grey", lw=1)
        top.set_title(f"goodput, prompt {length}, {out} out (dotted: = offered)", fontsize=9)
        top.set_ylabel("goodput (req/s)")
        bottom.axhline(target * 100, ls=":", color="grey", lw=1)
        bottom.set_title(f"SLO attainment (dotted: {target * 100:.0f} %)", fontsize=9)
        bottom.set_ylabel("requests within both SLOs (%)")
        bottom.set_ylim(-5, 105)
        for ax in (top, bottom):
            ax.set_xlabel("offered rate (req/s)")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"{stem}_goodput.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(str(path))
    return written


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one prompt length, two rates, few requests")
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument(
        "--setups",
        default="single,two_plain,pull,push,ours",
        help="comma list of single,two_plain,pull,push,ours (ours also runs ours_grpc unless --no-grpc)",
    )
    ap.add_argument("--no-grpc", action="store_true", help="skip the ours_grpc (scheduler Generate) runs")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="our setups (ours, ours_ft, ours_grpc) in one arrival stream per point, each arrival through one "
        "of them, each with the point's request count (paired under the same conditions; the load is the rate)",
    )
    ap.add_argument("--prompt-lens", default="512,1024,2048")
    ap.add_argument("--rates", default="", help="explicit rates (req/s) for every prompt length")
    ap.add_argument(
        "--rate-units",
        default="2,6,12,20",
        help="rates as multiples of rate-scale/prompt-len (default: 2,6,12,20 req/s at 1024 tokens)",
    )
    ap.add_argument("--rate-scale", type=float, default=1024.0)
    ap.add_argument("--requests", type=int, default=48, help="requests per point (upper bound)")
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-point-s", type=float, default=20.0, help="cap on requests/rate per point")
    ap.add_argument(
        "--output-lens", default="16,128", help="output tokens per request; the whole sweep runs once per length"
    )
    ap.add_argument("--max-tokens", type=int, default=None, help="one output length (same as --output-lens N)")
    ap.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="TTFT target of every request (default 0: --slo-scale x the single instance's unloaded TTFT p50)",
    )
    ap.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=0.0,
        help="mean-TPOT target of every request (default 0: --slo-scale x the single instance's unloaded TPOT p50)",
    )
    ap.add_argument("--slo-scale", type=float, default=3.0, help="SLO = this x unloaded p50, per prompt length")
    ap.add_argument(
        "--slo-base-n", type=int, default=3, help="sequential requests per prompt length for the unloaded p50"
    )
    ap.add_argument("--max-model-len", type=int, default=0, help="default: longest prompt + max-tokens, rounded")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--kv-buffer-device", default="cpu")
    ap.add_argument("--prefill-core", type=int, default=None)
    ap.add_argument("--decode-core", type=int, default=None)
    ap.add_argument(
        "--scheduler-core",
        type=int,
        default=None,
        help="pin the scheduler's threads to this core (default: not pinned, the OS places them)",
    )
    ap.add_argument(
        "--executor",
        choices=("uni", "mp"),
        default=None,
        help="how every one-rank vLLM runs its model: uni (in the EngineCore process, the default) or mp "
        "(a Worker process; vLLM's CPU default). Default: $KVPUSH_VLLM_EXECUTOR, else uni",
    )
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin process trees (GPU machines)")
    ap.add_argument("--prefill-env", action="append", default=[], help="KEY=VAL for P (and single), repeatable")
    ap.add_argument("--decode-env", action="append", default=[], help="KEY=VAL for D, repeatable")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM argument, repeatable")
    ap.add_argument(
        "--connector-extra",
        action="append",
        default=[],
        help="KEY=VAL added to both kvpush engines' kv_connector_extra_config, repeatable",
    )
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    ap.add_argument("--ready-timeout", type=float, default=400.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--nixl-reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--wait-quiet-s", type=float, default=0.0, help="before each setup, wait up to this long for foreign vLLMs"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "serving.json")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "bench-serving")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_lens = "1024"
        if not args.rates:
            args.rate_units = "4,16"
        args.requests = min(args.requests, 16)
        args.min_requests = min(args.min_requests, 16)
        args.warmup = min(args.warmup, 2)
    args.prompt_lens = [int(x) for x in str(args.prompt_lens).split(",") if x]
    if args.max_tokens is not None:
        args.output_lens = str(args.max_tokens)
    args.output_lens = sorted({int(x) for x in str(args.output_lens).split(",") if x})
    if not args.output_lens or min(args.output_lens) < 1:
        ap.error("--output-lens needs positive lengths")
    args.max_tokens = max(args.output_lens)
    args.rates = [float(x) for x in str(args.rates).split(",") if x]
    args.rate_units = [float(x) for x in str(args.rate_units).split(",") if x]
    args.setups = [x for x in str(args.setups).split(",") if x]
    bad = set(args.setups) - set(KINDS)
    if bad:
        ap.error(f"unknown setups {sorted(bad)}")
    if not args.max_model_len:
        need = max(args.prompt_lens) + max(args.output_lens)
        args.max_model_len = 1 << (need - 1).bit_length()
    return args


def wait_quiet(h: Harness, timeout_s: float) -> None:
    """On a shared machine: wait (bounded) until no foreign vLLM processes run."""
    deadline = time.monotonic() + timeout_s
    n = foreign_vllm_processes()
    if n and timeout_s > 0:
        h.note(f"{n} foreign vLLM processes running; waiting up to {timeout_s:.0f} s for them to end")
    while n and time.monotonic() < deadline:
        time.sleep(5)
        n = foreign_vllm_processes()
    if n:
        h.note(f"warning: {n} foreign vLLM processes share the machine; results are contaminated")


def _relative(path: Path) -> str:
    """A path as the report shows it: relative to the repository when inside it."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return path.name


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.model_dir / "config.json").exists():
        from scripts.cluster.vllm import make_model

        make_model(args.model_dir)
    h = Harness(args)
    if args.max_model_len > h.model.max_positions:
        raise SystemExit(f"--max-model-len {args.max_model_len} exceeds the model's {h.model.max_positions}")
    pts = points(args)
    h.note(f"points: {[p.key + f'(n={p.requests})' for p in pts]}; setups {args.setups}; logs in {h.run_dir}")
    t_start = time.monotonic()
    sizes = sorted({h.model.kv_bytes(p.prompt_len) for p in pts})
    raw = raw_nixl_times(sizes, args.nixl_reps, h.p_core if args.pin else None)
    h.note("raw NIXL WRITE: " + ", ".join(f"{n} B {v['p50_ms']:.3f} ms" for n, v in raw.items()))
    results: dict[str, list[PointResult]] = {}
    setup_s: dict[str, float] = {}
    for kind in args.setups:
        t0 = time.monotonic()
        wait_quiet(h, args.wait_quiet_s)
        h.note(f"setup {kind}: starting")
        try:
            results.update(asyncio.run(run_setup(kind, h, pts)))
        except Exception as exc:  # one broken setup must not lose the others
            h.note(f"setup {kind} failed: {type(exc).__name__}: {exc}")
        setup_s[kind] = time.monotonic() - t0
    slos = slos_for(args.prompt_lens, h.unloaded, args.slo_scale, args.slo_ttft_ms, args.slo_tpot_ms)
    apply_slo(results, slos)
    derived = derive(results, raw, h.model)
    fixed = args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0
    slo_info = {
        "source": (
            "fixed by --slo-ttft-ms/--slo-tpot-ms"
            if fixed
            else f"{args.slo_scale:g} × the single instance's unloaded p50 unless fixed by a flag"
        ),
        "scale": args.slo_scale,
        "ttft_ms_flag": args.slo_ttft_ms,
        "tpot_ms_flag": args.slo_tpot_ms,
        "attainment_target": SLO_ATTAINMENT,
        "unloaded": {str(k): v for k, v in h.unloaded.items()},
        "per_prompt_len": {str(k): (asdict(v) if v else None) for k, v in slos.items()},
    }
    res: dict[str, Any] = {
        "host": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "config": {
            **{k: (_relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": asdict(h.model),
            "prefill_core": h.p_core,
            "decode_core": h.d_core,
            "affinity_shim": h.shim is not None,
            "vllm_executor": h.executor,
        },
        "points": [asdict(p) for p in pts],
        "raw_nixl": {str(k): v for k, v in raw.items()},
        "results": {k: [asdict(r) for r in v] for k, v in results.items()},
        "derived": derived,
        "slo": slo_info,
        "goodput": goodput_summary(results),
        "goodput_by_tpot_slo": tpot_slo_sweep(results, slos, h.unloaded),
        "setup_seconds": setup_s,
        "total_seconds": time.monotonic() - t_start,
    }
    res["goals"] = goals(results, derived)
    res = _jsonable(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    args.out.with_suffix(".md").write_text(md)
    res["plots"] = plots(res, args.out.parent, args.out.stem)
    sys.stdout.write(md)
    sys.stdout.write(f"\nresults: {args.out}, plots: {', '.join(res['plots'])}; {res['total_seconds']:.0f} s\n")
    return 0 if all(r.ok == r.requests for rs in results.values() for r in rs) and results else 1


if __name__ == "__main__":
    raise SystemExit(main())

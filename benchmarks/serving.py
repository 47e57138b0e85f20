"""Serving benchmark: kvpush against vLLM's own NIXL connectors and one plain instance.

Setups, one after another on the same machine, with the same token-id prompts:

* ``single``: one plain vLLM (reference); also run with ``max_tokens=1`` for the prefill-only TTFT.
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

Per setup and point: TTFT and TPOT p50/p99, request throughput, and the hand-off overhead
``TTFT p50 - prefill-only TTFT p50 - single-instance TPOT p50``, beside the KV bytes per request and
the time of one single-descriptor NIXL WRITE of those bytes (measured in the same run). Writes
``bench-results/serving.json``, ``serving.md`` (also printed) and PNG plots.

Usage: ``python -m benchmarks.serving [--quick] [--prompt-lens 512,1024,2048] [--rates ...]``.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SETUPS = ("single", "pull", "push", "ours", "ours_grpc")
PAIRS = ("pull", "push", "ours")  # P/D pairs to start; ``ours`` serves ``ours`` and ``ours_grpc``
LABELS = {
    "single": "single instance",
    "prefill_only": "single, max_tokens=1",
    "pull": "vLLM NixlConnector (pull), sequential proxy",
    "push": "vLLM NixlPushConnector, concurrent proxy",
    "ours": "kvpush, Assign + concurrent proxy",
    "ours_grpc": "kvpush, scheduler Generate (gRPC)",
}
GOAL_TTFT_VS_PUSH = 0.7
GOAL_TTFT_VS_PULL = 0.4
GOAL_TPOT_VS_PUSH = 1.0
GOAL_HANDOFF_VS_NIXL = 1.2
SUSTAINED = 0.9  # a point is sustained when throughput >= 0.9 x offered rate and nothing failed

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

    @property
    def key(self) -> str:
        return f"L{self.prompt_len}_r{self.rate:g}"


@dataclass
class Sample:
    ok: bool
    sent: float  # monotonic seconds
    ttft: float = math.nan
    tpot: float = math.nan
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


def _pct(values: Sequence[float], q: float) -> float:
    v = [x for x in values if not math.isnan(x)]
    return float(np.percentile(np.asarray(v), q)) * 1e3 if v else math.nan


def summarize(setup: str, point: Point, samples: list[Sample]) -> PointResult:
    good = [s for s in samples if s.ok]
    errors = sorted({s.error for s in samples if not s.ok})[:5]
    duration = (max(s.done for s in good) - min(s.sent for s in samples)) if good else math.nan
    tput = len(good) / duration if good and duration > 0 else 0.0
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
    )


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

    def __init__(self, max_tokens: int, request_timeout_s: float) -> None:
        import aiohttp

        self.max_tokens = max_tokens
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

    async def stream(
        self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, rid: str, s: Sample
    ) -> None:
        """Streaming completion; fills TTFT (from ``s.sent``), TPOT and ``done`` into ``s``."""
        body = await self.body(url, prompt, max_tokens, params, stream=True)
        first = last = 0.0
        n = 0
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
                    now = time.monotonic()
                    first = first or now
                    last = now
                    n += got
        record(s, first, last, n, max_tokens)


def record(s: Sample, first: float, last: float, n: int, want: int) -> None:
    if n != want:
        raise RuntimeError(f"got {n} tokens, expected {want}")
    s.ttft = first - s.sent
    s.tpot = (last - first) / (n - 1) if n > 1 else math.nan
    s.done = time.monotonic()
    s.tokens = n
    s.ok = True


Proxy = Callable[[list[int], Sample], Awaitable[None]]


def single_proxy(c: Client, url: str, max_tokens: int) -> Proxy:
    async def run(prompt: list[int], s: Sample) -> None:
        await c.stream(url, prompt, max_tokens, None, uuid.uuid4().hex, s)

    return run


def pull_proxy(c: Client, p_url: str, d_url: str) -> Proxy:
    """vLLM's toy proxy: P (max_tokens=1, do_remote_decode) first, then D with P's params."""

    async def run(prompt: list[int], s: Sample) -> None:
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
        await c.stream(d_url, prompt, c.max_tokens, params, rid, s)

    return run


def push_proxy(c: Client, p_url: str, d_url: str, p_engine: str, p_host: str, p_port: int, tp: int) -> Proxy:
    """vLLM's push demo proxy: both legs at once, D told P's coordinates, the same X-Request-Id."""

    async def run(prompt: list[int], s: Sample) -> None:
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
        await both_legs(c, p_url, d_url, prompt, p_params, d_params, rid, s)

    return run


async def both_legs(
    c: Client,
    p_url: str,
    d_url: str,
    prompt: list[int],
    p_params: dict[str, Any],
    d_params: dict[str, Any],
    rid: str,
    s: Sample,
) -> None:
    prefill = asyncio.create_task(c.once(p_url, prompt, 1, p_params, rid))
    try:
        await c.stream(d_url, prompt, c.max_tokens, d_params, rid, s)
        await prefill
    finally:
        if not prefill.done():
            prefill.cancel()
        with contextlib.suppress(BaseException):
            await prefill  # also retrieves a failure of P when D failed first


def ours_proxy(c: Client, stub: Any, max_tokens: int) -> Proxy:
    """Our scheduler's Assign, then both legs at once with its parameters, then Release."""
    from google.protobuf.json_format import MessageToDict

    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], s: Sample) -> None:
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
                MessageToDict(a.prefill_kv_transfer_params),
                MessageToDict(a.decode_kv_transfer_params),
                rid,
                s,
            )
            outcome = pb.OUTCOME_OK
        finally:
            with contextlib.suppress(Exception):
                await stub.Release(
                    pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=outcome), timeout=10
                )

    return run


def grpc_proxy(stub: Any, max_tokens: int) -> Proxy:
    from kvpush.v1 import kvpush_pb2 as pb

    async def run(prompt: list[int], s: Sample) -> None:
        req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        first = last = 0.0
        n = 0
        async for msg in stub.Generate(req, timeout=120):
            s.transfer_id = s.transfer_id or msg.transfer_id
            if msg.token_ids:
                now = time.monotonic()
                first = first or now
                last = now
                n += len(msg.token_ids)
        record(s, first, last, n, max_tokens)

    return run


async def run_point(proxy: Proxy, prompts: list[list[int]], arrivals: list[float], timeout_s: float) -> list[Sample]:
    """Poisson-timed requests; each bounded by ``timeout_s``."""
    samples = [Sample(ok=False, sent=math.nan) for _ in prompts]
    t0 = time.monotonic() + 0.05

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
        s = samples[i]
        s.sent = time.monotonic()
        s.sent_wall = time.time()
        try:
            await asyncio.wait_for(proxy(prompts[i], s), timeout_s)
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
        self.log = sys.stderr

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
                        role, engine, sched.address, f"http://127.0.0.1:{port}", **sched.connector_extra(role, engine)
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
    out = []
    for length in args.prompt_lens:
        rates = args.rates or [r * args.rate_scale / length for r in args.rate_units]
        for rate in rates:
            n = max(args.min_requests, min(args.requests, int(round(rate * args.max_point_s))))
            out.append(Point(length, round(rate, 3), n))
    return out


async def measure(
    name: str, proxy: Proxy, pts: list[Point], h: Harness, logs: tuple[Path, Path] | None = None
) -> list[PointResult]:
    a = h.args
    res = []
    for pt in pts:
        offs = (_size(logs[0]), _size(logs[1])) if logs else (0, 0)
        t0 = time.monotonic()
        samples = await run_point(proxy, prompts_for(pt, h.model.vocab, a.seed), arrivals_for(pt, a.seed), a.timeout)
        r = summarize(name, pt, samples)
        r.load1 = os.getloadavg()[0]
        r.foreign_vllm = foreign_vllm_processes()
        if logs:
            await asyncio.sleep(0.3)  # let the log lines of the last transfers land
            r.phases = phase_stats(logs[0], logs[1], *offs, samples)
        res.append(r)
        h.note(
            f"{name:>12} L={pt.prompt_len} rate={pt.rate:g}/s n={pt.requests}: ok={r.ok} "
            f"TTFT p50={r.ttft_p50_ms:.1f} p99={r.ttft_p99_ms:.1f} ms TPOT p50={r.tpot_p50_ms:.2f} ms "
            f"{r.throughput_rps:.2f} req/s ({time.monotonic() - t0:.0f} s, load {r.load1:.1f}, "
            f"foreign vLLM procs {r.foreign_vllm}){' ' + r.errors[0] if r.errors else ''}"
        )
        await asyncio.sleep(a.settle_s)
    return res


async def warm_up(proxy: Proxy, h: Harness) -> None:
    """A few sequential then concurrent requests: handshakes, first-call allocations."""
    rng = np.random.default_rng(h.args.seed + 99)
    length = min(h.args.prompt_lens)
    for i in range(h.args.warmup):
        prompt = [int(t) for t in rng.integers(10, h.model.vocab - 10, size=length)]
        s = Sample(ok=False, sent=time.monotonic())
        try:
            await asyncio.wait_for(proxy(prompt, s), h.args.timeout * (3 if i == 0 else 1))
        except Exception as exc:
            h.note(f"warm-up request {i} failed: {type(exc).__name__}: {exc}")
    prompts = [[int(t) for t in rng.integers(10, h.model.vocab - 10, size=length)] for _ in range(4)]
    await run_point(proxy, prompts, [0.0, 0.01, 0.02, 0.03], h.args.timeout)


async def run_setup(kind: str, h: Harness, pts: list[Point]) -> dict[str, list[PointResult]]:
    a = h.args
    client = Client(a.max_tokens, a.timeout)
    out: dict[str, list[PointResult]] = {}
    try:
        if kind == "single":
            with h.single() as srv:
                full = single_proxy(client, srv.base_url, a.max_tokens)
                await warm_up(full, h)
                out["single"] = await measure("single", full, pts, h)
                out["prefill_only"] = await measure("prefill_only", single_proxy(client, srv.base_url, 1), pts, h)
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
                    proxy = ours_proxy(client, stub, a.max_tokens)
                    await warm_up(proxy, h)
                    out["ours"] = await measure("ours", proxy, pts, h, logs)
                    if not a.no_grpc:
                        gen = grpc_proxy(stub, a.max_tokens)
                        await warm_up(gen, h)
                        out["ours_grpc"] = await measure("ours_grpc", gen, pts, h, logs)
        return out
    finally:
        await client.close()


def derive(results: dict[str, list[PointResult]], raw: dict[int, dict[str, float]], model: ModelInfo) -> list[dict]:
    """Per point: hand-off overhead of each P/D setup and the ratios of ours to upstream."""
    by = {name: {(r.prompt_len, r.rate): r for r in rs} for name, rs in results.items()}
    rows = []
    for (length, rate), single in by.get("single", {}).items():
        pre = by.get("prefill_only", {}).get((length, rate))
        kv = model.kv_bytes(length)
        row: dict[str, Any] = {
            "prompt_len": length,
            "rate": rate,
            "kv_bytes": kv,
            "raw_nixl_ms": raw.get(kv, {}).get("p50_ms", math.nan),
            "prefill_only_ttft_p50_ms": pre.ttft_p50_ms if pre else math.nan,
            "single_tpot_p50_ms": single.tpot_p50_ms,
        }
        for name in ("pull", "push", "ours", "ours_grpc"):
            r = by.get(name, {}).get((length, rate))
            if r is None:
                continue
            handoff = r.ttft_p50_ms - row["prefill_only_ttft_p50_ms"] - single.tpot_p50_ms
            row[f"handoff_{name}_ms"] = handoff
            row[f"sustained_{name}"] = r.sustained
        for ours in ("ours", "ours_grpc"):
            o = by.get(ours, {}).get((length, rate))
            for up in ("push", "pull"):
                u = by.get(up, {}).get((length, rate))
                if o and u:
                    row[f"ttft_{ours}/{up}"] = o.ttft_p50_ms / u.ttft_p50_ms
                    row[f"tpot_{ours}/{up}"] = o.tpot_p50_ms / u.tpot_p50_ms
            if f"handoff_{ours}_ms" in row:
                row[f"handoff_{ours}/nixl"] = row[f"handoff_{ours}_ms"] / row["raw_nixl_ms"]
        rows.append(row)
    return rows


def goals(results: dict[str, list[PointResult]], derived: list[dict]) -> list[dict]:
    """Per prompt length, at the highest rate that ours, push and pull all sustained."""
    by = {name: {(r.prompt_len, r.rate): r for r in rs} for name, rs in results.items()}
    out = []
    for length in sorted({d["prompt_len"] for d in derived}):
        rows = [d for d in derived if d["prompt_len"] == length]
        ok = [
            d
            for d in rows
            if all(
                by.get(n, {}).get((length, d["rate"])) is not None and by[n][(length, d["rate"])].sustained
                for n in ("ours", "push", "pull")
            )
        ]
        if not ok:
            out.append({"prompt_len": length, "rate": None, "note": "no rate sustained by ours, push and pull"})
            continue
        d = max(ok, key=lambda x: x["rate"])
        light = min(rows, key=lambda x: x["rate"])
        g = {
            "prompt_len": length,
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


def markdown(res: dict[str, Any]) -> str:
    results: dict[str, list[dict]] = res["results"]
    cfg = res["config"]
    lines = [
        f"Model `{cfg['model_dir']}` ({cfg['model']['layers']} layers, {cfg['model']['kv_heads']} KV heads × "
        f"{cfg['model']['head_dim']}), {cfg['max_tokens']} output tokens, P on core {cfg['prefill_core']}, "
        f"D on core {cfg['decode_core']}, single instance on core {cfg['prefill_core']}; {res['host']}.",
        "",
        "### Latency and throughput per setup",
        "",
        "| prompt | rate /s | n | setup | ok | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | req/s | "
        "hand-off p50 ms | load1 / foreign vLLMs |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dmap = {(d["prompt_len"], d["rate"]): d for d in res["derived"]}
    keys = sorted({(r["prompt_len"], r["rate"]) for rs in results.values() for r in rs})
    for length, rate in keys:
        for name in ("single", "prefill_only", "pull", "push", "ours", "ours_grpc"):
            r = next((x for x in results.get(name, []) if (x["prompt_len"], x["rate"]) == (length, rate)), None)
            if r is None:
                continue
            handoff = dmap.get((length, rate), {}).get(f"handoff_{name}_ms")
            sus = "" if r["sustained"] else " †"
            lines.append(
                f"| {length} | {rate:g} | {r['requests']} | {name} | {r['ok']} | {_f(r['ttft_p50_ms'])} | "
                f"{_f(r['ttft_p99_ms'])} | {_f(r['tpot_p50_ms'], 2)} | {_f(r['tpot_p99_ms'], 2)} | "
                f"{_f(r['throughput_rps'], 2)}{sus} | {_f(handoff)} | {_f(r.get('load1'))} / {r.get('foreign_vllm', 0)} |"
            )
    lines += [
        "",
        "† not sustained (throughput < 0.9 × offered rate, or failures).",
        "",
        "### Ratios (p50), hand-off and raw NIXL",
        "",
        "| prompt | rate /s | KV bytes/req | raw NIXL WRITE ms | TTFT ours/push | TTFT ours/pull | TPOT ours/push | "
        "TPOT ours/pull | hand-off ours ms | hand-off ours/NIXL | TTFT grpc/push | our write_ms p50 | "
        "our released waited_ms p50 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ours = {(r["prompt_len"], r["rate"]): r for r in results.get("ours", [])}
    for d in res["derived"]:
        ph = ours.get((d["prompt_len"], d["rate"]), {}).get("phases", {})
        lines.append(
            f"| {d['prompt_len']} | {d['rate']:g} | {d['kv_bytes']} | {_f(d['raw_nixl_ms'], 3)} | "
            f"{_f(d.get('ttft_ours/push'), 2)} | {_f(d.get('ttft_ours/pull'), 2)} | {_f(d.get('tpot_ours/push'), 2)} | "
            f"{_f(d.get('tpot_ours/pull'), 2)} | {_f(d.get('handoff_ours_ms'))} | {_f(d.get('handoff_ours/nixl'), 0)} | "
            f"{_f(d.get('ttft_ours_grpc/push'), 2)} | {_f(ph.get('write_ms_p50'), 3)} | "
            f"{_f(ph.get('released_waited_ms_p50'), 1)} |"
        )
    lines += [
        "",
        "### Where our TTFT goes (p50 per phase, joined per request on the transfer id; ms)",
        "",
        "| prompt | rate /s | setup | TTFT | sent → WRITE start | WRITE (write_ms) | WRITE start → D release | "
        "D release → first token |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("ours", "ours_grpc"):
        for r in results.get(name, []):
            ph = r.get("phases") or {}
            lines.append(
                f"| {r['prompt_len']} | {r['rate']:g} | {name} | {_f(r['ttft_p50_ms'])} | "
                f"{_f(ph.get('to_write_start_ms_p50'))} | {_f(ph.get('write_ms_p50'), 2)} | "
                f"{_f(ph.get('write_start_to_release_ms_p50'), 2)} | {_f(ph.get('release_to_first_ms_p50'), 1)} |"
            )
    lines += [
        "",
        "### Goals (at the highest rate that ours, push and pull all sustained; hand-off at the lightest rate)",
        "",
        f"| prompt | rate /s | TTFT ours/push (≤ {GOAL_TTFT_VS_PUSH}) | TTFT ours/pull (≤ {GOAL_TTFT_VS_PULL}) | "
        f"TPOT ours/push (≤ {GOAL_TPOT_VS_PUSH}) | hand-off/NIXL at light load (≤ {GOAL_HANDOFF_VS_NIXL}) |",
        "|---:|---:|---|---|---|---|",
    ]
    for g in res["goals"]:
        if g.get("rate") is None:
            lines.append(f"| {g['prompt_len']} | – | {g['note']} | | | |")
            continue
        lines.append(
            f"| {g['prompt_len']} | {g['rate']:g} | {_f(g['ttft_ours/push'], 2)} {_f(g['pass_ttft_push'])} | "
            f"{_f(g['ttft_ours/pull'], 2)} {_f(g['pass_ttft_pull'])} | {_f(g['tpot_ours/push'], 2)} "
            f"{_f(g['pass_tpot_push'])} | {_f(g['handoff_ours/nixl_light'], 0)} {_f(g['pass_handoff'])} |"
        )
    lines += [
        "",
        "Hand-off = TTFT p50 − prefill-only TTFT p50 (single instance, max_tokens=1, same prompts and arrivals) − "
        "single-instance TPOT p50. Raw NIXL = median single-descriptor NIXL WRITE of the KV bytes (UCX, loopback).",
    ]
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out_dir: Path, stem: str = "serving") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, list[dict]] = res["results"]
    lengths = sorted({r["prompt_len"] for rs in results.values() for r in rs})
    written = []
    for metric, title in (("ttft", "TTFT"), ("tpot", "TPOT")):
        fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
        for ax, length in zip(axes[0], lengths, strict=True):
            for name in ("single", "pull", "push", "ours", "ours_grpc"):
                rs = sorted((r for r in results.get(name, []) if r["prompt_len"] == length), key=lambda r: r["rate"])
                if not rs:
                    continue
                x = [r["rate"] for r in rs]
                (line,) = ax.plot(x, [r[f"{metric}_p50_ms"] for r in rs], marker="o", label=f"{name} p50")
                ax.plot(x, [r[f"{metric}_p99_ms"] for r in rs], ls="--", color=line.get_color(), alpha=0.6)
            ax.set_title(f"{title}, prompt {length} tokens (dashed: p99)")
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
    ap.add_argument("--setups", default="single,pull,push,ours", help="comma list of single,pull,push,ours")
    ap.add_argument("--no-grpc", action="store_true", help="skip the ours_grpc (scheduler Generate) runs")
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
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=0, help="default: longest prompt + max-tokens, rounded")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--kv-buffer-device", default="cpu")
    ap.add_argument("--prefill-core", type=int, default=None)
    ap.add_argument("--decode-core", type=int, default=None)
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin process trees (GPU machines)")
    ap.add_argument("--prefill-env", action="append", default=[], help="KEY=VAL for P (and single), repeatable")
    ap.add_argument("--decode-env", action="append", default=[], help="KEY=VAL for D, repeatable")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM argument, repeatable")
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
    args.rates = [float(x) for x in str(args.rates).split(",") if x]
    args.rate_units = [float(x) for x in str(args.rate_units).split(",") if x]
    args.setups = [x for x in str(args.setups).split(",") if x]
    bad = set(args.setups) - {"single", *PAIRS}
    if bad:
        ap.error(f"unknown setups {sorted(bad)}")
    if not args.max_model_len:
        need = max(args.prompt_lens) + args.max_tokens
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
    derived = derive(results, raw, h.model)
    res: dict[str, Any] = {
        "host": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "config": {
            **{k: (_relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": asdict(h.model),
            "prefill_core": h.p_core,
            "decode_core": h.d_core,
            "affinity_shim": h.shim is not None,
        },
        "points": [asdict(p) for p in pts],
        "raw_nixl": {str(k): v for k, v in raw.items()},
        "results": {k: [asdict(r) for r in v] for k, v in results.items()},
        "derived": derived,
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

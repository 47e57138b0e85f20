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
* ``single_paired`` (``--paired-single-core C``): one plain vLLM on core C, started with our pair,
  whose requests join our setups' interleaved arrival stream: the same moments of the machine as
  ours, so TTFT differences and TPOT ratios against it are paired (at light load, where it and our
  engines seldom run at once; separate launches on a shared VM drift by tens of percent).

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

The run itself is here (servers, arrivals, measurement, logs); the setups' data types and
per-point summary are in ``serving_model``, the proxies in ``serving_proxies``, SLOs and goodput in
``serving_slo``, the report and plots in ``serving_report``.

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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.calibration import cpu_calibration_ms
from benchmarks.serving_model import (
    KINDS,
    OURS_KINDS,
    ROOT,
    ModelInfo,
    Point,
    PointResult,
    Sample,
    percentile,
    summarize,
)
from benchmarks.serving_proxies import (
    Client,
    Proxy,
    grpc_proxy,
    ours_ft_proxy,
    ours_proxy,
    pull_proxy,
    push_proxy,
    round_robin_proxy,
    single_proxy,
)
from benchmarks.serving_report import derive, goals, markdown, paired, plots
from benchmarks.serving_slo import SLO_ATTAINMENT, apply_slo, goodput_summary, slos_for, tpot_slo_sweep

_KV_RE = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s]+)")


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
        env = dict(env)
        # A PYTHONPATH in the server's own environment goes first (a benchmark's probe), not instead.
        pythonpath = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p]
        if self.shim is not None:
            pythonpath.append(str(self.shim))
        pythonpath.append(str(ROOT))
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
    def pair(self, kind: str, extra: Sequence[tuple[Any, int]] = ()) -> Iterator[Pair]:
        """The P/D pair of ``kind`` (with our scheduler for ``ours``); ``extra`` servers (with their
        cores) start side by side with it and stop with it."""
        from kvpush.services.common.vllm_server import free_port
        from scripts.cluster.scheduler import start_scheduler
        from scripts.cluster.vllm import connector_config

        a = self.args
        sched = None
        servers: list[tuple[Any, int | None]] = []
        try:
            p_side, d_side = free_port(), free_port()
            if kind in OURS_KINDS:
                (self.run_dir / kind).mkdir(parents=True, exist_ok=True)
                local: list[str] = []
                if kind == "ours_local":
                    local = [
                        "--local-prefill-wait-ms",
                        str(a.local_prefill_wait_ms),
                        "--local-prefill-max-tokens",
                        str(a.local_prefill_max_tokens),
                        "--local-prefill-ttft-ms",
                        str(a.local_prefill_ttft_ms),
                        "--local-prefill-max-decoding",
                        str(a.local_prefill_max_decoding),
                    ]
                sched = start_scheduler(self.run_dir / kind, extra_args=local)
            for role, core, side, extra_env in (
                ("prefill", self.p_core, p_side, a.prefill_env),
                ("decode", self.d_core, d_side, a.decode_env),
            ):
                env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), **_env_pairs(extra_env)}
                engine = f"{kind}-{role}-{uuid.uuid4().hex[:6]}"
                if kind in OURS_KINDS:
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
            servers.extend(extra)
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
        cal = core_calibration_ms(h)
        for j, (name, _) in enumerate(proxies):
            mine = [s for i, s in enumerate(samples) if which[i] == j]
            r = summarize(name, pt, mine, share=1.0 / k)
            r.load1, r.foreign_vllm, r.cpu_cal_ms = load1, foreign, cal
            if logs:
                r.phases = phase_stats(logs[0], logs[1], *offs, mine)
            res[name].append(r)
            h.note(
                f"{name:>12} L={pt.prompt_len} out={pt.max_tokens} rate={pt.rate:g}/s n={r.requests}"
                + (f" (interleaved with {k - 1} more)" if k > 1 else "")
                + f": ok={r.ok} TTFT p50={r.ttft_p50_ms:.1f} p99={r.ttft_p99_ms:.1f} ms TPOT p50={r.tpot_p50_ms:.2f} ms "
                f"{r.throughput_rps:.2f} req/s ({time.monotonic() - t0:.0f} s, load {load1:.1f}, "
                f"foreign vLLM procs {foreign}, CPU calibration P/D {cal[0]:.1f}/{cal[1]:.1f} ms)"
                f"{' ' + r.errors[0] if r.errors else ''}"
            )
        await asyncio.sleep(a.settle_s)
    return res


def core_calibration_ms(h: Harness) -> list[float]:
    """``cpu_calibration_ms`` on P's core, then on D's (this process pinned there meanwhile, its
    affinity restored after): the same launch can be slow while the VM is not, or the VM slow."""
    before = os.sched_getaffinity(0)
    out = []
    try:
        for core in (h.p_core, h.d_core):
            os.sched_setaffinity(0, {core})
            out.append(round(cpu_calibration_ms(5), 2))
    finally:
        os.sched_setaffinity(0, before)
    return out


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
            "ttft_ms": percentile([x.ttft for x in ok], 50),
            "tpot_ms": percentile([x.tpot for x in ok], 50),
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
        plain = None  # single_paired's server: one plain vLLM in our setups' arrival stream
        if kind == "ours" and a.paired_single_core is not None:
            core = a.paired_single_core
            env = _env_pairs(a.decode_env if core == h.d_core else a.prefill_env)
            plain = h.server("single_paired", core, None, env)
        with h.pair(kind, [(plain, a.paired_single_core)] if plain is not None else []) as pair:
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
                    if kind == "ours_local":
                        frontend = ours_proxy if a.local_prefill_frontend == "assign" else ours_ft_proxy
                        ours = [("ours_local", frontend(client, stub))]
                    else:
                        ours = [("ours", ours_proxy(client, stub)), ("ours_ft", ours_ft_proxy(client, stub))]
                        if not a.no_grpc:
                            ours.append(("ours_grpc", grpc_proxy(stub)))
                    if plain is not None:
                        ours.append(("single_paired", single_proxy(client, plain.base_url)))
                    if a.interleave or plain is not None:
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
        help="comma list of single,two_plain,pull,push,ours,ours_local (ours also runs ours_grpc unless --no-grpc; "
        "ours_local: ours_ft with the scheduler's local prefill, --local-prefill-*)",
    )
    ap.add_argument(
        "--local-prefill-wait-ms",
        type=float,
        default=150.0,
        help="ours_local: the scheduler's --local-prefill-wait-ms (prefill on decode past this prefill queue)",
    )
    ap.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="ours_local: the scheduler's --local-prefill-max-tokens (prompts this short prefill on decode)",
    )
    ap.add_argument(
        "--local-prefill-ttft-ms",
        type=float,
        default=0.0,
        help="ours_local: the scheduler's --local-prefill-ttft-ms (prefill on decode when prefill's first token "
        "would come later than this, and decode's in time)",
    )
    ap.add_argument(
        "--local-prefill-max-decoding",
        type=int,
        default=-1,
        help="ours_local: the scheduler's --local-prefill-max-decoding (the wait and TTFT rules pick only a decode "
        "decoding at most this many requests; -1: any)",
    )
    ap.add_argument(
        "--local-prefill-frontend",
        choices=("handoff", "assign"),
        default="handoff",
        help="ours_local's frontend: handoff (ours_ft's, first token from prefill) or assign (ours', no hand-off: "
        "the scheduler learns prefill's speed from its finished-prefill reports)",
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
    ap.add_argument(
        "--paired-single-core",
        type=int,
        default=None,
        help="with ours: one plain vLLM on this core joins our setups' interleaved arrival stream "
        "(single_paired; implies --interleave for ours), for TTFT and TPOT paired against one instance",
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
    if args.paired_single_core is not None and "ours" not in args.setups:
        ap.error("--paired-single-core joins our setups' arrival stream: it needs ours in --setups")
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
    res["paired"] = paired(results)
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

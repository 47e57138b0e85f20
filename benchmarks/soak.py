"""Soak: sustained load through the scheduler's ``Generate``, and through ``Assign`` as a custom
frontend uses it, on a 2P1D cluster with random faults.

Real processes on this machine: the scheduler, two prefill vLLMs and one decode vLLM with the
connector, mutual TLS on every hop. The expected output of every prompt comes from a plain vLLM
first (stopped before the load starts). Then, for ``--minutes``, ``--clients`` threads send
``Generate`` requests back to back, ``--assign-clients`` threads requests the way a custom
frontend does with the first-token hand-off (docs/first_token.md: ``Assign``, ``AwaitFirstToken``
and both legs at once, ``ReportLegFailure`` for an undelivered prefill leg, the prefill leg's answer
for the first token where the scheduler cannot answer, ``Release``), and ``--stream-clients``
threads the same through one shared ``AssignStream`` that delivers the first tokens
(benchmarks/soak_stream.py; a broken stream is replaced), while a fault thread injects, every
20-60 s, one of:

- ``kill_prefill``: SIGKILL one prefill instance, restart it on the same port;
- ``stop_prefill``: SIGSTOP one prefill instance for a few seconds (a stalled host), then SIGCONT;
- ``restart_scheduler``: SIGKILL the scheduler and restart it on its address;
- ``kill_decode``: SIGKILL the decode instance and restart it (every request on it fails).

Every request ends as ``ok`` (tokens equal to the plain instance's), ``wrong`` (tokens differ: a
corrupted transfer), ``failed`` (a gRPC status, with its reason) or ``hung`` (no answer within its
deadline). Every 5 s the RSS of each process tree and decode's free blocks are sampled, and the
connector counters of how first tokens and completions reached decode are scraped from every
instance's Prometheus endpoint (``COUNTERS``; a restarted instance's counters start again from zero
and are added on). At the end
the load stops, the cluster goes idle, and decode's and each prefill's free blocks are compared with
their idle values before the load. Writes ``runs/soak/soak.json``, ``docs/soak.md`` and
``docs/img/soak_rss.png``.

Run: ``make soak`` (20 minutes; ``ARGS="--minutes 5"`` for a short one). Not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shlex
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import psutil
from google.protobuf.json_format import MessageToDict

from benchmarks.soak_stream import StreamFrontend
from kvpush.services.common.vllm_server import VllmServer, VllmServerError, complete
from kvpush.services.scheduler.assign_client import AssignError
from kvpush.v1 import kvpush_pb2 as pb
from scripts.cluster import REPO
from scripts.cluster.pd import PDCluster, pd_cluster
from scripts.cluster.vllm import make_model

FAULTS = ("kill_prefill", "stop_prefill", "restart_scheduler", "kill_decode")
# The connector counters scraped during the load (every label set of each).
COUNTERS = (
    "kvpush_prefill_completion_notices_total",
    "kvpush_decode_completion_notices_total",
    "kvpush_decode_first_token_paths_total",
    "kvpush_decode_first_tokens_total",
)
WEIGHTS = (4, 3, 2, 1)


@dataclass
class Outcome:
    t: float  # seconds since the load started
    prompt: int
    kind: str  # ok | wrong | failed | hung
    seconds: float
    detail: str = ""
    path: str = "generate"  # generate | assign | stream


@dataclass
class Sample:
    t: float
    rss_mib: dict[str, float]
    decode_free_blocks: int | None
    load_avg: float


@dataclass
class Report:
    minutes: float
    clients: int
    requests: dict[str, int] = field(default_factory=dict)
    requests_by_path: dict[str, dict[str, int]] = field(default_factory=dict)
    failed_reasons: dict[str, int] = field(default_factory=dict)
    faults: list[tuple[float, str, str]] = field(default_factory=list)
    free_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (before, after)
    rss_mib: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # first, max, last
    max_seconds: float = 0.0
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # instance -> series -> total
    stream_frontend: dict[str, int] = field(default_factory=dict)  # StreamFrontend.counts()


def scrape_counters(port: int, names: tuple[str, ...] = COUNTERS, timeout_s: float = 2.0) -> dict[str, float] | None:
    """The samples of ``names`` on the Prometheus endpoint at ``port`` (``name{label="v",...}`` ->
    value); None when the endpoint does not answer (the instance is down or restarting)."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


class CounterTotals:
    """Counter totals over restarts: a value below the last one seen means the process started
    again from zero (a reset between two scrapes that grew past the old value goes unseen)."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], float] = {}
        self.totals: dict[str, dict[str, float]] = {}

    def add(self, instance: str, values: dict[str, float]) -> None:
        for series, value in values.items():
            prev = self.last.get((instance, series), 0.0)
            grown = value - prev if value >= prev else value
            per = self.totals.setdefault(instance, {})
            per[series] = per.get(series, 0.0) + grown
            self.last[(instance, series)] = value


def _tree_rss_mib(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def _statuses(c: PDCluster) -> dict[str, pb.InstanceStatus]:
    try:
        listing = c.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances
    except grpc.RpcError:
        return {}
    return {s.instance.engine_id: s for s in listing if s.alive}


def _loads(c: PDCluster) -> dict[str, pb.LoadReport]:
    return {n: s.load for n, s in _statuses(c).items()}


def _idle_free_blocks(c: PDCluster, names: list[str], timeout_s: float = 120.0) -> dict[str, int]:
    """Free blocks of each instance once idle: waits for reports that show no request and every
    block free but vLLM's null block (a request leaves the connector's books before vLLM frees its
    blocks, so the first idle report may still count them held); at the bound, what idle reports
    showed (-1: never idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = _statuses(c)
        idle = {
            n: statuses[n].load.free_blocks
            for n in names
            if n in statuses and not (statuses[n].load.running_requests or statuses[n].load.waiting_requests)
        }
        if len(idle) == len(names) and all(idle[n] == statuses[n].instance.total_kv_blocks - 1 for n in names):
            return idle
        if time.monotonic() > deadline:
            return {n: -1 for n in names} | idle
        time.sleep(0.5)


class Soak:
    def __init__(
        self,
        c: PDCluster,
        prompts: list[list[int]],
        expected: list[list[int]],
        args: argparse.Namespace,
        stream_frontend: StreamFrontend | None = None,
    ):
        self.c = c
        self.prompts = prompts
        self.expected = expected
        self.args = args
        self.outcomes: list[Outcome] = []
        self.samples: list[Sample] = []
        self.faults: list[tuple[float, str, str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.rng = random.Random(args.seed)
        self.cluster_lock = threading.Lock()  # a fault and a sample never race on a restart
        self.counters = CounterTotals()
        self.stream_frontend = stream_frontend  # for --stream-clients

    def now(self) -> float:
        return time.monotonic() - self.t0

    def client(self, k: int, path: str = "generate") -> None:
        rng = random.Random(self.args.seed * 100 + k + {"generate": 0, "assign": 50, "stream": 75}[path])
        while not self.stop.is_set():
            i = rng.randrange(len(self.prompts))
            start = time.monotonic()
            try:
                if path == "assign":
                    tokens = assign_request(self.c, self.prompts[i], self.args.max_tokens, self.args.deadline_s)
                elif path == "stream":
                    assert self.stream_frontend is not None
                    tokens = self.stream_frontend.request(self.prompts[i], self.args.max_tokens, self.args.deadline_s)
                else:
                    tokens = self.c.generate(self.prompts[i], self.args.max_tokens, timeout_s=self.args.deadline_s)[0]
                kind, detail = ("ok", "") if tokens == self.expected[i] else ("wrong", f"{tokens[:8]}...")
            except grpc.RpcError as exc:
                code = exc.code()
                kind = "hung" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
                detail = f"{code.name}: {(exc.details() or '')[:120]}"
            except AssignError as exc:  # the stream's answer for an assign or a first token
                kind = "hung" if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
                detail = f"{exc.code.name}: {exc.message[:120]}"
            except TimeoutError as exc:  # an HTTP leg (or a stream request) with no answer within the deadline
                kind, detail = "hung", f"timed out: {exc}"[:160]
            except (VllmServerError, OSError) as exc:
                kind, detail = "failed", f"leg: {exc}"[:160]
            except Exception as exc:  # anything else is counted (and named) too: a client thread never dies
                kind, detail = "failed", f"client error: {exc!r}"[:160]
            with self.lock:
                self.outcomes.append(Outcome(self.now(), i, kind, time.monotonic() - start, detail, path))
            if kind == "failed":
                self.stop.wait(0.5)  # the scheduler may have no instance for a moment

    def sample(self) -> None:
        while not self.stop.wait(self.args.sample_s):
            with self.cluster_lock:
                servers = {f"prefill-{i}": s for i, s in enumerate(self.c.prefills)} | {"decode-0": self.c.decode}
                rss = {n: _tree_rss_mib(s.pid) for n, s in servers.items()}
                rss["scheduler"] = _tree_rss_mib(self.c.scheduler.proc.pid)
            self.scrape()
            load = _loads(self.c).get("decode-0")
            self.samples.append(
                Sample(self.now(), rss, load.free_blocks if load else None, round(os.getloadavg()[0], 2))
            )

    def scrape(self) -> None:
        for name, port in self.c.metrics_ports.items():
            values = scrape_counters(port)
            if values is not None:
                self.counters.add(name, values)

    def inject(self) -> None:
        while not self.stop.wait(self.rng.uniform(20, 60)):
            fault = self.rng.choices(FAULTS, WEIGHTS)[0]
            with self.cluster_lock:
                detail = self._inject(fault)
            self.faults.append((round(self.now(), 1), fault, detail))

    def _inject(self, fault: str) -> str:
        c = self.c
        if fault in ("kill_prefill", "stop_prefill"):
            k = self.rng.randrange(len(c.prefills))
            srv = c.prefills[k]
            if fault == "kill_prefill":
                return f"prefill-{k}: " + _restart(srv, self.args.ready_timeout_s)
            assert srv.pid is not None
            secs = self.rng.uniform(2, 6)
            os.killpg(srv.pid, signal.SIGSTOP)
            self.stop.wait(secs)
            os.killpg(srv.pid, signal.SIGCONT)
            return f"prefill-{k} stopped {secs:.1f} s"
        if fault == "restart_scheduler":
            c.scheduler.restart()
            return "scheduler restarted"
        return "decode-0: " + _restart(c.decode, self.args.ready_timeout_s)

    def run(self) -> None:
        threads = [threading.Thread(target=self.client, args=(k,), daemon=True) for k in range(self.args.clients)]
        threads += [
            threading.Thread(target=self.client, args=(k, "assign"), daemon=True)
            for k in range(self.args.assign_clients)
        ]
        threads += [
            threading.Thread(target=self.client, args=(k, "stream"), daemon=True)
            for k in range(self.args.stream_clients)
        ]
        threads += [threading.Thread(target=self.sample, daemon=True)]
        faulter = threading.Thread(target=self.inject, daemon=True)
        for t in threads:
            t.start()
        if not self.args.no_faults:
            faulter.start()
        self.stop.wait(self.args.minutes * 60)
        self.stop.set()
        if faulter.is_alive():
            faulter.join(self.args.ready_timeout_s + 30)
        for t in threads:
            t.join(self.args.deadline_s + 30)
        hung_threads = sum(t.is_alive() for t in threads)
        if self.stream_frontend is not None and not hung_threads:
            self.stream_frontend.close()
        if hung_threads:
            with self.lock:
                self.outcomes.extend(
                    Outcome(self.now(), -1, "hung", 0.0, "client thread stuck") for _ in range(hung_threads)
                )


def assign_request(c: PDCluster, prompt: list[int], max_tokens: int, deadline_s: float) -> list[int]:
    """One request as a custom frontend sends it with the first-token hand-off
    (docs/first_token.md): ``Assign`` asking for it, ``AwaitFirstToken`` and both legs at once (the
    decode leg for one token less), ``ReportLegFailure`` when the prefill leg is not delivered; the
    first token is the scheduler's answer, or the prefill leg's where the scheduler cannot answer
    (it restarted). Returns the request's tokens; raises on a failed request."""
    req = pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=max_tokens, first_token_from_prefill=True)
    a = c.stub.Assign(req, timeout=10)
    outcome = pb.OUTCOME_FAILED
    handoff = a.first_token_from_prefill
    waiting = None
    if handoff:
        waiting = c.stub.AwaitFirstToken.future(
            pb.AwaitFirstTokenRequest(transfer_id=a.transfer_id, epoch=a.epoch), timeout=deadline_s
        )
    try:
        decode_params = MessageToDict(a.decode_kv_transfer_params)
        n = max_tokens - 1 if handoff else max_tokens
        with ThreadPoolExecutor(1) as pool:
            decoded = pool.submit(complete, a.decode.http_endpoint, prompt, n, decode_params, timeout=deadline_s)
            answered: list[int] = []
            try:
                prefill_params = MessageToDict(a.prefill_kv_transfer_params)
                answered = complete(a.prefill.http_endpoint, prompt, 1, prefill_params, timeout=deadline_s)[0]
            except (VllmServerError, OSError) as exc:
                with contextlib.suppress(grpc.RpcError):
                    c.stub.ReportLegFailure(
                        pb.LegFailure(
                            transfer_id=a.transfer_id, prefill_engine_id=a.prefill.engine_id, reason=str(exc)[:200]
                        ),
                        timeout=10,
                    )
            rest = decoded.result()[0]
        first: list[int] = []
        if waiting is not None:
            try:
                first = [waiting.result().token_id]
            except grpc.RpcError as exc:
                cannot = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED)
                if exc.code() not in cannot or not answered:
                    raise
                first = answered
        outcome = pb.OUTCOME_OK
        return first + rest
    finally:
        if waiting is not None:
            waiting.cancel()
        with contextlib.suppress(grpc.RpcError):
            c.stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=outcome), timeout=10)


def _restart(srv: VllmServer, ready_timeout_s: float) -> str:
    start = time.monotonic()
    srv.restart(kill=True)
    srv.wait_ready(ready_timeout_s)
    core = int(srv.extra_env.get("VLLM_CPU_OMP_THREADS_BIND", "0").split("|")[0] or 0)
    srv.pin_to_cpu(core)
    return f"killed, ready again after {time.monotonic() - start:.0f} s"


def _plot(samples: list[Sample], faults: list[tuple[float, str, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    names = sorted({n for s in samples for n in s.rss_mib})
    ts = [s.t / 60 for s in samples]
    for n in names:
        ax.plot(ts, [s.rss_mib.get(n, 0.0) for s in samples], label=n)
    ax.set_ylabel("RSS of the process tree (MiB)")
    ax.legend(loc="upper left", fontsize=8)
    bx.plot(ts, [s.decode_free_blocks if s.decode_free_blocks is not None else float("nan") for s in samples])
    bx.set_ylabel("decode free blocks")
    bx.set_xlabel("minutes")
    for t, kind, _ in faults:
        for axis in (ax, bx):
            axis.axvline(t / 60, color="grey", alpha=0.3, linestyle="--")
        ax.annotate(kind.replace("_", " "), (t / 60, ax.get_ylim()[1]), fontsize=6, rotation=90, va="top")
    fig.suptitle("kvpush soak: 2P1D under load with random faults")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _markdown(r: Report, args: argparse.Namespace) -> str:
    lines = [
        "# Soak",
        "",
        f"Latest `make soak` run: {r.minutes:g} minutes of load through `Generate` and through `Assign` with the",
        "first-token hand-off as a custom frontend sends it, on 2P1D (tiny seeded Llama,",
        f"vllm-cpu, one core per instance group on 2 cores), {r.clients} `Generate` clients, "
        f"{args.assign_clients} `Assign` clients and {args.stream_clients} clients sharing one `AssignStream`, "
        f"sending {args.prompt_min}-"
        f"{args.prompt_max}-token prompts back to back, {args.max_tokens} output tokens, deadline {args.deadline_s:g} s,",
        "random faults every 20-60 s. Load average at the end (1/5/15 min): "
        + " / ".join(f"{x:.2f}" for x in r.load_avg)
        + ".",
        "",
        "| requests | count | `Generate` | `Assign` | `AssignStream` |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {k} | {v} | {r.requests_by_path.get('generate', {}).get(k, 0)} | "
            f"{r.requests_by_path.get('assign', {}).get(k, 0)} | {r.requests_by_path.get('stream', {}).get(k, 0)} |"
            for k, v in r.requests.items()
        ),
        "",
        f"Slowest request: {r.max_seconds:.1f} s.",
        "",
    ]
    if r.stream_frontend:
        lines += [
            "`AssignStream` frontend: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.stream_frontend.items()),
            "",
        ]
    if r.failed_reasons:
        lines += ["| failed with | count |", "|---|---:|", *(f"| {k} | {v} |" for k, v in r.failed_reasons.items()), ""]
    lines += [
        "| instance | idle free blocks before | after |",
        "|---|---:|---:|",
        *(f"| {k} | {a} | {b} |" for k, (a, b) in r.free_blocks.items()),
        "",
        "| process tree | RSS first (MiB) | max | last |",
        "|---|---:|---:|---:|",
        *(f"| {k} | {a:.0f} | {b:.0f} | {c:.0f} |" for k, (a, b, c) in r.rss_mib.items()),
        "",
        "Connector counters over the load (all instances' restarts added up; warm-up included):",
        "",
        "| instance | counter | total |",
        "|---|---|---:|",
        *(f"| {n} | `{k}` | {v:.0f} |" for n, per in r.counters.items() for k, v in per.items()),
        "",
        "Faults injected (seconds into the load):",
        "",
        *(f"- {t:.0f} s: {kind} ({detail})" for t, kind, detail in r.faults),
        "",
        "![RSS and decode free blocks over time](img/soak_rss.png)",
        "",
        "A restarted instance is a new process tree, so its RSS starts again from its start-up size.",
        "Samples pause while the fault thread restarts an instance (the lines are straight across those gaps).",
        'Reproduce: `make soak` (`ARGS="--minutes 5"` for a short run).',
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=3, help="threads sending Generate requests")
    ap.add_argument(
        "--assign-clients", type=int, default=1, help="threads sending requests through Assign + AwaitFirstToken"
    )
    ap.add_argument(
        "--stream-clients",
        type=int,
        default=2,
        help="threads sending requests through one shared AssignStream that delivers first tokens",
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=120.0, help="per request; no answer by then counts as hung")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--ready-timeout-s", type=float, default=400.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument(
        "--scheduler-args",
        default="",
        help="more scheduler flags, e.g. '--local-prefill-max-tokens 300 --local-prefill-wait-ms 150' (local prefill)",
    )
    ap.add_argument("--run-dir", type=Path, default=REPO / "runs" / "soak")
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny-llama")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=True, help="write docs/soak.md")
    args = ap.parse_args()

    if not (args.model_dir / "config.json").exists():
        make_model(args.model_dir)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, 1000) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        for _ in range(args.prompts)
    ]
    args.run_dir.mkdir(parents=True, exist_ok=True)
    with pd_cluster(
        args.model_dir, args.run_dir, prefills=2, metrics=True, scheduler_args=shlex.split(args.scheduler_args)
    ) as c:
        assert c.baseline is not None
        expected = [complete(c.baseline.base_url, p, args.max_tokens)[0] for p in prompts]
        c.baseline.stop()
        frontend = StreamFrontend(c) if args.stream_clients else None
        for p, want in zip(prompts[:3], expected[:3], strict=True):  # warm every path once
            assert c.generate(p, args.max_tokens, timeout_s=120)[0] == want, "the cluster is wrong before any fault"
            assert assign_request(c, p, args.max_tokens, 120) == want, "Assign is wrong before any fault"
            if frontend is not None:
                assert frontend.request(p, args.max_tokens, 120) == want, "AssignStream is wrong before any fault"
        names = ["prefill-0", "prefill-1", "decode-0"]
        before = _idle_free_blocks(c, names)
        soak = Soak(c, prompts, expected, args, frontend)
        soak.run()
        c.wait_registered(timeout_s=120)
        after = _idle_free_blocks(c, names)
        soak.scrape()

    counts = collections.Counter(o.kind for o in soak.outcomes)
    reasons = collections.Counter(f"{o.path}: {o.detail}" for o in soak.outcomes if o.kind == "failed")
    rss: dict[str, tuple[float, float, float]] = {}
    for n in sorted({n for s in soak.samples for n in s.rss_mib}):
        vals = [s.rss_mib[n] for s in soak.samples if s.rss_mib.get(n)]
        if vals:
            rss[n] = (vals[0], max(vals), vals[-1])
    report = Report(
        minutes=args.minutes,
        clients=args.clients,
        requests={k: counts.get(k, 0) for k in ("ok", "wrong", "failed", "hung")},
        requests_by_path={
            path: {
                k: sum(o.kind == k and o.path == path for o in soak.outcomes) for k in ("ok", "wrong", "failed", "hung")
            }
            for path in ("generate", "assign", "stream")
        },
        failed_reasons=dict(reasons.most_common(8)),
        faults=soak.faults,
        free_blocks={n: (before.get(n, -1), after.get(n, -1)) for n in names},
        rss_mib=rss,
        max_seconds=max((o.seconds for o in soak.outcomes), default=0.0),
        load_avg=os.getloadavg(),
        counters={n: {k: v for k, v in sorted(per.items()) if v} for n, per in soak.counters.totals.items()},
        stream_frontend=frontend.counts() if frontend is not None else {},
    )
    out = {
        "report": asdict(report),
        "outcomes": [asdict(o) for o in soak.outcomes],
        "samples": [asdict(s) for s in soak.samples],
    }
    (args.run_dir / "soak.json").write_text(json.dumps(out, indent=1))
    _plot(
        soak.samples,
        soak.faults,
        (REPO / "docs" / "img" / "soak_rss.png") if args.docs else args.run_dir / "soak_rss.png",
    )
    md = _markdown(report, args)
    (REPO / "docs" / "soak.md" if args.docs else args.run_dir / "soak.md").write_text(md)
    sys.stdout.write(md)
    leaked = any(a != b for a, b in report.free_blocks.values())
    bad = report.requests["wrong"] or report.requests["hung"] or leaked
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()

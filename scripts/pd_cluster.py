"""A local 1P1D cluster on real processes: the kvpush scheduler, a prefill vLLM and a decode vLLM
with ``KvPushConnector``, optionally a plain vLLM as the single-instance baseline. Every gRPC hop
uses mutual TLS with development certificates (``scripts/make_certs.py``).

Used by the demo, the end-to-end tests and the benchmarks. Each vLLM gets its own core.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvpush.services.common.leg_signing import write_keypair
from kvpush.services.common.security import Security, TlsFiles
from kvpush.services.common.vllm_server import VllmServer, free_port
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from scripts.make_certs import make_certs

REPO = Path(__file__).resolve().parents[1]


def connector_config(role: str, engine_id: str, scheduler: str, http_endpoint: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvPushConnector",
        "kv_connector_module_path": "kvpush.connector.push_connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"scheduler_address": scheduler, "http_endpoint": http_endpoint, **extra},
    }


def make_model(out: Path) -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out)], check=True, timeout=300)
    return out


@dataclass
class SchedulerProcess:
    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    # The pair whose private half signs every leg (--leg-signing-key); None: an --insecure scheduler.
    leg_signing_key: Path | None = None
    leg_public_key: Path | None = None
    # mTLS: the `make certs` directory (scheduler, frontend and engine certificates); None: plaintext.
    cert_dir: Path | None = None
    argv: list[str] = field(default_factory=list)  # how it was started, for restart()

    def connector_extra(self, role: str = "", engine_id: str = "") -> dict[str, Any]:
        """The kv_connector_extra_config keys that make a connector verify this scheduler's legs
        and, given its role and engine id, speak mTLS with a certificate of its own (issued here)."""
        extra: dict[str, Any] = {}
        if self.leg_public_key is None:
            extra["insecure"] = True
        else:
            extra["leg_public_key_file"] = str(self.leg_public_key)
        if self.cert_dir is None or not engine_id:
            extra["insecure"] = True
            return extra
        make_certs(self.cert_dir, engines=[f"{role}/{engine_id}"])
        files = TlsFiles.in_dir(self.cert_dir, engine_id)
        return {**extra, "tls_ca_file": files.ca_file, "tls_cert_file": files.cert_file, "tls_key_file": files.key_file}

    def security(self, name: str = "frontend") -> Security:
        """Client credentials for talking to this scheduler (a frontend certificate by default)."""
        if self.cert_dir is None:
            return Security.insecure(f"client of {self.address}")
        return Security.mtls(TlsFiles.in_dir(self.cert_dir, name))

    def restart(self) -> None:
        """SIGKILLs the scheduler and starts it again on the same address, keys and certificates;
        returns once it accepts connections. Its in-memory state (registry, assignments) is lost."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = _spawn(self.argv, self.log_path)
        _wait_accepting(self)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_scheduler(
    log_dir: Path, lease_interval_ms: int = 500, sign_legs: bool = True, cert_dir: Path | None = None, tls: bool = True
) -> SchedulerProcess:
    """``sign_legs``: a fresh Ed25519 pair under ``log_dir/leg-keys`` signs every leg (connectors get
    the public key through ``connector_extra()``); False: an ``--insecure`` scheduler, unsigned legs.
    ``tls``: mutual TLS with the certificates in ``cert_dir`` (made or completed here; default
    ``log_dir/certs``); False: plaintext gRPC (``--insecure``)."""
    cert_dir = make_certs(cert_dir or log_dir / "certs") if tls else None
    port = free_port()
    address = f"127.0.0.1:{port}"
    log_path = log_dir / "scheduler.log"
    key = pub = None
    if sign_legs:
        key, pub = write_keypair(log_dir / "leg-keys", overwrite=True)
    argv = [
        sys.executable,
        "-m",
        "kvpush.services.scheduler.main",
        "--listen",
        address,
        "--lease-interval-ms",
        str(lease_interval_ms),
        "--metrics-port",
        "0",
        *(["--leg-signing-key", str(key)] if key is not None else []),
        *(_tls_flags(TlsFiles.in_dir(cert_dir, "scheduler")) if cert_dir is not None else []),
        *(["--insecure"] if key is None or cert_dir is None else []),
    ]
    sched = SchedulerProcess(address, _spawn(argv, log_path), log_path, key, pub, cert_dir, argv)
    _wait_accepting(sched)
    return sched


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO
        )


def _wait_accepting(sched: SchedulerProcess, timeout_s: float = 60.0) -> None:
    ch = sched.security().sync_channel(sched.address)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout_s)
    finally:
        ch.close()


def _tls_flags(files: TlsFiles) -> list[str]:
    return ["--tls-ca", files.ca_file, "--tls-cert", files.cert_file, "--tls-key", files.key_file]


@dataclass(frozen=True)
class Timed:
    tokens: list[int]
    ttft_s: float
    tpot_s: float


@dataclass
class PDCluster:
    scheduler: SchedulerProcess
    prefill: VllmServer
    decode: VllmServer
    baseline: VllmServer | None
    # Every prefill instance (``prefill`` is the first); engine ids prefill-0, prefill-1, ...
    prefills: list[VllmServer] = field(default_factory=list)
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.prefills = self.prefills or [self.prefill]
        self.channel = self.scheduler.security().sync_channel(self.scheduler.address)
        self.stub = pb_grpc.SchedulerStub(self.channel)

    def wait_registered(self, timeout_s: float = 120.0) -> list[pb.InstanceStatus]:
        deadline = time.monotonic() + timeout_s
        while True:
            live = [s for s in self.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances if s.alive]
            prefills = sum(s.instance.role == pb.ROLE_PREFILL for s in live)
            if prefills >= len(self.prefills) and any(s.instance.role == pb.ROLE_DECODE for s in live):
                return live
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances did not register within {timeout_s} s: {live}")
            time.sleep(0.2)

    def generate(self, prompt: list[int], max_tokens: int, timeout_s: float = 120.0) -> tuple[list[int], float]:
        """Greedy generation through the scheduler; returns (tokens, ttft seconds)."""
        r = self.generate_timed(prompt, max_tokens, timeout_s)
        return r.tokens, r.ttft_s

    def generate_timed(self, prompt: list[int], max_tokens: int, timeout_s: float = 120.0) -> Timed:
        """Greedy generation with client-side timings: TTFT, and TPOT over the later tokens."""
        tokens: list[int] = []
        start = time.perf_counter()
        first = last = 0.0
        req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for msg in self.stub.Generate(req, timeout=timeout_s):
            if msg.token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens.extend(msg.token_ids)
        ttft = first - start
        tpot = (last - first) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
        return Timed(tokens, ttft, tpot)

    def stop(self) -> None:
        self.channel.close()
        for srv in (*self.prefills, self.decode, self.baseline):
            if srv is not None:
                srv.stop()
        self.scheduler.stop()


@contextmanager
def pd_cluster(
    model_dir: Path,
    log_dir: Path,
    with_baseline: bool = True,
    kv_cache_memory_bytes: int = 64 << 20,
    max_num_seqs: int = 16,
    extra: dict[str, Any] | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    env: dict[str, str] | None = None,
    max_model_len: int = 1024,
    cert_dir: Path | None = None,
    prefills: int = 1,
) -> Iterator[PDCluster]:
    """``prefill_tp``/``decode_tp`` > 1 spread that instance's ranks over all cores; ``prefills``
    instances of prefill (prefill-0, prefill-1, ...). Every gRPC hop uses mTLS with certificates from
    ``cert_dir`` (made if missing; default ``log_dir/certs``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    sched = start_scheduler(log_dir, cert_dir=cert_dir)
    servers: list[tuple[VllmServer, int]] = []
    env_common = {
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "KVPUSH_LOG_LEVEL": "INFO",
        **(env or {}),
    }
    try:
        instances = [("prefill", f"prefill-{k}", prefill_tp) for k in range(prefills)] + [
            ("decode", "decode-0", decode_tp)
        ]
        for i, (role, engine_id, tp) in enumerate(instances):
            port = free_port()
            core = cores[i % len(cores)]
            bind = str(core) if tp == 1 else "|".join(str(cores[r % len(cores)]) for r in range(tp))
            srv = VllmServer(
                model_dir,
                port=port,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                kv_transfer_config=connector_config(
                    role,
                    engine_id,
                    sched.address,
                    f"http://127.0.0.1:{port}",
                    **{**sched.connector_extra(role, engine_id), **(extra or {})},
                ),
                env={**env_common, "VLLM_CPU_OMP_THREADS_BIND": bind},
                extra_args=["--tensor-parallel-size", str(tp)] if tp > 1 else [],
                log_path=log_dir / f"{engine_id if role == 'prefill' and prefills > 1 else role}.log",
                ready_timeout=None,
            )
            servers.append((srv.start(), core if tp == 1 else -1))
        baseline = None
        if with_baseline:
            core = cores[0]
            baseline = VllmServer(
                model_dir,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(core)},
                log_path=log_dir / "baseline.log",
                ready_timeout=None,
            )
            servers.append((baseline.start(), core))
        for srv, _ in servers:
            srv.wait_ready(float(os.environ.get("KVPUSH_VLLM_READY_TIMEOUT", "400")))
        for srv, core in servers:
            if core >= 0:
                srv.pin_to_cpu(core)
        cluster = PDCluster(
            sched, servers[0][0], servers[prefills][0], baseline, prefills=[srv for srv, _ in servers[:prefills]]
        )
        cluster.wait_registered()
        yield cluster
    finally:
        for srv, _ in servers:
            srv.stop()
        sched.stop()

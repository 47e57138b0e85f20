"""A local 1P1D cluster on real processes: the kvpush scheduler, a prefill vLLM and a decode vLLM
with ``KvPushConnector``, optionally a plain vLLM as the single-instance baseline. Every gRPC hop
uses mutual TLS with development certificates (``scripts/make_certs.py``).

Used by the demo, the hand-off benchmark and the end-to-end tests. Each vLLM gets its own core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvpush.services.common.vllm_server import VllmServer, free_port
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from scripts.cluster import REPO
from scripts.cluster.scheduler import LegAuthMode, SchedulerProcess, start_scheduler
from scripts.cluster.vllm import connector_config, cores, omp_bind, ready_timeout_s, start_side_by_side


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
    # With ``pd_cluster(metrics=True)``: each instance's Prometheus port (its rank 0), by engine id.
    metrics_ports: dict[str, int] = field(default_factory=dict)
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.prefills = self.prefills or [self.prefill]
        self.channel = self.scheduler.security().sync_channel(self.scheduler.address)
        self.stub = pb_grpc.SchedulerStub(self.channel)

    def wait_registered(self, timeout_s: float = 120.0) -> list[pb.InstanceStatus]:
        """Until every prefill and the decode instance are alive at the scheduler."""
        return self.scheduler.wait_registered(prefills=len(self.prefills), timeout_s=timeout_s)

    def generate(self, prompt: list[int], max_tokens: int, timeout_s: float = 120.0) -> tuple[list[int], float]:
        """Greedy generation through the scheduler; returns (tokens, ttft seconds)."""
        r = self.generate_timed(prompt, max_tokens, timeout_s)
        return r.tokens, r.ttft_s

    def generate_timed(
        self,
        prompt: list[int],
        max_tokens: int,
        timeout_s: float = 120.0,
        temperature: float = 0.0,
        seed: int = 0,
        ignore_eos: bool = True,
    ) -> Timed:
        """Generation (greedy unless ``temperature``; ``seed`` 0: none) with client-side timings:
        TTFT, and TPOT over the later tokens."""
        tokens: list[int] = []
        start = time.perf_counter()
        first = last = 0.0
        req = pb.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, seed=seed
        )
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
    legs: LegAuthMode = "sign",
    metrics: bool = False,
    scheduler_args: Sequence[str] = (),
) -> Iterator[PDCluster]:
    """``prefill_tp``/``decode_tp`` > 1 spread that instance's ranks over all cores; ``prefills``
    instances of prefill (prefill-0, prefill-1, ...). Every gRPC hop uses mTLS with certificates from
    ``cert_dir`` (made if missing; default ``log_dir/certs``). ``legs``: how the scheduler
    authenticates kv_transfer_params legs (``sign``: Ed25519; ``mac``: per-engine HMAC keys).
    ``metrics``: each instance serves its connector's Prometheus metrics (rank r on its
    ``metrics_ports`` entry + r). ``scheduler_args``: more scheduler flags."""
    log_dir.mkdir(parents=True, exist_ok=True)
    on = cores()
    sched = start_scheduler(log_dir, cert_dir=cert_dir, legs=legs, extra_args=scheduler_args)
    servers: list[tuple[VllmServer, int | None]] = []
    metrics_ports: dict[str, int] = {}
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
            core = on[i % len(on)]
            own: dict[str, Any] = {}
            if metrics:
                metrics_ports[engine_id] = free_port()
                own["metrics_base_port"] = metrics_ports[engine_id] - 1  # the connector serves rank r on base + 1 + r
            bind = [core] if tp == 1 else [on[r % len(on)] for r in range(tp)]
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
                    **{**sched.connector_extra(role, engine_id), **(extra or {}), **own},
                ),
                env={**env_common, **omp_bind(*bind)},
                extra_args=["--tensor-parallel-size", str(tp)] if tp > 1 else [],
                log_path=log_dir / f"{engine_id if role == 'prefill' and prefills > 1 else role}.log",
                ready_timeout=None,
            )
            servers.append((srv, core if tp == 1 else None))
        baseline = None
        if with_baseline:
            baseline = VllmServer(
                model_dir,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                env=omp_bind(on[0]),
                log_path=log_dir / "baseline.log",
                ready_timeout=None,
            )
            servers.append((baseline, on[0]))
        started = start_side_by_side(servers, ready_timeout_s(400.0))
        cluster = PDCluster(
            sched, started[0], started[prefills], baseline, prefills=started[:prefills], metrics_ports=metrics_ports
        )
        cluster.wait_registered()
        yield cluster
    finally:
        for srv, _ in servers:
            srv.stop()
        sched.stop()

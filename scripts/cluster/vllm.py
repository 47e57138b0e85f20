"""vLLM servers on this machine's cores: the tiny model, the connector's ``--kv-transfer-config``,
and ``start_side_by_side``, the one way the demo, the benchmarks and the tests start servers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.services.common.vllm_server import VllmServer
from scripts.cluster import REPO

READY_TIMEOUT_ENV = "KVPUSH_VLLM_READY_TIMEOUT"  # seconds a server may take to become healthy


def make_model(out: Path, timeout_s: float = 300.0, quiet: bool = False) -> Path:
    """The tiny seeded Llama in ``out`` (``scripts/make_tiny_model.py``, in a subprocess so this
    process never imports torch); ``quiet``: its output is captured, not shown."""
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out)],
        check=True,
        capture_output=quiet,
        timeout=timeout_s,
    )
    return out


def connector_config(role: str, engine_id: str, scheduler: str, http_endpoint: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvPushConnector",
        "kv_connector_module_path": "kvpush.connector.push_connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"scheduler_address": scheduler, "http_endpoint": http_endpoint, **extra},
    }


def cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def omp_bind(*on: int) -> dict[str, str]:
    """The environment that binds a server's OpenMP threads to these cores (one per TP rank)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in on)}


def ready_timeout_s(default: float) -> float:
    """``$KVPUSH_VLLM_READY_TIMEOUT`` if set, else ``default``."""
    return float(os.environ.get(READY_TIMEOUT_ENV, default))


def start_side_by_side(
    servers: Sequence[tuple[VllmServer, int | None]], ready_timeout_s: float, pin: bool = True
) -> list[VllmServer]:
    """Starts every server at once, waits until all are healthy, then (``pin``) pins each one's
    whole process tree to its core; None: not pinned (a TP > 1 instance spread over several).

    Side by side because one start-up costs ~70 s of CPU-bound imports on a 2-core machine. Build
    the servers with ``ready_timeout=None`` and ``omp_bind(core)`` in their environment; pinning
    waits until they are ready because vLLM's workers set their own affinity while starting
    (``VllmServer.pin_to_cpu``). The caller stops them, also when this raises."""
    for srv, _ in servers:
        srv.start()
    for srv, _ in servers:
        srv.wait_ready(ready_timeout_s)
    if pin:
        for srv, core in servers:
            if core is not None:
                srv.pin_to_cpu(core)
    return [srv for srv, _ in servers]

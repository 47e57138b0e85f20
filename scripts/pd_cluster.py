"""The former path of the PD cluster harness, now ``scripts/cluster/``: these re-exports keep its
callers working (``benchmarks/soak.py``). New code imports from ``scripts.cluster.*``; remove this
module once nothing imports it."""

from __future__ import annotations

from scripts.cluster import REPO
from scripts.cluster.pd import PDCluster, Timed, pd_cluster
from scripts.cluster.scheduler import SchedulerProcess, start_scheduler
from scripts.cluster.vllm import connector_config, make_model

__all__ = [
    "REPO",
    "PDCluster",
    "SchedulerProcess",
    "Timed",
    "connector_config",
    "make_model",
    "pd_cluster",
    "start_scheduler",
]

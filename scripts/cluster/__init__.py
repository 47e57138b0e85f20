"""The local cluster harness: every process the demo, the benchmarks and the tests start and stop.

* ``scripts.cluster.node``: ``Node``, one spawned process driven over a pipe (the agent nodes of
  the transfer, layout and GPU tests and of the transfer benchmark; stdlib only, cheap to import).
* ``scripts.cluster.scheduler``: ``start_scheduler`` (the kvpush scheduler as a subprocess, with
  leg signing and mTLS) and ``SchedulerProcess.wait_registered``.
* ``scripts.cluster.vllm``: ``make_model``, ``connector_config`` and ``start_side_by_side`` (vLLM
  servers started at once, each on its own core, pinned once all are ready).
* ``scripts.cluster.pd``: ``pd_cluster``, the 1P1D / NP1D cluster of the demo, the hand-off
  benchmark and the vLLM end-to-end tests, built from the three above.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

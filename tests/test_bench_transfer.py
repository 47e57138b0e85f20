"""Smoke test of the transfer benchmark: tiny sizes in a subprocess, bounded time, verified bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed")


def test_bench_transfer_quick(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.transfer",
        "--quick",
        "--total-mib",
        "2",
        "--block-kib",
        "16",
        "--small-kib",
        "256",
        "--reps",
        "1",
        "--small-iters",
        "5",
        "--warmup",
        "1",
        "--stream-n",
        "20",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=38)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| configuration |" in proc.stdout

    res = json.loads(out.read_text())
    assert {"config", "throughput", "stream_latency", "small_e2e", "goals", "verified"} <= res.keys()
    t = res["throughput"]
    for key in ("contiguous", "fragmented", "single", "memcpy", "memcpy_shuffled", "e2e_contiguous", "e2e_fragmented"):
        assert t[key]["verified"] is True, key
        assert t[key]["median_ms"] > 0 and t[key]["gbps"] > 0, key
    assert t["single"]["descriptors"] == 1
    assert t["contiguous"]["descriptors"] == 2  # one run per layer
    assert t["fragmented"]["descriptors"] > t["contiguous"]["descriptors"]
    assert {"contiguous", "fragmented"} <= t["ratios_vs_single"].keys()
    st = res["stream_latency"]
    assert st["n"] == 20 and st["missing"] == 0 and st["cleanup_settled"] == 20
    assert {"p50_ms", "p99_ms", "max_ms"} <= st["reserve_to_writer"].keys()
    small = res["small_e2e"]
    assert small["verified"] is True and small["bytes"] == 256 << 10
    assert small["prefill_first"]["n"] == 5 and small["reservation_first"]["n"] == 5
    assert {"fragmented_vs_single", "fragmented_met", "stream_p99_ms", "stream_met"} <= res["goals"].keys()
    assert res["verified"] is True

"""The scheduler benchmark: its pure helpers (CPU sets, the machine-speed calibration, the
report's host line) and one short run end to end (a real scheduler and the echo servicer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import scheduler as sb


def test_cpu_sets() -> None:
    assert sb._cpus("") == set()
    assert sb._cpus("0") == {0}
    assert sb._cpus("0,2") == {0, 2}
    assert sb._cpus("1-3,5") == {1, 2, 3, 5}
    with pytest.raises(ValueError):
        sb._cpus("a")


def test_cpu_calibration_is_a_positive_duration() -> None:
    ms = sb.cpu_calibration_ms(repeats=1)
    assert 0.0 < ms < 10_000.0


def test_table_says_how_fast_the_machine_was() -> None:
    row = {
        "phase": "AssignStream open loop, release inline",
        "offered_rps": 5000,
        "achieved_rps": 4999,
        "completed": 10,
        "errors": 0,
        **{k: 1.0 for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")},
    }
    host = {"cpus": 2, "loadavg_1m_before": 0.5, "loadavg_1m_after": 0.9}
    text = sb._table(
        {"results": [row], "host": {**host, "cpu_calibration_ms_before": 14.4, "cpu_calibration_ms_after": 15.1}}
    )
    assert "CPU calibration (fixed Python work, lower is faster) 14.4 ms before / 15.1 ms after" in text
    assert "CPU calibration (fixed Python work, lower is faster) – ms before" in sb._table(
        {"results": [row], "host": host}
    )


def _bench(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.scheduler`` with ``argv``, which must succeed."""
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.scheduler", *argv],
        cwd=sb.ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run


@pytest.mark.timeout(180)
def test_a_short_run_measures_the_scheduler_and_the_grpc_floor_at_the_same_rate(tmp_path: Path) -> None:
    out = tmp_path / "scheduler.json"
    argv = ["--unary", "0", "--stream-rates", "200", "--stream-workers", "0", "--seconds", "0.5"]
    argv += ["--decodes", "1", "--prefills", "1", "--release-delay-ms", "2", "--out", str(out)]
    run = _bench(argv)
    report = json.loads(out.read_text())
    assert report["setup"]["release_delay_ms"] == 2
    assert report["setup"]["legs"] == "mac" and "legs: mac;" in run.stdout  # the deployed default
    phases = {r["phase"]: r for r in report["results"]}
    assert set(phases) == {
        "AssignStream open loop, release inline",
        "AssignStream gRPC floor (echo servicer), open loop",
    }
    for r in phases.values():
        assert r["offered_rps"] == 200 and r["completed"] == 100 and r["errors"] == 0
        assert 0 < r["batches"] <= 200 and r["server_cpu_us_per_pair"] > 0  # a Release may go alone


@pytest.mark.timeout(180)
def test_a_short_handoff_run_delivers_every_first_token_both_ways(tmp_path: Path) -> None:
    """The hand-off phases end to end: every request gets its first token (the benchmark checks
    each is its prefill's), on the stream and by AwaitFirstToken."""
    out = tmp_path / "scheduler.json"
    argv = ["--unary", "0", "--stream-rates", "", "--stream-workers", "0", "--seconds", "0.5", "--baseline", "0"]
    argv += ["--decodes", "1", "--prefills", "2", "--handoff-rates", "200", "--prefill-ms", "5", "--out", str(out)]
    run = _bench(argv)
    report = json.loads(out.read_text())
    assert report["setup"]["handoff_via"] == "stream,unary"
    phases = {r["phase"]: r for r in report["results"]}
    assert set(phases) == {
        "hand-off: AssignStream + first token on the stream",
        "hand-off: AssignStream + first token by AwaitFirstToken",
    }
    for r in phases.values():
        assert r["completed"] == 100 and r["errors"] == 0 and r["first_tokens"] == 100
        assert 0 < r["first_token_p50_ms"] <= r["first_token_p99_ms"] and r["prefill_reports"] >= 1
    assert "first token p50 / p99 ms" in run.stdout

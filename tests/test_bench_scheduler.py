"""Pure helpers of the scheduler benchmark (no scheduler): CPU sets, the machine-speed
calibration and the report's host line."""

from __future__ import annotations

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

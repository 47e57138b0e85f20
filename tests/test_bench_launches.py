"""Pooling launches of the decode-speed benchmark (benchmarks/launches.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import launches


def _launch(ratio: float, serving_arg: list[str] | None = None, load: float = 0.5) -> dict[str, object]:
    return {
        "config": {"serving_arg": serving_arg or []},
        "load_before": load,
        "ratios": {"tpot decode/both": ratio, "tpot2 generate/both": ratio * 1.1},
    }


def test_launches_pool_per_arm_as_a_geometric_mean() -> None:
    pinned = ["--scheduler-core=0"]
    res = launches.pool(
        [_launch(0.9), _launch(1.0 / 0.9), _launch(1.2, pinned), _launch(1.2, pinned), _launch(1.2, pinned)]
    )
    assert set(res) == {"defaults", "--scheduler-core=0"}
    d = res["defaults"]["ratios"]["tpot decode/both"]
    assert d["geomean"] == pytest.approx(1.0)  # a ratio and its inverse average to 1
    assert d["launches"] == 2 and d["above_1"] == 1
    lo, hi = d["geomean_ci90"]
    assert 0.9 - 1e-9 <= lo <= 1.0 <= hi <= 1.0 / 0.9 + 1e-9
    p = res["--scheduler-core=0"]["ratios"]["tpot2 generate/both"]
    assert p["geomean"] == pytest.approx(1.32) and p["above_1"] == 3
    assert p["geomean_ci90"] == pytest.approx([1.32, 1.32])


def test_the_client_core_is_part_of_the_arm() -> None:
    pinned = _launch(1.0, ["--scheduler-core=0"])
    pinned["config"]["client_core"] = 0  # type: ignore[index]
    res = launches.pool([_launch(1.0, ["--scheduler-core=0"]), pinned])
    assert set(res) == {"--scheduler-core=0", "--scheduler-core=0 --client-core=0"}


def test_a_launch_without_a_ratio_or_with_nan_is_left_out_of_it() -> None:
    bare = _launch(1.0)
    bare["ratios"] = {"tpot decode/both": float("nan")}
    res = launches.pool([_launch(1.1), bare])
    r = res["defaults"]["ratios"]
    assert r["tpot decode/both"]["launches"] == 1
    assert r["tpot2 generate/both"]["launches"] == 1
    assert res["defaults"]["launches"] == 2


def test_main_reads_results_and_writes_markdown_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for i, ratio in enumerate((1.05, 0.95, 1.02)):
        f = tmp_path / f"ds-{i}.json"
        f.write_text(json.dumps(_launch(ratio, load=0.2 + i)))
        files.append(str(f))
    out = tmp_path / "pooled.json"
    assert launches.main([*files, "--out", str(out)]) == 0
    md = capsys.readouterr().out
    assert "**defaults**: 3 launches, load average before 0.20-2.20." in md
    assert "| tpot decode/both | 3 |" in md and "| 2 of 3 |" in md
    pooled = json.loads(out.read_text())
    assert math.isclose(pooled["defaults"]["ratios"]["tpot decode/both"]["geomean"], (1.05 * 0.95 * 1.02) ** (1 / 3))

"""``make bench-relay`` (benchmarks/relay.py): its fake engine's steps and a short run end to end
against the real scheduler."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import relay
from benchmarks.scheduler import ROOT


def test_streams_waiting_for_a_token_get_it_at_the_same_step() -> None:
    async def body() -> None:
        steps = relay.EngineSteps(0.01)
        loop = asyncio.get_running_loop()
        times: list[float] = []

        async def token() -> None:
            await steps.next()
            times.append(loop.time())

        await asyncio.gather(token(), token(), token())
        assert len(times) == 3 and max(times) - min(times) < 0.005  # one tick released all three
        await token()  # no timer ran while nobody waited: the next one is a fresh step
        assert len(times) == 4

    asyncio.run(body())


@pytest.mark.timeout(180)
def test_a_short_run_relays_every_token_and_reports_per_token_cost(tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    argv = ["--rounds", "2", "--short", "2", "--long", "6", "--streams", "4", "--seconds", "1", "--step-ms", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.relay", *argv, "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    light, loaded = report["results"]
    assert light["phase"] == "light load" and light["errors"] == 0
    assert set(light["cpu_ms_per_request"]) == {"2", "6"} and light["tokens_per_message"] >= 1.0
    assert loaded["streams"] == 4 and loaded["errors"] == 0 and loaded["calls"] >= 4
    assert loaded["tokens_per_s"] > 0 and loaded["cpu_us_per_token"] > 0 and loaded["tokens_per_message"] >= 1.0
    assert "| 4 streams |" in run.stdout and (tmp_path / "relay.md").read_text() == run.stdout

"""The request-start benchmark's arithmetic, against a fake server client (no vLLM)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks import request_start as rs


class _FakeClient:
    """Answers a prompt's first send slowly (prefill) and its second fast (prefix hit); tokens come
    at a fixed step. Times are in seconds, on a fake clock the benchmark reads too."""

    now = 0.0

    def __init__(self, timeout: float) -> None:
        self.seen: set[tuple[int, ...]] = set()

    async def token_times(
        self, url: str, prompt: list[int], max_tokens: int, params: Any, rid: str, clock: Any = None
    ) -> list[float]:
        key = tuple(prompt)
        first = 0.010 if key in self.seen else 0.030 * (len(prompt) - 1) / 1024  # prompts are length + 1
        self.seen.add(key)
        start = _FakeClient.now
        times = [start + first + i * 0.004 for i in range(max_tokens)]
        _FakeClient.now = times[-1] + 1.0
        return times

    async def close(self) -> None:
        pass


def test_measure_splits_a_full_prompt_from_a_prefix_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rs, "Client", _FakeClient)
    rows = asyncio.run(
        rs.measure("http://fake", [1024, 3072], requests=4, vocab=1000, seed=0, clock=lambda: _FakeClient.now)
    )
    assert [r["prompt_len"] for r in rows] == [1024, 3072]
    short, long = rows
    assert short["full_ttft_p50_ms"] == pytest.approx(30.0) and long["full_ttft_p50_ms"] == pytest.approx(90.0)
    for r in rows:
        assert r["hit_ttft_p50_ms"] == pytest.approx(10.0)
        assert r["hit_second_token_gap_p50_ms"] == pytest.approx(4.0)
        assert r["decode_step_p50_ms"] == pytest.approx(4.0)
        assert r["requests"] == 4

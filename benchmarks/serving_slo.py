"""The serving benchmark's SLOs and goodput (DistServe's measure): which requests meet a TTFT and a
TPOT target, the requests per second that do, and the highest rate at which enough of them do."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.serving_model import SETUPS, PointResult

SLO_ATTAINMENT = 0.9  # goodput summary: the highest rate up to which >= 90 % of requests meet the SLOs


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives: TTFT and the request's mean TPOT, both in ms."""

    ttft_ms: float
    tpot_ms: float


def meets_slo(ttft_ms: float | None, tpot_ms: float | None, slo: Slo) -> bool:
    """One request: TTFT <= the TTFT target and its mean TPOT <= the TPOT target. A failed request
    (TTFT NaN or None) misses; a one-token output (no TPOT) is judged on its TTFT alone."""
    if ttft_ms is None or math.isnan(ttft_ms) or ttft_ms > slo.ttft_ms:
        return False
    return tpot_ms is None or math.isnan(tpot_ms) or tpot_ms <= slo.tpot_ms


def goodput(
    req_ttft_ms: Sequence[float | None], req_tpot_ms: Sequence[float | None], duration_s: float, slo: Slo
) -> tuple[int, float, float]:
    """(requests meeting both SLOs, their fraction of all requests, their number per second of the
    point's duration). Failed requests count in the denominator of the fraction."""
    if len(req_ttft_ms) != len(req_tpot_ms):
        raise ValueError("one TTFT and one TPOT per request")
    met = sum(meets_slo(a, b, slo) for a, b in zip(req_ttft_ms, req_tpot_ms, strict=True))
    fraction = met / len(req_ttft_ms) if req_ttft_ms else math.nan
    rps = met / duration_s if met and duration_s > 0 else 0.0  # NaN duration (nothing ok): 0
    return met, fraction, rps


def max_rate_meeting(points: Sequence[tuple[float, float]], target: float = SLO_ATTAINMENT) -> float | None:
    """DistServe's goodput over a rate sweep: the highest offered rate up to which every measured
    rate kept SLO attainment >= ``target`` (a pass above a failing rate is noise, not capacity).
    ``points``: (rate, attainment); None when even the lowest rate missed."""
    best = None
    for rate, attainment in sorted(points):
        if math.isnan(attainment) or attainment < target:
            break
        best = rate
    return best


def slos_for(
    lengths: Sequence[int],
    unloaded: dict[int, dict[str, float]],
    scale: float,
    ttft_ms: float = 0.0,
    tpot_ms: float = 0.0,
) -> dict[int, Slo | None]:
    """Per prompt length: a fixed target where given (> 0), else ``scale`` x the single instance's
    unloaded p50 at that length; None where neither is known."""
    out: dict[int, Slo | None] = {}
    for length in lengths:
        base = unloaded.get(length, {})
        t = ttft_ms if ttft_ms > 0 else scale * base.get("ttft_ms", math.nan)
        p = tpot_ms if tpot_ms > 0 else scale * base.get("tpot_ms", math.nan)
        out[length] = None if math.isnan(t) or math.isnan(p) else Slo(t, p)
    return out


def apply_slo(results: dict[str, list[PointResult]], slos: dict[int, Slo | None]) -> None:
    """Fills each point's SLO fields (not the prefill-only reference, which has no decode)."""
    for name, rs in results.items():
        if name == "prefill_only":
            continue
        for r in rs:
            slo = slos.get(r.prompt_len)
            if slo is None:
                continue
            r.slo_ttft_ms, r.slo_tpot_ms = slo.ttft_ms, slo.tpot_ms
            r.slo_met, r.slo_attainment, r.goodput_rps = goodput(
                r.req_ttft_ms, r.req_tpot_ms, r.goodput_duration_s, slo
            )


def _judged_lengths(results: dict[str, list[PointResult]]) -> list[tuple[int, int]]:
    """The (prompt length, output length) pairs measured, the prefill-only reference left out."""
    return sorted({(r.prompt_len, r.max_tokens) for n, rs in results.items() if n != "prefill_only" for r in rs})


TPOT_SLO_FACTORS = (1.25, 1.5, 2.0, 3.0)  # the sweep's TPOT targets, x the single instance's unloaded p50


def tpot_slo_sweep(
    results: dict[str, list[PointResult]],
    slos: dict[int, Slo | None],
    unloaded: dict[int, dict[str, float]],
    factors: Sequence[float] = TPOT_SLO_FACTORS,
    target: float = SLO_ATTAINMENT,
) -> list[dict[str, Any]]:
    """Where each setup wins: per prompt and output length, and per TPOT target (``factors`` x the
    single instance's unloaded TPOT p50, the TTFT target kept), each setup's highest rate with
    >= ``target`` attainment and its goodput there. The points' own SLO fields are not touched."""
    rows = []
    keys = _judged_lengths(results)
    for length, out in keys:
        slo = slos.get(length)
        base = unloaded.get(length, {}).get("tpot_ms", math.nan)
        if slo is None or math.isnan(base):
            continue
        for factor in factors:
            tight = Slo(slo.ttft_ms, factor * base)
            row: dict[str, Any] = {
                "prompt_len": length,
                "max_tokens": out,
                "slo_ttft_ms": tight.ttft_ms,
                "tpot_factor": factor,
                "slo_tpot_ms": tight.tpot_ms,
                "setups": {},
            }
            for name in SETUPS:
                rs = [r for r in results.get(name, []) if (r.prompt_len, r.max_tokens) == (length, out)]
                if not rs:
                    continue
                judged = {r.rate: goodput(r.req_ttft_ms, r.req_tpot_ms, r.goodput_duration_s, tight) for r in rs}
                best = max_rate_meeting([(rate, g[1]) for rate, g in judged.items()], target)
                row["setups"][name] = {
                    "max_rate": best,
                    "goodput_rps_at_max_rate": judged[best][2] if best is not None else math.nan,
                    "best_goodput_rps": max(g[2] for g in judged.values()),
                    "rates": sorted(judged),
                }
            rows.append(row)
    return rows


def goodput_summary(results: dict[str, list[PointResult]], target: float = SLO_ATTAINMENT) -> list[dict[str, Any]]:
    """Per prompt length and output length: each setup's highest rate at >= ``target`` attainment,
    its goodput there, and its best goodput over the sweep."""
    rows = []
    keys = _judged_lengths(results)
    for length, out in keys:
        row: dict[str, Any] = {"prompt_len": length, "max_tokens": out, "attainment_target": target, "setups": {}}
        for name in SETUPS:
            rs = sorted(
                (r for r in results.get(name, []) if (r.prompt_len, r.max_tokens) == (length, out)),
                key=lambda r: r.rate,
            )
            if not rs or math.isnan(rs[0].slo_ttft_ms):
                continue
            row["slo_ttft_ms"], row["slo_tpot_ms"] = rs[0].slo_ttft_ms, rs[0].slo_tpot_ms
            best = max_rate_meeting([(r.rate, r.slo_attainment) for r in rs], target)
            at = next((r for r in rs if r.rate == best), None)
            row["setups"][name] = {
                "max_rate": best,
                "goodput_rps_at_max_rate": at.goodput_rps if at else math.nan,
                "best_goodput_rps": max(r.goodput_rps for r in rs),
                "rates": [r.rate for r in rs],
                "attainment": [r.slo_attainment for r in rs],
            }
        rows.append(row)
    return rows

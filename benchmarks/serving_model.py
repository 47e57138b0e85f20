"""The serving benchmark's setups, points, samples and their per-point summary."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Result names, report order; ``single_paired``: one plain vLLM in our setups' arrival stream (--paired-single-core).
SETUPS = ("single", "two_plain", "pull", "push", "ours", "ours_ft", "ours_grpc", "ours_local", "single_paired")
# P/D pairs to start; ``ours`` serves ``ours``, ``ours_ft`` and ``ours_grpc``; ``ours_local`` is
# ``ours_ft`` on a pair whose scheduler has local prefill on (--local-prefill-*)
PAIRS = ("pull", "push", "ours", "ours_local")
OURS_KINDS = ("ours", "ours_local")  # pairs with our scheduler
KINDS = ("single", "two_plain", *PAIRS)  # what ``--setups`` names
SUSTAINED = 0.9  # a point is sustained when throughput >= 0.9 x offered rate and nothing failed


@dataclass(frozen=True)
class ModelInfo:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    vocab: int
    max_positions: int

    @classmethod
    def load(cls, model_dir: Path) -> ModelInfo:
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return cls(
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            dtype_bytes=4 if "32" in dtype else 2,
            vocab=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings") or 4096),
        )

    def kv_bytes(self, tokens: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes * tokens


@dataclass(frozen=True)
class Point:
    prompt_len: int
    rate: float  # offered requests per second (Poisson)
    requests: int
    max_tokens: int = 16  # output tokens per request

    @property
    def key(self) -> str:
        return f"L{self.prompt_len}_o{self.max_tokens}_r{self.rate:g}"


@dataclass
class Sample:
    ok: bool
    sent: float  # monotonic seconds
    ttft: float = math.nan
    tpot: float = math.nan
    # The gap between the first and the second token, and the mean TPOT after the second: with the
    # first-token hand-off, decode's part of the hand-off moves from TTFT into that first gap.
    gap2: float = math.nan
    tpot_rest: float = math.nan
    done: float = math.nan
    tokens: int = 0
    error: str = ""
    transfer_id: str = ""  # ours: joins the request to our agents' log events
    # ours_ft: when the prefill leg's answer (with the same first token) came, after ``sent``
    ttft_answer: float = math.nan
    sent_wall: float = math.nan  # time.time() at send, to compare with log timestamps
    on_decode: bool = False  # ours, ours_ft: the scheduler had the decode prefill it (local prefill)


@dataclass
class PointResult:
    setup: str
    prompt_len: int
    rate: float
    requests: int
    ok: int
    errors: list[str]
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    throughput_rps: float
    duration_s: float
    sustained: bool
    phases: dict[str, Any] = field(default_factory=dict)
    load1: float = math.nan  # 1-minute load average at the end of the point
    foreign_vllm: int = 0  # vLLM processes on this machine that are not ours (shared machine)
    # Fixed Python work timed on P's and D's core right after the point (ms, lower is faster): how
    # fast the VM was then, to tell a slow hour from a slow launch.
    cpu_cal_ms: list[float] = field(default_factory=list)
    max_tokens: int = 16
    # Per request, in arrival order (NaN: failed; TPOT NaN also for one-token outputs): goodput input.
    req_ttft_ms: list[float] = field(default_factory=list)
    req_tpot_ms: list[float] = field(default_factory=list)
    gap2_p50_ms: float = math.nan  # first -> second token
    tpot_rest_p50_ms: float = math.nan  # mean TPOT from the second token on
    # ours_ft: TTFT p50 had the first token been taken from the prefill leg's answer (same requests)
    ttft_answer_p50_ms: float = math.nan
    # Filled by ``apply_slo`` once the SLOs are known (NaN: no SLO, e.g. no ``single`` run).
    slo_ttft_ms: float = math.nan
    slo_tpot_ms: float = math.nan
    slo_met: int = 0  # requests that met both SLOs
    slo_attainment: float = math.nan  # slo_met / requests (failed requests count as missed)
    goodput_rps: float = math.nan  # slo_met / (duration_s * share)
    # The share of the point's arrivals this setup got: 1 unless setups were interleaved in one
    # arrival stream (``--interleave``), where throughput and goodput are scaled by 1 / share.
    share: float = 1.0
    on_decode: int = 0  # requests the scheduler had their decode prefill (local prefill)
    req_on_decode: list[bool] = field(default_factory=list)  # per request, in arrival order

    @property
    def goodput_duration_s(self) -> float:
        """The duration goodput divides by: the point's, times this setup's share of its arrivals."""
        return self.duration_s * self.share


def percentile(values: Sequence[float], q: float) -> float:
    v = [x for x in values if not math.isnan(x)]
    return float(np.percentile(np.asarray(v), q)) * 1e3 if v else math.nan


def summarize(setup: str, point: Point, samples: list[Sample], share: float = 1.0) -> PointResult:
    """``share``: the fraction of the point's arrivals ``samples`` are (interleaved setups)."""
    good = [s for s in samples if s.ok]
    errors = sorted({s.error for s in samples if not s.ok})[:5]
    duration = (max(s.done for s in good) - min(s.sent for s in samples)) if good else math.nan
    tput = len(good) / (duration * share) if good and duration > 0 else 0.0
    return PointResult(
        setup=setup,
        prompt_len=point.prompt_len,
        rate=point.rate,
        requests=len(samples),
        ok=len(good),
        errors=errors,
        ttft_p50_ms=percentile([s.ttft for s in good], 50),
        ttft_p99_ms=percentile([s.ttft for s in good], 99),
        tpot_p50_ms=percentile([s.tpot for s in good], 50),
        tpot_p99_ms=percentile([s.tpot for s in good], 99),
        throughput_rps=tput,
        duration_s=duration,
        sustained=len(good) == len(samples) and tput >= SUSTAINED * point.rate,
        max_tokens=point.max_tokens,
        req_ttft_ms=[s.ttft * 1e3 if s.ok else math.nan for s in samples],
        req_tpot_ms=[s.tpot * 1e3 if s.ok else math.nan for s in samples],
        gap2_p50_ms=percentile([s.gap2 for s in good], 50),
        tpot_rest_p50_ms=percentile([s.tpot_rest for s in good], 50),
        ttft_answer_p50_ms=percentile([s.ttft_answer for s in good], 50),
        share=share,
        on_decode=sum(s.on_decode for s in samples),
        req_on_decode=[s.on_decode for s in samples],
    )

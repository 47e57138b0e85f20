"""The decode-speed benchmark's accounting (benchmarks/decode_speed.py) on synthetic rounds, and the
per-thread wake-up counter it reads (benchmarks/process_cpu.py)."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import pytest

from benchmarks import decode_speed
from benchmarks.process_cpu import tree_wakes_by_thread
from kvpush.services.common.thread_names import name_native_thread

ENGINE = "VLLM::EngineCor/main"


def _round(tpot: dict[str, float], cpu: dict[str, float], warmup: bool = False) -> dict[str, Any]:
    row: dict[str, Any] = {"warmup": warmup}
    for e in decode_speed.ENGINES:
        threads = {ENGINE: cpu[e]}
        wakes = {ENGINE: 50.0}
        if e == "decode":
            threads["VLLM::EngineCor/kv-poller-0"] = 0.0005
            wakes["VLLM::EngineCor/kv-poller-0"] = 4.0
        row[e] = {"tpot": tpot[e], "cpu_by_thread": threads, "wakes_by_thread": wakes}
    return row


def test_ratios_are_per_prompt_medians_and_skip_warmup() -> None:
    rows = [
        # a warm-up round that would flip every ratio if it counted
        _round({"plain": 0.010, "null": 0.010, "decode": 0.001}, {"plain": 0.1, "null": 0.1, "decode": 0.01}, True),
        _round({"plain": 0.004, "null": 0.004, "decode": 0.0044}, {"plain": 0.05, "null": 0.05, "decode": 0.06}),
        _round({"plain": 0.003, "null": 0.0033, "decode": 0.0033}, {"plain": 0.04, "null": 0.04, "decode": 0.04}),
        _round({"plain": 0.005, "null": 0.005, "decode": 0.0055}, {"plain": 0.06, "null": 0.06, "decode": 0.066}),
    ]
    res = decode_speed.analyse(rows)
    r = res["ratios"]
    assert res["n"] == 3
    assert r["tpot decode/plain"] == pytest.approx(1.1)
    assert r["tpot null/plain"] == pytest.approx(1.0)
    # per prompt: 1.1, 1.0, 1.1 -> median 1.1 (not the ratio of medians, 4.4/4.0)
    assert r["tpot decode/null"] == pytest.approx(1.1)
    # against both: decode over the geometric mean of plain and null, per prompt
    assert r["tpot decode/both"] == pytest.approx(0.0044 / 0.004)
    assert r["engine_cpu decode/plain"] == pytest.approx(1.1)
    assert r["engine_cpu decode/both"] == pytest.approx(1.1)
    dec = res["engines"]["decode"]
    assert dec["tpot_ms"] == pytest.approx(4.4)
    assert dec["cpu_ms_by_thread"]["VLLM::EngineCor/kv-poller-0"] == pytest.approx(0.5)
    assert dec["wakes_by_thread"]["VLLM::EngineCor/kv-poller-0"] == 4.0
    # a thread the plain vLLM does not have counts as nothing there, not as missing
    assert "VLLM::EngineCor/kv-poller-0" not in res["engines"]["plain"]["cpu_ms_by_thread"]


def test_a_thread_absent_from_a_round_counts_zero_there() -> None:
    rows = [_round({e: 0.004 for e in decode_speed.ENGINES}, {e: 0.05 for e in decode_speed.ENGINES}) for _ in range(3)]
    for row in rows[:2]:  # the poller did not run during two of the three requests
        del row["decode"]["cpu_by_thread"]["VLLM::EngineCor/kv-poller-0"]
        del row["decode"]["wakes_by_thread"]["VLLM::EngineCor/kv-poller-0"]
    dec = decode_speed.analyse(rows)["engines"]["decode"]
    assert dec["cpu_ms_by_thread"]["VLLM::EngineCor/kv-poller-0"] == 0.0
    assert dec["wakes_by_thread"]["VLLM::EngineCor/kv-poller-0"] == 0.0


def test_no_measured_round_is_an_error() -> None:
    with pytest.raises(ValueError, match="no measured rounds"):
        decode_speed.analyse(
            [_round({e: 0.004 for e in decode_speed.ENGINES}, {e: 0.05 for e in decode_speed.ENGINES}, True)]
        )


def test_markdown_reports_ratios_and_the_threads_that_used_cpu() -> None:
    rows = [_round({"plain": 0.004, "null": 0.004, "decode": 0.0044}, {"plain": 0.05, "null": 0.05, "decode": 0.055})]
    res = decode_speed.analyse(rows)
    res.update(
        config={"prompt_len": 1024, "output_len": 16, "pd": 2, "generate": 0},
        host="2 CPUs",
        load_before=0.5,
        load_after=0.6,
    )
    md = decode_speed.markdown(res)
    assert "| decode/plain | 1.100 | 1.100 |" in md
    assert "2 P/D (`Assign`), 0 `Generate`, 0 waiting and 0 busy P/D requests" in md
    assert f"| {ENGINE} | 50.00 | 50 | 50.00 | 50 | 55.00 | 50 |" in md
    assert "kv-poller-0 | 0.00 | 0 | 0.00 | 0 | 0.50 | 4 |" in md


def test_arguments_are_bounded() -> None:
    with pytest.raises(SystemExit):
        decode_speed.parse_args(["--pd", "-1"])
    args = decode_speed.parse_args(["--pd", "2", "--generate", "1"])
    assert (args.pd, args.generate, args.requests, args.client_core) == (2, 1, 20, None)
    assert decode_speed.parse_args(["--client-core", "0"]).client_core == 0


def test_wakes_by_thread_counts_a_named_threads_voluntary_switches() -> None:
    stop, named = threading.Event(), threading.Event()

    def sleeper() -> None:
        name_native_thread("kv-test-sleeper")
        named.set()
        while not stop.wait(0.001):  # each timed wait gives the CPU up: a voluntary switch
            pass

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        assert named.wait(10)
        first = _sleeper_wakes()
        now = first
        for _ in range(200):  # bounded: the thread wakes every millisecond
            now = _sleeper_wakes()
            if now >= first + 5:
                break
            stop.wait(0.005)
        assert now >= first + 5
    finally:
        stop.set()
        t.join(10)
    # Gone once it ended. join() returns when Python is done with the thread, a moment before the
    # OS thread (and its /proc entry) exits: bounded, for that moment only.
    gone = threading.Event()
    for _ in range(500):
        if _sleeper_wakes() == 0:
            break
        gone.wait(0.01)
    assert _sleeper_wakes() == 0


def _sleeper_wakes() -> float:
    """This process's ``<process name>/kv-test-sleeper`` count (keyed as the CPU counter keys)."""
    counts = tree_wakes_by_thread(os.getpid())
    return sum(v for k, v in counts.items() if k.endswith("/kv-test-sleeper"))


def _with_pd(row: dict[str, Any], pd: float, generate: float, generate2: float) -> dict[str, Any]:
    for e in decode_speed.ENGINES:
        row[e]["tpot2"] = row[e]["tpot"]
    row["pd"] = {"tpot": pd, "tpot2": pd}
    row["generate"] = {"tpot": generate, "tpot2": generate2}
    return row


def test_measured_pd_traffic_is_paired_with_the_rounds_plain_requests() -> None:
    speeds = {"plain": 0.004, "null": 0.004, "decode": 0.005}
    rows = [
        _with_pd(_round(speeds, {e: 0.05 for e in decode_speed.ENGINES}), 0.0044, 0.0048, 0.0046),
        _with_pd(_round(speeds, {e: 0.05 for e in decode_speed.ENGINES}), 0.0044, 0.0048, 0.0046),
        # a round whose Generate did not bring its tokens: left out of that ratio, not a zero
        _with_pd(_round(speeds, {e: 0.05 for e in decode_speed.ENGINES}), 0.0044, float("nan"), float("nan")),
    ]
    res = decode_speed.analyse(rows)
    r = res["ratios"]
    assert r["tpot pd/both"] == pytest.approx(1.1)
    assert r["tpot pd/decode"] == pytest.approx(0.88)  # against the decode engine's own plain request
    assert r["tpot generate/both"] == pytest.approx(1.2)
    assert r["tpot2 generate/both"] == pytest.approx(1.15)
    assert res["engines"]["generate"]["tpot2_ms"] == pytest.approx(4.6)
    # Generate against the same round's P/D request (the rounds where both brought their tokens)
    assert r["tpot generate/pd"] == pytest.approx(0.0048 / 0.0044)
    assert r["tpot2 generate/pd"] == pytest.approx(0.0046 / 0.0044)
    res.update(config={"prompt_len": 1024, "output_len": 16, "pd": 1, "generate": 1}, host="2 CPUs")
    res.update(load_before=0.5, load_after=0.6)
    md = decode_speed.markdown(res)
    assert "| `Generate`, at its caller, from the 2nd token | 4.60 | 1.150 | 0.920 |" in md
    assert "| P/D request (`Assign` path), decode leg, per request | 4.40 | 1.100 | 0.880 |" in md
    assert "same prompt and engine: 1.045 from the 2nd token." in md


def test_the_handoff_request_splits_generate_into_handoff_and_relay() -> None:
    speeds = {"plain": 0.004, "null": 0.004, "decode": 0.004}
    rows = []
    for _ in range(3):
        row = _with_pd(_round(speeds, {e: 0.05 for e in decode_speed.ENGINES}), 0.0040, 0.0048, 0.0046)
        row["pd_handoff"] = {"tpot": 0.0044, "tpot2": 0.0042}
        rows.append(row)
    res = decode_speed.analyse(rows)
    r = res["ratios"]
    assert r["tpot pd_handoff/pd"] == pytest.approx(1.1)  # the hand-off alone
    assert r["tpot2 generate/pd_handoff"] == pytest.approx(0.0046 / 0.0042)  # the relay alone
    assert r["tpot2 pd_handoff/both"] == pytest.approx(1.05)
    assert res["engines"]["pd_handoff"]["tpot_ms"] == pytest.approx(4.4)
    res.update(config={"prompt_len": 1024, "output_len": 16, "pd": 1, "generate": 1}, host="2 CPUs")
    res.update(load_before=0.5, load_after=0.6)
    md = decode_speed.markdown(res)
    assert "with the hand-off, prefill's token then decode's, per request | 4.40 | 1.100 | 1.100 |" in md
    assert "hand-off P/D request (its relay alone), same prompt and engine: 1.095 from the 2nd token." in md


_METRICS = """# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} %(n)s
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} %(n)s
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} %(s)s
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 7.5
"""


def test_engine_itl_is_the_histograms_growth_between_two_pages() -> None:
    before = decode_speed.itl_totals(_METRICS % {"n": "10.0", "s": "0.05"})
    after = decode_speed.itl_totals(_METRICS % {"n": "25.0", "s": "0.125"})
    assert before == pytest.approx((0.05, 10.0))  # the ITL histogram only, not the TTFT one
    assert decode_speed.engine_itl(before, after) == pytest.approx(0.075 / 15)
    assert math.isnan(decode_speed.engine_itl(after, after))  # nothing decoded in between
    assert decode_speed.itl_totals("") == (0.0, 0.0)


def test_engine_itl_ratios_pair_generate_with_the_handoff_request() -> None:
    speeds = {"plain": 0.004, "null": 0.004, "decode": 0.004}
    rows = []
    for _ in range(3):
        row = _with_pd(_round(speeds, {e: 0.05 for e in decode_speed.ENGINES}), 0.0040, 0.0048, 0.0046)
        row["pd_handoff"] = {"tpot": 0.0044, "tpot2": 0.0042, "itl": 0.0040}
        row["generate"]["itl"] = 0.0041
        rows.append(row)
    res = decode_speed.analyse(rows)
    assert res["ratios"]["itl generate/pd_handoff"] == pytest.approx(1.025)
    assert "itl pd/both" not in res["ratios"]  # neither the pd rows nor the plain ones have it
    assert "itl decode/plain" not in res["ratios"]
    for row in rows:
        for e, itl in (("plain", 0.004), ("null", 0.004), ("decode", 0.0042)):
            row[e]["itl"] = itl
    assert decode_speed.analyse(rows)["ratios"]["itl decode/both"] == pytest.approx(1.05)
    assert res["engines"]["generate"]["itl_ms"] == pytest.approx(4.1)
    assert math.isnan(res["engines"]["pd"]["itl_ms"])
    res.update(config={"prompt_len": 1024, "output_len": 16, "pd": 1, "generate": 1}, host="2 CPUs")
    res.update(load_before=0.5, load_after=0.6)
    md = decode_speed.markdown(res)
    assert "| `Generate`, at its caller, engine's inter-token latency | 4.10 | nan | nan |" in md
    assert "(its relay alone), same prompt and engine: 1.025 engine's inter-token latency." in md
    assert "P/D request (`Assign` path), decode leg, engine's" not in md


def test_rounds_without_pd_traffic_report_no_pd_ratios() -> None:
    rows = [_round({e: 0.004 for e in decode_speed.ENGINES}, {e: 0.05 for e in decode_speed.ENGINES})]
    res = decode_speed.analyse(rows)
    assert not [k for k in res["ratios"] if "pd/" in k or "generate/" in k]
    assert "pd" not in res["engines"]
    gen_only = _with_pd(
        _round({e: 0.004 for e in decode_speed.ENGINES}, {e: 0.05 for e in decode_speed.ENGINES}), 0, 0.0044, 0.0044
    )
    del gen_only["pd"]  # --generate without --pd: no pairing with a P/D request
    r = decode_speed.analyse([gen_only])["ratios"]
    assert r["tpot generate/both"] == pytest.approx(1.1) and "tpot generate/pd" not in r


def test_speed_of_a_short_stream_is_nan() -> None:
    s = decode_speed._speed([0.0, 0.004, 0.010], 3)
    assert (s["tpot"], s["tpot2"]) == pytest.approx((0.005, 0.006))
    assert s["gaps_ms"] == pytest.approx([4.0, 6.0])
    assert s["span"] == pytest.approx([0.0, 0.004, 0.010])
    short = decode_speed._speed([0.0, 0.004], 3)
    assert math.isnan(short["tpot"]) and math.isnan(short["tpot2"]) and short["gaps_ms"] == short["span"] == []


def test_gap_profile_is_the_median_gap_at_each_token() -> None:
    rows = [
        {"warmup": False, "generate": {"gaps_ms": [9.0, 5.0, 5.0]}},
        {"warmup": False, "generate": {"gaps_ms": [7.0, 5.0, 6.0]}},
        {"warmup": False, "generate": {"gaps_ms": [8.0, 4.0, 7.0]}},
        {"warmup": False, "generate": {"gaps_ms": []}},  # a short stream: left out
        {"warmup": False},
    ]
    assert decode_speed.gap_profile(rows, "generate") == pytest.approx([8.0, 5.0, 6.0])
    assert decode_speed.gap_profile(rows, "pd") == []
    md = "\n".join(decode_speed._gap_lines({"generate": [8.0, 5.0, 6.0]}))
    assert "| median gap (ms) before token | 2 | 3 | 4 |" in md
    assert "| generate | 8.00 | 5.00 | 6.00 |" in md

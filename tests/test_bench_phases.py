"""The per-phase benchmark's accounting (benchmarks/phases.py) on a synthetic timeline: which log
line is which phase, and the paired differences against the plain baseline."""

from __future__ import annotations

import math
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from benchmarks import phases

T0 = 1_800_000_000.0  # seconds since the epoch; every event below is an offset from it in ms


def _line(event: str, at_ms: float, **kw: str) -> str:
    ts = datetime.fromtimestamp(T0 + at_ms / 1e3, UTC).isoformat().replace("+00:00", "Z")
    fields = " ".join(f"{k}='{v}'" for k, v in kw.items())
    return f"(EngineCore pid=1) event='{event}' {fields} level='info' timestamp='{ts}'\n"


def _t(ms: float) -> float:
    return T0 + ms / 1e3


def _markdown(res: dict[str, Any]) -> str:
    """The report of an analysed run, with the run's own settings filled in."""
    run = {"config": {"prompt_len": 1024, "output_len": 3, "plain_instance_core": 0}, "host": "2 CPUs"}
    return phases.markdown({**res, **run, "load_before": 1.0, "load_after": 1.0})


def test_phases_split_the_prefill_leg_and_pair_it_with_the_plain_requests(tmp_path: Path) -> None:
    rid = {name: f"{i:032x}" for i, name in enumerate(("plain_a", "leg", "plain_b"), start=1)}
    p_log, d_log = tmp_path / "p.log", tmp_path / "d.log"
    p_log.write_text(
        "".join(
            [
                # plain a: sent 0, scheduled 6, forward done 86, finished 89, answered 95
                _line("request_scheduled", 6, request_id=f"cmpl-{rid['plain_a']}-0"),
                _line("forward_done", 86),
                _line("request_finished", 89, request_id=f"cmpl-{rid['plain_a']}-0"),
                # P/D leg: sent (after Assign) 1004, scheduled 1012, forward 1094, finished 1101
                _line("request_scheduled", 1012, request_id=f"cmpl-{rid['leg']}-0"),
                _line("forward_done", 1094),
                _line("write_finished", 1099, transfer_id="t1", write_ms="2.0"),
                _line("request_finished", 1101, request_id=f"cmpl-{rid['leg']}-0"),
                # Generate's leg (id chosen by the scheduler): sent 2000, scheduled 2010, forward 2090
                _line("request_scheduled", 2010, request_id="cmpl-scheduler-chosen-0"),
                _line("forward_done", 2090),
                _line("request_finished", 2093, request_id="cmpl-scheduler-chosen-0"),
                # its held push: WRITE from 2097 to 2098
                _line("write_finished", 2098, transfer_id="t3", write_ms="1.0"),
                # plain b: sent 3000, scheduled 3008, forward 3088, finished 3091, answered 3099
                _line("request_scheduled", 3008, request_id=f"cmpl-{rid['plain_b']}-0"),
                _line("forward_done", 3088),
                _line("request_finished", 3091, request_id=f"cmpl-{rid['plain_b']}-0"),
                # the hand-off into a running decode: WRITE done at 5001, released at 5004
                _line("write_finished", 5001, transfer_id="t2", write_ms="1.0"),
            ]
        )
    )
    d_log.write_text(
        "".join(
            [
                _line("transfer_released", 1100, transfer_id="t1"),
                # Generate: prefill's token appended at 2095, KV released at 2100, scheduled at 2101,
                # forward done at 2104; its second token reaches the client at 2109
                _line("first_token_appended", 2095, transfer_id="t3"),
                _line("transfer_released", 2100, transfer_id="t3"),
                _line("request_scheduled", 2101, request_id="cmpl-scheduler-chosen-decode-0"),
                _line("forward_done", 2104),
                _line("transfer_released", 5004, transfer_id="t2"),
            ]
        )
    )
    row = {
        "warmup": False,
        "plain_a": (rid["plain_a"], _t(0), _t(95)),
        "sent": _t(1000),
        "assigned": _t(1004),
        "p_rid": rid["leg"],
        "p_answer": _t(1110),
        "tid": "t1",
        "d_tokens": [_t(1120), _t(1130), _t(1140)],
        "g_sent": _t(2000),
        "g_tokens": [_t(2097), _t(2109), _t(2121)],
        "plain_d": [_t(2500), _t(2510), _t(2520)],
        "plain_d_pending": [_t(2600), _t(2611), _t(2622)],
        "plain_instance": [_t(4000), _t(4008), _t(4016)],
        "plain_instance_sent": _t(3990),
        "plain_instance_cpu_s": 0.050,
        "plain_instance_cpu_by_process": {"client": 0.010, "scheduler": 0.0, "decode": 0.001, "plain": 0.050},
        "generate_quiet_cpu_by_process": {"client": 0.009, "scheduler": 0.004, "decode": 0.052, "plain": 0.0},
        "plain_d_quiet_cpu_by_process": {"client": 0.010, "scheduler": 0.0, "decode": 0.055, "plain": 0.001},
        "generate_quiet": [_t(4200), _t(4220), _t(4232)],
        "generate_quiet_sent": _t(4190),
        "busy_tid": "t2",
        "busy_d_tokens": [_t(5012), _t(5020), _t(5028)],
        "plain_d_quiet": [_t(4100), _t(4109), _t(4118)],
        "plain_d_quiet_cpu_s": 0.055,
        "plain_b": (rid["plain_b"], _t(3000), _t(3099)),
    }
    res = phases.analyse([row, {**row, "warmup": True}], phases.Trace(p_log, d_log))
    p, d = res["p50_ms"], res["paired"]
    assert res["n"] == 1  # the warm-up row is left out
    # plain: mean of a (6, 80, 3, 6) and b (8, 80, 3, 8)
    assert p["plain.sent_to_scheduled"] == pytest.approx(7.0, abs=0.01)
    assert p["plain.forward"] == pytest.approx(80.0, abs=0.01)
    assert p["plain.finished_to_answer"] == pytest.approx(7.0, abs=0.01)
    assert p["plain.answer"] == pytest.approx(97.0, abs=0.01)
    # the leg, from Assign's answer
    assert p["pd.assign"] == pytest.approx(4.0, abs=0.01)
    assert p["pd.sent_to_scheduled"] == pytest.approx(8.0, abs=0.01)
    assert p["pd.forward"] == pytest.approx(82.0, abs=0.01)
    assert p["pd.forward_to_finished"] == pytest.approx(7.0, abs=0.01)
    assert d["leg_minus_plain.forward_to_finished"] == pytest.approx(4.0, abs=0.01)
    assert p["pd.forward_to_write"] == pytest.approx(3.0, abs=0.01)  # WRITE posted at 1097 = 1099 - 2
    assert p["pd.write_to_release"] == pytest.approx(1.0, abs=0.01)
    assert p["pd.release_to_first_token"] == pytest.approx(20.0, abs=0.01)
    # Generate's leg, found by time
    assert p["generate.sent_to_scheduled"] == pytest.approx(10.0, abs=0.01)
    assert p["generate.forward_to_finished"] == pytest.approx(3.0, abs=0.01)
    assert p["generate.finished_to_answer"] == pytest.approx(4.0, abs=0.01)
    assert d["generate_ttft_minus_plain_answer"] == pytest.approx(0.0, abs=0.01)
    assert d["tpot_ratio_pd_to_plain_decode"] == pytest.approx(1.0, abs=0.01)
    assert d["tpot_ratio_generate_to_plain_decode"] == pytest.approx(1.2, abs=0.01)
    assert d["tpot_ratio_transfer_waiting_to_plain_decode"] == pytest.approx(1.1, abs=0.01)
    assert d["tpot_ratio_decode_engine_to_plain_instance"] == pytest.approx(9 / 8, abs=0.001)
    # Generate's gap before its second token, from prefill's request end (2093)
    gap = {k: p[f"generate_gap.{k}"] for k in phases._GAP_PHASES}
    assert gap == pytest.approx(
        {
            "finished_to_token_appended": 2.0,
            "finished_to_write": 4.0,
            "write": 1.0,
            "write_to_release": 2.0,
            "release_to_scheduled": 1.0,
            "decode_forward": 3.0,
            "forward_to_second_token": 5.0,
        },
        abs=0.01,
    )
    # Generate against the plain vLLM in the same rotation, and the engines' CPU per request
    assert d["ttft_generate_minus_plain_instance"] == pytest.approx(0.0, abs=0.01)
    assert d["tpot_ratio_generate_to_plain_instance"] == pytest.approx(2.0, abs=0.001)
    assert d["tpot2_ratio_generate_to_plain_instance"] == pytest.approx(1.5, abs=0.001)
    assert d["gap_generate_minus_plain_instance"] == pytest.approx(12.0, abs=0.01)
    assert p["plain.cpu_decode_quiet"] == pytest.approx(55.0, abs=0.01)
    assert d["cpu_ratio_decode_engine_to_plain_instance"] == pytest.approx(1.1, abs=0.001)
    assert p["busy.write_to_release"] == pytest.approx(3.0, abs=0.01)
    assert p["busy.release_to_first_token"] == pytest.approx(8.0, abs=0.01)
    assert (
        "tpot_ratio_decode_engine_to_plain_instance"
        not in phases.analyse(
            [{k: v for k, v in row.items() if k not in ("plain_instance", "plain_d_quiet")}], phases.Trace(p_log, d_log)
        )["paired"]
    )
    md = _markdown(res)
    assert "| → request finished (sampled, output built) | 3.0 | 7.0 | +4.0 | 3.0 | +0.0 |" in md
    assert "| plain request while a P/D transfer waits on the decode engine | 11.00 | 1.100 |" in md
    assert "| the kvpush decode engine, plain request | 9.00 | 1.125 |" in md
    assert "| TPOT per request (the hand-off gap included) | 8.00 | 16.00 | 2.000× |" in md
    assert "| `Generate`: of the gap: request finished → the push's WRITE starts (negative: before it) | 4.00 |" in md
    # each process's CPU per request (no prefill column in the rows: nan, not a crash)
    assert p["generate.cpu_quiet.scheduler"] == pytest.approx(4.0, abs=0.01)
    assert "| CPU per request, p50 ms | client | scheduler | prefill | decode | plain |" in md
    assert "| `Generate` | 9.0 | 4.0 | nan | 52.0 | 0.0 |" in md
    assert "| decode engine, plain request | 10.0 | 0.0 | nan | 55.0 | 1.0 |" in md
    assert "two launches of one plain vLLM" not in md

    # --plain-twin: a second plain vLLM in the rotation; its ratio to the first is the run's
    # yardstick, and the P/D ratios are also taken against both plain vLLMs' mean.
    twin = {
        "plain_twin": [_t(4300), _t(4310), _t(4322)],  # TPOT 11, from the 2nd token 12
        "plain_twin_sent": _t(4290),
        "plain_twin_cpu_s": 0.060,
        "plain_twin_cpu_by_process": {"client": 0.010, "twin": 0.060},
    }
    res2 = phases.analyse([{**row, **twin}], phases.Trace(p_log, d_log))
    d2 = res2["paired"]
    assert d2["tpot_ratio_twin_to_plain_instance"] == pytest.approx(11 / 8, abs=0.001)
    assert d2["tpot2_ratio_twin_to_plain_instance"] == pytest.approx(12 / 8, abs=0.001)
    assert d2["cpu_ratio_twin_to_plain_instance"] == pytest.approx(60 / 50, abs=0.001)
    assert d2["tpot_ratio_decode_engine_to_plain_pair"] == pytest.approx(9 / 9.5, abs=0.001)
    assert d2["tpot_ratio_generate_to_plain_pair"] == pytest.approx(16 / 9.5, abs=0.001)
    assert d2["tpot2_ratio_generate_to_plain_pair"] == pytest.approx(12 / 10, abs=0.001)
    assert d2["tpot_ratio_decode_engine_to_plain_instance"] == d["tpot_ratio_decode_engine_to_plain_instance"]
    md2 = _markdown(res2)
    assert "| TPOT per request, the twin | 11.00 | 1.375 |" in md2
    assert "CPU per plain request by thread" not in md2  # rows without a per-thread count

    # Each engine's CPU per plain request by thread: a group missing from a request used nothing
    # there (a median over 0 and 4 ms, not over 4 ms alone), and groups under the floor are left out.
    threads = {
        "plain_instance_cpu_by_thread": {"VLLM::EngineCor/main": 0.040, "VLLM::EngineCor/gloo_tcp_loop": 0.002},
        "plain_d_quiet_cpu_by_thread": {"VLLM::EngineCor/main": 0.044, "VLLM::EngineCor/kv-poller-0": 0.004},
    }
    rows = [
        {**row, **twin, **threads},
        {
            **row,
            **twin,
            **threads,
            "plain_d_quiet_cpu_by_thread": {"VLLM::EngineCor/main": 0.046, "VLLM::EngineCor/idle": 0.00001},
        },
    ]
    res3 = phases.analyse(rows, phases.Trace(p_log, d_log))
    p3 = res3["p50_ms"]
    assert p3["threads.decode.VLLM::EngineCor/main"] == pytest.approx(45.0, abs=0.01)
    assert p3["threads.decode.VLLM::EngineCor/kv-poller-0"] == pytest.approx(2.0, abs=0.01)
    assert p3["threads.plain.VLLM::EngineCor/main"] == pytest.approx(40.0, abs=0.01)
    md3 = _markdown(res3)
    assert "| CPU per plain request by thread, p50 ms | plain | decode |" in md3
    assert "| VLLM::EngineCor/main | 40.00 | 45.00 |" in md3
    assert "| VLLM::EngineCor/kv-poller-0 | 0.00 | 2.00 |" in md3
    assert "VLLM::EngineCor/idle" not in md3
    assert "| `Generate` TPOT per request, against both plain vLLMs' mean | | 1.684 |" in md2


def test_a_push_started_before_its_request_finished_is_still_its_own(tmp_path: Path) -> None:
    """``push_after_output=false``: the hand-off's WRITE starts at the forward's end, before the
    request finished; the gap takes that WRITE (negative start), not the next request's."""
    p_log, d_log = tmp_path / "p.log", tmp_path / "d.log"
    p_log.write_text(
        "".join(
            [
                _line("request_scheduled", 10, request_id="cmpl-scheduler-chosen-0"),
                _line("forward_done", 90),
                _line("write_finished", 92, transfer_id="early", write_ms="1.0"),  # WRITE 91-92
                _line("request_finished", 93, request_id="cmpl-scheduler-chosen-0"),
                _line("request_scheduled", 500, request_id="cmpl-next-0"),
                _line("write_finished", 580, transfer_id="next", write_ms="1.0"),
            ]
        )
    )
    d_log.write_text(
        "".join(
            [
                _line("transfer_released", 94, transfer_id="early"),
                _line("first_token_appended", 96, transfer_id="early"),
                _line("request_scheduled", 97, request_id="cmpl-scheduler-chosen-decode-0"),
                _line("forward_done", 100),
            ]
        )
    )
    gap = {k: v * 1e3 for k, v in phases.Trace(p_log, d_log).handoff_gap(_t(0), _t(104)).items()}
    assert gap == pytest.approx(
        {
            "finished_to_token_appended": 3.0,
            "finished_to_write": -2.0,
            "write": 1.0,
            "write_to_release": 2.0,
            "release_to_scheduled": 3.0,
            "decode_forward": 3.0,
            "forward_to_second_token": 4.0,
        },
        abs=0.01,
    )


def test_tree_cpu_counts_this_process_threads() -> None:
    before = phases._tree_cpu_s(os.getpid())
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # 50 ms of CPU on this thread
        pass
    used = phases._tree_cpu_s(os.getpid()) - before
    assert 0.04 <= used < 5.0
    assert math.isnan(phases._tree_cpu_s(None))


def test_cpu_by_thread_tells_a_named_thread_from_the_rest() -> None:
    from benchmarks.process_cpu import tree_cpu_by_thread_s
    from kvpush.services.common.thread_names import name_native_thread

    named, done = threading.Event(), threading.Event()
    result: list[bool] = []

    def spin() -> None:
        result.append(name_native_thread("kv-test-spinner-long-name"))  # cut to 15 bytes
        deadline = time.thread_time() + 0.05
        while time.thread_time() < deadline:  # 50 ms of CPU on this thread
            pass
        named.set()
        done.wait(10)

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    assert named.wait(10)
    try:
        by_thread = tree_cpu_by_thread_s(os.getpid())
        proc = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
        assert result == [True]
        assert 0.04 <= by_thread[f"{proc}/kv-test-spinner"] < 5.0
        assert f"{proc}/main" in by_thread
        assert sum(by_thread.values()) == pytest.approx(phases._tree_cpu_s(os.getpid()), rel=0.05)
    finally:
        done.set()
        t.join(10)
    assert tree_cpu_by_thread_s(None) == {}


@pytest.mark.parametrize("plain_first", [False, True])
def test_plain_first_starts_the_plain_vllms_before_the_pair_and_stops_them_after(plain_first: bool) -> None:
    import contextlib
    from collections.abc import Iterator

    events: list[str] = []

    class Server:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            events.append(f"stop {self.name}")

    class Harness:
        def server(self, name: str, core: int, kv: Any, env: dict[str, str]) -> Server:
            return Server(name)

        def start(self, servers: list[tuple[Server, int]]) -> None:
            events.append("start " + "+".join(s.name for s, _ in servers))

        @contextlib.contextmanager
        def pair(self, kind: str) -> Iterator[str]:
            events.append("start pair")
            yield "pair"
            events.append("stop pair")

    flags = ["--plain-instance-core", "1", "--plain-twin", *(["--plain-first"] if plain_first else [])]
    with phases._engines(Harness(), phases.parse_args(flags)) as (pair, plain, twin):  # type: ignore[arg-type]
        assert (pair, plain.name, twin.name) == ("pair", "plain-instance", "plain-twin")
    plains = ["start plain-instance+plain-twin"]
    stops = ["stop plain-instance", "stop plain-twin"]
    if plain_first:
        assert events == [*plains, "start pair", "stop pair", *stops]
    else:
        assert events == ["start pair", *plains, *stops, "stop pair"]
    with pytest.raises(SystemExit):
        phases.parse_args(["--plain-first"])  # nothing to start first without a plain vLLM

"""``make bench-connector-cost``: its arithmetic, and the probe that switches the connector's
per-step work off and on inside a decode engine (benchmarks/connector_bypass.py), against the real
connector, rank and registration objects it reaches into."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from benchmarks import connector_bypass, connector_cost
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.messages import PushMetadata
from kvpush.connector.push_connector import KvPushConnector
from kvpush.connector.registration import Registration
from kvpush.connector.workers import DecodeWorker
from kvpush.services.decode_agent.barrier import Outcome, Released
from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig
from kvpush.v1 import kvpush_pb2 as pb
from tests.security_support import FakeEngine, regions
from tests.transfer_nodes import shape

ROOT = Path(__file__).resolve().parent.parent


def _connector() -> tuple[Any, DecodeRank, Registration]:
    """A decode KvPushConnector as vLLM's uni executor holds it (both halves in one process), with
    a real, unstarted rank and registration."""
    cfg = ConnectorConfig(engine_id="cost-d", role="decode", insecure=True)
    rank = DecodeRank(DecodeRankConfig(engine_id="cost-d", rank=0, tp_size=1, shape=shape()), FakeEngine(), regions())  # type: ignore[arg-type]
    worker = DecodeWorker(cfg, "m")
    worker.rank = rank
    registration = Registration(cfg, pb.InstanceInfo(engine_id="cost-d"), pb.LoadReport)
    conn: Any = object.__new__(KvPushConnector)
    conn.__dict__.update(
        cfg=cfg,
        worker=worker,
        scheduler=SimpleNamespace(registration=registration),
        _decode=True,
        _push_metadata_type=PushMetadata,
        _load_errors=set(),
        _trace=None,
        _connector_metadata=None,
    )
    return conn, rank, registration


def test_bypassed_hooks_answer_at_once_and_full_restores_them() -> None:
    conn, rank, _ = _connector()
    rank._released.put(Released("t", 1, "r", Outcome.OK, ""))
    connector_bypass.apply_mode("hooks", [conn])
    res = conn.get_transfer_results(set())
    assert isinstance(res, KVConnectorTransferResults) and res.finished_recving == set()  # not taken
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)
    connector_bypass.apply_mode("full", [conn])
    assert conn.get_transfer_results(set()).finished_recving == {"r"}  # the class's hook again


def test_quiet_threads_nap_long_until_full_again() -> None:
    conn, rank, registration = _connector()
    connector_bypass.apply_mode("threads", [conn])
    assert rank.cadence.idle_s == connector_bypass.QUIET_NAP_S
    wake = registration._wake
    assert isinstance(wake, connector_bypass.QuietableEvent)
    waiter = threading.Thread(target=wake.wait, args=(0.01,), daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # a 10 ms report interval now waits (for 30 s, or a load change)
    connector_bypass.apply_mode("full", [conn])
    waiter.join(5)
    assert not waiter.is_alive()  # full sets the wake-up: the stream reports at once
    assert rank.cadence.idle_s == rank.config.idle_poll_s
    wake.clear()
    assert wake.wait(0.0) is False  # the report interval is the stream's own again


def test_modes_are_checked() -> None:
    conn, _, _ = _connector()
    with pytest.raises(ValueError, match="unknown mode"):
        connector_bypass.apply_mode("off", [conn])
    with pytest.raises(RuntimeError, match="no KvPushConnector"):
        connector_bypass.apply_mode("full", [])


def test_the_probe_loads_only_where_asked_and_answers_a_signal(tmp_path: Path) -> None:
    """In a fresh interpreter, as in a decode engine's process: the sitecustomize wraps the
    connector's constructor, answers SIGUSR1 in the control directory, and hands over to the next
    sitecustomize on the path."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(f"open({str(tmp_path / 'chained')!r}, 'w').close()\n")
    control = tmp_path / "control"
    code = (
        "import os, signal\n"
        "import kvpush.connector.push_connector as m\n"
        "print(m.KvPushConnector.__init__.__name__)\n"
        f"open({str(control / 'mode')!r}, 'w').write('full')\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        f"print(open({str(control / 'ack')!r}).read())\n"
    )
    pythonpath = os.pathsep.join([str(connector_cost.PROBE_PATH), str(other), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": pythonpath, "KVPUSH_ENGINE_PROBE": str(control)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["keeping", "error: RuntimeError: no KvPushConnector in this process"]
    assert (tmp_path / "chained").exists()
    # Without the variable the probe stays out (the constructor is the class's own).
    env.pop("KVPUSH_ENGINE_PROBE")
    plain = subprocess.run(
        [sys.executable, "-c", code.split("open(")[0]], env=env, capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.strip() == "__init__"


def test_request_stats_split_the_engine_thread_from_the_others() -> None:
    before = {10: ("VLLM::EngineCor", 1_000_000, 5), 11: ("poller", 0, 100), 12: ("gone", 0, 0)}
    after = {10: ("VLLM::EngineCor", 5_000_000, 6), 11: ("poller", 2_000_000, 130), 13: ("new", 9_000_000, 9)}
    assert connector_cost.request_stats(10, before, after) == {
        "engine_cpu_ms": 4.0,
        "others_cpu_ms": 2.0,
        "others_wakeups": 30.0,
    }
    own = connector_cost.thread_stats(os.getpid())
    assert os.getpid() in own and own[os.getpid()][1] > 0


def test_paired_ratios_and_their_intervals() -> None:
    rng = np.random.default_rng(3)
    full = [
        {"tpot2_ms": float(t), "engine_cpu_ms": 100.0, "others_cpu_ms": 10.0, "others_wakeups": 50.0}
        for t in rng.uniform(2.0, 5.0, 80)  # the VM's swings, shared by both modes of a prompt
    ]
    bypassed = [{**r, "tpot2_ms": r["tpot2_ms"] * 0.9, "others_wakeups": 40.0} for r in full]
    res = connector_cost.analyse({"full": full, "bypassed": bypassed})
    p = res["paired"]["bypassed"]
    assert p["tpot2_ms"]["median"] == pytest.approx(0.9) and p["tpot2_ms"]["geomean"] == pytest.approx(0.9)
    assert p["tpot2_ms"]["median_ci90"] == pytest.approx([0.9, 0.9])
    assert p["others_wakeups"]["median"] == pytest.approx(0.8) and p["engine_cpu_ms"]["median"] == 1.0
    noisy = [{**r, "tpot2_ms": r["tpot2_ms"] * 0.9 * float(rng.uniform(0.8, 1.2))} for r in full]
    ci = connector_cost.analyse({"full": full, "bypassed": noisy})["paired"]["bypassed"]["tpot2_ms"]["median_ci90"]
    assert ci[0] < 0.9 < ci[1] and ci[1] - ci[0] < 0.15
    res["load_before"] = 0.5
    md = connector_cost.markdown(res)
    assert "| bypassed | tpot2_ms | 0.900 | 0.900–0.900 |" in md and "80 prompts per mode" in md


def test_modes_argument() -> None:
    assert connector_cost.parse_args(["--modes", "full,threads"]).mode_list == ["full", "threads"]
    for bad in ("full", "full,full", "full,off"):
        with pytest.raises(SystemExit):
            connector_cost.parse_args(["--modes", bad])

"""The decode rank's NIXL poller naps longer while the decode engine runs forwards on its core.

A 100 µs poller made the requests decoding next to a waiting P/D transfer 17-23 % slower per token
on a 2-core machine (services/decode_agent/cadence.py). These tests pin the cadence (pure), its
wiring from vLLM's step hooks (decode worker) and its use by the rank's poller thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.connector.messages import PushMetadata
from kvpush.connector.workers import DecodeWorker
from kvpush.services.decode_agent.cadence import PollCadence
from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.security_support import FakeEngine, regions
from tests.transfer_nodes import shape

WAIT_S = 10.0


def test_cadence_naps_long_only_while_the_engine_runs_forwards() -> None:
    c = PollCadence(expecting_s=1e-4, busy_s=1e-3, idle_s=5e-3, busy_hold_s=0.02)
    assert c.nap(False, 0.0) == 5e-3  # nothing expected: slow, whatever the engine does
    assert c.nap(True, 0.0) == 1e-4  # expected, engine idle: fast
    c.forward_started()
    assert c.nap(True, 100.0) == 1e-3  # a forward runs, however long
    assert c.nap(False, 100.0) == 5e-3
    c.step_ended(100.0)
    assert c.nap(True, 100.01) == 1e-3  # the gap to the next step is still busy
    c.step_ended(100.015)  # a step without a forward does not extend it
    assert c.nap(True, 100.021) == 1e-4
    c.forward_started()
    c.step_ended(200.0)
    assert c.engine_busy(200.019) and not c.engine_busy(200.021)


class _Rank:
    def __init__(self) -> None:
        self.cadence = PollCadence()

    def forward_started(self) -> None:
        self.cadence.forward_started()

    def step_ended(self, now: float) -> None:
        self.cadence.step_ended(now)

    def take_released(self) -> list[object]:
        return []


def test_decode_worker_reports_forward_steps_only() -> None:
    w = DecodeWorker(ConnectorConfig(engine_id="d0", role="decode", insecure=True), "m")
    rank = _Rank()
    w.rank = rank  # type: ignore[assignment]
    w.step_started(PushMetadata(forward_tokens=0))  # waiting for remote KV only: no forward
    assert not rank.cadence._in_forward
    w.transfer_results(set())
    assert not rank.cadence.engine_busy(rank.cadence._last_forward_end + 1.0)
    w.step_started(PushMetadata(forward_tokens=3))
    assert rank.cadence._in_forward
    w.transfer_results(set())
    assert not rank.cadence._in_forward
    end = rank.cadence._last_forward_end
    assert rank.cadence.engine_busy(end) and not rank.cadence.engine_busy(end + 2 * rank.cadence.busy_hold_s)


def test_poll_intervals_are_bounded() -> None:
    def cfg(**extra: object) -> SimpleNamespace:
        return SimpleNamespace(
            kv_role="kv_consumer", engine_id="d0", kv_connector_extra_config={"insecure": True, **extra}
        )

    assert ConnectorConfig.from_vllm(cfg(busy_poll_interval_us=500)).busy_poll_interval_us == 500
    for key in ("poll_interval_us", "busy_poll_interval_us"):
        for bad in (0, -1, 2e6):
            with pytest.raises(ConfigError, match=key):
                ConnectorConfig.from_vllm(cfg(**{key: bad}))
    # The engine's GIL switch interval: 0 keeps Python's; unset, 500 µs on prefill and Python's on
    # decode; negative or over a second is refused.
    assert ConnectorConfig.from_vllm(cfg()).switch_interval_us() == 0
    prefill = SimpleNamespace(kv_role="kv_producer", engine_id="p0", kv_connector_extra_config={"insecure": True})
    assert ConnectorConfig.from_vllm(prefill).switch_interval_us() == 500
    assert ConnectorConfig.from_vllm(cfg(gil_switch_interval_us=500)).switch_interval_us() == 500
    assert ConnectorConfig.from_vllm(cfg(gil_switch_interval_us=0)).switch_interval_us() == 0
    for bad in (-1, 2e6):
        with pytest.raises(ConfigError, match="gil_switch_interval_us"):
            ConnectorConfig.from_vllm(cfg(gil_switch_interval_us=bad))


class _RecordingCadence(PollCadence):
    """Signals once the poller took ``want`` naps of one length in a row."""

    def __init__(self, **kw: float) -> None:
        super().__init__(**kw)
        self.want = 0.0
        self.seen = threading.Event()
        self._run = 0

    def expect_naps(self, nap_s: float) -> None:
        self.want, self._run = nap_s, 0
        self.seen.clear()

    def nap(self, expecting: bool, now: float) -> float:
        out = super().nap(expecting, now)
        self._run = self._run + 1 if out == self.want else 0
        if self._run >= 5:
            self.seen.set()
        return out


def test_rank_poller_follows_the_engine() -> None:
    cfg = DecodeRankConfig(engine_id="cadence-decode", rank=0, tp_size=1, shape=shape())
    r = DecodeRank(cfg, FakeEngine(), regions())  # type: ignore[arg-type]
    cadence = _RecordingCadence(expecting_s=cfg.poll_interval_s, busy_s=cfg.busy_poll_s, idle_s=cfg.idle_poll_s)
    r.cadence = cadence
    r.start()
    try:
        stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(r.endpoint))
        exp = pb.Expectation(transfer_id="t1", epoch=1, request_id="r1", prefill_ranks=[0], prefill_engine_id="P")
        cadence.expect_naps(cfg.poll_interval_s)
        stub.Expect(pb.ExpectRequest(expectations=[exp]), timeout=WAIT_S)
        assert cadence.seen.wait(WAIT_S), "no fast polling while a transfer is expected and the engine idles"
        cadence.expect_naps(cfg.busy_poll_s)
        cadence.forward_started()
        assert cadence.seen.wait(WAIT_S), "the poller kept its fast cadence while the engine ran a forward"
        cadence.expect_naps(cfg.poll_interval_s)
        cadence.step_ended(0.0)  # long ago: idle again
        assert cadence.seen.wait(WAIT_S), "the poller stayed slow after the engine went idle"
    finally:
        r.stop()


class _CountingEngine(FakeEngine):
    """Counts the progress calls made from the thread that runs the test (the engine thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.from_engine_thread = 0
        self._engine_thread = threading.current_thread()

    def progress(self) -> dict[str, list[bytes]]:
        if threading.current_thread() is self._engine_thread:
            self.from_engine_thread += 1
        return {}


def test_engine_thread_progresses_nixl_at_step_end_only_while_a_transfer_is_expected() -> None:
    engine = _CountingEngine()
    cfg = DecodeRankConfig(engine_id="step-end-decode", rank=0, tp_size=1, shape=shape())
    r = DecodeRank(cfg, engine, regions()).start()  # type: ignore[arg-type]
    try:
        r.step_ended(0.0)
        assert engine.from_engine_thread == 0  # nothing expected: the step pays nothing
        stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(r.endpoint))
        exp = pb.Expectation(transfer_id="t1", epoch=1, request_id="r1", prefill_ranks=[0], prefill_engine_id="P")
        stub.Expect(pb.ExpectRequest(expectations=[exp]), timeout=WAIT_S)
        r.step_ended(0.0)
        assert engine.from_engine_thread == 1
        with r._progress_lock:  # the poller is progressing: the engine thread does not wait for it
            r.step_ended(0.0)
        assert engine.from_engine_thread == 1
    finally:
        r.stop()

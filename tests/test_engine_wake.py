"""The wakeable idle wait of vLLM's engine loop (connector/engine_wake.py) and who wakes it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.connector import engine_wake
from kvpush.connector.engine_wake import ENGINE_WAKE, EngineWake

core = pytest.importorskip("vllm.v1.engine.core")


@pytest.fixture
def vllm_step() -> Iterator[None]:
    """Restores vLLM's engine step and the wake's state after a test that installs it."""
    original = core.EngineCoreProc._process_engine_step
    installed = ENGINE_WAKE.installed
    ENGINE_WAKE.installed = False
    yield
    core.EngineCoreProc._process_engine_step = original
    ENGINE_WAKE.installed = installed
    ENGINE_WAKE.idle_wait(0)  # nothing left set for other tests


def test_installs_over_the_vllm_step_it_mirrors_once(vllm_step: None) -> None:
    assert core.EngineCoreProc._process_engine_step is not engine_wake._process_engine_step
    assert engine_wake.install()
    assert core.EngineCoreProc._process_engine_step is engine_wake._process_engine_step
    assert engine_wake.install()  # idempotent
    assert core.EngineCoreProc._process_engine_step is engine_wake._process_engine_step


def test_leaves_another_vllm_step_alone(vllm_step: None) -> None:
    def changed_step(self: Any) -> bool:
        return False

    core.EngineCoreProc._process_engine_step = changed_step
    assert not engine_wake.install()
    assert core.EngineCoreProc._process_engine_step is changed_step
    assert not ENGINE_WAKE.installed


def test_a_notification_ends_the_wait_and_is_consumed() -> None:
    w = EngineWake()
    assert not w.idle_wait(0)
    w.notify()
    assert w.idle_wait(0)
    assert not w.idle_wait(0)  # consumed: the next idle step waits again
    t = threading.Thread(target=w.notify)
    t.start()
    assert w.idle_wait(30.0)  # woken by another thread, not by the timeout
    t.join(5)


class _Engine:
    """What ``_process_engine_step`` touches of vLLM's ``EngineCoreProc``."""

    def __init__(self, model_executed: bool, has_requests: bool) -> None:
        self.model_executed, self._has = model_executed, has_requests
        self.queued: list[Any] = []
        self.output_queue = SimpleNamespace(put_nowait=self.queued.append)
        self.scheduler = SimpleNamespace(has_requests=lambda: self._has)
        self.post_steps: list[bool] = []

    def step_fn(self) -> tuple[dict[int, str], bool]:
        return {0: "out"}, self.model_executed

    def post_step(self, model_executed: bool) -> None:
        self.post_steps.append(model_executed)


class _Waits:
    def __init__(self) -> None:
        self.calls = 0

    def idle_wait(self, timeout_s: float = 0.001) -> bool:
        self.calls += 1
        return False


@pytest.mark.parametrize(
    ("model_executed", "has_requests", "waits"), [(False, True, 1), (True, True, 0), (False, False, 0)]
)
def test_the_step_waits_only_when_it_ran_no_model_and_requests_remain(
    monkeypatch: pytest.MonkeyPatch, model_executed: bool, has_requests: bool, waits: int
) -> None:
    spy = _Waits()
    monkeypatch.setattr(engine_wake, "ENGINE_WAKE", spy)
    e = _Engine(model_executed, has_requests)
    assert engine_wake._process_engine_step(e) is model_executed
    assert e.queued == [(0, "out")] and e.post_steps == [model_executed]
    assert spy.calls == waits


def test_a_decode_rank_release_wakes_the_engine() -> None:
    import grpc

    from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig
    from kvpush.v1 import kvpush_pb2 as pb
    from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
    from tests.security_support import FakeEngine, regions
    from tests.test_security_bounds import _exp
    from tests.transfer_nodes import shape

    woken = threading.Event()
    cfg = DecodeRankConfig(engine_id="wake-decode", rank=0, tp_size=1, shape=shape())
    r = DecodeRank(cfg, FakeEngine(), regions(), on_queued=woken.set).start()  # type: ignore[arg-type]
    try:
        stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(r.endpoint))
        stub.Expect(pb.ExpectRequest(expectations=[_exp("t1")]), timeout=5)
        assert not woken.is_set()
        stub.Settle(pb.Settlement(transfer_id="t1", epoch=1, status=pb.TRANSFER_STATUS_FAILED), timeout=5)
        assert woken.wait(5)
        assert [rel.request_id for rel in r.take_released()] == ["r-t1"]
    finally:
        r.stop()


def test_released_transfers_and_relayed_tokens_wake_the_engine() -> None:
    from kvpush.connector.push_connector import KvPushConnector

    ENGINE_WAKE.idle_wait(0)
    seen: list[tuple[set[str], set[str]]] = []
    conn = SimpleNamespace(
        _decode=True,
        _sched=SimpleNamespace(update_connector_output=lambda f, failed: seen.append((f, failed))),
    )
    KvPushConnector.update_connector_output(conn, SimpleNamespace(finished_recving=set(), failed_recving=None))  # type: ignore[arg-type]
    assert not ENGINE_WAKE.idle_wait(0)  # nothing released: no extra step
    KvPushConnector.update_connector_output(conn, SimpleNamespace(finished_recving={"a"}, failed_recving=None))  # type: ignore[arg-type]
    assert ENGINE_WAKE.idle_wait(0)
    assert seen == [({"a"}, set())]  # a step that finished nothing never reaches the scheduler half
    # A first token relayed to the decode engine: appended at the next step, run now.
    from tests.test_first_token_units import _decode, _token

    s, _ = _decode()
    s._first_tokens([_token()])
    assert ENGINE_WAKE.idle_wait(0)

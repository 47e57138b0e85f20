"""The decode connector's per-step hooks take a short path when the step moves no transfer: they
run in every step of vLLM's engine loop, next to the forward (docs/bench_phases.md, "The
connector's cost per step"). These tests pin what the short paths skip and what they still do."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvpush.connector.messages import PushMetadata
from kvpush.connector.push_connector import KvPushConnector
from kvpush.services.common.handoff import Handoff
from kvpush.services.decode_agent.barrier import Outcome, Released
from tests.test_first_token_units import _worker


def test_an_empty_handoff_answers_without_its_lock() -> None:
    h: Handoff[int] = Handoff()
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with h._cv:
            holding.set()
            done.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holding.wait(5)
    answered: list[list[int]] = []
    taker = threading.Thread(target=lambda: answered.append(h.take()), daemon=True)
    taker.start()
    taker.join(5)
    assert answered == [[]]  # did not wait for the lock another thread holds
    done.set()
    holder.join(5)
    h.put(7)
    assert h.take() == [7] and h.take() == []


def test_a_quiet_step_reports_nothing_but_still_ends_the_forward() -> None:
    w, rank = _worker()
    w.step_started(PushMetadata(forward_tokens=1))
    assert rank.cadence._in_forward
    assert w.transfer_results(set()) is None
    assert not rank.cadence._in_forward  # the poller still learns the forward ended
    rank.released = [Released("t", 1, "r", Outcome.OK, "")]
    out = w.transfer_results(set())
    assert out is not None and out.finished_recving == {"r"} and out.failed_recving == set()
    assert w.transfer_results(set()) is None  # reported once


def test_a_release_held_for_its_token_keeps_the_full_path_until_reported() -> None:
    w, rank = _worker()
    w.wait_for_save(PushMetadata(awaiting_first_token=["r"]))
    assert rank.awaited_calls == [True]
    rank.released = [Released("t", 1, "r", Outcome.OK, "")]
    held = w.transfer_results(set())
    assert held is not None and held.finished_recving == set()  # held for its token, not dropped
    assert w.transfer_results(set()) is not None  # checked at every step while held (its deadline)
    w.wait_for_save(PushMetadata(first_token_delivered=["r"]))
    out = w.transfer_results(set())
    assert out is not None and out.finished_recving == {"r"}
    assert w.transfer_results(set()) is None


def test_a_step_without_hand_off_bookkeeping_leaves_the_rank_alone() -> None:
    w, rank = _worker()
    w.wait_for_save(PushMetadata(forward_tokens=5))
    w.wait_for_save(None)
    assert rank.awaited_calls == []
    w.wait_for_save(PushMetadata(fail_loads=["x"]))
    assert rank.awaited_calls == [False]
    out = w.transfer_results(set())
    assert out is not None and out.finished_recving == {"x"} and out.failed_recving == {"x"}


def test_the_connector_maps_nothing_to_an_empty_report() -> None:
    conn = SimpleNamespace(worker=SimpleNamespace(transfer_results=lambda ids: None), _load_errors=set())
    res = KvPushConnector.get_transfer_results(conn, set())  # type: ignore[arg-type]
    assert isinstance(res, KVConnectorTransferResults)
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (set(), set(), set())
    # Fresh sets each step: vLLM owns what it is given.
    assert KvPushConnector.get_transfer_results(conn, set()).finished_recving is not res.finished_recving  # type: ignore[arg-type]


class _Lines:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **kw: object) -> None:
        self.events.append((event, kw))


def _traced_connector(trace: _Lines | None) -> KvPushConnector:
    conn = object.__new__(KvPushConnector)
    seen: list[PushMetadata | None] = []
    conn._trace = trace  # type: ignore[assignment]
    conn._push_metadata_type = PushMetadata
    conn.scheduler = SimpleNamespace(build_connector_meta=lambda out: PushMetadata())  # type: ignore[assignment]
    conn.worker = SimpleNamespace(wait_for_save=seen.append)  # type: ignore[assignment]
    conn._seen = seen  # type: ignore[attr-defined]
    return conn


def _step(conn: KvPushConnector, new_reqs: list[str]) -> None:
    """One engine step through both halves: the scheduler builds the metadata, the worker ends
    the forward (vLLM binds the metadata in between)."""
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new_reqs])
    conn._connector_metadata = conn.build_connector_meta(out)  # type: ignore[arg-type]
    conn.wait_for_save()


def test_the_step_trace_logs_only_forwards_of_steps_that_schedule_a_request() -> None:
    """A trace line in every decode step slowed the traced decode engine by 7-11 %: only the
    steps the per-phase benchmark reads (a request's first forward) are logged."""
    lines = _Lines()
    conn = _traced_connector(lines)
    _step(conn, ["a"])
    _step(conn, [])  # decode steps of "a"
    _step(conn, [])
    _step(conn, ["b", "c"])
    assert [e for e, _ in lines.events] == [
        "request_scheduled",
        "forward_done",
        "request_scheduled",
        "request_scheduled",
        "forward_done",
    ]
    assert [kw.get("request_id") for e, kw in lines.events if e == "request_scheduled"] == ["a", "b", "c"]
    seen = conn._seen  # type: ignore[attr-defined]
    assert [m.trace_forward for m in seen] == [True, False, False, True]  # the worker still gets every step's

    quiet = _traced_connector(None)  # trace_steps off: nothing logged, nothing marked
    _step(quiet, ["a"])
    assert quiet._seen[0].trace_forward is False  # type: ignore[attr-defined]

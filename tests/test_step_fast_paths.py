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

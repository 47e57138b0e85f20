"""Prefill posts a hand-off request's first token the moment its worker samples it
(connector/completion_tokens.py ``AwaitedFirstTokens``, connector/vllm_worker.py), and the push of
that transfer starts then (``push_at_sampling``), so the push's first completion already carries
the token; without the worker's tap both fall back to the request's end and the forward's end."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.connector import completion_tokens, sampler_state
from kvpush.connector.completion_tokens import AwaitedFirstTokens, AwaitedToken, SampledFirstTokens
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.handoff_holds import HANDOFF_HOLDS
from kvpush.connector.messages import FinishedPrefill, PushMetadata
from kvpush.connector.vllm_worker import after_sampling
from kvpush.connector.workers import PrefillWorker
from kvpush.services.common.transfer_params import PrefillLeg, to_params


def _output(**tokens: list[int]) -> SimpleNamespace:
    """A step's ModelRunnerOutput as far as the tap reads it: request id -> sampled tokens."""
    return SimpleNamespace(
        req_id_to_index={rid: i for i, rid in enumerate(tokens)}, sampled_token_ids=list(tokens.values())
    )


def test_an_awaited_token_is_posted_when_its_step_samples_it() -> None:
    board = SampledFirstTokens()
    awaited = AwaitedFirstTokens(board)
    awaited.await_token("r1", AwaitedToken("t1"))
    assert board.pending("t1")  # expected from the forward on: its completions wait for it
    assert awaited.sampled(_output(r0=[5], r1=[7, 8])) == [AwaitedToken("t1")]
    assert board.get("t1") == 7 and not board.pending("t1") and len(awaited) == 0
    assert awaited.sampled(_output(r1=[9])) == []  # once: a later step changes nothing
    assert board.get("t1") == 7


@pytest.mark.parametrize(
    "output",
    [_output(r0=[5]), _output(r1=[]), SimpleNamespace(async_output=True)],
    ids=["not-in-the-output", "nothing-sampled", "async-output"],
)
def test_a_token_the_step_did_not_sample_is_left_to_the_requests_end(output: Any) -> None:
    board = SampledFirstTokens()
    awaited = AwaitedFirstTokens(board)
    awaited.await_token("r1", AwaitedToken("t1", holds_push=True))
    assert awaited.sampled(output) == [AwaitedToken("t1", holds_push=True)]  # its held push starts anyway
    assert board.pending("t1") and len(awaited) == 0  # still expected; nothing kept here


def test_a_step_without_awaited_tokens_reads_nothing() -> None:
    awaited = AwaitedFirstTokens(SampledFirstTokens())
    assert awaited.sampled(object()) == []


@pytest.fixture
def tap() -> Iterator[list[tuple[str, str]]]:
    """A prefill worker process whose worker class taps the sampler (KvPushWorker bound), with a
    clean board; yields the pushes handed to the agent, in order."""
    saved = sampler_state._runner
    sampler_state._runner = object()
    board = completion_tokens.SAMPLED_FIRST_TOKENS
    for tid in ("t1", "t2"):
        board.forget(tid)
    try:
        yield []
    finally:
        sampler_state._runner = saved
        for tid in ("t1", "t2"):
            board.forget(tid)
        after_sampling(object())  # nothing stays awaited or held for the next test
        HANDOFF_HOLDS.release(["t1", "t2"])


def _worker(pushed: list[tuple[str, str]], writer: Any = None, **cfg: Any) -> PrefillWorker:
    """A prefill worker whose agent records each push; ``writer(tid, handled)``, if given, stands
    in for the writer thread that handles it."""
    w = PrefillWorker(ConnectorConfig(engine_id="p", role="prefill", **cfg), "m")

    def prefill_done(tid: str, rid: str, *a: Any, handled: threading.Event | None = None, **kw: Any) -> None:
        pushed.append(("push", tid))
        if writer is not None:
            writer(tid, handled)

    w.agent = SimpleNamespace(prefill_done=prefill_done, prefill_aborted=lambda *a, **kw: None)  # type: ignore[assignment]
    return w


def _step(w: PrefillWorker) -> None:
    w.wait_for_save(
        PushMetadata(
            finished_prefills=[
                FinishedPrefill("t1", "r1", ((1,),), 5, "d", first_token=True),
                FinishedPrefill("t2", "r2", ((2,),), 5, "d"),  # no hand-off: pushed at the forward's end
            ]
        )
    )


def test_a_handoff_push_starts_when_its_token_is_sampled(tap: list[tuple[str, str]]) -> None:
    w = _worker(tap)
    _step(w)
    board = completion_tokens.SAMPLED_FIRST_TOKENS
    assert tap == [("push", "t2")] and board.pending("t1")  # t1 waits for its token
    after_sampling(_output(r1=[42], r2=[3]))
    assert board.get("t1") == 42 and board.get("t2") is None  # only the hand-off's token
    assert tap == [("push", "t2"), ("push", "t1")]  # the WRITE starts with the token posted
    w.step_started(PushMetadata())  # the next step's fallback release finds nothing held
    assert tap == [("push", "t2"), ("push", "t1")]


def test_a_handoff_push_never_waits_past_the_next_step(tap: list[tuple[str, str]]) -> None:
    w = _worker(tap)
    _step(w)
    after_sampling(SimpleNamespace())  # no tokens read (an async output): the push goes anyway
    assert tap == [("push", "t2"), ("push", "t1")]
    w2 = _worker(tap)
    tap.clear()
    _step(w2)
    w2.step_started(PushMetadata())  # a step that never reached the sampler: the next step releases it
    assert tap == [("push", "t2"), ("push", "t1")]


def test_the_engine_thread_gives_the_handoff_write_the_core_first(tap: list[tuple[str, str]]) -> None:
    waited_for: dict[str, bool] = {}  # transfer -> the engine thread waits for the writer to handle it

    def writer(tid: str, handled: threading.Event | None) -> None:
        waited_for[tid] = handled is not None

        def run() -> None:
            tap.append(("written", tid))
            if handled is not None:
                handled.set()

        threading.Thread(target=run).start()

    w = _worker(tap, writer, push_first_wait_ms=30_000)
    _step(w)
    after_sampling(_output(r1=[42]))
    # Back on the engine thread only once the writer handled t1 (t2 went at the forward's end,
    # without a wait).
    assert tap[-2:] == [("push", "t1"), ("written", "t1")]
    assert waited_for == {"t1": True, "t2": False}


def test_a_stuck_writer_holds_the_engine_thread_only_up_to_the_bound(tap: list[tuple[str, str]]) -> None:
    w = _worker(tap, lambda tid, handled: None, push_first_wait_ms=50)  # never handled
    _step(w)
    t0 = time.monotonic()
    after_sampling(_output(r1=[42]))
    waited = time.monotonic() - t0
    assert 0.045 <= waited < 5 and tap[-1] == ("push", "t1")
    w0 = _worker(tap, lambda tid, handled: None, push_first_wait_ms=0)  # 0: no wait at all
    _step(w0)
    t0 = time.monotonic()
    after_sampling(_output(r1=[42]))
    assert time.monotonic() - t0 < 0.045


def test_the_writer_reports_a_push_handled_even_before_its_reservation() -> None:
    from kvpush.services.prefill_agent.agent import PrefillAgent, PrefillAgentConfig
    from tests.security_support import FakeEngine, regions
    from tests.transfer_nodes import shape

    agent = PrefillAgent(
        PrefillAgentConfig(engine_id="p", rank=0, tp_size=1, shape=shape()),
        FakeEngine(),  # type: ignore[arg-type]
        regions(),
    ).start()
    try:
        handled = threading.Event()
        agent.prefill_done("t-early", "r", [[1, 2]], 32, decode_engine_id="d", handled=handled)
        assert handled.wait(10)  # nothing to write yet: the engine thread need not wait
        assert agent.writer.call(lambda: agent.writer.table.active_count()).result(5) == 1
    finally:
        agent.stop()


def test_the_push_at_the_forwards_end_still_gets_the_token_at_sampling(tap: list[tuple[str, str]]) -> None:
    w = _worker(tap, push_at_sampling=False)
    _step(w)
    assert tap == [("push", "t1"), ("push", "t2")]  # both at once, in order
    after_sampling(_output(r1=[42]))
    assert completion_tokens.SAMPLED_FIRST_TOKENS.get("t1") == 42


@pytest.mark.parametrize("bound", [True, False], ids=["tap-off-by-config", "no-tap-worker-class"])
def test_without_the_tap_nothing_is_awaited_and_the_push_goes_at_the_forwards_end(
    tap: list[tuple[str, str]], bound: bool
) -> None:
    if not bound:
        sampler_state._runner = None
    w = _worker(tap, first_token_at_sampling=not bound)
    _step(w)
    assert tap == [("push", "t1"), ("push", "t2")]
    assert len(completion_tokens.AWAITED_FIRST_TOKENS) == 0


def test_the_requests_end_keeps_the_sampled_token_and_flags_a_different_one(tap: list[tuple[str, str]]) -> None:
    from structlog.testing import capture_logs

    from kvpush.connector.prefill_scheduler import PrefillScheduler
    from tests.test_connector_units import _Req, _vllm_cfg

    board = completion_tokens.SAMPLED_FIRST_TOKENS
    posts: list[tuple[str, int]] = []

    def listener(tid: str, token: int) -> None:
        posts.append((tid, token))

    board.add_listener(listener)
    try:
        with capture_logs() as logs:
            for tid, sampled, output in (("t1", 42, 42), ("t2", 42, 43)):
                s = PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill", insecure=True), _vllm_cfg())
                s._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([4],))
                r = _Req("r-" + tid, 10, to_params(PrefillLeg(tid, "d", first_token=True)))
                s.update_state_after_alloc(r, None, 0)
                s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={r.request_id: 10}))
                board.post(tid, sampled)  # the worker's tap
                r.output_token_ids = [output]  # type: ignore[attr-defined]
                s.request_finished(r)
                assert board.get(tid) == output
    finally:
        board.remove_listener(listener)
    # The same token is not posted twice (no second notice); a different one is, and is logged.
    assert posts == [("t1", 42), ("t2", 42), ("t2", 43)]
    assert [e["transfer_id"] for e in logs if e["event"] == "first_token_mismatch"] == ["t2"]

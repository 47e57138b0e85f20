"""The first-token hand-off's token on the push's own completion (connector/completion_tokens.py):
prefill puts the token it sampled in each OK completion of the transfer; decode's rank hands the
token of a completion its barrier accepted to the scheduler half, which appends it as it appends a
relayed one, but only from the leg's prefill and only for a request waiting for it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvpush.connector.completion_tokens import COMPLETION_TOKENS, CompletionTokenInbox, SampledFirstTokens
from kvpush.connector.config import ConnectorConfig
from kvpush.services.common.transfer_params import PrefillLeg, to_params
from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig
from kvpush.services.prefill_agent.agent import PrefillAgent
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.security_support import FakeEngine, regions
from tests.test_first_token_units import _Blocks, _decode, _leg, _request, _step, _token
from tests.test_security_bounds import _exp
from tests.transfer_nodes import shape

# ----- prefill ----------------------------------------------------------------------------------


def test_sampled_tokens_are_kept_until_forgotten_and_bounded() -> None:
    board = SampledFirstTokens(capacity=2)
    board.post("a", 1)
    board.post("b", 2)
    assert (board.get("a"), board.get("b"), board.get("x")) == (1, 2, None)
    board.forget("a")
    assert board.get("a") is None and len(board) == 1
    board.post("c", 3)
    board.expect("d")  # over capacity: the oldest goes
    assert (board.get("b"), board.get("c"), board.get("d")) == (None, 3, None) and len(board) == 2
    board.expect("c")  # expecting a posted token keeps it
    assert board.get("c") == 3


def test_a_wait_ends_with_the_post_from_another_thread() -> None:
    board = SampledFirstTokens()

    async def scenario() -> tuple[int | None, ...]:
        board.expect("t")
        waiting = asyncio.ensure_future(board.wait("t", timeout_s=30))
        await asyncio.sleep(0)  # the waiter is registered
        threading.Thread(target=board.post, args=("t", 0)).start()  # token 0 is a token
        got = await waiting
        return got, await board.wait("t", timeout_s=30)  # posted: at once

    assert asyncio.run(scenario()) == (0, 0)


def test_a_wait_ends_without_a_token_when_none_is_expected_forgotten_or_late() -> None:
    board = SampledFirstTokens(capacity=1)

    async def scenario() -> list[int | None]:
        out = [await board.wait("never", timeout_s=30)]  # not a hand-off's: no wait at all
        board.expect("t")
        waiting = asyncio.ensure_future(board.wait("t", timeout_s=30))
        await asyncio.sleep(0)
        board.forget("t")  # its request ended without a token
        out.append(await waiting)
        board.expect("u")
        out.append(await board.wait("u", timeout_s=0.01))  # bounded
        waiting = asyncio.ensure_future(board.wait("u", timeout_s=30))
        await asyncio.sleep(0)
        board.expect("v")  # over capacity: "u" is dropped, its waiter freed
        out.append(await waiting)
        return out

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [None, None, None, None]
    assert not board._waiters


def test_a_post_never_raises_into_the_engine_thread_for_a_closed_agent_loop() -> None:
    board = SampledFirstTokens()
    loop = asyncio.new_event_loop()
    board.expect("t")
    waiter = loop.create_future()
    board._waiters["t"] = [(loop, waiter)]  # a send that waits while its agent's loop is stopped
    loop.close()
    board.post("t", 3)  # the engine thread, at request_finished: must not raise
    assert board.get("t") == 3 and not board._waiters


def _sent(tokens: SampledFirstTokens | None, status: int, between: Callable[[], None] = lambda: None) -> pb.Completion:
    """The completion as the agent sends it: taken by ``_deliver`` (the writer thread), then by the
    send's own wait on the agent's loop; ``between`` runs in between (the engine thread)."""
    from kvpush.services.prefill_agent.writer import CompletionReport

    queued: list[Any] = []
    agent = SimpleNamespace(_first_tokens=tokens, _first_token_wait_s=5.0, _loop=SimpleNamespace(submit=queued.append))
    agent._send_completion = lambda report: report
    c = pb.Completion(transfer_id="t1", epoch=1, status=status)
    PrefillAgent._deliver(agent, CompletionReport("d:1", c))  # type: ignore[arg-type]
    assert queued and queued[0].completion is c
    between()
    asyncio.run(asyncio.wait_for(PrefillAgent._add_first_token(agent, c), 10))  # type: ignore[arg-type]
    return c


def test_only_an_ok_completion_carries_the_sampled_token() -> None:
    posted = SampledFirstTokens()
    posted.post("t1", 0)  # token 0 is a token: carried as present, not as "unset"
    ok = _sent(posted, pb.TRANSFER_STATUS_OK)
    assert ok.HasField("first_token") and ok.first_token == 0
    assert not _sent(posted, pb.TRANSFER_STATUS_FAILED).HasField("first_token")
    assert not _sent(SampledFirstTokens(), pb.TRANSFER_STATUS_OK).HasField("first_token")  # not a hand-off's
    assert not _sent(None, pb.TRANSFER_STATUS_OK).HasField("first_token")  # turned off


def test_a_token_posted_before_the_write_finished_is_taken_by_the_writer_thread() -> None:
    """Held for the step's output, the push starts after the token was posted: the writer thread
    puts it in the completion at once, whatever happens to the board before the agent's loop
    sends it."""
    tokens = SampledFirstTokens()
    tokens.post("t1", 5)
    assert _sent(tokens, pb.TRANSFER_STATUS_OK, between=lambda: tokens.forget("t1")).first_token == 5


def test_a_completion_whose_write_finished_first_waits_for_the_token() -> None:
    tokens = SampledFirstTokens()
    tokens.expect("t1")
    c = _sent(tokens, pb.TRANSFER_STATUS_OK, between=lambda: tokens.post("t1", 9))
    assert c.HasField("first_token") and c.first_token == 9


@pytest.mark.parametrize("on", [True, False])
def test_prefill_posts_the_token_it_sampled_for_its_completions(on: bool) -> None:
    from kvpush.connector import completion_tokens
    from kvpush.connector.prefill_scheduler import PrefillScheduler
    from tests.test_connector_units import _Req, _vllm_cfg

    completion_tokens.SAMPLED_FIRST_TOKENS.forget("t-post")
    cfg = ConnectorConfig(engine_id="p", role="prefill", insecure=True, first_token_on_completion=on)
    s = PrefillScheduler(cfg, _vllm_cfg())
    s._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([4],))
    r = _Req("r1", 10, to_params(PrefillLeg("t-post", "d", first_token=True)))
    s.update_state_after_alloc(r, None, 0)
    board = completion_tokens.SAMPLED_FIRST_TOKENS
    s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 10}))
    assert ("t-post" in board._tokens) is on  # expected from the step that computes its last chunk
    r.output_token_ids = [42]  # type: ignore[attr-defined]
    assert s.request_finished(r)[0]
    assert board.get("t-post") == (42 if on else None)
    s.update_connector_output({"r1"})  # its blocks are freed: kept for a completion sent late
    assert board.get("t-post") == (42 if on else None)
    board.forget("t-post")


def test_prefill_forgets_a_token_it_never_sampled() -> None:
    from kvpush.connector import completion_tokens
    from kvpush.connector.prefill_scheduler import PrefillScheduler
    from tests.test_connector_units import _Req, _vllm_cfg

    board = completion_tokens.SAMPLED_FIRST_TOKENS
    s = PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill", insecure=True), _vllm_cfg())
    s._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([4],))
    r = _Req("r1", 10, to_params(PrefillLeg("t-none", "d", first_token=True)))
    s.update_state_after_alloc(r, None, 0)
    s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 10}))
    assert "t-none" in board._tokens
    r.status = SimpleNamespace(name="FINISHED_ABORTED")
    s.request_finished(r)  # aborted before its token: a completion waiting for it stops waiting
    assert "t-none" not in board._tokens


# ----- decode rank ------------------------------------------------------------------------------


@pytest.fixture
def rank() -> Iterator[tuple[DecodeRank, list[tuple[str, Any]]]]:
    """A decode rank (real gRPC, plaintext) recording tokens and releases in the order they came."""
    events: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def token(ft: pb.FirstToken) -> None:
        with lock:
            events.append(("token", ft))

    def released(rel: Any) -> None:
        with lock:
            events.append(("released", rel.transfer_id))

    cfg = DecodeRankConfig(engine_id="d0", rank=0, tp_size=1, shape=shape())
    r = DecodeRank(cfg, FakeEngine(), regions(), on_release=released, on_first_token=token).start()  # type: ignore[arg-type]
    try:
        yield r, events
    finally:
        r.stop()


def _completion(tid: str, prefill: str = "P", epoch: int = 1, ok: bool = True, token: int | None = 9) -> pb.Completion:
    c = pb.Completion(
        transfer_id=tid,
        epoch=epoch,
        prefill_rank=0,
        decode_rank=0,
        status=pb.TRANSFER_STATUS_OK if ok else pb.TRANSFER_STATUS_FAILED,
        prefill=pb.EngineIdentity(engine_id=prefill),
    )
    if token is not None:
        c.first_token = token
    return c


def test_an_accepted_completion_hands_its_token_on_before_its_release(
    rank: tuple[DecodeRank, list[tuple[str, Any]]],
) -> None:
    r, events = rank
    stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(r.endpoint))
    stub.Expect(pb.ExpectRequest(expectations=[_exp("t1")]), timeout=5)
    assert stub.Complete(_completion("t1"), timeout=5).released
    assert events == [
        ("token", pb.FirstToken(transfer_id="t1", decode_engine_id="d0", prefill_engine_id="P", token_id=9)),
        ("released", "t1"),
    ]


def test_a_failing_token_taker_never_fails_the_completion() -> None:
    released: list[str] = []

    def broken(ft: pb.FirstToken) -> None:
        raise RuntimeError("the scheduler half is gone")

    cfg = DecodeRankConfig(engine_id="d0", rank=0, tp_size=1, shape=shape())
    r = DecodeRank(
        cfg, FakeEngine(), regions(), on_release=lambda rel: released.append(rel.transfer_id), on_first_token=broken
    ).start()  # type: ignore[arg-type]
    try:
        stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(r.endpoint))
        stub.Expect(pb.ExpectRequest(expectations=[_exp("t1")]), timeout=5)
        assert stub.Complete(_completion("t1"), timeout=5).released
        assert released == ["t1"]
    finally:
        r.stop()


def test_a_refused_or_failed_completion_hands_no_token_on(rank: tuple[DecodeRank, list[tuple[str, Any]]]) -> None:
    r, events = rank
    stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(r.endpoint))
    stub.Expect(pb.ExpectRequest(expectations=[_exp("t1"), _exp("t2"), _exp("t3")]), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(_completion("t1", prefill="Q"), timeout=5)  # not the transfer's prefill
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(_completion("t2", epoch=2), timeout=5)  # not its epoch
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert not stub.Complete(_completion("t3", ok=False), timeout=5).released  # a failed WRITE's
    assert stub.Complete(_completion("t2", token=None), timeout=5).released  # released, carried no token
    assert [e for e in events if e[0] == "token"] == []


# ----- decode scheduler half --------------------------------------------------------------------


def test_a_completions_token_is_appended_and_a_later_relay_changes_nothing() -> None:
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    assert _step(s).first_token_delivered == []
    from kvpush.services.decode_agent.metrics import FIRST_TOKEN_PATHS

    before = FIRST_TOKEN_PATHS.labels("completion")._value.get()
    s._completion_token(_token(token=7))
    assert _step(s).first_token_delivered == ["r"] and r.prompt_token_ids[-1] == 7 and r.num_prompt_tokens == 38
    assert FIRST_TOKEN_PATHS.labels("completion")._value.get() == before + 1
    s._first_tokens([_token(token=7)])  # the relay's copy of it
    assert _step(s).first_token_delivered == [] and r.num_prompt_tokens == 38
    assert not s._tokens and s._pending_tokens == 0


@pytest.mark.parametrize("took_token", [True, False])
def test_a_token_that_comes_after_its_request_ended_is_dropped_as_late(took_token: bool) -> None:
    """Under faults the relay's copy of a token decode already took from the completion can come
    after the request has ended (a soak on 2026-12-07: three such, each kept for a minute and then
    reported as an unclaimed token). A token for a transfer whose hand-off request ended here,
    with its token or without, is dropped at once and counted as late, never as expired."""
    from kvpush.services.decode_agent.metrics import FIRST_TOKENS

    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    _step(s)
    if took_token:
        s._completion_token(_token(token=7))
        assert _step(s).first_token_delivered == ["r"]
    s.request_finished(r)
    _step(s)
    late, expired = FIRST_TOKENS.labels("late")._value.get(), FIRST_TOKENS.labels("expired")._value.get()
    s._first_tokens([_token(token=7)])
    _step(s)
    assert not s._tokens and s._pending_tokens == 0
    s._take_tokens(time.monotonic() + 61)
    assert FIRST_TOKENS.labels("late")._value.get() == late + 1
    assert FIRST_TOKENS.labels("expired")._value.get() == expired
    s._first_tokens([_token(tid="nobody")])  # a transfer never reserved here still waits, then expires
    _step(s)
    assert s._pending_tokens == 1


def test_a_completions_token_is_taken_only_from_the_legs_prefill() -> None:
    """After a reroute the new prefill's completion carries the token it sampled, which may differ
    from the one the frontend streamed (the first prefill's, which the relay carries)."""
    s, agent = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    agent.prefill = "p1"
    s._completion_token(_token(prefill="p1", token=5))
    assert _step(s).first_token_delivered == [] and r.num_prompt_tokens == 37
    s._first_tokens([_token(prefill="p0", token=6)])
    assert _step(s).first_token_delivered == ["r"] and r.prompt_token_ids[-1] == 6


def test_a_completions_token_nobody_waits_for_is_dropped() -> None:
    s, _ = _decode()
    s._completion_token(_token(tid="nobody"))
    s._completion_token(_token(token=1000))  # out of the vocabulary too
    assert _step(s).first_token_delivered == []
    assert not s._tokens and s._pending_tokens == 0 and not s._completion_inbox


def test_a_completions_token_out_of_the_vocabulary_is_refused() -> None:
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    s._completion_token(_token(token=1000))
    assert _step(s).first_token_delivered == [] and "r" in s._want_token


def test_a_seeded_request_taking_a_completions_token_advances_its_sampler() -> None:
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg(), seed=11)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    s._completion_token(_token())
    _step(s)
    assert _step(s, new=("r",)).advance_sampler == ["r"]


def test_the_inbox_reaches_a_bound_scheduler_half_only() -> None:
    inbox = CompletionTokenInbox()
    assert not inbox.offer(_token())  # nobody in this process takes tokens (vLLM's mp executor)
    got: list[pb.FirstToken] = []
    inbox.bind(got.append)
    assert inbox.offer(_token()) and got == [_token()]
    inbox.bind(None)
    assert not inbox.offer(_token())
    assert COMPLETION_TOKENS is not inbox

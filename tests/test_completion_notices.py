"""Completion notices (services/common/completion_notice.py): a prefill rank's OK completion sent
ahead of its RPC as a NIXL notification, MACed with the key of the transfer's epoch. Real NIXL on
both ends (UCX over loopback); the decode rank's gRPC server is real too (plaintext)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvpush.connector.completion_tokens import SampledFirstTokens
from kvpush.services.common import completion_notice as cn
from kvpush.services.common.nixl_engine import NixlEngine, NixlError
from kvpush.services.decode_agent import metrics as decode_metrics
from kvpush.services.decode_agent import rank as rank_module
from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig
from kvpush.services.prefill_agent import metrics as prefill_metrics
from kvpush.services.prefill_agent.agent import PrefillAgent
from kvpush.services.prefill_agent.notices import CompletionNotices, NoticeTarget
from kvpush.services.prefill_agent.writer import CompletionReport
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.security_support import regions
from tests.transfer_nodes import shape

WAIT_S = 10.0


def _until(cond: Callable[[], bool], timeout: float = WAIT_S, pump: NixlEngine | None = None) -> bool:
    """Polls ``cond`` under a deadline. ``pump``: a sending engine to progress meanwhile (a
    connection no WRITE has used yet opens only while its sender calls into NIXL; the writer's
    notices always follow a WRITE that did)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        if pump is not None:
            pump.progress()
        time.sleep(0.002)  # polling a condition under a deadline
    return True


def _refused(outcome: str = "refused") -> float:
    return decode_metrics.COMPLETION_NOTICES.labels(outcome=outcome)._value.get()


def _accepted() -> float:
    return decode_metrics.COMPLETION_NOTICES.labels(outcome="accepted")._value.get()


# ----- the codec --------------------------------------------------------------------------------


def test_a_notice_verifies_only_under_its_key_and_with_every_field_as_sent() -> None:
    key = cn.new_key()
    raw = cn.encode(key, "t1", 3, 1, 2, 77)
    n = cn.decode(raw)
    assert isinstance(n, pb.CompletionNotice)
    assert (n.transfer_id, n.epoch, n.prefill_rank, n.decode_rank, n.first_token) == ("t1", 3, 1, 2, 77)
    assert cn.verify(key, n)
    assert not cn.verify(cn.new_key(), n)
    assert not cn.verify(b"", n)
    for name, value in (("transfer_id", "t2"), ("epoch", 4), ("prefill_rank", 0), ("decode_rank", 0)):
        forged = pb.CompletionNotice()
        forged.CopyFrom(n)
        setattr(forged, name, value)
        assert not cn.verify(key, forged), name
    other_token = pb.CompletionNotice()
    other_token.CopyFrom(n)
    other_token.first_token = 78
    assert not cn.verify(key, other_token)
    no_token = pb.CompletionNotice()
    no_token.CopyFrom(n)
    no_token.ClearField("first_token")
    assert not cn.verify(key, no_token)  # a token cannot be stripped or added either
    assert cn.verify(key, cn.decode(cn.encode(key, "t1", 3, 1, 2)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not a notice",
        cn.PREFIX + b"\xff\xff\xff",
        cn.PREFIX + b"x" * cn.MAX_NOTICE_BYTES,
        cn.PREFIX + pb.CompletionNotice(transfer_id="t", epoch=1).SerializeToString(),  # no MAC
        cn.PREFIX + pb.CompletionNotice(epoch=1, mac=b"m" * 32).SerializeToString(),  # no transfer id
        cn.PREFIX + pb.CompletionNotice(transfer_id="t" * 200, epoch=1, mac=b"m" * 32).SerializeToString(),
    ],
)
def test_malformed_notices_are_named_not_parsed(raw: bytes) -> None:
    assert isinstance(cn.decode(raw), str)


# ----- the decode rank --------------------------------------------------------------------------


def _ok_completion(tid: str) -> pb.Completion:
    """The Completion RPC that follows a notice (epoch 1, prefill "P", ranks 0 -> 0)."""
    return pb.Completion(
        transfer_id=tid,
        epoch=1,
        prefill_rank=0,
        decode_rank=0,
        status=pb.TRANSFER_STATUS_OK,
        prefill=pb.EngineIdentity(engine_id="P"),
    )


@dataclass
class _Rank:
    rank: DecodeRank
    stub: pb_grpc.DecodeRankStub
    sender: NixlEngine
    peer: str  # the rank's NIXL agent, as the sender knows it
    events: list[tuple[str, Any]] = field(default_factory=list)

    def expect(self, tid: str, key: bytes, epoch: int = 1, request_id: str = "") -> pb.ExpectResult:
        e = pb.Expectation(
            transfer_id=tid,
            epoch=epoch,
            request_id=request_id or f"r-{tid}",
            prefill_ranks=[0],
            prefill_engine_id="P",
            completion_key=key,
        )
        result: pb.ExpectResult = self.stub.Expect(pb.ExpectRequest(expectations=[e]), timeout=WAIT_S).results[0]
        return result

    def notify(self, raw: bytes) -> None:
        assert self.sender.send_notif(self.peer, raw)

    def wait(self, cond: Callable[[], bool]) -> bool:
        return _until(cond, pump=self.sender)

    def released(self) -> list[str]:
        return [tid for kind, tid in list(self.events) if kind == "released"]


@pytest.fixture
def rank() -> Iterator[_Rank]:
    events: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def token(ft: pb.FirstToken) -> None:
        with lock:
            events.append(("token", (ft.transfer_id, ft.prefill_engine_id, ft.token_id)))

    def released(rel: Any) -> None:
        with lock:
            events.append(("released", rel.transfer_id))

    engine = NixlEngine(f"notice-decode-{os.getpid()}")
    cfg = DecodeRankConfig(engine_id="notice-decode", rank=0, tp_size=1, shape=shape())
    r = DecodeRank(cfg, engine, regions(), on_release=released, on_first_token=token).start()
    sender = NixlEngine(f"notice-prefill-{os.getpid()}")
    try:
        yield _Rank(
            r,
            pb_grpc.DecodeRankStub(grpc.insecure_channel(r.endpoint)),
            sender,
            sender.add_peer(engine.metadata()),
            events,
        )
    finally:
        r.stop()
        sender.close()
        engine.close()


def test_a_notice_releases_its_transfer_and_hands_its_token_on_first(rank: _Rank) -> None:
    key = cn.new_key()
    assert rank.expect("t1", key).code == 0
    accepted = _accepted()
    rank.notify(cn.encode(key, "t1", 1, 0, 0, 42))
    assert rank.wait(lambda: rank.released() == ["t1"])  # no Completion RPC was sent
    assert rank.events == [("token", ("t1", "P", 42)), ("released", "t1")]
    assert _accepted() == accepted + 1
    # The Completion RPC that follows every notice is a duplicate now: acknowledged, no second release.
    c = _ok_completion("t1")
    assert not rank.stub.Complete(c, timeout=WAIT_S).released
    assert rank.released() == ["t1"]


def test_forged_stale_and_misdirected_notices_release_nothing_and_the_rank_keeps_serving(rank: _Rank) -> None:
    key, old_key = cn.new_key(), cn.new_key()
    assert rank.expect("t1", old_key, epoch=1).code == 0
    assert rank.expect("t1", key, epoch=2).code == 0  # a retry's newer epoch replaces it, with its own key
    assert rank.expect("plain", b"").code == 0  # an expectation without a key takes no notices
    refused = [
        cn.encode(cn.new_key(), "t1", 2, 0, 0, 5),  # somebody without the key
        cn.encode(old_key, "t1", 2, 0, 0, 5),  # the superseded epoch's prefill, claiming the new epoch
        cn.encode(key, "t1", 2, 0, 1, 5),  # meant for another decode rank
        cn.encode(key, "t1", 2, 3, 0, 5),  # a prefill rank that does not write it
        b"x" * 4096,
        cn.PREFIX + b"\x0a\xff",
    ]
    unknown = [  # nothing to check a MAC against: dropped as unknown
        cn.encode(old_key, "t1", 1, 0, 0, 5),  # the superseded epoch's prefill, with its own key
        cn.encode(cn.new_key(), "plain", 1, 0, 0, 5),
    ]
    early = [cn.encode(key, "nobody-expects-it", 1, 0, 0, 5)]  # held for an expectation that never comes
    before = _refused(), _refused("unknown"), _refused("early")
    for raw in refused + unknown + early:
        rank.notify(raw)
    assert rank.wait(
        lambda: (
            (_refused(), _refused("unknown"), _refused("early"))
            == (before[0] + len(refused), before[1] + len(unknown), before[2] + len(early))
        )
    )
    assert rank.events == []  # nothing released, no token handed on
    assert rank.rank.table.get("t1").ok == set()  # type: ignore[union-attr]
    rank.notify(cn.encode(key, "t1", 2, 0, 0, 6))
    assert rank.wait(lambda: rank.released() == ["t1"])
    assert rank.events[0] == ("token", ("t1", "P", 6))


def test_a_replayed_notice_changes_nothing(rank: _Rank) -> None:
    key = cn.new_key()
    assert rank.expect("t1", key).code == 0
    raw = cn.encode(key, "t1", 1, 0, 0)
    rank.notify(raw)
    assert rank.wait(lambda: rank.released() == ["t1"])
    accepted = _accepted()
    rank.notify(raw)
    assert rank.wait(lambda: _accepted() == accepted + 1)  # taken as the duplicate it is
    assert rank.released() == ["t1"]
    assert all(kind != "token" for kind, _ in rank.events)  # it carried none


def test_a_notice_that_overtook_its_expectation_is_taken_when_the_expectation_comes(rank: _Rank) -> None:
    key = cn.new_key()
    early = _refused("early")
    rank.notify(cn.encode(key, "early", 1, 0, 0, 8))
    assert rank.wait(lambda: _refused("early") == early + 1)
    assert rank.events == []
    assert rank.expect("early", key).code == 0  # no Completion RPC: the held notice releases it
    assert rank.wait(lambda: rank.released() == ["early"])
    assert rank.events[0] == ("token", ("early", "P", 8))


def test_notices_waiting_for_an_expectation_are_bounded_and_expire(rank: _Rank) -> None:
    r = rank.rank
    key = cn.new_key()
    unknown = _refused("unknown")
    with r._table_lock:
        for i in range(rank_module.MAX_EARLY_NOTICES + 10):
            r._hold_early(cn.decode(cn.encode(key, f"flood-{i}", 1, 0, 0)))  # type: ignore[arg-type]
        assert r._early_count == rank_module.MAX_EARLY_NOTICES == len(r._early)
        assert "flood-0" not in {tid for tid, _ in r._early}  # the oldest went first
        r._expire_early(time.monotonic() + r.config.expect_wait_s)
        assert r._early_count == 0 and not r._early
    assert _refused("unknown") == unknown + rank_module.MAX_EARLY_NOTICES + 10


# ----- the prefill side -------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[NixlEngine, NixlEngine, str]]:
    """(prefill engine, decode engine, the decode agent's name as prefill knows it)."""
    decode = NixlEngine(f"notice-d-{os.getpid()}")
    prefill = NixlEngine(f"notice-p-{os.getpid()}")
    try:
        yield prefill, decode, prefill.add_peer(decode.metadata())
    finally:
        prefill.close()
        decode.close()


def _received(decode: NixlEngine, n: int, sender: NixlEngine) -> list[pb.CompletionNotice]:
    got: list[bytes] = []

    def more() -> bool:
        got.extend(m for msgs in decode.progress().values() for m in msgs)
        return len(got) >= n

    assert _until(more, pump=sender)
    out = [cn.decode(bytes(m)) for m in got]
    assert all(isinstance(x, pb.CompletionNotice) for x in out)
    return out  # type: ignore[return-value]


def test_the_writer_sends_the_token_it_finds_posted(pair: tuple[NixlEngine, NixlEngine, str]) -> None:
    prefill, decode, peer = pair
    board = SampledFirstTokens()
    board.expect("t1")
    board.post("t1", 11)
    notices = CompletionNotices(prefill, rank=1, board=board)
    key = cn.new_key()
    notices.written("t1", 4, key, [NoticeTarget(0, peer)])
    (n,) = _received(decode, 1, prefill)
    assert (n.transfer_id, n.epoch, n.prefill_rank, n.decode_rank, n.first_token) == ("t1", 4, 1, 0, 11)
    assert cn.verify(key, n)
    assert notices.owed_count() == 0


def test_a_token_posted_after_the_write_goes_from_the_posting_thread(pair: tuple[NixlEngine, NixlEngine, str]) -> None:
    prefill, decode, peer = pair
    board = SampledFirstTokens()
    notices = CompletionNotices(prefill, rank=0, board=board)
    board.add_listener(notices.token_posted)
    board.expect("t1")
    key = cn.new_key()
    notices.written("t1", 1, key, [NoticeTarget(0, peer)])
    (first,) = _received(decode, 1, prefill)
    assert not first.HasField("first_token") and cn.verify(key, first)
    assert notices.owed_count() == 1
    board.post("t1", 23)  # the engine thread: it sends the token itself
    (second,) = _received(decode, 1, prefill)
    assert (second.first_token, cn.verify(key, second)) == (23, True)
    assert notices.owed_count() == 0
    board.post("t1", 23)  # posted twice: sent once
    notices.written("plain", 1, key, [NoticeTarget(0, peer)])  # not a hand-off: owes no token
    (third,) = _received(decode, 1, prefill)
    assert third.transfer_id == "plain" and notices.owed_count() == 0


def test_the_engine_thread_never_waits_for_nixl(pair: tuple[NixlEngine, NixlEngine, str]) -> None:
    prefill, _, peer = pair
    board = SampledFirstTokens()
    notices = CompletionNotices(prefill, rank=0, board=board)
    board.add_listener(notices.token_posted)
    board.expect("t1")
    notices.written("t1", 1, cn.new_key(), [NoticeTarget(0, peer)])
    busy = prefill_metrics.COMPLETION_NOTICES.labels(sender="engine", result="busy")._value.get()
    entered, leave = threading.Event(), threading.Event()

    def writer_inside_nixl() -> None:
        with prefill._lock:
            entered.set()
            leave.wait(WAIT_S)

    t = threading.Thread(target=writer_inside_nixl)
    t.start()
    try:
        assert entered.wait(WAIT_S)
        posting = threading.Thread(target=board.post, args=("t1", 5))
        posting.start()
        posting.join(WAIT_S)
        assert not posting.is_alive()  # returned while the writer still held NIXL
        assert prefill_metrics.COMPLETION_NOTICES.labels(sender="engine", result="busy")._value.get() == busy + 1
    finally:
        leave.set()
        t.join(WAIT_S)


def test_owed_tokens_are_bounded_and_a_raising_listener_never_reaches_the_poster() -> None:
    class _Quiet:
        def send_notif(self, peer: str, message: bytes, blocking: bool = True) -> bool:
            return True

    board = SampledFirstTokens()
    notices = CompletionNotices(_Quiet(), rank=0, board=board, capacity=3)  # type: ignore[arg-type]
    for i in range(5):
        board.expect(f"t{i}")
        notices.written(f"t{i}", 1, cn.new_key(), [NoticeTarget(0, "d")])
    assert notices.owed_count() == 3

    def broken(tid: str, token: int) -> None:
        raise RuntimeError("listener bug")

    board.add_listener(broken)
    board.post("t4", 1)  # does not raise
    assert board.get("t4") == 1


def test_nixl_is_progressed_at_the_expecting_cadence_while_a_first_token_is_awaited(rank: _Rank) -> None:
    """A hand-off's KV can be released by the writer's notice before the engine sampled the token,
    which then comes in a notice of its own: the poller must not drop to its idle nap meanwhile."""
    r = rank.rank
    assert not r._active.is_set()  # nothing expected: idle naps
    r.awaiting_first_tokens(True)
    assert r._active.is_set()
    key = cn.new_key()
    assert rank.expect("t1", key).code == 0
    rank.notify(cn.encode(key, "t1", 1, 0, 0))  # the writer's notice: KV released, no token
    assert rank.wait(lambda: rank.released() == ["t1"])
    assert r._active.is_set()  # the barrier is gone, the token is still awaited
    rank.notify(cn.encode(key, "t1", 1, 0, 0, 31))  # the engine thread's, with the token
    assert rank.wait(lambda: ("token", ("t1", "P", 31)) in rank.events)
    r.awaiting_first_tokens(False)
    assert not r._active.is_set()


def test_a_notice_and_its_rpc_racing_release_the_transfer_once(rank: _Rank) -> None:
    """The notice is taken on the thread that drained it, the RPC on the rank's loop: one barrier
    change at a time, so however they interleave each transfer is released exactly once."""
    keys = {f"race-{i}": cn.new_key() for i in range(40)}
    for tid, key in keys.items():
        assert rank.expect(tid, key).code == 0

    def rpcs() -> None:
        for tid in keys:
            c = _ok_completion(tid)
            rank.stub.Complete(c, timeout=WAIT_S)

    t = threading.Thread(target=rpcs)
    t.start()
    for tid, key in keys.items():
        rank.notify(cn.encode(key, tid, 1, 0, 0))
    t.join(WAIT_S)
    assert rank.wait(lambda: sorted(rank.released()) == sorted(keys))
    assert rank.rank.table.pending_count() == 0


def test_written_names_the_ranks_its_notices_went_to() -> None:
    class _Engine:
        def send_notif(self, peer: str, message: bytes, blocking: bool = True) -> bool:
            if peer == "gone":
                raise NixlError("send_notif: disconnected")
            return peer != "busy"

    notices = CompletionNotices(_Engine(), rank=0, board=None)  # type: ignore[arg-type]
    targets = [NoticeTarget(0, "d0"), NoticeTarget(1, "busy"), NoticeTarget(2, "gone"), NoticeTarget(3, "d3")]
    assert notices.written("t1", 1, cn.new_key(), targets) == {0, 3}
    assert notices.written("t2", 1, b"", targets) == set()  # no key: no notices


def test_only_a_noticed_ok_completion_waits_before_its_rpc() -> None:
    agent = SimpleNamespace(_completion_rpc_delay_s=0.2)

    def delay(status: int, noticed: bool) -> float:
        report = CompletionReport("d:1", pb.Completion(transfer_id="t", status=status), noticed=noticed)  # type: ignore[arg-type]
        return PrefillAgent._rpc_delay_s(agent, report)  # type: ignore[arg-type]

    assert delay(pb.TRANSFER_STATUS_OK, True) == 0.2
    assert delay(pb.TRANSFER_STATUS_OK, False) == 0.0  # no notice went: the RPC is the completion
    assert delay(pb.TRANSFER_STATUS_FAILED, True) == 0.0  # a failure is never held back

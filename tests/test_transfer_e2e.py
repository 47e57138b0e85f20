"""Transfer core end to end: a decode process and prefill-rank processes, real gRPC, real NIXL.

Every successful transfer is verified byte for byte in decode memory.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.transfer_nodes import Cluster, Node, prefill_node, start_cluster

TOKENS = 40  # any count: the tests pair block lists explicitly


@pytest.fixture(scope="module")
def c21() -> Iterator[Cluster]:
    """Prefill TP2 -> decode TP1."""
    c = start_cluster(2, 1, tag="21")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def c12() -> Iterator[Cluster]:
    """Prefill TP1 -> decode TP2."""
    c = start_cluster(1, 2, tag="12")
    yield c
    c.stop()


def _rank_stub(c: Cluster, rank: int = 0) -> pb_grpc.DecodeRankStub:
    layout = pb.RankLayout.FromString(c.decode.info["layouts"][rank])
    return pb_grpc.DecodeRankStub(grpc.insecure_channel(layout.completion_endpoint))


def _sync(c: Cluster) -> None:
    """Returns once every prefill writer processed what was sent before (FIFO inbox)."""
    for n in c.prefill:
        n.call("table")


def _run(c: Cluster, tid: str, dst: list[int], src: list[int], reservation_first: bool = True) -> None:
    if reservation_first:
        c.decode.call("reserve", tid, c.leg(tid), [dst], TOKENS, 0)
        c.done_all(tid, src, TOKENS)
    else:
        c.done_all(tid, src, TOKENS)
        _sync(c)
        c.decode.call("reserve", tid, c.leg(tid), [dst], TOKENS, 0)


def _wait(c: Cluster, tids: list[str], timeout: float = 30.0) -> dict:
    return c.decode.call("wait", tids, timeout, timeout=timeout + 10)


def _released(c: Cluster, tids: set[str]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for i, n in enumerate(c.prefill):
        got: set[str] = set()
        for _ in range(50):
            got |= {t for t, _ in n.call("released", 0.2)}
            if tids <= got:
                break
        out[i] = got
    return out


@pytest.mark.parametrize("reservation_first", [True, False], ids=["reservation-first", "prefill-first"])
def test_both_arrival_orders(c21: Cluster, reservation_first: bool) -> None:
    tid = f"order-{reservation_first}"
    dst, src = ([470, 471, 472] if reservation_first else [480, 481, 482]), [5, 6, 7]
    _run(c21, tid, dst, src, reservation_first)
    res = _wait(c21, [tid])
    assert res["ranks"][tid] == ("ok", "")
    assert c21.decode.call("verify", [(dst, src)]) == []
    assert all(tid in s for s in _released(c21, {tid}).values())


def test_many_concurrent_transfers_fragmented(c21: Cluster) -> None:
    rng = random.Random(7)
    free = list(range(100, 400))  # other tests of this cluster use 400..
    rng.shuffle(free)
    jobs = []
    for i in range(200):
        n = 1 if i % 3 else 2 if i < 100 else 1
        dst = [free.pop() for _ in range(n)]
        src = rng.sample(range(0, 200), n)
        jobs.append((f"many-{i}", dst, src))
    for i, (tid, dst, _) in enumerate(jobs):
        c21.decode.send("reserve", tid, c21.leg(tid), [dst], TOKENS, 0)
        if i % 2:
            c21.done_all(*jobs[i - 1][0:1], jobs[i - 1][2], TOKENS)
            c21.done_all(tid, jobs[i][2], TOKENS)
    epochs = [c21.decode.conn.recv() for _ in jobs]
    assert len(set(epochs)) == len(jobs)
    res = _wait(c21, [j[0] for j in jobs], timeout=60)
    assert {tid: v for tid, v in res["ranks"].items() if v != ("ok", "")} == {}
    assert c21.decode.call("verify", [(dst, src) for _, dst, src in jobs]) == []
    assert c21.decode.call("open") == 0


def test_contiguous_and_fragmented_into_decode_tp2(c12: Cluster) -> None:
    cases = {"contig": ([40, 41, 42, 43, 44], [1, 2, 3, 4, 5]), "frag": ([90, 60, 61, 77, 3], [9, 10, 11, 30, 2])}
    for tid, (dst, src) in cases.items():
        _run(c12, tid, dst, src)
    res = _wait(c12, list(cases))
    assert res["ranks"] == {t: ("ok", "") for t in cases}
    assert c12.decode.call("verify", list(cases.values())) == []


def test_partial_prefix_hit_writes_only_the_rest(c21: Cluster) -> None:
    tid = "prefix"
    c21.decode.call("reserve", tid, c21.leg(tid), [[400, 401]], TOKENS, 2)
    c21.done_all(tid, [20, 21, 22, 23], TOKENS)
    assert _wait(c21, [tid])["ranks"][tid] == ("ok", "")
    assert c21.decode.call("verify", [([400, 401], [22, 23])]) == []


def test_cancel_before_the_write(c21: Cluster) -> None:
    tid = "cancel-before"
    c21.decode.call("reserve", tid, c21.leg(tid), [[410, 411]], TOKENS, 0)
    c21.decode.call("cancel", tid)
    res = _wait(c21, [tid])
    assert res["settled"][tid][0] == "cancelled"
    assert res["ranks"][tid][0] == "cancelled"
    # The KV computed afterwards is released at once and never written.
    c21.done_all(tid, [1, 2], TOKENS)
    assert all(tid in s for s in _released(c21, {tid}).values())
    _sync(c21)
    assert c21.decode.call("zero_blocks", [410, 411]) == [410, 411]


def test_cancel_during_the_write_waits_for_it() -> None:
    """A Cancel that reaches the prefill rank while its WRITE is inside NIXL (a large, fragmented
    WRITE: tens of thousands of descriptors) is acked only after the WRITE ended, and decode
    settles only after that; the data is whole."""
    n = 120_000
    c = start_cluster(1, 1, tag="cdw", num_blocks=n)
    try:
        tid = "cancel-during"
        dst = list(range(0, n, 2))
        src = [b + 1 for b in dst]
        epoch = c.decode.call("reserve", tid, c.leg(tid), [dst], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
        c.prefill[0].call("arm_write_entered")
        c.done_all(tid, src, TOKENS)
        assert c.prefill[0].call("wait_write_entered", 10.0)
        c.decode.call("cancel", tid)
        assert c.decode.call("wait_settled", tid, epoch, 20.0, timeout=30) == "cancelled"
        timeline = c.prefill[0].call("timeline")
        ((post_start, post_end),) = timeline["posts"]
        (cancel_at,) = timeline["cancels"]
        assert post_start <= cancel_at < post_end, f"the Cancel did not arrive during the WRITE: {timeline}"
        assert c.decode.call("settled_at", tid, epoch) > post_end, "decode settled before the WRITE ended"
        assert c.decode.call("verify", [(dst, src)], timeout=60) == []
        assert c.decode.call("state", tid) is None
    finally:
        c.stop()


def test_cancel_after_the_write_is_a_no_op(c21: Cluster) -> None:
    tid = "cancel-after"
    _run(c21, tid, [430], [8])
    assert _wait(c21, [tid])["ranks"][tid] == ("ok", "")
    c21.decode.call("cancel", tid)
    assert c21.decode.call("state", tid) is None
    assert c21.decode.call("verify", [([430], [8])]) == []


def test_new_epoch_supersedes_and_stale_completion_is_refused(c21: Cluster) -> None:
    tid = "epochs"
    e1 = c21.decode.call("reserve", tid, c21.leg(tid), [[440]], TOKENS, 0)
    e2 = c21.decode.call("reserve", tid, c21.leg(tid), [[441]], TOKENS, 0)
    assert e2 > e1
    # The older epoch is fenced (cancelled at prefill) before the newer one is published.
    assert c21.decode.call("wait_settled", tid, e1, 10.0, timeout=20) == "cancelled"
    assert all(n.call("wait_reservation", tid, e2, 10.0, timeout=20) == e2 for n in c21.prefill)
    c21.done_all(tid, [9], TOKENS)
    assert _wait(c21, [tid])["ranks"][tid] == ("ok", "")
    assert c21.decode.call("verify", [([441], [9])]) == []
    assert c21.decode.call("zero_blocks", [440]) == [440]
    stub = _rank_stub(c21)
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(
            pb.Completion(
                transfer_id=tid,
                epoch=e1,
                decode_rank=0,
                status=pb.TRANSFER_STATUS_OK,
                prefill=pb.EngineIdentity(engine_id=c21.prefill_engine_id),
            ),
            timeout=5,
        )
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_bad_reservations_fail_cleanly_and_service_continues(c21: Cluster) -> None:
    # Out of range: rejected by the prefill ranks before any WRITE.
    c21.decode.call("reserve", "oob", c21.leg("oob"), [[100_000]], TOKENS, 0)
    # Block count mismatch: decode reserved 2, prefill computed 3.
    c21.decode.call("reserve", "mismatch", c21.leg("mismatch"), [[450, 451]], TOKENS, 0)
    c21.done_all("mismatch", [1, 2, 3], TOKENS)
    res = _wait(c21, ["oob", "mismatch"])
    assert res["settled"]["oob"][0] == "failed" and "outside the registered region" in res["settled"]["oob"][1]
    assert res["settled"]["mismatch"][0] == "failed" and "block count mismatch" in res["settled"]["mismatch"][1]
    assert all("mismatch" in s for s in _released(c21, {"mismatch"}).values())
    assert c21.decode.call("zero_blocks", [450, 451]) == [450, 451]
    # Everyone else is still served.
    _run(c21, "after-bad", [452], [4])
    assert _wait(c21, ["after-bad"])["ranks"]["after-bad"] == ("ok", "")


def test_decode_rank_rejects_bad_completions(c21: Cluster) -> None:
    stub = _rank_stub(c21)
    cases = [
        (pb.Completion(transfer_id="nope", epoch=1, status=pb.TRANSFER_STATUS_OK), grpc.StatusCode.NOT_FOUND),
        (pb.Completion(transfer_id="x", epoch=1, decode_rank=3, status=1), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.Completion(transfer_id="x", epoch=1), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for msg, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(msg, timeout=5)
        assert err.value.code() is code, msg
    with pytest.raises(grpc.RpcError) as err:
        stub.Settle(pb.Settlement(transfer_id="nope", epoch=1, status=pb.TRANSFER_STATUS_CANCELLED), timeout=5)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND


def _hello_call(endpoint: str, hello: pb.Hello | None, first: pb.DecodeMessage | None = None) -> grpc.RpcError:
    stub = pb_grpc.PrefillAgentStub(grpc.insecure_channel(endpoint))
    msgs = [first or pb.DecodeMessage(hello=hello)]
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Reservations(iter(msgs), timeout=10):
            pass
    return err.value


def test_prefill_refuses_bad_hellos(c21: Cluster) -> None:
    ep = c21.prefill[0].info["endpoint"]
    good = pb.DecodeMessage()
    good.hello.decode.CopyFrom(
        pb.EngineIdentity(engine_id="intruder", incarnation="i1", role=pb.ROLE_DECODE, tp_size=1)
    )
    good.hello.decode_ranks.append(pb.RankLayout.FromString(c21.decode.info["layouts"][0]))
    from tests.transfer_nodes import shape

    good.hello.decode.compatibility_hash = shape().compatibility_hash()
    not_hello = _hello_call(ep, None, pb.DecodeMessage(cancel=pb.Cancel(transfer_id="t", epoch=1)))
    assert not_hello.code() is grpc.StatusCode.INVALID_ARGUMENT

    bad_hash = pb.Hello()
    bad_hash.CopyFrom(good.hello)
    bad_hash.decode.compatibility_hash = "other-model"
    err = _hello_call(ep, bad_hash)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "incompatible" in err.details()

    bad_layout = pb.Hello()
    bad_layout.CopyFrom(good.hello)
    bad_layout.decode_ranks[0].block_bytes += 1
    err = _hello_call(ep, bad_layout)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "layout mismatch" in err.details()

    wrong_engine = pb.Hello()
    wrong_engine.CopyFrom(good.hello)
    wrong_engine.expected_prefill_engine_id = "someone-else"
    assert _hello_call(ep, wrong_engine).code() is grpc.StatusCode.FAILED_PRECONDITION

    # The real decode engine keeps being served.
    _run(c21, "after-hellos", [460], [11])
    assert _wait(c21, ["after-hellos"])["ranks"]["after-hellos"] == ("ok", "")


def test_unauthenticated_peer_is_refused() -> None:
    c = start_cluster(1, 1, auth="s3cret", tag="auth")
    try:
        hello = pb.Hello(
            decode=pb.EngineIdentity(engine_id="x", incarnation="i", role=pb.ROLE_DECODE, tp_size=1),
            auth_token="wrong",
        )
        err = _hello_call(c.prefill[0].info["endpoint"], hello)
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED
        _run(c, "authed", [1], [2])  # the agents share the token
        assert _wait(c, ["authed"])["ranks"]["authed"] == ("ok", "")
    finally:
        c.stop()


def test_prefill_restart_fails_fast_and_new_incarnation_works() -> None:
    c = start_cluster(1, 1, tag="restart")
    try:
        old_incarnation = c.prefill[0].info["incarnation"]
        epoch = c.decode.call("reserve", "inflight", c.leg("inflight"), [[10]], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "inflight", epoch, 10.0, timeout=20) == epoch
        c.prefill[0].kill()
        res = _wait(c, ["inflight"], timeout=15)
        assert res["settled"]["inflight"][0] == "failed"
        assert "lost" in res["settled"]["inflight"][1]
        c.prefill[0] = Node(prefill_node, c.prefill_engine_id, 0, 1, 512, "")
        assert c.prefill[0].info["incarnation"] != old_incarnation
        c.decode.call("reserve", "stale", c.leg("stale", incarnations=[old_incarnation]), [[11]], TOKENS, 0)
        res = _wait(c, ["stale"], timeout=15)
        assert res["settled"]["stale"][0] == "failed" and "incarnation" in res["settled"]["stale"][1]
        _run(c, "fresh", [12], [3])
        assert _wait(c, ["fresh"])["ranks"]["fresh"] == ("ok", "")
        assert c.decode.call("verify", [([12], [3])]) == []
    finally:
        c.stop()


def test_decode_restart_supersedes_the_old_incarnation() -> None:
    from tests.transfer_nodes import decode_node

    c = start_cluster(1, 1, tag="drestart")
    second = None
    try:
        epoch = c.decode.call("reserve", "old-inc", c.leg("old-inc"), [[10]], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "old-inc", epoch, 10.0, timeout=20) == epoch
        second = Node(decode_node, "decodedrestart", 1, 512, "", 0.5)  # same engine id, new incarnation
        second.call("reserve", "new-inc", c.leg("new-inc"), [[20]], TOKENS, 0)
        c.done_all("new-inc", [4], TOKENS)
        assert second.call("wait", ["new-inc"], 20.0, timeout=30)["ranks"]["new-inc"] == ("ok", "")
        # The superseded incarnation's open transfer is failed, never written.
        res = _wait(c, ["old-inc"], timeout=15)
        assert res["settled"]["old-inc"][0] == "failed"
        assert c.decode.call("zero_blocks", [10]) == [10]
    finally:
        if second is not None:
            second.stop()
        c.stop()


def test_stalled_target_write_is_torn_down_and_never_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode rank stops calling into NIXL while a large WRITE comes over TCP, so the WRITE
    cannot finish (the socket buffers fill up). At the write timeout the prefill rank recreates
    its NIXL agent (nothing queued survives), decode fails and settles the transfer, the path
    recovers, and no byte of the abandoned WRITE lands once the target progresses again."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # over cma the initiator copies without the target
    n = 40_000
    c = start_cluster(1, 1, tag="stall", num_blocks=n, write_timeout_s=1.5)
    try:
        ids = list(range(0, n, 2))
        c.decode.call("progress", False)
        try:
            _run(c, "stalled", ids, [i + 1 for i in ids])
            res = _wait(c, ["stalled"], timeout=20)
            assert res["ranks"]["stalled"] is not None and res["ranks"]["stalled"][0] == "failed", res
            assert "torn down" in res["ranks"]["stalled"][1], res
            assert res["settled"]["stalled"] is not None and res["settled"]["stalled"][0] == "failed", res
            c.decode.call("clear")  # decode owns the blocks again
        finally:
            c.decode.call("progress", True)
        _run(c, "after-stall", [1], [3])
        assert _wait(c, ["after-stall"])["ranks"]["after-stall"] == ("ok", "")
        assert c.decode.call("verify", [([1], [3])]) == []
        assert len(c.decode.call("zero_blocks", ids, timeout=60)) == len(ids)
    finally:
        c.stop()


def test_frozen_target_write_is_torn_down_and_never_lands_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode process freezes (SIGSTOP) with a large WRITE over TCP in flight: the writer tears
    the NIXL connection down at its write timeout. Once decode runs again, it fails the transfer
    (prefill's failed completion, then the fence), and no byte of the torn-down WRITE lands in the
    blocks after decode released them."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # cma would copy into a stopped process
    n = 40_000
    c = start_cluster(1, 1, tag="frozen", num_blocks=n, write_timeout_s=1.5)
    try:
        ids = list(range(0, n, 2))
        epoch = c.decode.call("reserve", "frozen", c.leg("frozen"), [ids], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "frozen", epoch, 10.0, timeout=20) == epoch
        os.kill(c.decode.proc.pid, signal.SIGSTOP)
        try:
            c.done_all("frozen", [i + 1 for i in ids], TOKENS)
            assert c.prefill[0].call("wait_in_flight", 5.0, timeout=10), "no WRITE in flight"
            released = c.prefill[0].call("released", 10.0, timeout=20)
            assert [tid for tid, _ in released] == ["frozen"] and "torn down" in released[0][1], released
        finally:
            os.kill(c.decode.proc.pid, signal.SIGCONT)
        res = _wait(c, ["frozen"], timeout=20)
        assert res["ranks"]["frozen"][0] == "failed" and "torn down" in res["ranks"]["frozen"][1], res
        assert res["settled"]["frozen"] is not None and res["settled"]["frozen"][0] == "failed", res
        # Released: the blocks are decode's again. Whatever the torn-down WRITE carried must not land now.
        c.decode.call("clear")
        _run(c, "after-freeze", [1], [3])
        assert _wait(c, ["after-freeze"])["ranks"]["after-freeze"] == ("ok", "")
        assert c.decode.call("verify", [([1], [3])]) == []
        assert len(c.decode.call("zero_blocks", ids, timeout=60)) == len(ids)
    finally:
        c.stop()


def test_cut_control_path_stops_writes_by_the_lease() -> None:
    """The gRPC path between decode and prefill is partitioned (a relay stops forwarding, both
    sockets stay open) while NIXL still works. Before either side's keepalive notices, the
    prefill rank's write lease runs out, so the KV computed afterwards is never written; decode
    fails the transfer once the stream is declared lost and its fence bound passed."""
    from tests.tcp_relay import TcpRelay

    c = start_cluster(1, 1, tag="cut")
    host, port = c.prefill[0].info["endpoint"].rsplit(":", 1)
    relay = TcpRelay(host, int(port)).start()
    try:
        tid = "cut"
        leg = {**c.leg(tid), "prefill_agent_endpoints": [relay.address]}
        epoch = c.decode.call("reserve", tid, leg, [[50, 51]], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
        relay.cut()
        deadline = time.monotonic() + 10
        left = c.prefill[0].call("lease_left")
        while left and left[0] > 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a condition under a deadline
            left = c.prefill[0].call("lease_left")
        assert left and left[0] <= 0, f"lease not expired, or the session already lost: {left}"
        c.done_all(tid, [5, 6], TOKENS)  # the KV is ready, but the lease is gone
        released = c.prefill[0].call("released", 10.0, timeout=20)
        # Held for a renewal that never comes, then refused at the hold bound, or dropped with the
        # session if that ends first: either way nothing was posted.
        assert [t for t, _ in released] == [tid], released
        assert "lease expired" in released[0][1] or "stream lost before the write" in released[0][1], released
        assert c.prefill[0].call("timeline")["posts"] == [], "a WRITE was posted without a lease"
        res = _wait(c, [tid], timeout=20)
        assert res["settled"][tid] is not None and res["settled"][tid][0] == "failed", res
        assert c.decode.call("zero_blocks", [50, 51]) == [50, 51]
    finally:
        relay.stop()
        c.stop()


def test_draining_prefill_refuses_new_streams_and_finishes_open_ones() -> None:
    c = start_cluster(1, 1, tag="drain")
    try:
        _run(c, "before-drain", [20], [1])
        assert _wait(c, ["before-drain"])["ranks"]["before-drain"] == ("ok", "")
        c.prefill[0].call("drain")
        hello = pb.Hello(decode=pb.EngineIdentity(engine_id="late", incarnation="i", role=pb.ROLE_DECODE, tp_size=1))
        assert _hello_call(c.prefill[0].info["endpoint"], hello).code() is grpc.StatusCode.UNAVAILABLE
        _run(c, "open-stream", [21], [2])  # the connected decode keeps its stream
        assert _wait(c, ["open-stream"])["ranks"]["open-stream"] == ("ok", "")
    finally:
        c.stop()

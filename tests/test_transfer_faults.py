"""Faults on the transfer core: real prefill and decode processes, real gRPC and NIXL.

Each fault is injected where it happens in production (a process killed with SIGKILL, a
completion lost on the wire before or after the rank took it, an expectation that reaches the
decode rank after the completion, a prefill rank restarted on the same port), and each test then
checks the same things:

- no byte changed outside the blocks a live transfer owns: every other decode block holds a
  canary pattern before the fault and still holds it after;
- nothing is stranded: the prefill rank's table and the decode agent's open transfers are back to
  zero, every decode rank released each request exactly once;
- every transfer ended, OK or with a clear reason, within its bound;
- the services still serve: a fresh transfer afterwards is verified byte for byte.
"""

from __future__ import annotations

import os
import signal
import time

import grpc

from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.transfer_nodes import WRITE_TIMEOUT_S, Cluster, Node, decode_node, prefill_node, start_cluster

TOKENS = 40


def _run(c: Cluster, tid: str, dst: list[int], src: list[int]) -> int:
    epoch: int = c.decode.call("reserve", tid, c.leg(tid), [dst], TOKENS, 0)
    c.done_all(tid, src, TOKENS)
    return epoch


def _wait(c: Cluster, tids: list[str], timeout: float = 30.0) -> dict:
    return c.decode.call("wait", tids, timeout, timeout=timeout + 10)


def _until(what: str, probe, want, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    """Polls ``probe()`` until ``want(value)`` holds, failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not want(value):
        assert time.monotonic() < deadline, f"{what}: still {value!r} after {timeout} s"
        time.sleep(0.05)  # polling a condition under a deadline
        value = probe()
    return value


def _nothing_stranded(c: Cluster) -> None:
    for n in c.prefill:
        _until("prefill transfers still open", lambda n=n: n.call("table"), lambda v: v == 0)
    _until("decode transfers still open", lambda: c.decode.call("open"), lambda v: v == 0)


def _still_serves(c: Cluster, tid: str, dst: int, src: int) -> None:
    _run(c, tid, [dst], [src])
    assert _wait(c, [tid])["ranks"][tid] == ("ok", "")
    assert c.decode.call("verify", [([dst], [src])]) == []


def _next_decode_incarnation_serves(c: Cluster, tid: str, dst: int, src: int) -> None:
    """The decode engine comes back (same engine id, new incarnation): the prefill rank serves it."""
    c.decode = Node(decode_node, c.decode_engine_id, 1, 512, "", 0.5)
    c.decode.call("canary", [dst])
    _nothing_stranded(c)
    _still_serves(c, tid, dst, src)
    assert c.decode.call("canary_broken", [dst]) == []


def test_dropped_completions_are_retried_until_they_land() -> None:
    """The first completions are lost before the decode rank sees them (UNAVAILABLE): prefill
    retries with backoff, the request is released OK once, and nothing else was written."""
    c = start_cluster(1, 1, tag="fdrop", notices=False)
    try:
        owned = [30, 31]
        c.decode.call("canary", owned)
        c.decode.call("faults", {"drop_completions": 3})
        _run(c, "dropped", owned, [4, 5])
        assert _wait(c, ["dropped"])["ranks"]["dropped"] == ("ok", "")
        assert c.decode.call("faults", {}) == 4, "3 dropped completions and the one that landed"
        assert c.decode.call("verify", [(owned, [4, 5])]) == []
        assert c.decode.call("release_counts") == {"dreq-dropped/0": 1}
        assert c.decode.call("canary_broken", owned) == []
        _nothing_stranded(c)
    finally:
        c.stop()


def test_duplicate_completions_release_once() -> None:
    """A completion the rank took whose answer is lost is sent again (a duplicate), and a peer
    replays it once more by hand: the rank releases the request exactly once, answers the
    duplicates with a clear status, and keeps serving."""
    c = start_cluster(1, 1, tag="fdup", notices=False)
    try:
        owned = [40]
        c.decode.call("canary", [*owned, 41])
        c.decode.call("faults", {"lose_acks": 1})
        epoch = _run(c, "dup", owned, [6])
        assert _wait(c, ["dup"])["ranks"]["dup"] == ("ok", "")
        _until("the lost ack was not retried", lambda: c.decode.call("faults", {}), lambda v: v >= 2)
        layout = pb.RankLayout.FromString(c.decode.info["layouts"][0])
        replay = pb.Completion(
            transfer_id="dup",
            epoch=epoch,
            prefill=pb.EngineIdentity(engine_id=c.prefill_engine_id, role=pb.ROLE_PREFILL, tp_size=1),
            prefill_rank=0,
            decode_rank=0,
            status=pb.TRANSFER_STATUS_OK,
        )
        with grpc.insecure_channel(layout.completion_endpoint) as ch:
            try:
                ack = pb_grpc.DecodeRankStub(ch).Complete(replay, timeout=10)
                assert not ack.released, "a duplicate completion released the request again"
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), exc
        assert c.decode.call("release_counts") == {"dreq-dup/0": 1}
        assert c.decode.call("verify", [(owned, [6])]) == []
        assert c.decode.call("canary_broken", [*owned, 41]) == []
        _nothing_stranded(c)
        _still_serves(c, "after-dup", 41, 7)
    finally:
        c.stop()


def test_completion_notices_release_while_every_completion_rpc_is_lost() -> None:
    """With every Completion RPC lost before the rank sees it, each prefill rank's completion
    notice (NIXL, MACed with the epoch's key) still releases the transfer OK, exactly once, with
    its bytes in place and nothing else written; the RPCs are still sent (and retried)."""
    c = start_cluster(2, 1, tag="fnotice")
    try:
        owned = [60, 61, 62]
        c.decode.call("canary", owned)
        c.decode.call("faults", {"drop_completions": 10**6})
        _run(c, "noticed", owned, [10, 11, 12])
        assert _wait(c, ["noticed"], timeout=20)["ranks"]["noticed"] == ("ok", "")
        assert c.decode.call("verify", [(owned, [10, 11, 12])]) == []
        assert c.decode.call("release_counts") == {"dreq-noticed/0": 1}
        assert c.decode.call("canary_broken", owned) == []
        # The RPCs are still sent (and retried): both ranks' reach the rank, after the release.
        _until("the Completion RPCs did not come", lambda: c.decode.call("faults", {}), lambda v: v >= 2)
        c.decode.call("faults", {"drop_completions": 0})
        _nothing_stranded(c)
    finally:
        c.stop()


def test_completion_before_its_expectation_still_releases() -> None:
    """The decode agent's expectation reaches the rank only after the completion was refused as
    unknown (it waited ``expect_wait_s`` for it): prefill retries, and the late expectation still
    gets its completion."""
    c = start_cluster(1, 1, tag="flate", notices=False)
    try:
        owned = [50, 51]
        c.decode.call("canary", owned)
        c.decode.call("hold_expect", True)
        epoch = c.decode.call("reserve", "late", c.leg("late"), [owned], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "late", epoch, 10.0, timeout=20) == epoch
        assert _until("no expectation held", lambda: c.decode.call("expects_held"), lambda v: v >= 1)
        c.done_all("late", [8, 9], TOKENS)
        # The first completion waited for its expectation, was refused, and came again.
        _until("the completion was not retried", lambda: c.decode.call("faults", {}), lambda v: v >= 2)
        c.decode.call("hold_expect", False)
        assert _wait(c, ["late"])["ranks"]["late"] == ("ok", "")
        assert c.decode.call("verify", [(owned, [8, 9])]) == []
        assert c.decode.call("release_counts") == {"dreq-late/0": 1}
        assert c.decode.call("canary_broken", owned) == []
        _nothing_stranded(c)
    finally:
        c.stop()


def test_decode_killed_after_publishing_frees_prefill() -> None:
    """Decode dies with SIGKILL after its reservation reached prefill, before the KV is ready:
    prefill drops the reservation with the stream, releases its KV as soon as prefill is done,
    and serves the engine's next incarnation."""
    c = start_cluster(1, 1, tag="fdkill")
    try:
        epoch = c.decode.call("reserve", "orphan", c.leg("orphan"), [[60, 61]], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "orphan", epoch, 10.0, timeout=20) == epoch
        c.decode.kill()
        _until("the dead decode's stream is still open", lambda: c.prefill[0].call("sessions"), lambda v: v == 0)
        start = time.monotonic()
        c.done_all("orphan", [1, 2], TOKENS)
        released = c.prefill[0].call("released", 10.0, timeout=20)
        assert [t for t, _ in released] == ["orphan"] and released[0][1], released
        assert time.monotonic() - start < 5, "prefill held the KV of a dead decode"
        _next_decode_incarnation_serves(c, "after-decode-kill", 3, 7)
    finally:
        c.stop()


def test_decode_killed_mid_write_frees_prefill() -> None:
    """Decode dies with SIGKILL while the writer is inside the WRITE: the WRITE fails (or is torn
    down at the write timeout), prefill releases its KV within that bound and serves the next
    incarnation."""
    c = start_cluster(1, 1, tag="fdmid")
    try:
        epoch = c.decode.call("reserve", "midwrite", c.leg("midwrite"), [[70, 71, 72]], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "midwrite", epoch, 10.0, timeout=20) == epoch
        c.prefill[0].call("hold_writes")
        c.done_all("midwrite", [1, 2, 3], TOKENS)
        assert c.prefill[0].call("wait_write_entered", 10.0, timeout=20), "the writer never reached the WRITE"
        c.decode.kill()
        start = time.monotonic()
        c.prefill[0].call("release_writes")
        released = c.prefill[0].call("released", WRITE_TIMEOUT_S + 10, timeout=WRITE_TIMEOUT_S + 20)
        assert [t for t, _ in released] == ["midwrite"], released
        assert time.monotonic() - start < WRITE_TIMEOUT_S + 5, "the WRITE into a dead decode outlived its bound"
        _next_decode_incarnation_serves(c, "after-mid-kill", 4, 9)
    finally:
        c.stop()


def test_prefill_restarted_on_the_same_port() -> None:
    """A prefill rank is killed with a reservation open and comes back on the same address with a
    new incarnation: the open transfer fails with a reason within its fence bound and nothing is
    written into it; legs naming the old incarnation are refused; the new one serves."""
    c = start_cluster(1, 1, tag="fport")
    try:
        old = c.prefill[0].info
        port = int(old["endpoint"].rsplit(":", 1)[1])
        owned = [10]
        c.decode.call("canary", [])  # the open transfer's block too: a WRITE into it would show
        epoch = c.decode.call("reserve", "inflight", c.leg("inflight"), [owned], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "inflight", epoch, 10.0, timeout=20) == epoch
        c.prefill[0].kill()
        c.prefill[0] = Node(prefill_node, c.prefill_engine_id, 0, 1, 512, "", WRITE_TIMEOUT_S, "", port)
        assert c.prefill[0].info["endpoint"] == old["endpoint"]
        assert c.prefill[0].info["incarnation"] != old["incarnation"]
        res = _wait(c, ["inflight"], timeout=20)
        assert res["settled"]["inflight"] is not None and res["settled"]["inflight"][0] == "failed", res
        c.decode.call("reserve", "stale", c.leg("stale", incarnations=[old["incarnation"]]), [[11]], TOKENS, 0)
        res = _wait(c, ["stale"], timeout=20)
        assert res["settled"]["stale"][0] == "failed" and "incarnation" in res["settled"]["stale"][1], res
        assert c.decode.call("canary_broken", []) == []
        _nothing_stranded(c)
        _still_serves(c, "after-restart", 12, 3)
        assert c.decode.call("canary_broken", [12]) == []
    finally:
        c.stop()


def test_decode_stalled_past_the_lease_writes_once_renewed() -> None:
    """Decode's loop answers no Ping for longer than the write lease (SIGSTOP: a busy or starved
    host), but less than the two leases after which it declares the stream lost. The KV that
    became ready meanwhile is not written without a lease, and not refused either: it is written
    at the next renewal, and the request succeeds."""
    c = start_cluster(1, 1, tag="fstall")
    try:
        owned = [80, 81]
        c.decode.call("canary", owned)
        epoch = c.decode.call("reserve", "stalled", c.leg("stalled"), [owned], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", "stalled", epoch, 10.0, timeout=20) == epoch
        os.kill(c.decode.proc.pid, signal.SIGSTOP)
        try:
            _until("the lease did not run out", lambda: c.prefill[0].call("lease_left"), lambda v: v and v[0] <= 0)
            c.done_all("stalled", [1, 2], TOKENS)
            c.prefill[0].call("table")  # the writer took the KV while the lease was out
        finally:
            os.kill(c.decode.proc.pid, signal.SIGCONT)
        assert _wait(c, ["stalled"])["ranks"]["stalled"] == ("ok", "")
        assert c.decode.call("verify", [(owned, [1, 2])]) == []
        assert c.decode.call("canary_broken", owned) == []
        _nothing_stranded(c)
    finally:
        c.stop()

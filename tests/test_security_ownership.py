"""Ownership and duplicates, attacked over real gRPC and NIXL (and their pure logic directly).

A second decode engine speaks the raw reservations stream with its own NIXL memory; a rogue
prefill server answers a decode agent's link; the prefill and decode nodes are the real agents in
their own processes (``tests/transfer_nodes.py``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvpush.services.decode_agent.cadence import PollCadence
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.security_support import RawStream
from tests.transfer_nodes import TOTAL_HEADS, Cluster, Pool, shape, start_cluster

TOKENS = 40


@pytest.fixture(scope="module")
def c() -> Iterator[Cluster]:
    """Prefill TP1 -> decode TP1 (engines ``prefillsec`` and ``decodesec``)."""
    cluster = start_cluster(1, 1, tag="sec", grace_s=0.3)
    yield cluster
    cluster.stop()


def _wait(c: Cluster, tids: list[str], timeout: float = 15.0) -> dict[str, Any]:
    return c.decode.call("wait", tids, timeout, timeout=timeout + 10)


def _released(node: Any, want: set[str], timeout: float = 10.0) -> dict[str, str]:
    """request id -> reason of the prefill releases, until every request in ``want`` was released."""
    got: dict[str, str] = {}
    for _ in range(int(timeout / 0.2)):
        got.update({rid: reason for _, rid, reason in node.call("released_requests", 0.2)})
        if want <= set(got):
            break
    return got


class Intruder:
    """A second decode engine: its own NIXL memory and engine id, and a raw reservations stream
    (``RawStream``: ``send``, ``recv``, ``recv_kind``)."""

    def __init__(self, endpoint: str, engine_id: str = "intruder", num_blocks: int = 64) -> None:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from kvpush.services.common.layout import layout_message
        from kvpush.services.common.nixl_engine import NixlEngine

        self.pool = Pool.create(num_blocks, TOTAL_HEADS)
        regions = self.pool.regions()
        self.engine = NixlEngine(f"{engine_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.engine.register([(r.base_addr, r.num_blocks * r.block_stride) for r in regions.regions])
        layout = layout_message(regions, shape(), 0, self.engine.name, self.engine.metadata(), "127.0.0.1:1")
        self.hello = pb.Hello(
            decode=pb.EngineIdentity(
                engine_id=engine_id,
                incarnation=uuid.uuid4().hex,
                compatibility_hash=shape().compatibility_hash(),
                role=pb.ROLE_DECODE,
                tp_size=1,
            ),
            decode_ranks=[layout],
        )
        self.stream = RawStream(endpoint, pb.DecodeMessage(hello=self.hello), timeout=120)
        assert self.stream.recv_kind("hello_ack") is not None
        self.send, self.recv, self.recv_kind = self.stream.send, self.stream.recv, self.stream.recv_kind

    def close(self) -> None:
        self.stream.close()
        self.engine.close()


@pytest.fixture
def intruder(c: Cluster) -> Iterator[Intruder]:
    i = Intruder(c.prefill[0].info["endpoint"])
    yield i
    i.close()


def _no_leaks(c: Cluster) -> None:
    """Nothing open on either side once the transfers ended."""
    for _ in range(100):
        if c.prefill[0].call("table") == 0 and c.decode.call("open") == 0:
            return
        threading.Event().wait(0.05)  # a bounded poll of another process's state
    raise AssertionError(f"left behind: prefill {c.prefill[0].call('table')}, decode {c.decode.call('open')}")


# ----- one decode engine cannot touch another's transfers ------------------------------------


def test_second_decode_cannot_cancel_anothers_transfer(c: Cluster, intruder: Intruder) -> None:
    tid = "own-cancel"
    epoch = c.decode.call("reserve", tid, c.leg(tid), [[10, 11]], TOKENS, 0)
    assert c.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
    intruder.send(cancel=pb.Cancel(transfer_id=tid, epoch=epoch, reason="hostile"))
    ack = intruder.recv_kind("cancel_ack")  # acked, for the intruder's own (empty) transfer
    assert ack.transfer_id == tid and not ack.data_written
    c.done_all(tid, [1, 2], TOKENS)
    assert _wait(c, [tid])["ranks"][tid] == ("ok", "")
    assert c.decode.call("verify", [([10, 11], [1, 2])]) == []
    _no_leaks(c)


def test_second_decode_cannot_supersede_anothers_reservation(c: Cluster, intruder: Intruder) -> None:
    tid = "own-supersede"
    epoch = c.decode.call("reserve", tid, c.leg(tid), [[20, 21]], TOKENS, 0)
    assert c.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
    hostile = epoch + 1000
    intruder.send(
        reservation=pb.Reservation(
            transfer_id=tid, epoch=hostile, block_ids=[pb.BlockIds(ids=[5, 6])], num_tokens=TOKENS, lease_ms=300
        )
    )
    assert c.prefill[0].call("wait_reservation", tid, hostile, 10.0, "intruder", timeout=20) == hostile
    c.done_all(tid, [3, 4], TOKENS)
    assert _wait(c, [tid])["ranks"][tid] == ("ok", "")
    assert c.decode.call("verify", [([20, 21], [3, 4])]) == []
    # The KV never reached the intruder; its own reservation expires unmatched.
    rej = intruder.recv_kind("rejected")
    assert (rej.transfer_id, rej.epoch, rej.code) == (tid, hostile, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    assert not intruder.pool.array[:, [5, 6]].any()
    _no_leaks(c)


def test_refusals_echo_no_hash_or_incarnation(c: Cluster) -> None:
    ep = c.prefill[0].info["endpoint"]
    real_incarnation = c.prefill[0].info["incarnation"]
    real_hash = shape().compatibility_hash()
    base = pb.Hello(
        decode=pb.EngineIdentity(
            engine_id="probe", incarnation="p1", role=pb.ROLE_DECODE, tp_size=1, compatibility_hash=real_hash
        ),
        decode_ranks=[pb.RankLayout.FromString(c.decode.info["layouts"][0])],
    )
    bad_hash = pb.Hello()
    bad_hash.CopyFrom(base)
    bad_hash.decode.compatibility_hash = "kvpush1-guessguessguess"
    bad_incarnation = pb.Hello()
    bad_incarnation.CopyFrom(base)
    bad_incarnation.expected_prefill_incarnation = "guessed-incarnation"
    for hello, word in ((bad_hash, "incompatible"), (bad_incarnation, "incarnation")):
        stub = pb_grpc.PrefillAgentStub(grpc.insecure_channel(ep))
        with pytest.raises(grpc.RpcError) as err:
            for _ in stub.Reservations(iter([pb.DecodeMessage(hello=hello)]), timeout=10):
                pass
        details = err.value.details() or ""
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION and word in details
        for secret in (real_hash, "kvpush1-", real_incarnation, "guessed-incarnation"):
            assert secret not in details, details


# ----- a prefill link's rejection counts only for transfers published to it ------------------


class RoguePrefill(pb_grpc.PrefillAgentServicer):
    """Accepts any decode stream, records what it gets and sends what the test queues."""

    def __init__(self) -> None:
        self.received: queue.Queue[pb.DecodeMessage] = queue.Queue()
        self.outbox: queue.Queue[pb.PrefillMessage | None] = queue.Queue()

    def Reservations(self, request_iterator: Any, context: Any) -> Iterator[pb.PrefillMessage]:  # noqa: N802
        next(request_iterator)  # the Hello
        yield pb.PrefillMessage(
            hello_ack=pb.HelloAck(
                prefill=pb.EngineIdentity(
                    engine_id="rogue",
                    incarnation="r1",
                    compatibility_hash=shape().compatibility_hash(),
                    role=pb.ROLE_PREFILL,
                    tp_size=1,
                ),
                prefill_rank=0,
                lease_ms=30_000,  # never pings: its stream stays up through the test
                write_timeout_ms=1_000,
            )
        )

        def pump() -> None:
            with contextlib.suppress(grpc.RpcError):  # the stream ends with the test (cancelled)
                for msg in request_iterator:
                    self.received.put(msg)

        threading.Thread(target=pump, daemon=True).start()
        while context.is_active():
            try:
                msg = self.outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg is None:
                return
            yield msg

    def next_of(self, kind: str, timeout: float = 10.0) -> Any:
        while True:
            msg = self.received.get(timeout=timeout)
            if msg.WhichOneof("body") == kind:
                return getattr(msg, kind)


def test_rejection_from_an_unrelated_prefill_link_is_ignored(c: Cluster) -> None:
    rogue = RoguePrefill()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PrefillAgentServicer_to_server(rogue, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        bait_leg = {
            "transfer_id": "bait",
            "epoch": 1,
            "prefill_engine_id": "rogue",
            "prefill_incarnation": "",
            "prefill_tp_size": 1,
            "prefill_agent_endpoints": [f"127.0.0.1:{port}"],
            "prefill_rank_incarnations": [],
        }
        bait_epoch = c.decode.call("reserve", "bait", bait_leg, [[50]], TOKENS, 0)
        assert rogue.next_of("reservation").transfer_id == "bait"  # the rogue link is up
        tid = "victim-of-rogue"
        epoch = c.decode.call("reserve", tid, c.leg(tid), [[30, 31]], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
        for t, e in ((tid, epoch), ("bait", bait_epoch)):  # the victim's first, then its own
            rogue.outbox.put(
                pb.PrefillMessage(
                    rejected=pb.ReservationRejected(
                        transfer_id=t, epoch=e, code=grpc.StatusCode.ABORTED.value[0], message="rogue"
                    )
                )
            )
        # Its own transfer is fenced (a Cancel comes back), so the rejection before it was read.
        cancel = rogue.next_of("cancel")
        assert (cancel.transfer_id, cancel.epoch) == ("bait", bait_epoch)
        rogue.outbox.put(pb.PrefillMessage(cancel_ack=pb.CancelAck(transfer_id="bait", epoch=bait_epoch)))
        assert c.decode.call("wait_settled", "bait", bait_epoch, 10.0, timeout=20) == "failed"
        assert c.decode.call("state", tid) == "published"
        c.done_all(tid, [5, 6], TOKENS)
        assert _wait(c, [tid])["ranks"][tid] == ("ok", "")
        assert c.decode.call("verify", [([30, 31], [5, 6])]) == []
    finally:
        rogue.outbox.put(None)
        server.stop(0)
    _no_leaks(c)


# ----- duplicate transfer ids: refused, never superseded --------------------------------------


def test_duplicate_prefill_done_releases_the_second_at_once(c: Cluster) -> None:
    tid = "dup-prefill"
    c.prefill[0].send("done", tid, [[7, 8]], TOKENS, "req-first")
    c.prefill[0].send("done", tid, [[9, 10]], TOKENS, "req-second")
    got = _released(c.prefill[0], {"req-second"})
    assert got.get("req-second") == "duplicate transfer id"
    assert "req-first" not in got  # the first is untouched
    c.decode.call("reserve", tid, c.leg(tid), [[60, 61]], TOKENS, 0)
    assert _wait(c, [tid])["ranks"][tid] == ("ok", "")
    assert c.decode.call("verify", [([60, 61], [7, 8])]) == []
    assert "req-first" in _released(c.prefill[0], {"req-first"})
    _no_leaks(c)


def test_duplicate_reservation_is_refused_not_superseded(c: Cluster) -> None:
    tid = "dup-decode"
    epoch = c.decode.call("reserve", tid, c.leg(tid), [[40, 41]], TOKENS, 0)
    assert c.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
    c.decode.call("reserve", tid, c.leg(tid), [[42, 43]], TOKENS, 0, "second-request")
    res = c.decode.call("wait_request", ["second-request"], 10.0, timeout=20)
    # The second request fails (never reported as a success); nothing was published for it.
    assert res["ranks"]["second-request"] is not None
    assert {o for o, _ in res["ranks"]["second-request"].values()} == {"failed"}
    state, reason = res["settled"]["second-request"]
    assert state == "failed" and "duplicate transfer id" in reason
    assert c.decode.call("state", tid) == "published"  # the first is untouched
    c.done_all(tid, [11, 12], TOKENS)
    assert _wait(c, [tid])["ranks"][tid] == ("ok", "")
    assert c.decode.call("verify", [([40, 41], [11, 12])]) == []
    assert c.decode.call("zero_blocks", [42, 43]) == [42, 43]
    _no_leaks(c)


# ----- the connector: duplicates and CANCELLED are never a successful load --------------------


def _vllm_cfg() -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))


class _Req(SimpleNamespace):
    pass


def _req(rid: str, params: Any, prompt: int = 64) -> Any:
    return _Req(
        request_id=rid,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        kv_transfer_params=params,
        status=SimpleNamespace(name="FINISHED_ABORTED"),
    )


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [self.ids]

    def get_block_ids(self) -> list[list[int]]:
        return [self.ids]


class _FakeDecodeAgent:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._epochs = iter(range(1, 1000))

    def reserve(self, tid: str, rid: str, *a: Any, **kw: Any) -> int:
        epoch = next(self._epochs)
        self.calls.append(("reserve", tid, rid, epoch))
        return epoch

    def release_prefill(self, tid: str, *a: Any) -> None:
        self.calls.append(("release_prefill", tid))

    def cancel(self, tid: str, reason: str = "", epoch: int | None = None) -> None:
        self.calls.append(("cancel", tid, epoch))

    def finished(self, tid: str, epoch: int | None = None) -> None:
        self.calls.append(("finished", tid, epoch))


def test_decode_scheduler_computes_a_duplicate_locally_and_never_touches_the_first() -> None:
    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.decode_scheduler import DecodeScheduler
    from kvpush.services.common.transfer_params import DecodeLeg, to_params

    s = DecodeScheduler(ConnectorConfig(engine_id="d", role="decode", insecure=True), _vllm_cfg())
    agent = _FakeDecodeAgent()
    s.agent = agent  # type: ignore[assignment]
    params = to_params(DecodeLeg("t", 1, "p", "", 1, ["127.0.0.1:1"]))
    first, second = _req("first", params), _req("second", params)
    assert s.get_num_new_matched_tokens(first, 0) == (64, True)
    s.update_state_after_alloc(first, _Blocks([1, 2, 3, 4]), 64)
    assert s.get_num_new_matched_tokens(second, 0) == (0, False)  # computed locally
    s.update_state_after_alloc(second, _Blocks([5, 6, 7, 8]), 0)
    assert s.request_finished(second) == (False, None)
    # Neither the duplicate's allocation nor its end released or cancelled the first's transfer.
    assert agent.calls == [("reserve", "t", "first", 1)]
    s.request_finished(first)
    assert agent.calls[-1] == ("cancel", "t", 1)  # by epoch: only the first's own reservation


def test_prefill_scheduler_serves_a_duplicate_plainly() -> None:
    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.prefill_scheduler import PrefillScheduler
    from kvpush.services.common.transfer_params import PrefillLeg, to_params

    s = PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill", insecure=True), _vllm_cfg())
    s._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([1, 2, 3, 4],))
    params = to_params(PrefillLeg("t", "d"))
    first, second = _req("first", params), _req("second", params)
    s.update_state_after_alloc(first, None, 0)
    s.update_state_after_alloc(second, None, 0)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"first": 64, "second": 64}))
    assert [(f.request_id, f.decode_engine_id) for f in meta.finished_prefills] == [("first", "d")]
    assert s.request_finished(second) == (False, None)  # not held, nothing aborted
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).aborted == []


def test_decode_worker_reports_only_ok_as_a_successful_load() -> None:
    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.workers import DecodeWorker
    from kvpush.services.decode_agent.barrier import Outcome, Released

    w = DecodeWorker(ConnectorConfig(engine_id="d", role="decode", insecure=True), "m")
    rels = [
        Released("a", 1, "ok-req", Outcome.OK, ""),
        Released("b", 1, "failed-req", Outcome.FAILED, "boom"),
        Released("c", 1, "cancelled-req", Outcome.CANCELLED, "superseded"),
    ]
    w.rank = SimpleNamespace(take_released=lambda: rels, step_ended=PollCadence().step_ended)  # type: ignore[assignment]
    results = w.transfer_results()
    assert results is not None
    done, failed = results.finished_recving, results.failed_recving
    assert done == {"ok-req", "failed-req", "cancelled-req"}
    assert failed == {"failed-req", "cancelled-req"}


# ----- the pure logic, directly -----------------------------------------------------------------


def _r(engine: str, tid: str = "t", epoch: int = 1, blocks: tuple[int, ...] = (10, 11), peer: str = "") -> Any:
    from kvpush.services.prefill_agent.table import Reservation

    return Reservation(peer or f"{engine}/stream", tid, epoch, (blocks,), 32, 0, lease_s=5.0, decode_engine=engine)


def _d(engine: str, tid: str = "t", request_id: str = "req", blocks: tuple[int, ...] = (1, 2)) -> Any:
    from kvpush.services.prefill_agent.table import PrefillDone

    return PrefillDone(tid, request_id, (blocks,), 32, decode_engine=engine)


def test_table_keys_transfers_by_decode_engine() -> None:
    from kvpush.services.common.refusal import RefusalCode
    from kvpush.services.prefill_agent.table import AckCancel, PrefillState, Reject, StartWrite, TransferTable

    t = TransferTable()
    assert t.on_reservation(_r("A", blocks=(10, 11)), 0) == []
    # Another engine's Cancel and newer epoch reach only its own (new, separate) entry.
    assert t.on_cancel("E/stream", "E", "t", 5, 0) == [AckCancel("E/stream", "t", 5, data_written=False)]
    assert t.on_reservation(_r("E", epoch=99, blocks=(30, 31)), 0) == []
    assert t.state("A", "t") is PrefillState.WAITING_PREFILL and t.reservation_epoch("A", "t") == 1
    assert t.reservation_epoch("E", "t") == 99  # E's own transfer, which no KV will ever match
    # KV meant for A matches only A's reservation.
    (start,) = t.on_prefill_done(_d("A"), 1)
    assert isinstance(start, StartWrite) and start.reservation.decode_engine == "A"
    assert start.reservation.block_ids == ((10, 11),)
    # E's stream going away drops E's reservation only.
    t.on_peer_lost("E/stream", 1)
    assert t.state("A", "t") is PrefillState.WRITING and t.state("E", "t") is PrefillState.CANCELLED
    (rej,) = t.on_reservation(_r("E", epoch=1), 1)  # E's epoch 1 was cancelled by E itself
    assert isinstance(rej, Reject) and rej.code is RefusalCode.FAILED_PRECONDITION


def test_table_refuses_a_duplicate_prefill_done_in_every_state() -> None:
    from kvpush.services.prefill_agent.table import PrefillState, ReleaseBlocks, TransferTable

    t = TransferTable()
    t.on_prefill_done(_d("A", request_id="first"), 0)  # WAITING_RESERVATION
    assert t.on_prefill_done(_d("A", request_id="second"), 0) == [ReleaseBlocks("t", "second", "duplicate transfer id")]
    assert t.on_prefill_done(_d("A", request_id="first"), 0) == []  # the same request again: no release
    t.on_reservation(_r("A"), 0)  # WRITING
    assert t.on_prefill_done(_d("A", request_id="third"), 0) == [ReleaseBlocks("t", "third", "duplicate transfer id")]
    t.on_write_finished("A", "t", 1, True, "", 1)  # DONE
    assert t.state("A", "t") is PrefillState.DONE
    assert t.on_prefill_done(_d("A", request_id="fourth"), 1) == [ReleaseBlocks("t", "fourth", "duplicate transfer id")]
    # The same transfer id for another decode engine is another transfer.
    assert t.on_prefill_done(_d("B", request_id="other"), 1) == []
    assert t.state("B", "t") is PrefillState.WAITING_RESERVATION


def test_table_bounds_per_decode_engine() -> None:
    from kvpush.services.common.refusal import RefusalCode
    from kvpush.services.prefill_agent.table import AckCancel, Reject, TransferTable

    t = TransferTable(max_open_per_decode=2, max_entries_per_decode=3)
    assert t.on_reservation(_r("E", tid="a"), 0) == [] and t.on_reservation(_r("E", tid="b"), 0) == []
    (rej,) = t.on_reservation(_r("E", tid="c"), 0)
    assert isinstance(rej, Reject) and rej.code is RefusalCode.RESOURCE_EXHAUSTED
    assert t.on_reservation(_r("A", tid="c"), 0) == []  # other engines are not affected
    assert t.open_count("E") == 2 and t.open_count("A") == 1 and t.active_count() == 3
    t.on_cancel("E/stream", "E", "a", 1, 0)  # a closes: room for one more
    assert t.open_count("E") == 1
    assert t.on_cancel("E/stream", "E", "x", 1, 0) == [AckCancel("E/stream", "x", 1, data_written=False)]
    assert t.entry_count("E") == 3  # a, b, and the tombstone of x
    # Past the entry cap an unknown cancel is still acked, but leaves no tombstone.
    assert t.on_cancel("E/stream", "E", "y", 1, 0) == [AckCancel("E/stream", "y", 1, data_written=False)]
    assert t.entry_count("E") == 3
    t.expire(1000)  # tombstones go, the lease of b ends
    t.expire(2000)
    assert t.entry_count() == 0 and t.active_count() == 0


def test_barrier_refuses_a_duplicate_request_and_still_releases_it_failed() -> None:
    from kvpush.services.common.refusal import RefusalCode
    from kvpush.services.decode_agent.barrier import BarrierTable, CompletionError, Outcome

    b = BarrierTable()
    b.expect("t", 1, "first", [0], "P", 0)
    with pytest.raises(CompletionError) as err:
        b.expect("t", 2, "second", [0], "P", 0)
    assert err.value.code is RefusalCode.ALREADY_EXISTS
    assert b.get("t").request_id == "first"  # type: ignore[union-attr]
    rel = b.settle("t", 2, Outcome.CANCELLED, "duplicate transfer id", 0)
    assert rel is not None and (rel.request_id, rel.outcome) == ("second", Outcome.FAILED)
    # The first is untouched and completes.
    ok = b.complete("t", 1, 0, "P", True, "", 0)
    assert ok is not None and (ok.request_id, ok.outcome) == ("first", Outcome.OK)
    # After its release too, the transfer id is not another request's.
    with pytest.raises(CompletionError) as err:
        b.expect("t", 3, "third", [0], "P", 0)
    assert err.value.code is RefusalCode.ALREADY_EXISTS
    # An expectation naming no prefill rank registers nothing; its settlement fails the request.
    with pytest.raises(CompletionError):
        b.expect("u", 1, "refused", [], "P", 0)
    rel = b.settle("u", 1, Outcome.FAILED, "refused by the agent", 0)
    assert rel is not None and (rel.request_id, rel.outcome) == ("refused", Outcome.FAILED)
    assert b.pending_count() == 0 and b.refused_count() == 1  # "third" waits for its settle
    b.expire(1000)
    assert b.refused_count() == 0


def test_pure_modules_import_no_grpc() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kvpush.services.prefill_agent.table, kvpush.services.prefill_agent.plan, kvpush.services.decode_agent.barrier\n"
        "import kvpush.services.decode_agent.transfers, kvpush.services.common.tp, kvpush.services.common.limits\n"
        "import kvpush.services.common.refusal\n"
        "assert not [m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')], 'grpc imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

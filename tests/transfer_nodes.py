"""Separate-process decode and prefill nodes for the transfer-core tests (no vLLM).

Each node registers numpy KV pools with real NIXL, runs the real agents and gRPC servers, and is
driven by the test over a multiprocessing pipe. Prefill pools hold a deterministic pattern per
(layer, block, global head); decode verifies written blocks against it byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from scripts.cluster.node import Node

NUM_LAYERS = 2
TOTAL_HEADS = 4
HEAD_BYTES = 256  # one head of one block (K and V for all tokens of the block)
TOKENS_PER_BLOCK = 16


def shape() -> Any:
    from kvpush.services.common.layout import ModelShape

    return ModelShape(
        model="pattern-test",
        dtype="uint8",
        num_layers=NUM_LAYERS,
        total_kv_heads=TOTAL_HEADS,
        head_bytes=HEAD_BYTES,
        tokens_per_block=TOKENS_PER_BLOCK,
    )


def pattern(layer: int, blocks: np.ndarray, global_heads: np.ndarray) -> np.ndarray:
    """Bytes of the given blocks x heads: shape (len(blocks), len(heads) * HEAD_BYTES)."""
    b = blocks.astype(np.uint64)[:, None, None]
    h = global_heads.astype(np.uint64)[None, :, None]
    i = np.arange(HEAD_BYTES, dtype=np.uint64)[None, None, :]
    v = np.uint64(layer * 1_000_003) + b * np.uint64(7919) + h * np.uint64(104_729) + i * np.uint64(31)
    v = (v ^ (v >> np.uint64(7))) & np.uint64(0xFF)
    return v.astype(np.uint8).reshape(len(blocks), -1)


@dataclass
class Pool:
    """KV pool of one rank: [layers, blocks, heads_on_rank * HEAD_BYTES]."""

    array: np.ndarray
    heads: int

    @classmethod
    def create(cls, num_blocks: int, heads: int) -> Pool:
        arr = np.zeros((NUM_LAYERS, num_blocks, heads * HEAD_BYTES), dtype=np.uint8)
        arr.fill(0)  # touch every page before NIXL writes into it
        return cls(arr, heads)

    def regions(self) -> Any:
        from kvpush.services.common.layout import RankRegions, Region

        stride = self.array.shape[2]
        return RankRegions(
            regions=tuple(
                Region(self.array[layer].ctypes.data, self.array.shape[1], stride) for layer in range(NUM_LAYERS)
            ),
            block_bytes=stride,
            num_heads=self.heads,
        )


def _env() -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


# A node started while this names a directory of `make certs` files serves and dials with mutual
# TLS, as the engine ``engine_id`` (``start_cluster(tls_dir=...)`` sets it around the spawn).
TLS_DIR_ENV = "KVPUSH_TEST_TLS_DIR"


def _security(engine_id: str) -> Any:
    from kvpush.services.common.security import Security, TlsFiles

    tls_dir = os.environ.get(TLS_DIR_ENV, "")
    return Security.mtls(TlsFiles.in_dir(tls_dir, engine_id)) if tls_dir else None


@contextlib.contextmanager
def tls_env(tls_dir: str) -> Any:
    """Nodes spawned inside use the certificates in ``tls_dir`` (empty: plaintext)."""
    old = os.environ.pop(TLS_DIR_ENV, None)
    if tls_dir:
        os.environ[TLS_DIR_ENV] = tls_dir
    try:
        yield
    finally:
        os.environ.pop(TLS_DIR_ENV, None)
        if old is not None:
            os.environ[TLS_DIR_ENV] = old


# ----- prefill node ---------------------------------------------------------------------------


# Short fence bounds, so a lost stream's transfers settle within seconds (docs/fence.md).
LEASE_S = 1.0
WRITE_TIMEOUT_S = 3.0


def prefill_node(
    conn: Connection,
    engine_id: str,
    rank: int,
    tp_size: int,
    num_blocks: int,
    auth: str,
    write_timeout_s: float = WRITE_TIMEOUT_S,
    decode_engine_id: str = "",
    port: int = 0,
) -> None:
    """``decode_engine_id``: the decode engine that prefill legs name unless a command says
    otherwise; by default the cluster's (``prefill<tag>`` pairs with ``decode<tag>``). ``port``:
    the agent's port (0: a free one), so a test can restart a rank on the same address."""
    _env()
    decode_engine_id = decode_engine_id or engine_id.replace("prefill", "decode", 1)
    from kvpush.services.common.nixl_engine import NixlEngine
    from kvpush.services.prefill_agent.agent import PrefillAgent, PrefillAgentConfig

    heads = TOTAL_HEADS // tp_size
    pool = Pool.create(num_blocks, heads)
    global_heads = np.arange(rank * heads, (rank + 1) * heads)
    for layer in range(NUM_LAYERS):
        pool.array[layer] = pattern(layer, np.arange(num_blocks), global_heads)
    regions = pool.regions()
    engine = NixlEngine(f"prefill-{engine_id}-{os.getpid()}-r{rank}")
    engine.register([(r.base_addr, r.num_blocks * r.block_stride) for r in regions.regions])
    cfg = PrefillAgentConfig(
        engine_id=engine_id,
        rank=rank,
        tp_size=tp_size,
        shape=shape(),
        auth_token=auth,
        write_timeout_s=write_timeout_s,
        security=_security(engine_id),
        lease_s=LEASE_S,
        host=os.environ.get("KVPUSH_TEST_HOST", "127.0.0.1"),  # tests/test_netns.py: a namespace's address
        port=port,
    )
    agent = PrefillAgent(cfg, engine, regions).start()
    # A gate in front of the real NIXL post, so a test can hold the writer inside a WRITE.
    gate_open, gate_entered = threading.Event(), threading.Event()
    gate_open.set()
    real_post = engine.post_write

    posts: list[tuple[float, float]] = []  # (start, end) of every real NIXL post, monotonic
    cancels: list[float] = []  # when the agent received each Cancel from the stream
    real_cancel = agent.writer.cancel

    def gated_post(*a: Any, **kw: Any) -> Any:
        gate_entered.set()
        gate_open.wait(30)
        start = time.monotonic()
        try:
            return real_post(*a, **kw)
        finally:
            posts.append((start, time.monotonic()))

    def timed_cancel(*a: Any, **kw: Any) -> None:
        cancels.append(time.monotonic())
        real_cancel(*a, **kw)

    agent.writer.cancel = timed_cancel  # type: ignore[method-assign]

    engine.post_write = gated_post  # type: ignore[method-assign]
    conn.send({"endpoint": agent.endpoint, "incarnation": agent.identity.incarnation})
    while True:
        cmd, *args = conn.recv()
        if cmd == "hold_writes":
            gate_entered.clear()
            gate_open.clear()
            conn.send(None)
        elif cmd == "lease_left":
            # Seconds of write lease left per connected decode session (negative: expired).
            def left() -> list[float]:
                now = agent.writer.clock()
                return [sess.lease_until - now for sess in agent.writer._sessions.values()]

            conn.send(agent.writer.call(left).result(5))
        elif cmd == "arm_write_entered":
            gate_entered.clear()
            conn.send(None)
        elif cmd == "timeline":
            conn.send({"posts": list(posts), "cancels": list(cancels)})
        elif cmd == "wait_write_entered":
            conn.send(gate_entered.wait(args[0]))
        elif cmd == "release_writes":
            gate_open.set()
            conn.send(None)
        elif cmd == "done":
            # tid, block_ids, num_tokens[, request_id[, decode_engine_id]]
            tid, block_ids, num_tokens, *rest = args
            rid = rest[0] if rest else f"req-{tid}"
            engine = rest[1] if len(rest) > 1 else decode_engine_id
            agent.prefill_done(tid, rid, block_ids, num_tokens, decode_engine_id=engine)
        elif cmd == "released":
            (timeout,) = args
            conn.send([(r.transfer_id, r.reason) for r in agent.take_released(timeout)])
        elif cmd == "released_requests":
            (timeout,) = args
            conn.send([(r.transfer_id, r.request_id, r.reason) for r in agent.take_released(timeout)])
        elif cmd == "wait_reservation":
            # tid, epoch, timeout[, decode_engine_id]
            tid, epoch, timeout, *rest = args
            engine = rest[0] if rest else decode_engine_id
            deadline = time.monotonic() + timeout
            got = None
            while time.monotonic() < deadline:
                got = agent.writer.call(
                    lambda tid=tid, engine=engine: agent.writer.table.reservation_epoch(engine, tid)
                ).result(5)
                if got == epoch:
                    break
                time.sleep(0.01)  # polling a condition under a deadline
            conn.send(got)
        elif cmd == "drain":
            agent.drain("test drain")
            conn.send(None)
        elif cmd == "table":
            conn.send(agent.writer.call(lambda: agent.writer.table.active_count()).result(5))
        elif cmd == "sessions":
            conn.send(agent.writer.call(lambda: len(agent.writer._sessions)).result(5))
        elif cmd == "wait_in_flight":
            # Until the writer has a WRITE posted and not yet finished (NIXL state PROC).
            (timeout,) = args
            deadline = time.monotonic() + timeout
            while True:
                n = agent.writer.call(lambda: len(agent.writer._in_flight)).result(5)
                if n or time.monotonic() >= deadline:
                    break
                time.sleep(0.005)  # polling a condition under a deadline
            conn.send(n)
        elif cmd == "stop":
            agent.stop()
            conn.send("stopped")
            return


# ----- decode node ----------------------------------------------------------------------------


@dataclass
class _Outcomes:
    """Per transfer: every rank's release, and the agent's settlement if any."""

    tp_size: int
    cv: threading.Condition = field(default_factory=threading.Condition)
    rank_releases: dict[str, dict[int, tuple[str, str]]] = field(default_factory=lambda: defaultdict(dict))
    settled: dict[str, tuple[str, str]] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)  # newest epoch seen per transfer
    settled_epochs: dict[tuple[str, int], str] = field(default_factory=dict)
    # Per decode request id: every rank's release, and the agent's settlement if any.
    by_request: dict[str, dict[int, tuple[str, str]]] = field(default_factory=lambda: defaultdict(dict))
    settled_by_request: dict[str, tuple[str, str]] = field(default_factory=dict)
    settled_at: dict[tuple[str, int], float] = field(default_factory=dict)  # monotonic
    # How many times each (request id, rank) was released: exactly once, whatever was retried.
    release_counts: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, tid: str, epoch: int) -> None:
        """Keeps only the newest epoch's releases."""
        if epoch > self.epochs.get(tid, 0):
            self.epochs[tid] = epoch
            self.rank_releases.pop(tid, None)
            self.settled.pop(tid, None)

    def final(self, tid: str) -> tuple[str, str] | None:
        ranks = self.rank_releases.get(tid, {})
        if len(ranks) < self.tp_size:
            return None
        bad = [v for v in ranks.values() if v[0] != "ok"]
        return bad[0] if bad else ("ok", "")


CANARY = 0xA5  # the byte fault tests fill free decode blocks with


class _RankFaults:
    """Faults injected at the decode ranks' gRPC servicer, behind the real server and client:
    completions dropped before the rank sees them, or processed with their answer lost (so the
    prefill side retries a completion the rank already took: a duplicate), and expectations held
    back so completions overtake them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.drop_completions = 0  # the next n Complete calls fail UNAVAILABLE, unprocessed
        self.lose_acks = 0  # the next n Complete calls are processed, then fail UNAVAILABLE
        self.completions_seen = 0
        self.expect_open = threading.Event()
        self.expect_open.set()
        self.expects_held = 0

    def _take(self, name: str) -> bool:
        with self.lock:
            n = getattr(self, name)
            if n > 0:
                setattr(self, name, n - 1)
            return n > 0

    def install(self) -> None:
        """Wraps the servicer methods on the class, before any rank registers with gRPC."""
        import asyncio

        import grpc

        from kvpush.services.decode_agent.rank import DecodeRank

        real_complete, real_expect = DecodeRank.Complete, DecodeRank.Expect
        faults = self

        async def complete(rank: Any, request: Any, context: Any) -> Any:
            with faults.lock:
                faults.completions_seen += 1
            if faults._take("drop_completions"):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "test: completion dropped")
            ack = await real_complete(rank, request, context)
            if faults._take("lose_acks"):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "test: completion ack lost")
            return ack

        async def expect(rank: Any, request: Any, context: Any) -> Any:
            if not faults.expect_open.is_set():
                with faults.lock:
                    faults.expects_held += 1
                await asyncio.get_running_loop().run_in_executor(None, faults.expect_open.wait, 30.0)
            return await real_expect(rank, request, context)

        DecodeRank.Complete = complete  # type: ignore[method-assign]
        DecodeRank.Expect = expect  # type: ignore[method-assign]


def decode_node(
    conn: Connection, engine_id: str, tp_size: int, num_blocks: int, auth: str, grace_s: float, notices: bool = True
) -> None:
    """``notices``: the agent mints completion-notice keys (services/common/completion_notice.py);
    false: completions travel by RPC only."""
    _env()
    from kvpush.services.common.nixl_engine import NixlEngine
    from kvpush.services.common.transfer_params import DecodeLeg
    from kvpush.services.decode_agent.agent import DecodeAgent, DecodeAgentConfig, Settled
    from kvpush.services.decode_agent.barrier import Released
    from kvpush.services.decode_agent.rank import DecodeRankConfig, create_rank

    heads = TOTAL_HEADS // tp_size
    outcomes = _Outcomes(tp_size)
    agent_box: list[DecodeAgent] = []

    def on_release(rank: int) -> Any:
        def cb(rel: Released) -> None:
            with outcomes.cv:
                outcomes.release_counts[(rel.request_id, rank)] += 1
                mine = outcomes.by_request[rel.request_id]
                mine[rank] = (rel.outcome.value, rel.reason)
                done = len(mine) == outcomes.tp_size
                outcomes.cv.notify_all()
                # Per transfer id, only the requests named the default way (``dreq-<tid>``).
                if rel.request_id == f"dreq-{rel.transfer_id}":
                    outcomes.record(rel.transfer_id, rel.epoch)
                    if rel.epoch >= outcomes.epochs[rel.transfer_id]:
                        outcomes.rank_releases[rel.transfer_id][rank] = (rel.outcome.value, rel.reason)
            if done and agent_box:
                agent_box[0].finished(rel.transfer_id, rel.epoch)

        return cb

    def on_settled(s: Settled) -> None:
        with outcomes.cv:
            outcomes.settled_by_request[s.request_id] = (s.state.value, s.reason)
            if s.request_id == f"dreq-{s.transfer_id}":
                outcomes.settled_epochs[(s.transfer_id, s.epoch)] = s.state.value
                outcomes.settled_at[(s.transfer_id, s.epoch)] = time.monotonic()
                outcomes.record(s.transfer_id, s.epoch)
                if s.epoch == outcomes.epochs[s.transfer_id]:
                    outcomes.settled[s.transfer_id] = (s.state.value, s.reason)
            outcomes.cv.notify_all()

    pools = [Pool.create(num_blocks, heads) for _ in range(tp_size)]
    security = _security(engine_id)
    faults = _RankFaults()
    faults.install()
    ranks = []
    progress_allowed = threading.Event()
    progress_allowed.set()
    for d, pool in enumerate(pools):
        engine = NixlEngine(f"decode-{engine_id}-{os.getpid()}-r{d}")
        real_progress = engine.progress
        # A switch in front of the real NIXL progress, so a test can make this target stall.
        engine.progress = lambda real=real_progress: real() if progress_allowed.is_set() else {}  # type: ignore[method-assign]
        cfg = DecodeRankConfig(
            engine_id=engine_id,
            rank=d,
            tp_size=tp_size,
            shape=shape(),
            security=security,
            host=os.environ.get("KVPUSH_TEST_HOST", "127.0.0.1"),
        )
        ranks.append(create_rank(cfg, engine, pool.regions(), on_release=on_release(d)))
    agent = DecodeAgent(
        DecodeAgentConfig(
            engine_id=engine_id,
            tp_size=tp_size,
            shape=shape(),
            auth_token=auth,
            grace_s=grace_s,
            security=security,
            completion_notices=notices,
        ),
        [r.layout() for r in ranks],
        on_settled=on_settled,
    ).start()
    agent_box.append(agent)
    conn.send({"layouts": [r.layout().SerializeToString() for r in ranks], "incarnation": agent.identity.incarnation})
    while True:
        cmd, *args = conn.recv()
        if cmd == "reserve":
            # tid, leg, block_ids, num_tokens, skip[, request_id]
            tid, leg, block_ids, num_tokens, skip, *rest = args
            rid = rest[0] if rest else f"dreq-{tid}"
            epoch = agent.reserve(tid, rid, DecodeLeg(**leg), block_ids, num_tokens, skip)
            if rid == f"dreq-{tid}":
                with outcomes.cv:
                    outcomes.record(tid, epoch)
            conn.send(epoch)
        elif cmd == "wait_request":
            # Every rank's release of each request (and the settlement, for one not OK).
            rids, timeout = args
            deadline = time.monotonic() + timeout

            def finals(rids: list[str] = rids) -> dict[str, Any]:
                out: dict[str, Any] = {}
                for rid in rids:
                    ranks_of = outcomes.by_request.get(rid, {})
                    out[rid] = dict(ranks_of) if len(ranks_of) == tp_size else None
                return out

            with outcomes.cv:
                while True:
                    got = finals()
                    settled_ok = all(
                        v is not None and (all(o == "ok" for o, _ in v.values()) or r in outcomes.settled_by_request)
                        for r, v in got.items()
                    )
                    if settled_ok or time.monotonic() >= deadline:
                        break
                    outcomes.cv.wait(max(0.0, deadline - time.monotonic()))
                conn.send({"ranks": got, "settled": {r: outcomes.settled_by_request.get(r) for r in rids}})
        elif cmd == "wait_settled":
            tid, epoch, timeout = args
            with outcomes.cv:
                key = (tid, epoch)
                outcomes.cv.wait_for(lambda key=key: key in outcomes.settled_epochs, timeout)
                conn.send(outcomes.settled_epochs.get((tid, epoch)))
        elif cmd == "settled_at":
            tid, epoch = args
            with outcomes.cv:
                conn.send(outcomes.settled_at.get((tid, epoch)))
        elif cmd == "progress":
            (progress_allowed.set if args[0] else progress_allowed.clear)()
            conn.send(None)
        elif cmd == "cancel":
            agent.cancel(args[0], "test cancel")
            conn.send(None)
        elif cmd == "wait":
            tids, timeout = args
            deadline = time.monotonic() + timeout
            with outcomes.cv:
                while True:
                    result = {t: outcomes.final(t) for t in tids}
                    # Done when every rank released, and anything not OK was also settled.
                    if all(v is not None and (v[0] == "ok" or t in outcomes.settled) for t, v in result.items()):
                        break
                    if time.monotonic() >= deadline:
                        break
                    outcomes.cv.wait(max(0.0, deadline - time.monotonic()))
                conn.send({"ranks": result, "settled": {t: outcomes.settled.get(t) for t in tids}})
        elif cmd == "verify":
            # [(dst_ids, src_ids)] per transfer; returns mismatching (rank, layer, dst block) triples.
            (pairs,) = args
            bad = []
            for d, pool in enumerate(pools):
                gh = np.arange(d * heads, (d + 1) * heads)
                for dst_ids, src_ids in pairs:
                    for layer in range(NUM_LAYERS):
                        want = pattern(layer, np.asarray(src_ids), gh)
                        got = pool.array[layer, np.asarray(dst_ids)]
                        rows = np.flatnonzero((want != got).any(axis=1))
                        bad.extend((d, layer, int(dst_ids[r])) for r in rows)
            conn.send(bad)
        elif cmd == "zero_blocks":
            # Which of these blocks are still all zero on every rank and layer.
            (ids,) = args
            conn.send([b for b in ids if all(not pool.array[:, b].any() for pool in pools)])
        elif cmd == "clear":
            for pool in pools:
                pool.array.fill(0)
            conn.send(None)
        elif cmd == "faults":
            # drop_completions=n, lose_acks=n; returns the completions the ranks saw so far
            with faults.lock:
                for k, v in args[0].items():
                    setattr(faults, k, v)
                conn.send(faults.completions_seen)
        elif cmd == "hold_expect":
            (faults.expect_open.clear if args[0] else faults.expect_open.set)()
            conn.send(None)
        elif cmd == "expects_held":
            with faults.lock:
                conn.send(faults.expects_held)
        elif cmd == "release_counts":
            with outcomes.cv:
                conn.send({f"{r}/{k}": n for (r, k), n in outcomes.release_counts.items()})
        elif cmd == "canary":
            # Fill every block except ``owned`` with the canary byte, on every rank and layer.
            (owned,) = args
            mask = np.ones(num_blocks, dtype=bool)
            mask[np.asarray(owned, dtype=np.int64)] = False
            for pool in pools:
                pool.array[:, mask] = CANARY
            conn.send(int(mask.sum()))
        elif cmd == "canary_broken":
            # Blocks outside ``owned`` where any byte is no longer the canary.
            (owned,) = args
            mask = np.ones(num_blocks, dtype=bool)
            mask[np.asarray(owned, dtype=np.int64)] = False
            broken = np.zeros(num_blocks, dtype=bool)
            for pool in pools:
                broken |= (pool.array != CANARY).any(axis=(0, 2))
            conn.send(np.flatnonzero(broken & mask).tolist())
        elif cmd == "state":
            st = agent.state(args[0])
            conn.send(st.value if st else None)
        elif cmd == "open":
            conn.send(agent.open_transfers())
        elif cmd == "stop":
            agent.stop()
            for r in ranks:
                r.stop()
            conn.send("stopped")
            return


# ----- handles used by the tests --------------------------------------------------------------


@dataclass
class Cluster:
    decode: Node
    prefill: list[Node]
    prefill_engine_id: str
    tp_decode: int
    decode_engine_id: str = ""

    def leg(self, tid: str, incarnations: list[str] | None = None) -> dict[str, Any]:
        return {
            "transfer_id": tid,
            "epoch": 1,
            "prefill_engine_id": self.prefill_engine_id,
            "prefill_incarnation": "",
            "prefill_tp_size": len(self.prefill),
            "prefill_agent_endpoints": [n.info["endpoint"] for n in self.prefill],
            "prefill_rank_incarnations": incarnations or [n.info["incarnation"] for n in self.prefill],
        }

    def done_all(self, tid: str, src_ids: list[int], num_tokens: int) -> None:
        for n in self.prefill:
            n.send("done", tid, [src_ids], num_tokens)

    def stop(self) -> None:
        for n in [*self.prefill, self.decode]:
            n.stop()


def start_cluster(
    prefill_tp: int,
    decode_tp: int,
    num_blocks: int = 512,
    auth: str = "",
    grace_s: float = 0.5,
    tag: str = "",
    write_timeout_s: float = WRITE_TIMEOUT_S,
    tls_dir: str = "",
    notices: bool = True,
) -> Cluster:
    """``tls_dir``: mutual TLS with the certificates there (for engines ``prefill<tag>`` and
    ``decode<tag>``); empty: plaintext. ``notices``: completion notices on (the default) or off,
    so a test of the Completion RPC's own path sees that path alone."""
    pe = f"prefill{tag}"
    with tls_env(tls_dir):
        prefill = [Node(prefill_node, pe, r, prefill_tp, num_blocks, auth, write_timeout_s) for r in range(prefill_tp)]
        decode = Node(decode_node, f"decode{tag}", decode_tp, num_blocks, auth, grace_s, notices)
    return Cluster(decode, prefill, pe, decode_tp, f"decode{tag}")

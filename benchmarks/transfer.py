"""Transfer benchmark: the push writer's NIXL path, end-to-end transfers and control-plane latency.

Two processes (a prefill/initiator and a decode/target), real NIXL with UCX over loopback, numpy
KV pools of ``LAYERS`` layers, driven by this process over multiprocessing pipes. One run measures:

1. Writer throughput: ``plan_writes`` + ``NixlEngine.post_write`` + polling (what
   ``PushWriter._write`` does) for contiguous and for shuffled destination block ids, against one
   single-descriptor WRITE of the same bytes and an in-process ``np.copyto``; the same bytes also
   end to end through the real ``DecodeAgent`` -> ``PrefillAgent`` -> ``DecodeRank`` path.
2. Reservation publish latency: ``DecodeAgent.reserve()`` in the decode process to
   ``PushWriter.reserve`` in the prefill process, paced (default 1 per ms).
3. Small-transfer latency end to end (default 1 MiB): until the decode rank releases it.

Both processes run on one machine, so ``time.monotonic()`` (CLOCK_MONOTONIC, system-wide on
Linux) is comparable across them. Every NIXL configuration is verified once against per-block
BLAKE2 digests of the source. Prints a markdown table; writes JSON (default
bench-results/transfer.json). Usage: ``python -m benchmarks.transfer [--quick] [--total-mib 256]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from scripts.cluster.node import Node

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
KIB = 1 << 10
LAYERS = 2
HEADS = 8  # KV heads of the benchmark model (TP 1 on both sides: every block is written whole)
TOKENS_PER_BLOCK = 16
STREAM_BLOCKS = 8  # blocks per reservation in the stream-latency phase
PREFILL_ENGINE = "bench-prefill"
DECODE_ENGINE = "bench-decode"
NIXL_CONFIGS = ("contiguous", "fragmented", "single")
MEMCPY_CONFIGS = ("memcpy", "memcpy_shuffled")
E2E_CONFIGS = ("e2e_contiguous", "e2e_fragmented")
GOAL_FRAGMENTED_VS_SINGLE = 0.8
GOAL_STREAM_P99_MS = 1.0


@dataclass(frozen=True)
class Sizes:
    block_bytes: int
    blocks: int  # per layer
    small_blocks: int  # per layer, for the small end-to-end transfer
    layers: int = LAYERS

    @property
    def total_bytes(self) -> int:
        return self.layers * self.blocks * self.block_bytes

    @property
    def small_bytes(self) -> int:
        return self.layers * self.small_blocks * self.block_bytes


def _env(log_level: str) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("KVPUSH_LOG_LEVEL", log_level)


def _shape(sizes: Sizes) -> Any:
    from kvpush.services.common.layout import ModelShape

    return ModelShape(
        model="bench-transfer",
        dtype="uint8",
        num_layers=sizes.layers,
        total_kv_heads=HEADS,
        head_bytes=sizes.block_bytes // HEADS,
        tokens_per_block=TOKENS_PER_BLOCK,
    )


def _create_pool(sizes: Sizes) -> np.ndarray:
    arr = np.empty((sizes.layers, sizes.blocks, sizes.block_bytes), dtype=np.uint8)
    arr.fill(0)  # touch every page before NIXL writes into it
    return arr


def _regions(arr: np.ndarray) -> Any:
    from kvpush.services.common.layout import RankRegions, Region

    layers, blocks, block_bytes = arr.shape
    return RankRegions(
        regions=tuple(Region(arr[layer].ctypes.data, blocks, block_bytes) for layer in range(layers)),
        block_bytes=block_bytes,
        num_heads=HEADS,
    )


def _digests(arr: np.ndarray, ids: Sequence[int]) -> bytes:
    """8-byte BLAKE2b digest of every (layer, block), layer-major."""
    out = bytearray()
    for layer in range(arr.shape[0]):
        for b in ids:
            out += hashlib.blake2b(arr[layer, b], digest_size=8).digest()
    return bytes(out)


def _id_sets(sizes: Sizes, seed: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Named (source ids, destination ids) pairs, identical in every process."""
    n, k = sizes.blocks, sizes.small_blocks
    ident = tuple(range(n))
    perm = tuple(int(b) for b in np.random.default_rng(seed).permutation(n))
    stream = tuple(range(min(STREAM_BLOCKS, n)))
    return {
        "contiguous": (ident, ident),
        "fragmented": (ident, perm),
        "small": (tuple(range(k)), tuple(range(n - k, n))),
        "stream": (stream, stream),
    }


# ----- prefill (initiator) process ------------------------------------------------------------


def prefill_node(conn: Connection, sizes: Sizes, seed: int, log_level: str) -> None:
    _env(log_level)
    from kvpush.services.common.nixl_engine import NixlEngine
    from kvpush.services.common.tp import HeadSlice
    from kvpush.services.prefill_agent.agent import PrefillAgent, PrefillAgentConfig
    from kvpush.services.prefill_agent.plan import plan_writes
    from kvpush.services.prefill_agent.table import Reservation
    from kvpush.services.prefill_agent.writer import CompletionReport
    from kvpush.v1 import kvpush_pb2 as pb

    ids = _id_sets(sizes, seed)
    pool = _create_pool(sizes)
    rng = np.random.default_rng(seed + 1)
    pool.reshape(-1)[:] = np.frombuffer(rng.bytes(pool.nbytes), dtype=np.uint8)
    regions = _regions(pool)
    src_digests = _digests(pool, ids["contiguous"][0])
    copy_dst = _create_pool(sizes)

    bare = NixlEngine(f"bench-prefill-bare-{os.getpid()}")
    bare.register([(pool.ctypes.data, pool.nbytes)])
    engine = NixlEngine(f"bench-prefill-{os.getpid()}")
    engine.register([(r.base_addr, r.num_blocks * r.block_stride) for r in regions.regions])
    cfg = PrefillAgentConfig(engine_id=PREFILL_ENGINE, rank=0, tp_size=1, shape=_shape(sizes))
    agent = PrefillAgent(cfg, engine, regions).start()

    # Timestamps: when a reservation reaches PushWriter.reserve (gRPC reader -> writer inbox) and
    # when the writer thread hands it to its table; what the writer reported per transfer.
    cv = threading.Condition()
    at_writer: dict[str, float] = {}
    at_table: dict[str, float] = {}
    reports: dict[str, dict[str, Any]] = {}
    real_reserve = agent.writer.reserve
    real_on_reservation = agent.writer.table.on_reservation
    real_deliver = agent.writer.deliver

    def reserve(res: Reservation) -> None:
        t = time.monotonic()
        real_reserve(res)
        with cv:
            at_writer[res.transfer_id] = t
            cv.notify_all()

    def on_reservation(res: Reservation, now: float) -> Any:
        at_table[res.transfer_id] = time.monotonic()
        return real_on_reservation(res, now)

    def deliver(report: CompletionReport) -> None:
        c = report.completion
        reports[c.transfer_id] = {
            "write_seconds": c.write_seconds,
            "descriptors": c.descriptors,
            "bytes": c.bytes_written,
            "ok": c.status == pb.TRANSFER_STATUS_OK,
        }
        real_deliver(report)

    agent.writer.reserve = reserve  # type: ignore[method-assign]
    agent.writer.table.on_reservation = on_reservation  # type: ignore[method-assign]
    agent.writer.deliver = deliver

    peer = ""
    remote: Any = None
    remote_base = 0
    whole = HeadSlice(prefill_rank=0, decode_rank=0, src_head=0, dst_head=0, num_heads=HEADS)

    def bare_write(kind: str) -> dict[str, Any]:
        # The body of PushWriter._write for one destination rank: plan, post, poll to DONE.
        t0 = time.perf_counter()
        if kind == "single":
            local_d = np.array([[pool.ctypes.data, pool.nbytes, 0]], dtype=np.uint64)
            remote_d = np.array([[remote_base, pool.nbytes, 0]], dtype=np.uint64)
        else:
            src_ids, dst_ids = ids[kind]
            plan = plan_writes(regions, remote, [src_ids], [dst_ids], whole)
            local_d, remote_d = plan.local, plan.remote
        t1 = time.perf_counter()
        handle, state = bare.post_write(local_d, remote_d, peer)
        t2 = time.perf_counter()
        polls = 0
        while state == "PROC":
            state = bare.check(handle)
            polls += 1
            if state == "PROC":
                time.sleep(50e-6)
        bare.release(handle)
        t3 = time.perf_counter()
        if state != "DONE":
            raise RuntimeError(f"bare WRITE {kind} ended in state {state}")
        return {
            "seconds": t3 - t0,
            "plan_seconds": t1 - t0,
            "post_seconds": t2 - t1,
            "poll_seconds": t3 - t2,
            "polls": polls,
            "descriptors": len(local_d),
            "bytes": int(local_d[:, 1].sum()),
        }

    def memcpy(kind: str, check: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        if kind == "memcpy":
            np.copyto(copy_dst, pool)
        else:
            copy_dst[:, np.asarray(ids["fragmented"][1])] = pool
        seconds = time.perf_counter() - t0
        ok = None
        if check:
            want = copy_dst if kind == "memcpy" else copy_dst[:, np.asarray(ids["fragmented"][1])]
            ok = bool(np.array_equal(want, pool))
            copy_dst.fill(0)
        return {"seconds": seconds, "bytes": pool.nbytes, "verified": ok}

    conn.send({"endpoint": agent.endpoint, "incarnation": agent.identity.incarnation, "digests": src_digests})
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "bare_connect":
                md, remote_base, blocks, block_bytes = args
                peer = bare.add_peer(md)
                remote_arr_layers = [(remote_base + layer * blocks * block_bytes) for layer in range(sizes.layers)]
                from kvpush.services.common.layout import RankRegions, Region

                remote = RankRegions(
                    regions=tuple(Region(a, blocks, block_bytes) for a in remote_arr_layers),
                    block_bytes=block_bytes,
                    num_heads=HEADS,
                )
                conn.send(peer)
            elif cmd == "bare_write":
                conn.send(bare_write(args[0]))
            elif cmd == "memcpy":
                conn.send(memcpy(args[0], args[1]))
            elif cmd == "done":
                # prefill_done, then wait until the writer thread processed it (FIFO inbox).
                tid, name = args
                src = ids[name][0]
                agent.prefill_done(
                    tid, f"req-{tid}", [list(src)], len(src) * TOKENS_PER_BLOCK, decode_engine_id=DECODE_ENGINE
                )
                agent.writer.call(lambda: None).result(30)
                conn.send(None)
            elif cmd == "done_after_reserved":
                # Waits for the reservation to reach the writer, then calls prefill_done.
                tid, name, timeout = args
                src = ids[name][0]
                with cv:
                    seen = cv.wait_for(lambda tid=tid: tid in at_writer, timeout)
                t_done = time.monotonic()
                if seen:
                    agent.prefill_done(
                        tid, f"req-{tid}", [list(src)], len(src) * TOKENS_PER_BLOCK, decode_engine_id=DECODE_ENGINE
                    )
                conn.send((at_writer.get(tid), t_done if seen else None))
            elif cmd == "stamps":
                tids, timeout = args
                with cv:
                    cv.wait_for(lambda tids=tids: all(t in at_writer for t in tids), timeout)
                agent.writer.call(lambda: None).result(30)  # the table saw everything queued before
                conn.send({t: (at_writer.get(t), at_table.get(t)) for t in tids})
            elif cmd == "report":
                conn.send(reports.get(args[0]))
            elif cmd == "stop":
                agent.stop()
                bare.close()
                engine.close()
                conn.send("stopped")
                return
            else:
                conn.send(RuntimeError(f"unknown command {cmd!r}"))
        except Exception as exc:  # report to the driver instead of dying silently
            conn.send(RuntimeError(f"prefill {cmd}: {type(exc).__name__}: {exc}"))


# ----- decode (target) process ----------------------------------------------------------------


def decode_node(conn: Connection, sizes: Sizes, seed: int, log_level: str, rank_poll_us: float) -> None:
    _env(log_level)
    from kvpush.services.common.nixl_engine import NixlEngine
    from kvpush.services.common.transfer_params import DecodeLeg
    from kvpush.services.decode_agent.agent import DecodeAgent, DecodeAgentConfig, Settled
    from kvpush.services.decode_agent.barrier import Released
    from kvpush.services.decode_agent.rank import DecodeRankConfig, create_rank

    ids = _id_sets(sizes, seed)
    pool = _create_pool(sizes)
    regions = _regions(pool)

    # The bare-writer phase uses its own engine on the same memory, progressed like DecodeRank._poll
    # does (get_new_notifs every 100 us) while the phase runs.
    bare = NixlEngine(f"bench-decode-bare-{os.getpid()}")
    bare.register([(pool.ctypes.data, pool.nbytes)])
    bare_active = threading.Event()
    stopping = threading.Event()

    def bare_poll() -> None:
        while not stopping.is_set():
            if not bare_active.wait(0.5):
                continue
            bare.progress()
            time.sleep(100e-6)

    poller = threading.Thread(target=bare_poll, name="bench-bare-poller", daemon=True)
    poller.start()

    cv = threading.Condition()
    released: dict[str, tuple[float, str]] = {}
    settled: set[str] = set()
    expected_at: dict[str, float] = {}
    agent_box: list[DecodeAgent] = []

    def on_release(rel: Released) -> None:
        t = time.monotonic()
        with cv:
            released[rel.transfer_id] = (t, rel.outcome.value)
            cv.notify_all()
        if rel.outcome.value == "ok" and agent_box:
            agent_box[0].finished(rel.transfer_id, rel.epoch)

    def on_settled(s: Settled) -> None:
        with cv:
            settled.add(s.transfer_id)
            cv.notify_all()

    engine = NixlEngine(f"bench-decode-{os.getpid()}")
    cfg = DecodeRankConfig(
        engine_id=DECODE_ENGINE, rank=0, tp_size=1, shape=_shape(sizes), poll_interval_s=rank_poll_us * 1e-6
    )
    rank = create_rank(cfg, engine, regions, on_release=on_release)
    real_expect = rank.table.expect

    def expect(transfer_id: str, *a: Any, **kw: Any) -> Any:
        expected_at[transfer_id] = time.monotonic()
        return real_expect(transfer_id, *a, **kw)

    rank.table.expect = expect  # type: ignore[method-assign]
    agent = DecodeAgent(
        DecodeAgentConfig(engine_id=DECODE_ENGINE, tp_size=1, shape=_shape(sizes)),
        [rank.layout()],
        on_settled=on_settled,
    ).start()
    agent_box.append(agent)

    def reserve(tid: str, leg: dict[str, Any], name: str) -> float:
        dst = ids[name][1]
        t = time.monotonic()
        agent.reserve(
            tid, f"dreq-{tid}", DecodeLeg(**{**leg, "transfer_id": tid}), [list(dst)], len(dst) * TOKENS_PER_BLOCK
        )
        return t

    conn.send({"bare_metadata": bare.metadata(), "base": pool.ctypes.data})
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "bare_poller":
                (bare_active.set if args[0] else bare_active.clear)()
                conn.send(None)
            elif cmd == "zero":
                pool.fill(0)
                conn.send(None)
            elif cmd == "digests":
                conn.send(_digests(pool, ids[args[0]][1]))
            elif cmd == "reserve_wait":
                tid, leg, name, timeout = args
                t0 = reserve(tid, leg, name)
                with cv:
                    cv.wait_for(lambda tid=tid: tid in released, timeout)
                    rel = released.get(tid)
                conn.send((t0, rel[0] if rel else None, rel[1] if rel else "timeout", expected_at.get(tid)))
            elif cmd == "reserve_paced":
                prefix, n, interval_s, leg, name = args
                out: dict[str, float] = {}
                start = time.monotonic() + 0.01
                for i in range(n):
                    delay = start + i * interval_s - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)  # pacing the offered load, not synchronisation
                    tid = f"{prefix}{i}"
                    out[tid] = reserve(tid, leg, name)
                conn.send(out)
            elif cmd == "expect_stamps":
                conn.send({t: expected_at.get(t) for t in args[0]})
            elif cmd == "cancel_all":
                tids, timeout = args
                for t in tids:
                    agent.cancel(t, "benchmark cleanup")
                with cv:
                    cv.wait_for(lambda tids=tids: all(t in settled for t in tids), timeout)
                    conn.send(sum(1 for t in tids if t in settled))
            elif cmd == "stop":
                stopping.set()
                agent.stop()
                rank.stop()
                poller.join(5)
                bare.close()
                engine.close()
                conn.send("stopped")
                return
            else:
                conn.send(RuntimeError(f"unknown command {cmd!r}"))
        except Exception as exc:
            conn.send(RuntimeError(f"decode {cmd}: {type(exc).__name__}: {exc}"))


# ----- driver ---------------------------------------------------------------------------------


def _node(target: Callable[..., None], *args: Any) -> Node:
    """A benchmark process: the errors it reports are raised here; large pools take long to set up."""
    return Node(target, *args, start_timeout_s=120.0, call_timeout_s=60.0, stop_timeout_s=20.0, raise_errors=True)


def _pcts(values_s: Sequence[float]) -> dict[str, float]:
    v = np.asarray(values_s, dtype=np.float64) * 1e3
    if not len(v):
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan"), "mean_ms": float("nan")}
    return {
        "n": len(v),
        "p50_ms": float(np.percentile(v, 50)),
        "p99_ms": float(np.percentile(v, 99)),
        "max_ms": float(v.max()),
        "mean_ms": float(v.mean()),
    }


def _throughput(samples: list[float], nbytes: int, **extra: Any) -> dict[str, Any]:
    med = statistics.median(samples)
    return {
        "median_ms": med * 1e3,
        "min_ms": min(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
        "gbps": nbytes / med / 1e9,
        "samples_ms": [s * 1e3 for s in samples],
        "bytes": nbytes,
        **extra,
    }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        block_bytes = args.block_kib * KIB
        blocks = (args.total_mib * MIB) // (LAYERS * block_bytes)
        small_blocks = max(1, (args.small_kib * KIB) // (LAYERS * block_bytes))
        if block_bytes % HEADS or blocks < max(small_blocks, 2):
            raise SystemExit(
                f"--total-mib {args.total_mib} / --block-kib {args.block_kib} / --small-kib {args.small_kib}: "
                f"need blocks of a multiple of {HEADS} bytes and at least {max(small_blocks, 2)} blocks per layer"
            )
        self.args = args
        self.sizes = Sizes(block_bytes=block_bytes, blocks=blocks, small_blocks=small_blocks)
        self.pre: Node | None = None
        self.dec: Node | None = None
        self._n = 0

    def _tid(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}-{self._n}"

    @property
    def p(self) -> Node:
        assert self.pre is not None
        return self.pre

    @property
    def d(self) -> Node:
        assert self.dec is not None
        return self.dec

    def leg(self) -> dict[str, Any]:
        return {
            "transfer_id": "",
            "epoch": 1,
            "prefill_engine_id": PREFILL_ENGINE,
            "prefill_incarnation": "",
            "prefill_tp_size": 1,
            "prefill_agent_endpoints": [self.p.info["endpoint"]],
            "prefill_rank_incarnations": [self.p.info["incarnation"]],
        }

    def verify(self, name: str) -> bool:
        """Decode blocks of id set ``name`` hold exactly the source blocks they were paired with."""
        src_all = np.frombuffer(self.p.info["digests"], dtype=np.uint64).reshape(LAYERS, self.sizes.blocks)
        got = np.frombuffer(self.d.call("digests", name, timeout=120), dtype=np.uint64).reshape(LAYERS, -1)
        src_ids, _ = _id_sets(self.sizes, self.args.seed)[name]
        return bool(np.array_equal(got, src_all[:, np.asarray(src_ids)]))

    def e2e(self, name: str, reservation_first: bool, timeout: float = 60.0) -> dict[str, Any]:
        """One transfer through DecodeAgent -> PrefillAgent -> DecodeRank; times on one clock."""
        tid = self._tid(f"e2e-{name}")
        if reservation_first:
            self.d.send("reserve_wait", tid, self.leg(), name, timeout)
            self.p.send("done_after_reserved", tid, name, timeout)
            at_writer, t_done = self.p.recv(timeout + 10, "done_after_reserved")
            t_reserve, t_release, outcome, t_expect = self.d.recv(timeout + 10, "reserve_wait")
            start = t_done
        else:
            self.p.call("done", tid, name)
            t_reserve, t_release, outcome, t_expect = self.d.call("reserve_wait", tid, self.leg(), name, timeout)
            at_writer, start = None, t_reserve
        if outcome != "ok" or t_release is None or start is None:
            raise RuntimeError(f"transfer {tid} ({name}) ended {outcome}")
        return {
            "tid": tid,
            "seconds": t_release - start,
            "t_reserve": t_reserve,
            "at_writer": at_writer,
            "t_expect": t_expect,
        }

    # ----- phases -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        a, s = self.args, self.sizes
        self.pre = _node(prefill_node, s, a.seed, a.log_level)
        self.dec = _node(decode_node, s, a.seed, a.log_level, a.rank_poll_us)
        self.p.call("bare_connect", self.d.info["bare_metadata"], self.d.info["base"], s.blocks, s.block_bytes)
        results: dict[str, Any] = {}
        results["throughput"] = self.throughput()
        results["small_e2e"] = self.small_latency()
        results["stream_latency"] = self.stream_latency()
        return results

    def throughput(self) -> dict[str, Any]:
        a, s = self.args, self.sizes
        out: dict[str, Any] = {}
        info: dict[str, dict[str, Any]] = {}
        samples: dict[str, list[float]] = {k: [] for k in (*NIXL_CONFIGS, *MEMCPY_CONFIGS, *E2E_CONFIGS)}

        # Bare writer path: warm-up + verification per configuration, then interleaved repetitions.
        self.d.call("bare_poller", True)
        for cfg in NIXL_CONFIGS:
            self.d.call("zero", timeout=120)
            info[cfg] = self.p.call("bare_write", cfg, timeout=120)
            info[cfg]["verified"] = self.verify("contiguous" if cfg == "single" else cfg)
        for cfg in MEMCPY_CONFIGS:
            info[cfg] = self.p.call("memcpy", cfg, True, timeout=120)
        reps: list[dict[str, dict[str, Any]]] = []
        for _ in range(a.reps):
            rep: dict[str, dict[str, Any]] = {}
            for cfg in NIXL_CONFIGS:
                rep[cfg] = self.p.call("bare_write", cfg, timeout=120)
                samples[cfg].append(rep[cfg]["seconds"])
            for cfg in MEMCPY_CONFIGS:
                samples[cfg].append(self.p.call("memcpy", cfg, False, timeout=120)["seconds"])
            reps.append(rep)
        self.d.call("bare_poller", False)
        for cfg in NIXL_CONFIGS:
            out[cfg] = _throughput(
                samples[cfg],
                info[cfg]["bytes"],
                descriptors=info[cfg]["descriptors"],
                plan_ms=statistics.median(r[cfg]["plan_seconds"] for r in reps) * 1e3,
                post_ms=statistics.median(r[cfg]["post_seconds"] for r in reps) * 1e3,
                poll_ms=statistics.median(r[cfg]["poll_seconds"] for r in reps) * 1e3,
                verified=info[cfg]["verified"],
            )
        for cfg in MEMCPY_CONFIGS:
            out[cfg] = _throughput(samples[cfg], s.total_bytes, descriptors=None, verified=info[cfg]["verified"])

        # The same bytes end to end (prefill done first, then reserve -> release at the decode rank).
        self.e2e("small", reservation_first=False)  # opens the reservations stream
        for cfg in E2E_CONFIGS:
            name = cfg.removeprefix("e2e_")
            self.d.call("zero", timeout=120)
            first = self.e2e(name, reservation_first=False, timeout=120)
            info[cfg] = {"verified": self.verify(name), "report": self.p.call("report", first["tid"])}
        write_s: dict[str, list[float]] = {cfg: [] for cfg in E2E_CONFIGS}
        for _ in range(a.reps):
            for cfg in E2E_CONFIGS:
                r = self.e2e(cfg.removeprefix("e2e_"), reservation_first=False, timeout=120)
                samples[cfg].append(r["seconds"])
                write_s[cfg].append(self.p.call("report", r["tid"])["write_seconds"])
        for cfg in E2E_CONFIGS:
            rep0 = info[cfg]["report"] or {}
            out[cfg] = _throughput(
                samples[cfg],
                s.total_bytes,
                descriptors=rep0.get("descriptors"),
                writer_write_ms=statistics.median(write_s[cfg]) * 1e3,
                verified=info[cfg]["verified"] and bool(rep0.get("ok")),
            )

        # Ratios of medians, plus the median of per-repetition ratios (same repetition, side by side).
        single = samples["single"]

        def ratio(cfg: str, ref: list[float] = single) -> dict[str, float]:
            per_rep = [r / c for r, c in zip(ref, samples[cfg], strict=True)]
            return {
                "of_medians": statistics.median(ref) / statistics.median(samples[cfg]),
                "median_per_rep": statistics.median(per_rep),
            }

        out["ratios_vs_single"] = {cfg: ratio(cfg) for cfg in ("contiguous", "fragmented", "memcpy", "memcpy_shuffled")}
        out["ratios_vs_single"]["e2e_contiguous"] = {
            "of_medians": statistics.median(single) / statistics.median(samples["e2e_contiguous"])
        }
        out["ratios_vs_single"]["e2e_fragmented"] = {
            "of_medians": statistics.median(single) / statistics.median(samples["e2e_fragmented"])
        }
        return out

    def small_latency(self) -> dict[str, Any]:
        a = self.args
        for _ in range(a.warmup):
            self.e2e("small", reservation_first=False)
            self.e2e("small", reservation_first=True)
        self.d.call("zero", timeout=120)
        first = self.e2e("small", reservation_first=False)
        verified = self.verify("small")
        report = self.p.call("report", first["tid"]) or {}
        lat: dict[str, list[float]] = {"prefill_first": [], "reservation_first": []}
        publish: list[float] = []
        to_expect: list[float] = []
        for _ in range(a.small_iters):
            lat["prefill_first"].append(self.e2e("small", reservation_first=False)["seconds"])
            r = self.e2e("small", reservation_first=True)
            lat["reservation_first"].append(r["seconds"])
            publish.append(r["at_writer"] - r["t_reserve"])
            if r["t_expect"] is not None:
                to_expect.append(r["t_expect"] - r["t_reserve"])
        return {
            "bytes": self.sizes.small_bytes,
            "descriptors": report.get("descriptors"),
            "verified": verified and bool(report.get("ok")),
            "prefill_first": {
                "what": "reserve() -> decode rank release (KV already computed)",
                **_pcts(lat["prefill_first"]),
            },
            "reservation_first": {
                "what": "prefill_done() -> decode rank release (reservation already at the writer)",
                **_pcts(lat["reservation_first"]),
            },
            "publish_unloaded": {"what": "reserve() -> PushWriter.reserve, one at a time", **_pcts(publish)},
            "expect_unloaded": {"what": "reserve() -> DecodeRank Expect handled, one at a time", **_pcts(to_expect)},
        }

    def stream_latency(self) -> dict[str, Any]:
        a = self.args
        n, interval = a.stream_n, a.stream_interval_ms / 1e3
        prefix = self._tid("stream") + "-"
        t_reserve = self.d.call("reserve_paced", prefix, n, interval, self.leg(), "stream", timeout=n * interval + 60)
        tids = list(t_reserve)
        stamps = self.p.call("stamps", tids, 60.0, timeout=90)
        expects = self.d.call("expect_stamps", tids)
        missing = [t for t in tids if stamps[t][0] is None]
        to_writer = [stamps[t][0] - t_reserve[t] for t in tids if stamps[t][0] is not None]
        to_table = [stamps[t][1] - t_reserve[t] for t in tids if stamps[t][1] is not None]
        to_expect = [expects[t] - t_reserve[t] for t in tids if expects[t] is not None]
        expect_to_writer = [
            stamps[t][0] - expects[t] for t in tids if expects[t] is not None and stamps[t][0] is not None
        ]
        offered_s = max(t_reserve.values()) - min(t_reserve.values())
        arrived = [stamps[t][0] for t in tids if stamps[t][0] is not None]
        drained_s = (max(arrived) - min(t_reserve.values())) if arrived else float("nan")
        settled = self.d.call("cancel_all", tids, 120.0, timeout=150)
        return {
            "n": n,
            "offered_per_s": (n - 1) / offered_s if offered_s > 0 else float("nan"),
            "achieved_per_s": len(arrived) / drained_s if drained_s > 0 else float("nan"),
            "missing": len(missing),
            "cleanup_settled": settled,
            "reserve_to_writer": {"what": "DecodeAgent.reserve() -> PushWriter.reserve", **_pcts(to_writer)},
            "reserve_to_expect": {
                "what": "reserve() -> DecodeRank Expect handled (decode-local RPC)",
                **_pcts(to_expect),
            },
            "expect_to_writer": {
                "what": "Expect handled -> PushWriter.reserve (stream leg)",
                **_pcts(expect_to_writer),
            },
            "reserve_to_table": {"what": "reserve() -> writer thread's table.on_reservation", **_pcts(to_table)},
        }

    def stop(self) -> None:
        for node in (self.dec, self.pre):
            if node is not None:
                node.stop()


# ----- report ---------------------------------------------------------------------------------


def markdown(res: dict[str, Any]) -> str:
    t, cfg = res["throughput"], res["config"]
    r = t["ratios_vs_single"]
    rows = [
        ("contiguous", "writer path: plan_writes + post_write + poll, contiguous ids"),
        ("fragmented", "writer path, shuffled destination ids"),
        ("single", "one single-descriptor NIXL WRITE"),
        ("memcpy", "in-process np.copyto (reference)"),
        ("memcpy_shuffled", "in-process block scatter dst[:, perm] = src (reference)"),
        ("e2e_contiguous", "end to end: reserve -> decode rank release, contiguous"),
        ("e2e_fragmented", "end to end, shuffled destination ids"),
    ]
    size = f"{cfg['total_bytes'] / MIB:g} MiB in {cfg['block_bytes'] / KIB:g} KiB blocks ({cfg['layers']} layers)"
    out = [
        f"### Throughput: {size}, median of {cfg['reps']}",
        "",
        "| configuration | descriptors | median ms | GB/s | x single-desc (median of per-rep ratios) | verified |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for key, label in rows:
        v = t[key]
        ratio = r.get(key, {})
        rr = ratio.get("median_per_rep", ratio.get("of_medians"))
        rtxt = "1.00" if key == "single" else (f"{rr:.2f}" if rr is not None else "")
        desc = "" if v.get("descriptors") is None else str(v["descriptors"])
        extra = ""
        if "plan_ms" in v:
            extra = f" (plan {v['plan_ms']:.2f} ms, post {v['post_ms']:.1f} ms, poll {v['poll_ms']:.2f} ms)"
        elif "writer_write_ms" in v:
            extra = f" (writer's own WRITE time {v['writer_write_ms']:.1f} ms)"
        out.append(f"| {label}{extra} | {desc} | {v['median_ms']:.1f} | {v['gbps']:.2f} | {rtxt} | {v['verified']} |")
    st, sm = res["stream_latency"], res["small_e2e"]
    out += [
        "",
        "### Latency (ms; both processes on one host, time.monotonic() = CLOCK_MONOTONIC is system-wide)",
        "",
        "| measurement | n | p50 | p99 | max |",
        "|---|---:|---:|---:|---:|",
    ]
    lat_rows = [
        (
            f"stream, offered {st['offered_per_s']:.0f}/s, drained {st['achieved_per_s']:.0f}/s: "
            f"{st['reserve_to_writer']['what']}",
            st["reserve_to_writer"],
        ),
        (f"stream: {st['reserve_to_expect']['what']}", st["reserve_to_expect"]),
        (f"stream: {st['expect_to_writer']['what']}", st["expect_to_writer"]),
        (f"stream: {st['reserve_to_table']['what']}", st["reserve_to_table"]),
        (f"{sm['bytes'] / MIB:g} MiB ({sm['descriptors']} desc): {sm['prefill_first']['what']}", sm["prefill_first"]),
        (f"{sm['bytes'] / MIB:g} MiB: {sm['reservation_first']['what']}", sm["reservation_first"]),
        (f"unloaded: {sm['publish_unloaded']['what']}", sm["publish_unloaded"]),
        (f"unloaded: {sm['expect_unloaded']['what']}", sm["expect_unloaded"]),
    ]
    for label, v in lat_rows:
        out.append(f"| {label} | {v['n']} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} | {v['max_ms']:.3f} |")
    g = res["goals"]
    out += [
        "",
        f"Small transfer verified: {sm['verified']}. Stream reservations missing: {st['missing']}, "
        f"cleaned up (cancel + settle): {st['cleanup_settled']}/{st['n']}.",
        "",
        "Goals (reported, not asserted):",
        f"- fragmented >= {GOAL_FRAGMENTED_VS_SINGLE}x single-descriptor WRITE: "
        f"{g['fragmented_vs_single']:.2f}x -> {'MET' if g['fragmented_met'] else 'NOT MET'}",
        f"- stream publish latency p99 <= {GOAL_STREAM_P99_MS} ms: "
        f"{g['stream_p99_ms']:.3f} ms -> {'MET' if g['stream_met'] else 'NOT MET'}",
    ]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and counts (CI smoke)")
    ap.add_argument("--total-mib", type=int, default=None, help="bytes per throughput transfer (default 256; quick 16)")
    ap.add_argument("--block-kib", type=int, default=16, help="KV block size per layer (default 16)")
    ap.add_argument("--reps", type=int, default=None, help="throughput repetitions (default 5; quick 2)")
    ap.add_argument("--small-kib", type=int, default=1024, help="small end-to-end transfer size (default 1024)")
    ap.add_argument("--small-iters", type=int, default=None, help="small transfers per order (default 200; quick 20)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up small transfers per order (default 10)")
    ap.add_argument("--stream-n", type=int, default=None, help="paced reservations (default 1000; quick 100)")
    ap.add_argument("--stream-interval-ms", type=float, default=1.0, help="reservation pacing (default 1 ms)")
    ap.add_argument(
        "--rank-poll-us", type=float, default=100.0, help="DecodeRank NIXL poll interval (default 100, its default)"
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--log-level", default="WARNING", help="KVPUSH_LOG_LEVEL of the agent processes")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "transfer.json"))
    args = ap.parse_args(argv)
    q = args.quick
    args.total_mib = args.total_mib or (16 if q else 256)
    args.reps = args.reps or (2 if q else 5)
    args.small_iters = args.small_iters or (20 if q else 200)
    args.warmup = args.warmup if args.warmup is not None else (3 if q else 10)
    args.stream_n = args.stream_n or (100 if q else 1000)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in (("UCX_NET_DEVICES", "lo"), ("NIXL_LOG_LEVEL", "WARN")):
        os.environ.setdefault(key, value)
    bench = Bench(args)
    started = time.monotonic()
    try:
        res = bench.run()
    finally:
        bench.stop()
    t, st = res["throughput"], res["stream_latency"]
    frag = t["ratios_vs_single"]["fragmented"]["median_per_rep"]
    res["goals"] = {
        "fragmented_vs_single": frag,
        "fragmented_met": frag >= GOAL_FRAGMENTED_VS_SINGLE,
        "stream_p99_ms": st["reserve_to_writer"]["p99_ms"],
        "stream_met": st["reserve_to_writer"]["p99_ms"] <= GOAL_STREAM_P99_MS,
    }
    res["verified"] = all(t[k]["verified"] for k in (*NIXL_CONFIGS, *MEMCPY_CONFIGS, *E2E_CONFIGS)) and bool(
        res["small_e2e"]["verified"]
    )
    res["config"] = {
        **asdict(bench.sizes),
        "total_bytes": bench.sizes.total_bytes,
        "small_bytes": bench.sizes.small_bytes,
        "heads": HEADS,
        "reps": args.reps,
        "quick": args.quick,
        "small_iters": args.small_iters,
        "stream_n": args.stream_n,
        "stream_interval_ms": args.stream_interval_ms,
        "seed": args.seed,
        "rank_poll_us": args.rank_poll_us,
        "env": {k: os.environ.get(k, "") for k in ("UCX_NET_DEVICES", "UCX_TLS", "NIXL_LOG_LEVEL")},
        "agent_log_level": args.log_level,
        "clock": "time.monotonic() (CLOCK_MONOTONIC, system-wide on Linux) across processes",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "wall_s": time.monotonic() - started,
    }
    cli = list(sys.argv[1:] if argv is None else argv)
    res["command"] = "make bench-transfer" + (f" ARGS='{' '.join(cli)}'" if cli else "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(markdown(res))  # noqa: T201 - the benchmark's report
    print(f"\nJSON: {out}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Separate-process prefill and decode nodes whose KV caches are torch CPU tensors in one of the
layouts of ``tests/layout_cases.py`` (test support).

They run the connector's real worker halves (``PrefillWorker``, ``DecodeWorker``: description
from the tensors, NIXL registration, the compute-fence gate, the agents and gRPC servers) with
vLLM's TP rank lookup replaced by the node's own; the decode node adds the ``DecodeAgent`` that
vLLM's scheduler side would run. Driven over a pipe with ``scripts.cluster.node.Node``.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

from scripts.cluster.node import Node
from tests.transfer_nodes import LEASE_S, WRITE_TIMEOUT_S, _env

TOTAL_HEADS = 4
BLOCKS = 64


def heads_per_rank(case: str, tp: int) -> int:
    return 1 if case == "mla" else TOTAL_HEADS // tp


def _config(engine_id: str, role: str) -> Any:
    from kvpush.connector.config import ConnectorConfig

    return ConnectorConfig(
        engine_id=engine_id, role=role, insecure=True, write_lease_s=LEASE_S, write_timeout_s=WRITE_TIMEOUT_S
    )


def _as_rank(rank: int, tp: int) -> None:
    import kvpush.connector.workers as workers

    workers._tp = lambda: (rank, tp)  # what vLLM's parallel state would answer in this worker


def prefill_layout_node(conn: Connection, case: str, engine_id: str, rank: int, tp: int, decode_engine: str) -> None:
    _env()
    from kvpush.connector.messages import FinishedPrefill, PushMetadata
    from kvpush.connector.workers import PrefillWorker
    from tests.layout_cases import build, fill

    heads = heads_per_rank(case, tp)
    caches = build(case, BLOCKS, heads)
    fill(case, caches, rank, heads)
    _as_rank(rank, tp)
    worker = PrefillWorker(_config(engine_id, "prefill"), "layout-test")
    worker.register_kv_caches(caches)
    hs = worker.handshake()
    assert hs is not None and worker.agent is not None
    conn.send(
        {"endpoint": hs.endpoint, "incarnation": hs.incarnation, "hash": worker.agent.identity.compatibility_hash}
    )
    while True:
        cmd, *args = conn.recv()
        if cmd == "done":
            tid, src_ids, num_tokens = args
            meta = PushMetadata(
                finished_prefills=[FinishedPrefill(tid, f"req-{tid}", (tuple(src_ids),), num_tokens, decode_engine)]
            )
            worker.wait_for_save(meta)
        elif cmd == "stop":
            worker.shutdown()
            conn.send("stopped")
            return


def decode_layout_node(conn: Connection, case: str, engine_id: str, tp: int, device: str = "cpu") -> None:
    _env()
    from kvpush.connector.workers import DecodeWorker
    from kvpush.services.common.transfer_params import DecodeLeg
    from kvpush.services.decode_agent.agent import DecodeAgent, DecodeAgentConfig
    from tests.layout_cases import build, mismatches

    heads = heads_per_rank(case, tp)
    caches, workers = [], []
    for d in range(tp):
        caches.append(build(case, BLOCKS, heads, device))
        _as_rank(d, tp)
        w = DecodeWorker(_config(engine_id, "decode"), "layout-test")
        w.register_kv_caches(caches[-1])
        workers.append(w)
    shape = workers[0].handshake().shape  # type: ignore[union-attr]
    agent = DecodeAgent(
        DecodeAgentConfig(engine_id=engine_id, tp_size=tp, shape=shape, grace_s=0.5),
        [w.rank.layout() for w in workers],  # type: ignore[union-attr]
    ).start()
    layouts = [w.rank.layout().SerializeToString() for w in workers]  # type: ignore[union-attr]
    conn.send({"layouts": layouts, "hash": shape.compatibility_hash(), "incarnation": agent.identity.incarnation})
    epochs: dict[str, int] = {}
    outcomes: dict[str, dict[int, tuple[str, str]]] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "reserve":
            tid, leg, dst_ids, num_tokens = args
            epochs[tid] = agent.reserve(tid, f"dreq-{tid}", DecodeLeg(**leg), [dst_ids], num_tokens, 0)
            conn.send(epochs[tid])
        elif cmd == "wait":
            # Until every rank released every transfer (or the deadline): {tid: {rank: (outcome, reason)}}.
            tids, timeout = args
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(len(outcomes.get(t, {})) < tp for t in tids):
                for d, w in enumerate(workers):
                    for rel in w.rank.take_released(0.05):  # type: ignore[union-attr]
                        outcomes.setdefault(rel.transfer_id, {})[d] = (rel.outcome.value, rel.reason)
                        if len(outcomes[rel.transfer_id]) == tp:
                            agent.finished(rel.transfer_id, rel.epoch)
            conn.send({t: outcomes.get(t, {}) for t in tids})
        elif cmd == "verify":
            dst_ids, src_ids = args
            conn.send([m for d in range(tp) for m in mismatches(case, caches[d], d, heads, dst_ids, src_ids)])
        elif cmd == "clear":
            for rank_caches in caches:
                for t in rank_caches.values():
                    t.zero_()
            conn.send(None)
        elif cmd == "registrations":
            conn.send([len(w.rank.engine._registrations) for w in workers])  # type: ignore[union-attr]
        elif cmd == "stop":
            agent.stop()
            for w in workers:
                w.shutdown()
            conn.send("stopped")
            return


class LayoutCluster:
    def __init__(self, case: str, prefill_tp: int, decode_tp: int) -> None:
        tag = f"{case}-{prefill_tp}{decode_tp}"
        self.prefill_engine, self.decode_engine = f"prefill-{tag}", f"decode-{tag}"
        self.prefill = [
            Node(prefill_layout_node, case, self.prefill_engine, r, prefill_tp, self.decode_engine)
            for r in range(prefill_tp)
        ]
        self.decode = Node(decode_layout_node, case, self.decode_engine, decode_tp)

    def leg(self, tid: str) -> dict[str, Any]:
        return {
            "transfer_id": tid,
            "epoch": 1,
            "prefill_engine_id": self.prefill_engine,
            "prefill_incarnation": "",
            "prefill_tp_size": len(self.prefill),
            "prefill_agent_endpoints": [n.info["endpoint"] for n in self.prefill],
            "prefill_rank_incarnations": [n.info["incarnation"] for n in self.prefill],
        }

    def transfer(self, tid: str, src_ids: list[int], dst_ids: list[int], tokens: int) -> dict[int, tuple[str, str]]:
        self.decode.call("reserve", tid, self.leg(tid), dst_ids, tokens)
        for n in self.prefill:
            n.send("done", tid, src_ids, tokens)
        return self.decode.call("wait", [tid], 30.0, timeout=45)[tid]

    def stop(self) -> None:
        for n in [*self.prefill, self.decode]:
            n.stop()

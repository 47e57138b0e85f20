"""Every KV layout across processes: the connector's worker halves with torch CPU tensors in the
layout (views with the real strides), real gRPC and real NIXL, heterogeneous TP both ways where
the layout allows it, fragmented block ids; decode memory verified block by block and head by
head; an NHD peer of another TP is refused at the handshake."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvpush.connector.kv_layout import describe
from kvpush.services.common.layout import layout_message
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.layout_cases import TOKENS, build
from tests.layout_nodes import LayoutCluster

pytest.importorskip("torch")

# (layout, prefill TP, decode TP)
TOPOLOGIES = [
    ("kv_split_hnd", 2, 1),
    ("blocks_first_hnd", 1, 2),
    ("cross_layer", 2, 1),
    ("kv_split_nhd", 1, 1),
    ("mla", 2, 2),
]


@pytest.fixture(params=TOPOLOGIES, ids=[f"{c}-P{p}D{d}" for c, p, d in TOPOLOGIES])
def cluster(request: pytest.FixtureRequest) -> Iterator[LayoutCluster]:
    c = LayoutCluster(*request.param)
    yield c
    c.stop()


def test_layout_transfers_are_byte_exact(cluster: LayoutCluster) -> None:
    cases = {
        "contiguous": (list(range(8, 14)), list(range(40, 46))),
        "fragmented": ([3, 4, 60, 17, 18, 1], [50, 2, 3, 33, 61, 7]),
    }
    for tid, (src, dst) in cases.items():
        ranks = cluster.transfer(tid, src, dst, len(src) * TOKENS)
        assert ranks == {d: ("ok", "") for d in range(len(ranks))} and ranks
        assert cluster.decode.call("verify", dst, src) == []
    # The decode worker registered its KV memory with NIXL once (not again in create_rank).
    assert set(cluster.decode.call("registrations")) == {1}
    if cluster.prefill_engine.startswith("prefill-kv_split_nhd"):
        _refuses_a_decode_of_another_tp(cluster)


def _refuses_a_decode_of_another_tp(c: LayoutCluster) -> None:
    """A TP2 decode offered to this TP1 NHD prefill rank: an NHD head slice is not one range per
    block, so the layouts cannot be written into each other; the Hello is refused."""
    caches = build("kv_split_nhd", 64, 2)
    desc = describe(caches, 2, "layout-test")
    hello = pb.Hello(
        decode=pb.EngineIdentity(
            engine_id=c.decode_engine,
            incarnation="other-decode",
            compatibility_hash=desc.shape.compatibility_hash(),
            role=pb.ROLE_DECODE,
            tp_size=2,
        ),
        decode_ranks=[layout_message(desc.regions, desc.shape, r, f"d{r}", b"md", "127.0.0.1:1") for r in range(2)],
    )
    assert desc.shape.compatibility_hash() != c.prefill[0].info["hash"]
    with grpc.insecure_channel(c.prefill[0].info["endpoint"]) as ch:
        stream = pb_grpc.PrefillAgentStub(ch).Reservations(iter([pb.DecodeMessage(hello=hello)]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stream))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible KV layout" in (err.value.details() or "")

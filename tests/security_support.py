"""Helpers for the bounds and fuzz tests: the real PrefillAgent and DecodeRank servers in this
process, with a NIXL stand-in (no memory is ever written: these tests stop at the gRPC edges),
and a raw client of the reservations stream. (Collected by pytest, holds no tests.)"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpush.services.common.layout import RankRegions, Region, layout_message
from kvpush.services.common.nixl_engine import NixlError
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.transfer_nodes import HEAD_BYTES, NUM_LAYERS, TOTAL_HEADS, shape

NUM_BLOCKS = 64


class FakeEngine:
    """Stands in for NixlEngine at the control plane: peers load, nothing is written."""

    def __init__(self, name: str = "fake-nixl") -> None:
        self.name = name
        self.peers: set[str] = set()
        self._n = 0

    def register(self, ranges: list[tuple[int, int]]) -> None:
        pass

    def metadata(self) -> bytes:
        return b"fake-nixl-metadata"

    def add_peer(self, metadata: bytes) -> str:
        self._n += 1
        name = f"peer-{self._n}"
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def post_write(self, local: Any, remote: Any, peer: str) -> tuple[Any, str]:
        raise NixlError("the fake engine writes nothing")

    def check(self, handle: Any) -> str:
        return "ERR"

    def release(self, handle: Any) -> None:
        pass

    def progress(self) -> dict[str, list[bytes]]:
        return {}


def regions(num_blocks: int = NUM_BLOCKS, heads: int = TOTAL_HEADS) -> RankRegions:
    stride = heads * HEAD_BYTES
    return RankRegions(
        tuple(Region(0x1000_0000 * (layer + 1), num_blocks, stride) for layer in range(NUM_LAYERS)), stride, heads
    )


def decode_layout(rank: int = 0, endpoint: str = "127.0.0.1:1", num_blocks: int = NUM_BLOCKS) -> pb.RankLayout:
    return layout_message(regions(num_blocks), shape(), rank, f"fake-decode-{rank}", b"fake-metadata", endpoint)


def hello(engine_id: str = "decode-x", incarnation: str = "inc-1") -> pb.Hello:
    return pb.Hello(
        decode=pb.EngineIdentity(
            engine_id=engine_id,
            incarnation=incarnation,
            compatibility_hash=shape().compatibility_hash(),
            role=pb.ROLE_DECODE,
            tp_size=1,
        ),
        decode_ranks=[decode_layout()],
    )


def reservation(tid: str, epoch: int = 1, ids: list[int] | None = None, **kw: Any) -> pb.Reservation:
    return pb.Reservation(
        transfer_id=tid,
        epoch=epoch,
        block_ids=[pb.BlockIds(ids=ids if ids is not None else [1, 2])],
        num_tokens=32,
        **kw,
    )


def serving(endpoint: str, timeout: float = 5.0) -> bool:
    """The server answers its health check (SERVING)."""
    with grpc.insecure_channel(endpoint) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


class RawStream:
    """A reservations stream driven message by message; ``read=False`` leaves responses unread
    (a peer that stops reading)."""

    def __init__(
        self,
        endpoint: str,
        first: pb.DecodeMessage,
        *,
        read: bool = True,
        options: list[tuple[str, Any]] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self._out: queue.Queue[pb.DecodeMessage | None] = queue.Queue()
        self.inbox: queue.Queue[Any] = queue.Queue()
        self._channel = grpc.insecure_channel(endpoint, options=options or [])
        self._call = pb_grpc.PrefillAgentStub(self._channel).Reservations(iter(self._out.get, None), timeout=timeout)
        self._out.put(first)
        self._done = threading.Event()
        self._reader: threading.Thread | None = None
        if read:
            self.start_reading()

    def start_reading(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self.inbox.put(msg)
            self.inbox.put(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            self.inbox.put(exc.code())
        finally:
            self._done.set()

    def send(self, **body: Any) -> None:
        self._out.put(pb.DecodeMessage(**body))

    def recv(self, timeout: float = 10.0) -> Any:
        """The next message, or the final status code once the stream ended."""
        return self.inbox.get(timeout=timeout)

    def recv_kind(self, kind: str, timeout: float = 10.0) -> Any:
        while True:
            msg = self.recv(timeout)
            if isinstance(msg, grpc.StatusCode):
                raise AssertionError(f"stream ended with {msg.name} before a {kind}")
            if msg.WhichOneof("body") == kind:
                return getattr(msg, kind)

    def status(self, timeout: float = 10.0) -> grpc.StatusCode:
        """Half-closes the stream, reads what is left and returns its final status."""
        self._out.put(None)
        self.start_reading()
        while True:
            msg = self.recv(timeout)
            if isinstance(msg, grpc.StatusCode):
                return msg

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._channel.close()
        if self._reader is not None:
            self._reader.join(5)

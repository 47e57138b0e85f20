"""The fault tests' TCP relay: relays, partitions, resets."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from tests.tcp_relay import TcpRelay


@pytest.fixture
def echo_server() -> tuple[str, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(4096), b"")], daemon=True
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()
    srv.close()


def test_relay_forwards_then_cut_swallows_then_reset_closes(echo_server: tuple[str, int]) -> None:
    relay = TcpRelay(*echo_server).start()
    try:
        c = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        c.sendall(b"ping")
        assert c.recv(16) == b"ping"
        relay.cut()
        c.sendall(b"lost")
        c.settimeout(0.3)
        with pytest.raises(TimeoutError):
            c.recv(16)  # nothing comes back, and the socket stays open
        relay.reset()
        c.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert c.recv(16) == b""  # closed by the relay
    finally:
        relay.stop()

"""A TCP relay a fault test can sever: put it in front of a gRPC port, then cut the path.

``cut()`` models a partition: connections stay open on both sides but no byte crosses any more
(nothing is closed, so neither side learns of it from the socket; only keepalives and leases can).
``reset()`` closes every relayed connection at once (a crashed middlebox). ``heal()`` lets new
connections through again. Runs on its own daemon thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class TcpRelay:
    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-relay", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = True
        self.connections = 0

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def start(self) -> TcpRelay:
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def _call(self, coro: object, timeout: float = 10.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._flowing:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                with contextlib.suppress(Exception):
                    writer.write_eof()
                return
            if not self._flowing:
                # Partitioned: swallow everything, keep the sockets open, until reset.
                continue
            writer.write(data)
            await writer.drain()

    def cut(self) -> None:
        """No byte crosses from now on; connections stay open; new ones are refused."""
        self._loop.call_soon_threadsafe(setattr, self, "_flowing", False)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_flowing", True)

    def reset(self) -> None:
        """Closes every relayed connection now."""

        async def close_all() -> None:
            for w in list(self._writers):
                with contextlib.suppress(Exception):
                    w.transport.abort()

        self._call(close_all())

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                with contextlib.suppress(Exception):
                    w.transport.abort()

        with contextlib.suppress(Exception):
            self._call(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

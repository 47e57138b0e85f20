"""``Node``: a spawned process driven over a pipe.

The child runs ``target(conn, *args)``: it first sends one message, its ``info`` (endpoints,
incarnations, layouts...), then answers the command tuples it receives; ``("stop",)`` ends it.
Used by the transfer-core tests (``tests/transfer_nodes.py``, ``tests/layout_nodes.py``), the GPU
check and the transfer benchmark. Imports only the standard library: the spawned children import
this module again.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any


class Node:
    """``start_timeout_s``: how long the child may take to send its ``info``; ``call_timeout_s``:
    the default wait for an answer; ``stop_timeout_s``: for the answer to ``stop`` before the
    process is killed (a child that has already returned is only reaped). ``raise_errors``: an ``Exception`` the child sends (instead of an answer)
    is raised here; otherwise it is returned like any answer."""

    def __init__(
        self,
        target: Callable[..., None],
        *args: Any,
        start_timeout_s: float = 180.0,
        call_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        raise_errors: bool = False,
    ) -> None:
        self.name = getattr(target, "__name__", "node")
        self.call_timeout_s = call_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.raise_errors = raise_errors
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        # Generous, because a loaded 2-core machine takes tens of seconds to import torch and NIXL
        # in a fresh interpreter; a child that dies on the way is reported at once instead.
        deadline = time.monotonic() + start_timeout_s
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name} exited with code {self.proc.exitcode} before it started")
            if time.monotonic() >= deadline:
                self.kill()  # not left running behind the error
                raise TimeoutError(f"{self.name} did not start within {start_timeout_s:g} s")
        self.info: dict[str, Any] = self._take()

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float | None = None, what: str = "") -> Any:
        """The next answer, within ``timeout`` (default ``call_timeout_s``)."""
        timeout = self.call_timeout_s if timeout is None else timeout
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name} did not answer {what!r} within {timeout:g} s")
        return self._take()

    def call(self, *msg: Any, timeout: float | None = None) -> Any:
        self.send(*msg)
        return self.recv(timeout, str(msg[0]))

    def stop(self) -> None:
        """Asks the child to stop; kills it if it does not end in time."""
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, OSError, EOFError, RuntimeError):
                self.call("stop", timeout=self.stop_timeout_s)
        self.proc.join(5)
        if self.proc.is_alive():
            self.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)

    def _take(self) -> Any:
        got = self.conn.recv()
        if self.raise_errors and isinstance(got, Exception):
            raise got
        return got

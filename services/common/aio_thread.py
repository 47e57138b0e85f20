"""An asyncio event loop on its own daemon thread, for gRPC aio servers and clients that live
inside a host process (vLLM's EngineCore or worker) whose own threads must never block on them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from kvpush.services.common.thread_names import name_native_thread

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str, native_name: str | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._native_name = native_name or name
        self._started = threading.Event()

    def _run(self) -> None:
        name_native_thread(self._native_name)
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(10)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        """Runs ``coro`` on the loop and waits for it (never call from the loop thread)."""
        return self.submit(coro).result(timeout)

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

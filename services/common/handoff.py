"""A thread-safe hand-off of results from an agent's threads to its host's thread."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    def __init__(self) -> None:
        self._items: list[T] = []
        self._cv = threading.Condition()

    def put(self, item: T) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def take(self, timeout_s: float = 0.0) -> list[T]:
        """Everything handed over so far, waiting up to ``timeout_s`` for at least one item."""
        if not self._items and timeout_s <= 0:
            # Nothing handed over: no lock (the decode engine asks at every step). An item put
            # while this returns is taken by the next call; ``put`` is what wakes the taker.
            return []
        with self._cv:
            if not self._items and timeout_s > 0:
                self._cv.wait(timeout_s)
            out, self._items = self._items, []
        return out

"""Orders a prefill rank's WRITEs after the compute that fills their blocks.

``wait_for_save`` runs on the engine thread once the step's forward has been *launched*. On CUDA
the KV kernels may still be running: a :class:`CudaEventFence` recorded there on the current
stream completes when every kernel queued before it is done. The rank's :class:`FenceGate` thread
waits on each step's fence, in order, and only then hands the step's transfers to the writer, so
no WRITE is posted before its blocks are written and the engine thread never blocks. On CPU the
forward is synchronous and the fence is :class:`NoFence`: the gate runs the hand-off on the
engine thread (it only queues the transfer for the writer), and CPU tests run the gate's threaded
path GPUs take through a fence of their own (tests/test_layout_ranges.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from kvpush.services.common.logs import get_logger
from kvpush.services.common.thread_names import name_native_thread

log = get_logger("kvpush.connector.fence")


class Fence(Protocol):
    def wait(self) -> None:
        """Returns once the compute recorded before the fence is complete; raises if it failed."""


class NoFence:
    """CPU: the forward has finished when ``wait_for_save`` runs."""

    def wait(self) -> None:
        return None


class CudaEventFence:
    """A CUDA event recorded on the current stream of ``device`` when created."""

    def __init__(self, device: int) -> None:
        import torch

        self.event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        self.event.synchronize()  # releases the GIL while it waits


FenceFactory = Callable[[], Fence]


def fence_factory(mem_type: str, device_id: int) -> FenceFactory:
    """How a rank whose KV lives in ``mem_type`` fences its steps."""
    if mem_type == "VRAM":
        return lambda: CudaEventFence(device_id)
    return NoFence


_STOP = object()


class FenceGate:
    """One thread per rank: runs each submitted callback once its fence completed, in submission
    order (a step's fence covers every earlier step on the same stream). A fence that raises runs
    the callback's ``on_fail`` instead: the KV cannot be trusted."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fence: Fence, then: Callable[[], None], on_fail: Callable[[], None] | None = None) -> None:
        """Runs ``then`` once ``fence`` completed. A ``NoFence`` (CPU: the compute is done) on a gate
        that never had to wait runs it here, on the caller's thread: one thread hand-off less right
        after the forward, when the engine's own threads need the core. Once the gate has a thread,
        everything goes through it, in order."""
        with self._lock:
            if not self._started:
                if isinstance(fence, NoFence):
                    self._call(then)
                    return
                self._thread.start()
                self._started = True
        self._queue.put((fence, then, on_fail))

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            if not self._started:
                return
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        name_native_thread("kv-fence-gate")
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fence, then, on_fail = item
            try:
                fence.wait()
            except Exception:
                log.exception("compute_fence_failed")
                if on_fail is not None:
                    self._call(on_fail)
                continue
            self._call(then)

    @staticmethod
    def _call(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # the gate must outlive any one callback
            log.exception("fence_callback_failed")

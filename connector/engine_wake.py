"""``EngineWake``: ends vLLM's idle wait as soon as a pushed transfer's state moves on.

vLLM's engine loop sleeps 1 ms after every step that ran no model while requests remain
(``EngineCoreProc._process_engine_step``, to let transfer threads run). A decode engine whose
only requests wait for their pushed KV therefore looks for releases once a millisecond, and the
step that reports a release (it runs no model) sleeps again before the next step schedules the
request: about 1.5 ms of the path from "KV landed" to decode's next token is spent asleep
(docs/bench_phases.md, "The engine's idle wait"). vLLM plans to wake its loop on connector events
(its RFC "Non-blocking core model loop"); until then this module replaces that one sleep with a
wait on an event that the connector sets when:

- a decode rank releases a transfer (its completion landed, or it was settled);
- a relayed first token arrives for the scheduler half to append;
- a step reported released transfers (``update_connector_output``): the next step can schedule
  them at once.

The wait is never longer than vLLM's (1 ms), so a missed or spurious wake costs at most what vLLM
costs today, and a wake only lets the loop run one more cheap idle step. The replacement is
installed only over the exact vLLM method it was written against (checked by a hash of its
source); any other vLLM keeps its own loop and logs ``engine_wake_off``. The event is per process:
with vLLM's ``mp`` executor a rank's releases happen in the worker process, so only the scheduler
half's wakes reach the engine loop.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from typing import Any

from kvpush.services.common.logs import get_logger

log = get_logger("kvpush.connector.engine_wake")

# sha256 of ``inspect.getsource(EngineCoreProc._process_engine_step)`` in vLLM 0.32.0: the body
# below mirrors it line for line except for the idle wait.
_KNOWN_SOURCE_SHA256 = "b894c3b32cc020f7c81bf70b7cafecb3d04708e9d8975276170a2da70de2bcb7"
_IDLE_WAIT_S = 0.001  # vLLM's


class EngineWake:
    """A process-wide wake-up for the engine loop's idle wait (thread-safe)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.installed = False

    def notify(self) -> None:
        self._event.set()

    def idle_wait(self, timeout_s: float = _IDLE_WAIT_S) -> bool:
        """Waits up to ``timeout_s`` for a notification; True when one came. Clearing after the
        wait cannot lose one: a notifier changes the state it signals before it sets the event,
        and the step that follows reads that state."""
        woke = self._event.wait(timeout_s)
        self._event.clear()
        return woke


ENGINE_WAKE = EngineWake()


def _process_engine_step(self: Any) -> bool:
    """vLLM 0.32.0's ``EngineCoreProc._process_engine_step`` with the idle sleep made wakeable."""
    outputs, model_executed = self.step_fn()
    for output in outputs.items() if outputs else ():
        self.output_queue.put_nowait(output)
    self.post_step(model_executed)
    if not model_executed and self.scheduler.has_requests():
        ENGINE_WAKE.idle_wait()
    return bool(model_executed)


def install() -> bool:
    """Installs the wakeable idle wait in this process's vLLM engine loop (idempotent). Returns
    whether it is installed; when vLLM's method is not the one it mirrors, it is left alone."""
    if ENGINE_WAKE.installed:
        return True
    try:
        from vllm.v1.engine.core import EngineCoreProc

        source = inspect.getsource(EngineCoreProc._process_engine_step)
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        log.info("engine_wake_off", reason=f"vLLM's engine loop not found: {exc}")
        return False
    if hashlib.sha256(source.encode()).hexdigest() != _KNOWN_SOURCE_SHA256:
        log.info("engine_wake_off", reason="vLLM's engine step is not the one this wake was written for")
        return False
    EngineCoreProc._process_engine_step = _process_engine_step
    ENGINE_WAKE.installed = True
    log.info("engine_wake_on")
    return True

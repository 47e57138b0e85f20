"""Hand-off pushes held until their first token is sampled or has left the prefill engine's process.

With ``push_at_sampling`` (the default, with prefill's ``KvPushWorker``) a first-token hand-off's
push is held from the forward's end until the worker has sampled its token
(``connector/vllm_worker.py``), then released there, so its completions carry the token; the next
step's start releases it at the latest.

With ``push_after_output`` (off by default since docs/bench_phases.md runs 73-80: the push at the
forward's end shortens the gap before the second token by more than the TTFT it costs), a
first-token hand-off transfer's push does not compete with the token for the prefill core: the
client's first token is the token prefill sampled. The worker then holds the push after the
forward. It is released by whichever comes first:

- the engine's next step starts (``release``, called by the worker): vLLM schedules it after it
  processed the step's output;
- with ``push_on_token_sent`` (off by default), the token left this process (``token_sent``): its
  ``ReportFirstTokens`` call started on the engine thread, or a load report carrying it was sent.
  Only where the registration (vLLM's scheduler process) and the worker share a process: vLLM's
  ``uni`` executor.

Measured on the 2-core VM: the next step started 2.35 ms after the request finished, the token's
call 0.4-1.9 ms after it; releasing on the token started the WRITE 0.6-1 ms sooner but cost the
hand-off paths' TTFT up to 2.8 ms side by side without a consistent gain on the gap before the
second token (docs/bench_phases.md "The first token's own call", docs/bench_serving.md runs X-Z).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvpush.services.common.logs import get_logger

log = get_logger("kvpush.connector.handoff")


class HandoffHolds:
    """Held pushes by transfer id; each runs exactly once, on the thread that releases it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, Callable[[], None]] = {}

    def hold(self, transfer_id: str, push: Callable[[], None]) -> None:
        with self._lock:
            self._held[transfer_id] = push

    def token_sent(self, transfer_ids: Iterable[str]) -> None:
        """The first tokens of ``transfer_ids`` are on the wire: their pushes start now. Ids this
        process holds nothing for (another process's worker, or already released) are ignored."""
        self._run(transfer_ids)

    def release(self, transfer_ids: Iterable[str]) -> None:
        """The fallback (the next engine step): starts the pushes still held, in the given order."""
        self._run(transfer_ids)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _run(self, transfer_ids: Iterable[str]) -> None:
        with self._lock:
            pushes = [p for p in (self._held.pop(t, None) for t in transfer_ids) if p is not None]
        for push in pushes:
            try:
                push()
            except Exception:  # a caller's thread (the registration's) must outlive any one push
                log.exception("held_push_failed")


# One per process: the worker holds, the registration thread of the same process releases.
HANDOFF_HOLDS = HandoffHolds()

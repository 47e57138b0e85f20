"""``KvPushWorker``: vLLM's worker for this platform, with two taps for the first-token hand-off.

kvpush engines run with ``--worker-cls kvpush.connector.vllm_worker.KvPushWorker``:

- decode: the connector advances a seeded request's sampler past the token prefill sampled
  (``kvpush.connector.sampler_state``); a decode engine without it offers no hand-off;
- prefill: a hand-off request's first token is posted for the push's completions the moment it
  is sampled (``AWAITED_FIRST_TOKENS``), not when the engine has processed the step's output; a
  prefill engine without it posts the token when the request ends, as before.

Nothing else changes.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.platforms import current_platform

from kvpush.connector import sampler_state
from kvpush.connector.completion_tokens import AWAITED_FIRST_TOKENS
from kvpush.connector.handoff_holds import HANDOFF_HOLDS

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker  # type: ignore[assignment]


class KvPushWorker(_PlatformWorker):
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        sampler_state.bind(self.model_runner)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        after_sampling(output)
        return output


def after_sampling(output: Any) -> None:
    """Prefill: posts the hand-off tokens this step sampled, starts the pushes held for them
    (``push_at_sampling``) and gives their WRITEs the core first, up to ``push_first_wait_ms``:
    the engine thread waits for the writer to have posted them before it processes the step's
    output (on one core the two would otherwise interleave and both finish late)."""
    awaited = AWAITED_FIRST_TOKENS.sampled(output)
    if not awaited:
        return
    HANDOFF_HOLDS.release([a.transfer_id for a in awaited if a.holds_push])
    waits = [(a.handled, a.wait_s) for a in awaited if a.handled is not None]
    if waits:
        deadline = time.monotonic() + max(wait_s for _, wait_s in waits)
        for handled, _ in waits:
            handled.wait(max(0.0, deadline - time.monotonic()))

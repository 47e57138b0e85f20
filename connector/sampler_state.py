"""The worker's sampler, as far as the first-token hand-off needs it (decode workers only).

A request that continues from its prefill's first token must sample its second token with the
random state a single instance would have there: a seeded request's generator has made one draw
(for the first token) on that instance, and none on this decode engine. ``advance_one_step`` makes
that draw, by running this engine's own sampler once on a dummy row with the request's generator,
so it consumes exactly what one real sampling step consumes, whichever sampler the platform uses.

vLLM hands connectors no model runner; ``KvPushWorker`` (``kvpush.connector.vllm_worker``) binds
it here once the model is loaded.
"""

from __future__ import annotations

from typing import Any

from kvpush.services.common.logs import get_logger

log = get_logger("kvpush.connector.sampler")

WORKER_QUALNAME = "kvpush.connector.vllm_worker.KvPushWorker"

_runner: Any = None


def bind(runner: Any) -> None:
    global _runner
    _runner = runner
    log.info("sampler_bound", runner=type(runner).__name__)


def bound() -> bool:
    return _runner is not None


def advance_one_step(request_id: str) -> bool:
    """Advances the request's generator by one sampling step; False when it has none (unseeded or
    greedy requests: nothing to advance) or no runner is bound."""
    runner = _runner
    if runner is None:
        return False
    state = getattr(runner, "requests", {}).get(request_id)
    gen = getattr(state, "generator", None)
    if gen is None:
        return False
    import torch

    vocab = int(runner.input_batch.vocab_size)
    logits = torch.zeros((1, vocab), dtype=torch.float32, device=gen.device)
    runner.sampler.topk_topp_sampler(logits, {0: gen}, None, None)
    return True

"""``KvPushWorker``: vLLM's worker for this platform, binding its model runner for the connector.

Decode engines that offer the first-token hand-off run with
``--worker-cls kvpush.connector.vllm_worker.KvPushWorker``: the connector then advances a seeded
request's sampler past the token prefill sampled (``kvpush.connector.sampler_state``). Nothing
else changes.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms import current_platform

from kvpush.connector import sampler_state

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker  # type: ignore[assignment]


class KvPushWorker(_PlatformWorker):
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        sampler_state.bind(self.model_runner)

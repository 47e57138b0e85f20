"""``KvPushConnector``: vLLM KV connector for push-mode P/D disaggregation over kvpush.

Load it with ``--kv-transfer-config '{"kv_connector": "KvPushConnector",
"kv_connector_module_path": "kvpush.connector.push_connector", "kv_role": "kv_producer" | "kv_consumer",
"engine_id": "...", "kv_connector_extra_config": {...}}'`` (see ``kvpush.connector.config``).

This module is imported in vLLM's API-server process at config time, so it imports nothing heavy:
the agents (gRPC, NIXL) load when an engine process builds the connector.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpush.connector.roles import SchedulerHalf, WorkerHalf


# Not ``SupportsHMA``: kvpush pushes one KV-cache group (connector/kv_groups.py), so vLLM turns the
# hybrid KV-cache manager off, and an engine left with several groups is refused here.
class KvPushConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        from kvpush.connector.kv_groups import require_single_group

        require_single_group(kv_cache_config)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from kvpush.connector.config import ConnectorConfig
        from kvpush.connector.kv_layout import default_model_id
        from kvpush.services.common.logs import configure, get_logger

        configure()
        assert vllm_config.kv_transfer_config is not None
        self.cfg = ConnectorConfig.from_vllm(vllm_config.kv_transfer_config)
        switch_us = self.cfg.switch_interval_us()
        if switch_us:
            sys.setswitchinterval(switch_us / 1e6)
            get_logger("kvpush.connector").info("gil_switch_interval_set", us=switch_us)
        model_id = self.cfg.model_id or default_model_id(vllm_config.model_config.model)
        self._trace = get_logger("kvpush.connector.trace") if self.cfg.trace_steps else None
        self._num_groups = max(1, len(kv_cache_config.kv_cache_groups)) if kv_cache_config else 1
        # One half per process, of this engine's role (connector/roles.py).
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        self._load_errors: set[int] = set()
        self._decode = self.cfg.role == "decode"
        from kvpush.connector.messages import PushMetadata

        self._push_metadata_type = PushMetadata  # imported here: this module loads in the API server too
        if role == KVConnectorRole.SCHEDULER:
            if self.cfg.role == "decode":
                from kvpush.connector.decode_scheduler import DecodeScheduler

                self.scheduler = DecodeScheduler(self.cfg, vllm_config)
                if self.cfg.engine_wake:
                    from kvpush.connector.engine_wake import install

                    install()
            else:
                from kvpush.connector.prefill_scheduler import PrefillScheduler

                self.scheduler = PrefillScheduler(self.cfg, vllm_config)
        else:
            from kvpush.connector.workers import DecodeWorker, PrefillWorker

            self.worker = (DecodeWorker if self.cfg.role == "decode" else PrefillWorker)(self.cfg, model_id)

    @property
    def _sched(self) -> SchedulerHalf:
        assert self.scheduler is not None, "a scheduler-side hook called in a worker process"
        return self.scheduler

    @property
    def _worker(self) -> WorkerHalf:
        assert self.worker is not None, "a worker-side hook called in the scheduler process"
        return self.worker

    # ----- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # Every group is written remotely: never let allocation zero a block a WRITE may fill.
        return tuple(range(self._num_groups))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        trace = self._trace if scheduler_output.scheduled_new_reqs else None
        if trace is not None:
            for new in scheduler_output.scheduled_new_reqs:
                trace.info("request_scheduled", request_id=new.req_id)
        meta = self._sched.build_connector_meta(scheduler_output)
        if trace is not None and isinstance(meta, self._push_metadata_type):
            meta.trace_forward = True  # its forward's end is logged too (wait_for_save)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._decode:
            if not connector_output.finished_recving and not connector_output.failed_recving:
                return  # most steps (this runs in every step of the engine loop)
            finished = set(connector_output.finished_recving or ())
            self._sched.update_connector_output(finished, set(connector_output.failed_recving or ()))
            if finished:
                from kvpush.connector.engine_wake import ENGINE_WAKE

                ENGINE_WAKE.notify()  # vLLM schedules them in the next step: no idle wait before it
        else:
            self._sched.update_connector_output(set(connector_output.finished_sending or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._trace is not None:
            self._trace.info("request_finished", request_id=request.request_id)
        return self._sched.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def has_pending_push_work(self) -> bool:
        return self._sched.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        from kvpush.connector.messages import RankHandshake

        handshakes = {rank: m for rank, m in metadata.items() if isinstance(m, RankHandshake)}
        self._sched.set_handshakes(handshakes, getattr(self, "_kv_cache_manager", None))

    # ----- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake()

    # The worker-side hooks below run in every step of the engine loop: each keeps its path short
    # when the step moves no transfer (docs/bench_phases.md, "The connector's cost per step").

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.step_started(
            connector_metadata if isinstance(connector_metadata, self._push_metadata_type) else None
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # decode never loads: prefill pushes

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._connector_metadata  # this step's, bound by bind_connector_metadata (or None)
        push_meta = meta if isinstance(meta, self._push_metadata_type) else None
        if self._trace is not None and push_meta is not None and push_meta.trace_forward:
            # Only the forward of a step that scheduled a new request: a line in every decode step
            # slowed the decode engine it traced by 7-11 % (docs/bench_phases.md, "The step trace's own cost").
            self._trace.info("forward_done")
        self._worker.wait_for_save(push_meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = self.worker.transfer_results(finished_req_ids) if self.worker is not None else None
        if res is None:
            return KVConnectorTransferResults()
        self._load_errors = res.invalid_block_ids
        return KVConnectorTransferResults(
            finished_sending=res.finished_sending,
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of vetoed hand-off requests (``PushMetadata.veto_blocks``), from this step's
        ``get_transfer_results``: vLLM fails the requests that hold them (load failure policy
        ``fail``, which the hand-off requires) and drops this step's output for them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def shutdown(self) -> None:
        for part in (self.scheduler, self.worker):
            if part is not None:
                part.shutdown()

"""Scheduler-side halves of the connector (in vLLM's EngineCore, called from the engine loop).

Nothing here blocks: the decode agent publishes from its own loop thread, and the prefill side
only flags, per step, which transfers' KV the step completes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from connector.config import ConnectorConfig
from connector.messages import FinishedPrefill, PushMetadata, RankHandshake
from connector.registration import Registration
from kvpush.v1 import kvpush_pb2 as pb
from services.common.logs import get_logger
from services.common.transfer_params import DecodeLeg, PrefillLeg, parse
from services.decode_agent.agent import DecodeAgent, DecodeAgentConfig

log = get_logger("connector.scheduler")


def leg_of(request: Any) -> PrefillLeg | DecodeLeg | None:
    try:
        return parse(request.kv_transfer_params)
    except ValueError as exc:
        log.warning("bad_kv_transfer_params", request_id=request.request_id, error=str(exc))
        return None


def _engine_incarnation(handshakes: list[RankHandshake]) -> str:
    return ",".join(h.incarnation for h in handshakes)


def register(
    cfg: ConnectorConfig,
    role: pb.Role.ValueType,
    tp_size: int,
    ranks: list[RankHandshake],
    load: Callable[[], pb.LoadReport],
) -> Registration | None:
    """Registers the engine with the kvpush scheduler and keeps its load stream, when configured."""
    if not cfg.scheduler_address:
        return None
    shape = ranks[0].shape
    assert shape is not None
    info = pb.InstanceInfo(
        engine_id=cfg.engine_id,
        role=role,
        incarnation=_engine_incarnation(ranks),
        tp_size=tp_size,
        agent_endpoints=[h.endpoint for h in ranks],
        agent_incarnations=[h.incarnation for h in ranks],
        total_kv_blocks=ranks[0].num_blocks,
        tokens_per_block=shape.tokens_per_block,
        http_endpoint=cfg.http_endpoint,
    )
    return Registration(cfg, info, load).start()


class DecodeScheduler:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any) -> None:
        self.cfg = cfg
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.agent: DecodeAgent | None = None
        self.registration: Registration | None = None
        self._tried: set[str] = set()  # requests whose transfer was reserved or released
        self._reserved: dict[str, str] = {}  # request id -> transfer id, until the request ends
        self._unfilled: dict[str, int] = {}  # request id -> blocks reserved and not yet written
        self._received: set[str] = set()  # reserved requests the workers reported done
        self._cancelling: set[str] = set()  # aborted while waiting; workers report once fenced
        self._kv_cache_manager: Any = None

    # ----- start-up -----------------------------------------------------------------------

    def set_handshakes(self, handshakes: dict[int, RankHandshake], kv_cache_manager: Any) -> None:
        ranks = [handshakes[r] for r in sorted(handshakes)]
        shape = ranks[0].shape
        assert shape is not None
        self._kv_cache_manager = kv_cache_manager
        self.agent = DecodeAgent(
            DecodeAgentConfig(
                engine_id=self.cfg.engine_id,
                tp_size=self.tp_size,
                shape=shape,
                auth_token=self.cfg.auth_token(),
                grace_s=self.cfg.grace_s,
                max_fence_s=self.cfg.max_fence_s,
                transfer_timeout_s=self.cfg.transfer_timeout_s,
                reservation_lease_ms=self.cfg.reservation_lease_ms,
            ),
            [pb.RankLayout.FromString(h.layout) for h in ranks],
            incarnation=_engine_incarnation(ranks),
        ).start()
        self.cfg.serve_metrics(0)
        self.registration = register(self.cfg, pb.ROLE_DECODE, self.tp_size, ranks, self._load)

    def _load(self) -> pb.LoadReport:
        free = self._kv_cache_manager.block_pool.get_num_free_blocks() if self._kv_cache_manager else 0
        return pb.LoadReport(
            free_blocks=free,
            reserved_unfilled_blocks=sum(self._unfilled.values()),
            waiting_requests=len(self._unfilled),
            running_requests=len(self._reserved) - len(self._unfilled),
        )

    # ----- hooks --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.agent is None or request.request_id in self._tried or not isinstance(leg_of(request), DecodeLeg):
            return 0, False  # not ours, already tried, or no agent yet: compute locally
        n = request.num_prompt_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        leg = leg_of(request)
        if not isinstance(leg, DecodeLeg) or rid in self._tried or self.agent is None:
            return
        self._tried.add(rid)
        if num_external_tokens == 0:
            self.agent.release_prefill(leg.transfer_id, leg, "decode holds the whole prompt")
            return
        new = blocks.get_unhashed_block_ids_all_groups()
        every = blocks.get_block_ids()
        skip = len(every[0]) - len(new[0])
        self.agent.reserve(leg.transfer_id, rid, leg, [list(g) for g in new], request.num_prompt_tokens, skip)
        self._reserved[rid] = leg.transfer_id
        self._unfilled[rid] = sum(len(g) for g in new)

    def update_connector_output(self, finished_recving: set[str]) -> None:
        for rid in finished_recving:
            self._cancelling.discard(rid)
            self._unfilled.pop(rid, None)
            tid = self._reserved.get(rid)
            if tid is not None and self.agent is not None:
                self._received.add(rid)
                self.agent.finished(tid)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        tid = self._reserved.pop(rid, None)
        received = rid in self._received
        tried = rid in self._tried
        self._received.discard(rid)
        self._unfilled.pop(rid, None)
        self._tried.discard(rid)
        if self.agent is None:
            return False, None
        if tid is None:
            leg = leg_of(request)
            if isinstance(leg, DecodeLeg) and not tried:
                # Ended before its blocks were allocated: free the prefill side now.
                self.agent.release_prefill(leg.transfer_id, leg, f"decode request ended ({request.status.name})")
        elif not received:
            # Still waiting for its KV (abort, error): fence the WRITEs; the workers report the
            # request in finished_recving only once no WRITE can land, and vLLM frees the blocks then.
            self._cancelling.add(rid)
            self.agent.cancel(tid, f"decode request ended ({request.status.name})")
        return False, None

    def has_pending_push_work(self) -> bool:
        return bool(self._cancelling)

    def shutdown(self) -> None:
        if self.registration is not None:
            self.registration.stop()
        if self.agent is not None:
            self.agent.stop()


class PrefillScheduler:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any) -> None:
        self.cfg = cfg
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.registration: Registration | None = None
        self._requests: dict[str, tuple[PrefillLeg, Any]] = {}
        self._flagged: set[str] = set()  # KV handed to the writers
        self._held: set[str] = set()  # finished requests whose blocks wait for finished_sending
        self._aborted: list[str] = []
        self._kv_cache_manager: Any = None

    def set_handshakes(self, handshakes: dict[int, RankHandshake], kv_cache_manager: Any) -> None:
        ranks = [handshakes[r] for r in sorted(handshakes)]
        self._kv_cache_manager = kv_cache_manager
        log.info("prefill_engine_ready", endpoints=[h.endpoint for h in ranks])
        self.registration = register(self.cfg, pb.ROLE_PREFILL, self.tp_size, ranks, self._load)

    def _load(self) -> pb.LoadReport:
        free = self._kv_cache_manager.block_pool.get_num_free_blocks() if self._kv_cache_manager else 0
        return pb.LoadReport(free_blocks=free, running_requests=len(self._requests), waiting_requests=len(self._held))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        leg = leg_of(request)
        if isinstance(leg, PrefillLeg):
            self._requests.setdefault(request.request_id, (leg, request))

    def build_connector_meta(self, scheduler_output: Any) -> PushMetadata:
        meta = PushMetadata(aborted=self._aborted)
        self._aborted = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            entry = self._requests.get(rid)
            if entry is None or rid in self._flagged:
                continue
            leg, request = entry
            if request.num_computed_tokens + n < request.num_prompt_tokens:
                continue  # more prompt chunks to come
            block_ids = self._kv_cache_manager.get_block_ids(rid)
            meta.finished_prefills.append(
                FinishedPrefill(leg.transfer_id, rid, tuple(tuple(g) for g in block_ids), request.num_prompt_tokens)
            )
            self._flagged.add(rid)
        return meta

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        entry = self._requests.pop(rid, None)
        if entry is None:
            return False, None
        leg, _ = entry
        if rid in self._flagged:
            self._flagged.discard(rid)
            self._held.add(rid)
            return True, {"kvpush": {"role": "prefill_done", "transfer_id": leg.transfer_id}}
        self._aborted.append(leg.transfer_id)  # no KV will come: let decode fail fast
        return False, None

    def update_connector_output(self, finished_sending: set[str]) -> None:
        self._held -= finished_sending

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._aborted)

    def shutdown(self) -> None:
        if self.registration is not None:
            self.registration.stop()

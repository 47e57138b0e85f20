"""The prefill engine's scheduler-side half of the connector (in vLLM's EngineCore, called from the
engine loop): flags, per step, which transfers' KV the step completes, and holds their blocks until
the writers sent them.
"""

from __future__ import annotations

import threading
from typing import Any

from kvpush.connector.completion_tokens import SAMPLED_FIRST_TOKENS
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.handoff_holds import HANDOFF_HOLDS
from kvpush.connector.legs import LegGate
from kvpush.connector.messages import AbortedPrefill, FinishedPrefill, PushMetadata, RankHandshake, UnreservedPrefill
from kvpush.connector.registration import Registration, model_vocab_size, register_engine
from kvpush.services.common.logs import get_logger
from kvpush.services.common.transfer_params import PrefillLeg
from kvpush.v1 import kvpush_pb2 as pb

log = get_logger("kvpush.connector.scheduler")


class PrefillScheduler:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any) -> None:
        self.cfg = cfg
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.registration: Registration | None = None
        self.legs = LegGate(cfg)  # a refused leg: the request runs as on a plain instance, nothing is pushed
        self._vocab_size = model_vocab_size(vllm_config)
        self._requests: dict[str, tuple[PrefillLeg, Any]] = {}
        self._flagged: set[str] = set()  # KV handed to the writers
        self._held: set[str] = set()  # finished requests whose blocks wait for finished_sending
        self._aborted: list[AbortedPrefill] = []
        self._holders: dict[str, str] = {}  # transfer id -> the live request whose KV is pushed for it
        self._kv_cache_manager: Any = None
        self._push_bytes: dict[str, int] = {}  # request -> KV bytes handed to the writers, not yet sent
        self._block_bytes = 0  # one block of every layer on every rank
        # transfer id -> (request id, decode engine) of a live or held request, for leg failures;
        # and request id -> transfer id of the held ones, so a step's finished_sending is O(sent)
        self._transfers: dict[str, tuple[str, str]] = {}
        self._held_transfers: dict[str, str] = {}
        # Undelivered decode legs, from the registration thread, for the next step's metadata.
        self._unreserved_lock = threading.Lock()
        self._unreserved: list[UnreservedPrefill] = []

    def set_handshakes(self, handshakes: dict[int, RankHandshake], kv_cache_manager: Any) -> None:
        ranks = [handshakes[r] for r in sorted(handshakes)]
        self._kv_cache_manager = kv_cache_manager
        shape = ranks[0].shape
        if shape is not None:
            self._block_bytes = shape.num_layers * shape.total_kv_heads * shape.head_bytes
        log.info("prefill_engine_ready", endpoints=[h.endpoint for h in ranks])
        self.registration = register_engine(
            self.cfg,
            pb.ROLE_PREFILL,
            self.tp_size,
            ranks,
            self._load,
            on_leg_failures=self._leg_failures,
            vocab_size=self._vocab_size,
            leg_keys=self.legs.mac_keys,
            on_tokens_sent=HANDOFF_HOLDS.token_sent if self.cfg.push_on_token_sent else None,
        )

    def _leg_failures(self, failures: list[pb.LegFailure]) -> None:
        """Undelivered decode legs, from the scheduler (registration thread): no reservation will
        come for those transfers, so the workers free their KV as soon as it is done."""
        found = []
        for f in failures:
            if f.leg != pb.ROLE_DECODE:
                continue
            held = self._transfers.get(f.transfer_id)
            if held is None:
                continue  # not a transfer of this engine (or already gone)
            found.append(UnreservedPrefill(f.transfer_id, held[1]))
            log.warning("decode_leg_failed", transfer_id=f.transfer_id, request_id=held[0], reason=f.reason)
        if found:
            with self._unreserved_lock:
                self._unreserved.extend(found)

    def _load(self) -> pb.LoadReport:
        free = self._kv_cache_manager.block_pool.get_num_free_blocks() if self._kv_cache_manager else 0
        return pb.LoadReport(
            free_blocks=free,
            running_requests=len(self._requests),
            waiting_requests=len(self._held),
            write_bytes_in_flight=sum(self._push_bytes.values()),  # the scheduler's prefill busyness
        )

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        leg = self.legs.of(request)
        if not isinstance(leg, PrefillLeg) or not leg.decode_engine_id:
            return
        rid = request.request_id
        holder = self._holders.setdefault(leg.transfer_id, rid)
        if holder != rid:
            # A second live request with the same transfer id: served plainly, never pushed.
            log.warning("duplicate_transfer_id", request_id=rid, transfer_id=leg.transfer_id, holder_request_id=holder)
            return
        self._requests.setdefault(rid, (leg, request))
        self._transfers[leg.transfer_id] = (rid, leg.decode_engine_id)

    def build_connector_meta(self, scheduler_output: Any) -> PushMetadata:
        meta = PushMetadata(aborted=self._aborted)
        self._aborted = []
        if self._unreserved:
            with self._unreserved_lock:
                meta.unreserved, self._unreserved = self._unreserved, []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            entry = self._requests.get(rid)
            if entry is None or rid in self._flagged:
                continue
            leg, request = entry
            if request.num_computed_tokens + n < request.num_prompt_tokens:
                continue  # more prompt chunks to come
            block_ids = self._kv_cache_manager.get_block_ids(rid)
            meta.finished_prefills.append(
                FinishedPrefill(
                    leg.transfer_id,
                    rid,
                    tuple(tuple(g) for g in block_ids),
                    request.num_prompt_tokens,
                    leg.decode_engine_id,
                    after_output=leg.first_token and self.cfg.push_after_output,
                    first_token=leg.first_token and self.cfg.first_token_on_completion,
                )
            )
            self._flagged.add(rid)
            self._push_bytes[rid] = sum(len(g) for g in block_ids) * self._block_bytes
            if leg.first_token and self.cfg.first_token_on_completion:
                SAMPLED_FIRST_TOKENS.expect(leg.transfer_id)  # its completions wait for the token
        return meta

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.legs.forget(rid)
        entry = self._requests.pop(rid, None)
        if entry is None:
            return False, None
        leg, _ = entry
        if self._holders.get(leg.transfer_id) == rid:
            del self._holders[leg.transfer_id]
        if rid in self._flagged:
            self._flagged.discard(rid)
            self._held.add(rid)
            self._held_transfers[rid] = leg.transfer_id
            if leg.first_token:
                self._send_first_token(leg, request)
            elif self.registration is not None:  # the scheduler's estimate of this engine's queue
                self.registration.prefill_done(leg.transfer_id)
            return True, {"kvpush": {"role": "prefill_done", "transfer_id": leg.transfer_id}}
        self._aborted.append(AbortedPrefill(leg.transfer_id, leg.decode_engine_id))  # no KV will come: fail fast
        self._push_bytes.pop(rid, None)
        self._forget_transfer(leg.transfer_id, rid)
        return False, None

    def _send_first_token(self, leg: PrefillLeg, request: Any) -> None:
        """First-token hand-off: the token this engine sampled goes to the scheduler now, which
        relays it to the decode engine and to the frontend."""
        out = list(getattr(request, "output_token_ids", ()) or ())
        if self.cfg.first_token_on_completion:
            if not out:
                SAMPLED_FIRST_TOKENS.forget(leg.transfer_id)
            else:
                # For the push's completions, unless the worker posted it when it was sampled.
                posted = SAMPLED_FIRST_TOKENS.get(leg.transfer_id)
                if posted != int(out[0]):
                    if posted is not None:  # never expected: the worker read another token
                        log.error("first_token_mismatch", transfer_id=leg.transfer_id, sampled=posted, output=out[0])
                    SAMPLED_FIRST_TOKENS.post(leg.transfer_id, int(out[0]))
        if not out or self.registration is None:
            log.warning("first_token_not_sent", transfer_id=leg.transfer_id, request_id=request.request_id)
            return
        self.registration.first_token(
            pb.FirstToken(
                transfer_id=leg.transfer_id,
                decode_engine_id=leg.decode_engine_id,
                token_id=int(out[0]),
                stopped=request.status.name == "FINISHED_STOPPED",
            )
        )

    def _forget_transfer(self, transfer_id: str, rid: str) -> None:
        if self._transfers.get(transfer_id, ("",))[0] == rid:
            del self._transfers[transfer_id]

    def update_connector_output(self, finished_sending: set[str], failed: set[str] | None = None) -> None:
        self._held -= finished_sending
        for rid in finished_sending:
            self._push_bytes.pop(rid, None)
            tid = self._held_transfers.pop(rid, None)
            if tid is not None:
                self._forget_transfer(tid, rid)

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._aborted or self._unreserved)

    def shutdown(self) -> None:
        if self.registration is not None:
            self.registration.stop()

"""The decode engine's scheduler-side half of the connector (in vLLM's EngineCore, called from the
engine loop): claims pushed loads, reserves them with the decode agent, takes relayed first tokens.

Nothing here blocks: the decode agent publishes from its own loop thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, NamedTuple

from kvpush.connector.completion_tokens import COMPLETION_TOKENS
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.engine_wake import ENGINE_WAKE
from kvpush.connector.legs import LegGate
from kvpush.connector.messages import PushMetadata, RankHandshake
from kvpush.connector.registration import Registration, engine_incarnation, model_vocab_size, register_engine
from kvpush.connector.sampler_state import WORKER_QUALNAME
from kvpush.services.common.logs import get_logger
from kvpush.services.common.transfer_params import DecodeLeg
from kvpush.services.decode_agent.agent import DecodeAgent, DecodeAgentConfig
from kvpush.services.decode_agent.metrics import FIRST_TOKEN_PATHS, FIRST_TOKENS
from kvpush.services.decode_agent.reroute import Rerouter
from kvpush.v1 import kvpush_pb2 as pb

log = get_logger("kvpush.connector.scheduler")

_MAX_PENDING_TOKENS = 4096  # first tokens kept for transfers this engine has not reserved yet
_PENDING_TOKEN_S = 60.0  # ... and for how long


def _is_seeded(request: Any) -> bool:
    sp = getattr(request, "sampling_params", None)
    return sp is not None and sp.sampling_type.name == "RANDOM_SEED"  # vLLM gives these a generator


def _handoff_problem(cfg: ConnectorConfig, vllm_config: Any) -> str | None:
    """Why this decode engine cannot offer the first-token hand-off (None: it can)."""
    if not cfg.first_token_handoff:
        return "first_token_handoff is off"
    policy = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_load_failure_policy", "fail")
    if policy != "fail":
        # A request whose token never comes must fail, not be recomputed from its prompt alone:
        # its frontend already streamed that token.
        return f"kv_load_failure_policy is {policy!r}, not 'fail'"
    worker_cls = getattr(vllm_config.parallel_config, "worker_cls", "")
    if worker_cls != WORKER_QUALNAME:
        return f"worker_cls is {worker_cls!r}, not {WORKER_QUALNAME}"
    return None


def append_first_token(request: Any, token: int) -> None:
    """Makes ``token`` the last prompt token of a request still waiting for its KV: vLLM then
    computes only that position (the prompt's KV is all pushed) and samples the second token.
    ``prompt_token_ids`` is the list the scheduler hands the workers for a new request."""
    request.prompt_token_ids.append(token)
    request._all_token_ids.append(token)
    if getattr(request, "prompt_is_token_ids", None) is not None:
        request.prompt_is_token_ids.append(True)
    request.num_prompt_tokens += 1
    request.update_block_hashes()


class _WantToken(NamedTuple):
    """A hand-off request reserved on this engine whose first token is not appended yet."""

    transfer_id: str
    leg_prefill: str  # the prefill its leg names (a rerouted one is asked of the agent)
    request: Any  # vLLM's Request, to append the token to
    # A block of its own holding pushed KV, reported as failed to load should vLLM schedule the
    # request before its token is in (PushMetadata.veto_blocks); None: none it could name.
    veto_block: int | None


class DecodeScheduler:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any) -> None:
        self.cfg = cfg
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.agent: DecodeAgent | None = None
        self.registration: Registration | None = None
        # Every leg is checked here (signature, expiry, this engine) before anything is dialed or
        # reserved; a refused one leaves the request to be computed locally.
        self.legs = LegGate(cfg)
        self._tried: set[str] = set()  # requests whose transfer was reserved or released
        # request id -> (transfer id, epoch), until the request ends; and who holds each transfer id
        self._reserved: dict[str, tuple[str, int]] = {}
        self._holders: dict[str, str] = {}  # transfer id -> request id of the live request holding it
        self._duplicates: set[str] = set()  # requests whose transfer id another live request holds
        self._unfilled: dict[str, int] = {}  # request id -> blocks reserved and not yet written
        self._received: set[str] = set()  # reserved requests the workers reported done
        self._cancelling: set[str] = set()  # aborted while waiting; workers report once fenced
        self._kv_cache_manager: Any = None
        # First-token hand-off (docs/first_token.md).
        self._handoff_problem = _handoff_problem(cfg, vllm_config)
        self._vocab_size = model_vocab_size(vllm_config)
        self._vocab = self._vocab_size or 2**31
        self._token_lock = threading.Lock()
        self._token_inbox: list[pb.FirstToken] = []  # from the registration thread
        self._completion_inbox: list[pb.FirstToken] = []  # with completions, from a decode rank's thread
        # transfer id -> prefill engine -> (token, arrival, order): relayed, not yet taken
        self._tokens: dict[str, dict[str, tuple[pb.FirstToken, float, int]]] = {}
        self._pending_tokens = 0
        self._token_seq = 0  # relay order
        # Transfer ids whose request ended here, and when (bounded like the pending tokens): a first
        # token for one that comes later (the relay's copy of a token taken from a completion, late
        # under faults) is dropped at once as late, not kept to expire as an unclaimed token.
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._want_token: dict[str, _WantToken] = {}  # hand-off requests reserved, token not appended yet
        self._new_waiting: list[str] = []  # reserved this step, waiting for their token too
        self._delivered: list[str] = []  # tokens appended this step
        self._advance: set[str] = set()  # seeded requests to advance when they are first scheduled
        self._abandoned: list[str] = []  # ended while waiting for their token
        self._block_size = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 0) or 0)
        # Requests that ask for the hand-off but cannot have it here (their leg was refused, e.g.
        # expired while they queued; the agent is not up; a duplicate of a live request's leg):
        # served locally they would repeat the first token the frontend streamed, so they are
        # claimed as loads that are reported failed at once. request id -> (transfer id, why)
        self._handoff_refused: dict[str, tuple[str | None, str]] = {}
        self._fail_loads: list[str] = []

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
                max_reroutes=self.cfg.max_reroutes,
                security=self.cfg.security(f"decode-agent {self.cfg.engine_id}"),
                completion_notices=self.cfg.completion_notices,
            ),
            [pb.RankLayout.FromString(h.layout) for h in ranks],
            incarnation=engine_incarnation(ranks),
            rerouter=self._rerouter(),
        ).start()
        self.cfg.serve_metrics(0)
        if self._handoff_problem is not None:
            log.info("first_token_handoff_off", reason=self._handoff_problem)
        self.registration = register_engine(
            self.cfg,
            pb.ROLE_DECODE,
            self.tp_size,
            ranks,
            self._load,
            on_leg_failures=self._leg_failures,
            on_first_tokens=self._first_tokens,
            first_token_handoff=self._handoff_problem is None,
            vocab_size=self._vocab_size,
            leg_keys=self.legs.mac_keys,
        )
        if self._handoff_problem is None:
            COMPLETION_TOKENS.bind(self._completion_token)

    def _first_tokens(self, tokens: list[pb.FirstToken]) -> None:
        """Relayed first tokens (registration thread): taken at the next step."""
        with self._token_lock:
            self._token_inbox.extend(tokens)
        ENGINE_WAKE.notify()  # the next step appends it; an idle engine runs that step now

    def _completion_token(self, token: pb.FirstToken) -> None:
        """A first token that came with a completion its rank's barrier accepted (a decode rank's
        thread, this process: connector/completion_tokens.py): taken at the next step."""
        with self._token_lock:
            self._completion_inbox.append(token)
        ENGINE_WAKE.notify()

    def _take_tokens(self, now: float) -> None:
        """Moves relayed tokens into ``_tokens`` and appends one to the prompt of the request
        waiting for it, once it comes from a prefill the transfer was published to: its leg's, or
        the current one after a reroute (a rerouted prefill's token can come before decode has the
        new leg, so a token from another prefill waits too). The first accepted token wins; tokens
        for transfers not reserved yet, or from prefills not (yet) the transfer's, wait for a
        bounded time. A token that came with a completion is taken only for a request waiting for
        it, and only from its leg's prefill: the token its frontend streamed (after a reroute the
        relay carries the first prefill's token, which is the one streamed)."""
        if self._completion_inbox:
            with self._token_lock:
                carried, self._completion_inbox = self._completion_inbox, []
            for ft in carried:
                self._take_carried(ft)
        if self._token_inbox:
            with self._token_lock:
                inbox, self._token_inbox = self._token_inbox, []
            for ft in inbox:
                if ft.token_id >= self._vocab:
                    FIRST_TOKENS.labels("refused").inc()
                    log.warning("first_token_refused", transfer_id=ft.transfer_id, reason="token id out of range")
                    continue
                holder = self._holders.get(ft.transfer_id)
                if holder is not None and holder not in self._want_token:
                    continue  # its request took its token already (say, from a completion)
                if holder is None and ft.transfer_id in self._ended:
                    FIRST_TOKENS.labels("late").inc()
                    log.info("first_token_late", transfer_id=ft.transfer_id, prefill=ft.prefill_engine_id)
                    continue
                if self._pending_tokens >= _MAX_PENDING_TOKENS:
                    FIRST_TOKENS.labels("refused").inc()
                    log.warning("first_token_refused", transfer_id=ft.transfer_id, reason="too many pending")
                    continue
                per = self._tokens.setdefault(ft.transfer_id, {})
                if ft.prefill_engine_id not in per:
                    self._token_seq += 1
                    per[ft.prefill_engine_id] = (ft, now, self._token_seq)
                    self._pending_tokens += 1
        if not self._tokens:
            return
        for tid, per in list(self._tokens.items()):
            rid = self._holders.get(tid)
            want = self._want_token.get(rid) if rid is not None else None
            if want is not None:
                leg_prefill = want.leg_prefill
                current = self.agent.prefill_of(tid) if self.agent is not None else None
                # The earliest relayed of the acceptable ones: the token Generate streamed too.
                candidates = [per[p] for p in {leg_prefill, current} if p is not None and p in per]
                taken = min(candidates, key=lambda c: c[2]) if candidates else None
                if taken is not None:
                    assert rid is not None
                    self._append(rid, want, taken[0], "relay")
                    continue
            for prefill, (_, arrived, _) in list(per.items()):
                if now - arrived > _PENDING_TOKEN_S:
                    # No request of this engine took it: never reserved here, or not from a prefill
                    # the transfer was published to.
                    del per[prefill]
                    self._pending_tokens -= 1
                    FIRST_TOKENS.labels("expired").inc()
                    log.warning("first_token_expired", transfer_id=tid, prefill=prefill)
            if not per:
                del self._tokens[tid]

    def _note_ended(self, tid: str) -> None:
        now = time.monotonic()
        self._ended[tid] = now
        self._ended.move_to_end(tid)
        while self._ended and (
            len(self._ended) > _MAX_PENDING_TOKENS or now - next(iter(self._ended.values())) > _PENDING_TOKEN_S
        ):
            self._ended.popitem(last=False)

    def _take_carried(self, ft: pb.FirstToken) -> None:
        rid = self._holders.get(ft.transfer_id)
        want = self._want_token.get(rid) if rid is not None else None
        if want is None or rid is None:
            return  # appended already (relayed first), or not a hand-off waiting here
        if ft.token_id >= self._vocab:
            FIRST_TOKENS.labels("refused").inc()
            log.warning("first_token_refused", transfer_id=ft.transfer_id, reason="completion's token out of range")
            return
        if ft.prefill_engine_id != want.leg_prefill:
            # A rerouted transfer's new prefill: its token can differ from the streamed one, which the
            # relay carries (expected after every reroute, so not a warning).
            log.info("first_token_from_completion_skipped", transfer_id=ft.transfer_id, prefill=ft.prefill_engine_id)
            return
        self._append(rid, want, ft, "completion")

    def _append(self, rid: str, want: _WantToken, ft: pb.FirstToken, via: str) -> None:
        append_first_token(want.request, int(ft.token_id))
        del self._want_token[rid]
        self._drop_tokens(want.transfer_id)
        self._delivered.append(rid)
        if _is_seeded(want.request):
            self._advance.add(rid)
        FIRST_TOKENS.labels("appended").inc()
        FIRST_TOKEN_PATHS.labels(via).inc()
        log.info(
            "first_token_appended", transfer_id=want.transfer_id, request_id=rid, prefill=ft.prefill_engine_id, via=via
        )

    def _drop_tokens(self, tid: str) -> None:
        self._pending_tokens -= len(self._tokens.pop(tid, {}))

    def _leg_failures(self, failures: list[pb.LegFailure]) -> None:
        """Undelivered prefill legs, from the scheduler: those transfers fail over now."""
        if self.agent is not None:
            for f in failures:
                self.agent.prefill_leg_failed(f.transfer_id, f.prefill_engine_id, f.reason)

    def _rerouter(self) -> Rerouter | None:
        """Retry elsewhere through the scheduler, when there is one and it is not turned off."""
        if not self.cfg.scheduler_address or self.cfg.max_reroutes <= 0:
            return None
        security = self.cfg.security(f"decode-reroute {self.cfg.engine_id}")
        return Rerouter(self.cfg.scheduler_address, self.cfg.engine_id, security, self.legs.verifier)

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
        rid = request.request_id
        if rid in self._tried:
            return 0, False  # already tried: compute locally
        n = request.num_prompt_tokens - num_computed_tokens
        if rid in self._handoff_refused:
            return (n, True) if n > 0 else (0, False)
        # A request this engine cannot serve as a transfer (its leg refused, no agent yet, another
        # live request holds its transfer id) is computed locally, unless it asks for the hand-off:
        # its frontend may have streamed prefill's token, so it is claimed as a load that fails
        # instead (update_state_after_alloc).
        leg = self.legs.of(request)
        if not isinstance(leg, DecodeLeg):
            (handoff, tid), why = self.legs.claims_handoff(request), "its leg was refused"
        elif self.agent is None:
            handoff, tid, why = leg.first_token, leg.transfer_id, "no decode agent yet"
        elif self._is_duplicate(request):
            handoff, tid, why = leg.first_token, leg.transfer_id, "another live request holds its transfer id"
        else:
            return (n, True) if n > 0 else (0, False)
        if not handoff:
            return 0, False
        self._handoff_refused[rid] = (tid, why)
        return (n, True) if n > 0 else (0, False)

    def _is_duplicate(self, request: Any) -> bool:
        """Whether another live request holds this request's transfer id; such a request is never
        claimed, and nothing it does (allocation, end) touches the holder's transfer."""
        rid = request.request_id
        if rid in self._duplicates:
            return True
        leg = self.legs.of(request)
        holder = self._holders.get(leg.transfer_id) if isinstance(leg, DecodeLeg) else None
        if holder is None or holder == rid or leg is None:
            return False
        log.warning("duplicate_transfer_id", request_id=rid, transfer_id=leg.transfer_id, holder_request_id=holder)
        self._duplicates.add(rid)
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        refused = self._handoff_refused.get(rid)
        if refused is not None:  # claimed as a load to fail (get_num_new_matched_tokens)
            tid, why = refused
            if num_external_tokens:
                self._fail_loads.append(rid)
                log.warning("first_token_handoff_refused", transfer_id=tid, request_id=rid, reason=why)
            else:  # vLLM computes it locally after all: nothing here can stop that
                log.error("first_token_handoff_computed_locally", transfer_id=tid, request_id=rid)
            return
        leg = self.legs.of(request)
        if not isinstance(leg, DecodeLeg) or rid in self._tried or self.agent is None:
            return
        if num_external_tokens == 0 and self._is_duplicate(request):
            return  # computed locally; releasing the prefill KV would take it from the holder
        self._tried.add(rid)
        if num_external_tokens == 0:
            if leg.first_token:
                # vLLM loads nothing for it (e.g. prompt logprobs asked: vLLM skips every cached and
                # external prefix), so it samples its own first token after the frontend's.
                log.error("first_token_handoff_computed_locally", transfer_id=leg.transfer_id, request_id=rid)
            self.agent.release_prefill(leg.transfer_id, leg, "decode holds the whole prompt")
            return
        new = blocks.get_unhashed_block_ids_all_groups()
        every = blocks.get_block_ids()
        skip = len(every[0]) - len(new[0])
        # A duplicate that got here anyway (claimed before the holder reserved) is refused by the
        # agent and fails through its ranks, never as a successful load.
        epoch = self.agent.reserve(
            leg.transfer_id,
            rid,
            leg,
            [list(g) for g in new],
            request.num_prompt_tokens,
            skip,
            # A copy: the first-token hand-off appends to the request's list later, and a retry
            # elsewhere must send the prompt whose KV this reservation holds (None for prompt
            # embeds: no retry).
            prompt_token_ids=tuple(getattr(request, "prompt_token_ids", None) or ()),
        )
        self._reserved[rid] = (leg.transfer_id, epoch)
        self._holders.setdefault(leg.transfer_id, rid)
        self._unfilled[rid] = sum(len(g) for g in new)
        if leg.first_token and self._holders.get(leg.transfer_id) == rid:
            if self._handoff_problem is not None or getattr(request, "prompt_token_ids", None) is None:
                # The frontend streams prefill's token and asked for one token less: decode cannot
                # continue from it, so the request must fail rather than repeat that token.
                why = self._handoff_problem or "prompt embeddings"
                log.warning("first_token_handoff_refused", transfer_id=leg.transfer_id, request_id=rid, reason=why)
                self.agent.cancel(leg.transfer_id, f"first-token hand-off not possible: {why}", epoch=epoch)
                return
            veto = self._own_block(request, every[0], skip)
            self._want_token[rid] = _WantToken(leg.transfer_id, leg.prefill_engine_id, request, veto)
            self._new_waiting.append(rid)

    def _own_block(self, request: Any, blocks: list[int], skip: int) -> int | None:
        """The block holding the last pushed prompt position that vLLM counts as computed should
        it schedule the request before its token is in (position ``num_prompt_tokens - 2``): one
        of the blocks allocated for this push (index >= ``skip``), last in the prompt, so the least
        likely to be shared by a prefix hit of another request (a partial block never is)."""
        if self._block_size <= 0 or request.num_prompt_tokens < 2:
            return None
        idx = (request.num_prompt_tokens - 2) // self._block_size
        return blocks[idx] if skip <= idx < len(blocks) else None

    def _veto(self, meta: PushMetadata, rid: str) -> None:
        """vLLM scheduled a hand-off request before its token was appended (never expected: the
        workers hold its KV release until then): it would sample a first token of its own after
        the one the frontend streamed. Its block is reported as failed to load, so vLLM fails it
        and drops this step's output for it; it no longer waits for its token."""
        want = self._want_token.pop(rid)
        tid, block = want.transfer_id, want.veto_block
        self._drop_tokens(tid)
        self._abandoned.append(rid)
        if block is not None:
            meta.veto_blocks.append(block)
        log.error(
            "first_token_missing_at_schedule",
            request_id=rid,
            transfer_id=tid,
            action="failed" if block is not None else "none: no block of its own to report",
        )

    def build_connector_meta(self, scheduler_output: Any) -> PushMetadata:
        """Decode workers need the first-token hand-off's bookkeeping, and whether the step runs
        a forward."""
        meta = PushMetadata(forward_tokens=scheduler_output.total_num_scheduled_tokens)
        if self._want_token:
            for new in scheduler_output.scheduled_new_reqs:
                if new.req_id in self._want_token:
                    self._veto(meta, new.req_id)
        if self._want_token or self._tokens or self._token_inbox or self._completion_inbox:
            self._take_tokens(time.monotonic())
        if self._new_waiting:
            meta.awaiting_first_token, self._new_waiting = self._new_waiting, []
        if self._delivered:
            meta.first_token_delivered, self._delivered = self._delivered, []
        if self._abandoned:
            meta.first_token_abandoned, self._abandoned = self._abandoned, []
        if self._fail_loads:
            meta.fail_loads, self._fail_loads = self._fail_loads, []
        if self._advance:
            for new in scheduler_output.scheduled_new_reqs:
                if new.req_id in self._advance:
                    self._advance.discard(new.req_id)
                    meta.advance_sampler.append(new.req_id)
        return meta

    def update_connector_output(self, finished_recving: set[str], failed: set[str] | None = None) -> None:
        for rid in finished_recving:
            if rid in self._want_token and (failed is None or rid not in failed):
                # Never expected: a hand-off request's load is reported only once its token is in.
                log.error(
                    "first_token_kv_released_early", request_id=rid, transfer_id=self._want_token[rid].transfer_id
                )
            self._cancelling.discard(rid)
            self._unfilled.pop(rid, None)
            reserved = self._reserved.get(rid)
            if reserved is not None and self.agent is not None:
                self._received.add(rid)
                self.agent.finished(*reserved)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        reserved = self._reserved.pop(rid, None)
        tid = reserved[0] if reserved is not None else None
        if tid is not None and self._holders.get(tid) == rid:
            del self._holders[tid]
            self._note_ended(tid)
        received = rid in self._received
        tried = rid in self._tried or rid in self._duplicates
        self._received.discard(rid)
        self._unfilled.pop(rid, None)
        self._tried.discard(rid)
        self._duplicates.discard(rid)
        self._handoff_refused.pop(rid, None)
        self._advance.discard(rid)
        if self._want_token.pop(rid, None) is not None:
            self._abandoned.append(rid)  # its worker stops waiting for the token
            if tid is not None:
                self._drop_tokens(tid)
        leg = self.legs.of(request) if tid is None and not tried and self.agent is not None else None
        self.legs.forget(rid)
        if self.agent is None:
            return False, None
        if tid is None:
            if isinstance(leg, DecodeLeg) and not tried:
                # Ended before its blocks were allocated: free the prefill side now.
                self.agent.release_prefill(leg.transfer_id, leg, f"decode request ended ({request.status.name})")
        elif not received and reserved is not None:
            # Still waiting for its KV (abort, error): fence the WRITEs; the workers report the
            # request in finished_recving only once no WRITE can land, and vLLM frees the blocks then.
            self._cancelling.add(rid)
            self.agent.cancel(tid, f"decode request ended ({request.status.name})", epoch=reserved[1])
        return False, None

    def has_pending_push_work(self) -> bool:
        return bool(self._cancelling)

    def shutdown(self) -> None:
        COMPLETION_TOKENS.bind(None)
        if self.registration is not None:
            self.registration.stop()
        if self.agent is not None:
            self.agent.stop()

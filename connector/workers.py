"""Worker-side halves of the connector (one instance per vLLM worker rank).

Decode: registers the KV caches with NIXL (once, in ``create_rank``), runs the rank's completion
server and NIXL poller, and reports released transfers. Prefill: registers its KV caches, runs the
rank's agent and push writer, hands it each transfer whose KV the step just computed once the
step's compute fence has passed (a CUDA event on GPUs, nothing on CPU), and reports blocks it no
longer needs.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from kvpush.connector import sampler_state
from kvpush.connector.completion_tokens import (
    AWAITED_FIRST_TOKENS,
    COMPLETION_TOKENS,
    SAMPLED_FIRST_TOKENS,
    AwaitedToken,
)
from kvpush.connector.compute_fence import Fence, FenceFactory, FenceGate, NoFence, fence_factory
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.engine_wake import ENGINE_WAKE
from kvpush.connector.handoff_holds import HANDOFF_HOLDS
from kvpush.connector.kv_layout import KvDescription, describe
from kvpush.connector.messages import AbortedPrefill, FinishedPrefill, PushMetadata, RankHandshake, UnreservedPrefill
from kvpush.connector.roles import TransferResults
from kvpush.services.common.layout import new_incarnation
from kvpush.services.common.logs import get_logger
from kvpush.services.common.nixl_engine import NixlEngine
from kvpush.services.decode_agent.barrier import Outcome, Released
from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig, create_rank
from kvpush.services.prefill_agent.agent import PrefillAgent, PrefillAgentConfig
from kvpush.services.prefill_agent.table import ReleaseBlocks

log = get_logger("kvpush.connector.worker")


def _tp() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _describe(
    cfg: ConnectorConfig, kv_caches: dict[str, Any], model_id: str, incarnation: str, side: str
) -> tuple[int, int, KvDescription, NixlEngine]:
    """Describes this rank's KV caches and makes its NIXL engine (nothing registered yet)."""
    rank, tp = _tp()
    desc = describe(kv_caches, tp, model_id)
    engine = NixlEngine(f"kvpush-{cfg.engine_id}-{incarnation[:8]}-{side}{rank}", cfg.ucx_params())
    mem_type, device_id = desc.regions.memory()
    log.info("kv_caches_described", rank=rank, layout=desc.shape.layout, mem_type=mem_type, device=device_id)
    return rank, tp, desc, engine


class DecodeWorker:
    def __init__(self, cfg: ConnectorConfig, model_id: str) -> None:
        self.cfg = cfg
        self.model_id = model_id
        self.incarnation = new_incarnation()
        self.rank: DecodeRank | None = None
        self._handshake: RankHandshake | None = None
        # First-token hand-off: requests whose release also waits for their token, releases held
        # for it (with their deadline), and held releases whose token came.
        self._needs_token: set[str] = set()
        self._held: dict[str, tuple[Released, float]] = {}
        self._ready: list[Released] = []
        self._fail_now: list[str] = []  # loads to report failed at once (PushMetadata.fail_loads)
        self._veto_blocks: set[int] = set()  # blocks to report invalid (PushMetadata.veto_blocks)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        rank, tp, desc, engine = _describe(self.cfg, kv_caches, self.model_id, self.incarnation, "d")
        rcfg = DecodeRankConfig(
            engine_id=self.cfg.engine_id,
            rank=rank,
            tp_size=tp,
            shape=desc.shape,
            host=self.cfg.agent_host,
            port=self.cfg.port_for(rank),
            poll_interval_s=self.cfg.poll_interval_us * 1e-6,
            busy_poll_s=self.cfg.busy_poll_interval_us * 1e-6,
            security=self.cfg.security(f"decode-rank {self.cfg.engine_id}/{rank}"),
        )
        # A release wakes vLLM's engine loop from its idle wait to report it now (engine_wake.py).
        # A token that came with a completion goes to the scheduler half of this process, if there
        # is one there (vLLM's uni executor; connector/completion_tokens.py).
        self.rank = create_rank(
            rcfg, engine, desc.regions, on_queued=ENGINE_WAKE.notify, on_first_token=COMPLETION_TOKENS.offer
        )
        self.cfg.serve_metrics(1 + rank)
        layout = self.rank.layout()
        layout.completion_endpoint = self.cfg.advertised(self.rank.port)
        self._handshake = RankHandshake(
            tp_rank=rank,
            endpoint=layout.completion_endpoint,
            incarnation=self.incarnation,
            layout=layout.SerializeToString(),
            num_blocks=desc.regions.regions[0].num_blocks,
            shape=desc.shape,
        )
        log.info(
            "decode_worker_ready", rank=rank, endpoint=layout.completion_endpoint, blocks=self._handshake.num_blocks
        )

    def handshake(self) -> RankHandshake | None:
        return self._handshake

    def step_started(self, meta: PushMetadata | None) -> None:
        if meta is not None and meta.forward_tokens and self.rank is not None:
            self.rank.forward_started()

    def wait_for_save(self, meta: PushMetadata | None) -> None:
        """Decode saves nothing (prefill pushes into it); before this step samples, it takes the
        first-token hand-off's bookkeeping: which requests wait for their token as well as their
        KV, whose token came (or who ended first), and whose seeded sampler to advance now."""
        if meta is None or not (
            meta.awaiting_first_token
            or meta.first_token_delivered
            or meta.first_token_abandoned
            or meta.fail_loads
            or meta.veto_blocks
            or meta.advance_sampler
        ):
            return  # most steps: no hand-off moved (this runs in every step of the engine loop)
        self._needs_token.update(meta.awaiting_first_token)
        for rid in (*meta.first_token_delivered, *meta.first_token_abandoned):
            self._needs_token.discard(rid)
            held = self._held.pop(rid, None)
            if held is not None:
                self._ready.append(held[0])
        self._fail_now.extend(meta.fail_loads)
        self._veto_blocks.update(meta.veto_blocks)
        if self.rank is not None:
            self.rank.awaiting_first_tokens(bool(self._needs_token))
        for rid in meta.advance_sampler:
            if not sampler_state.advance_one_step(rid):
                log.warning("sampler_not_advanced", request_id=rid)

    def transfer_results(self, finished_req_ids: set[str] | None = None) -> TransferResults | None:
        """Requests the rank's barriers released (finished_recving), each exactly once; those not
        released OK also in failed_recving. A request waiting for its first token (hand-off) is
        reported once its token was appended, or as failed after ``first_token_wait_s``; a load
        the scheduler half refused (``PushMetadata.fail_loads``) is reported failed at once, and a
        vetoed request's block (``PushMetadata.veto_blocks``) as one that failed to load. None:
        nothing to report (most steps; this runs in every step of the engine loop)."""
        rank = self.rank
        released: list[Released] = []
        now = 0.0
        if rank is not None:
            now = time.monotonic()
            rank.step_ended(now)
            released = rank.take_released()
        if not (released or self._veto_blocks or self._fail_now or self._ready or self._held):
            return None
        out = TransferResults()
        if self._veto_blocks:
            out.invalid_block_ids, self._veto_blocks = self._veto_blocks, set()
        if self._fail_now:
            out.finished_recving.update(self._fail_now)
            out.failed_recving.update(self._fail_now)
            self._fail_now.clear()
        if rank is None:
            return out
        for rel in released:
            if rel.outcome is Outcome.OK and rel.request_id in self._needs_token:
                self._held[rel.request_id] = (rel, now + self.cfg.first_token_wait_s)
                continue
            self._report(out, rel, rel.outcome is Outcome.OK)
        if self._ready:
            for rel in self._ready:
                self._report(out, rel, rel.outcome is Outcome.OK)
            self._ready.clear()
        if self._held:
            for rid, (rel, deadline) in list(self._held.items()):
                if now > deadline:
                    del self._held[rid]
                    self._needs_token.discard(rid)
                    log.warning("first_token_timeout", request_id=rid, transfer_id=rel.transfer_id)
                    self._report(out, rel, False)
            rank.awaiting_first_tokens(bool(self._needs_token))
        return out

    @staticmethod
    def _report(out: TransferResults, rel: Released, ok: bool) -> None:
        out.finished_recving.add(rel.request_id)
        # Only OK is a load: CANCELLED (a fenced or superseded reservation) wrote nothing usable.
        if not ok:
            out.failed_recving.add(rel.request_id)

    def shutdown(self) -> None:
        if self.rank is not None:
            self.rank.stop()
            self.rank = None


class PrefillWorker:
    def __init__(self, cfg: ConnectorConfig, model_id: str) -> None:
        self.cfg = cfg
        self.model_id = model_id
        self.agent: PrefillAgent | None = None
        self._handshake: RankHandshake | None = None
        self._lock = threading.Lock()
        self._released: set[str] = set()  # request ids the agent no longer needs
        self._finished: set[str] = set()  # request ids the scheduler has finished
        self._active: set[str] = set()  # request ids handed to the agent
        self._fence: FenceFactory = NoFence
        self._gate = FenceGate("kvpush-fence-gate")
        # Hand-off transfers held after their forward (connector/handoff_holds.py), worker thread only.
        self._after_output: list[str] = []

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        incarnation = new_incarnation()
        rank, tp, desc, engine = _describe(self.cfg, kv_caches, self.model_id, incarnation, "p")
        engine.register(desc.ranges, *desc.regions.memory())
        self._fence = fence_factory(*desc.regions.memory())
        acfg = PrefillAgentConfig(
            engine_id=self.cfg.engine_id,
            rank=rank,
            tp_size=tp,
            shape=desc.shape,
            host=self.cfg.agent_host,
            port=self.cfg.port_for(rank),
            auth_token=self.cfg.auth_token(),
            prefill_lease_s=self.cfg.prefill_lease_s,
            lease_s=self.cfg.write_lease_s,
            write_timeout_s=self.cfg.write_timeout_s,
            security=self.cfg.security(f"prefill-agent {self.cfg.engine_id}/{rank}"),
        )
        self.agent = PrefillAgent(
            acfg,
            engine,
            desc.regions,
            incarnation=incarnation,
            on_release=self._on_release,
            first_tokens=SAMPLED_FIRST_TOKENS if self.cfg.first_token_on_completion else None,
            first_token_wait_s=self.cfg.first_token_completion_wait_ms * 1e-3,
            completion_notices=self.cfg.completion_notices,
            completion_rpc_delay_s=self.cfg.completion_rpc_delay_ms * 1e-3,
        )
        self.agent.start()
        self.cfg.serve_metrics(1 + rank)
        self._handshake = RankHandshake(
            tp_rank=rank,
            endpoint=self.cfg.advertised(self.agent.port),
            incarnation=incarnation,
            num_blocks=desc.regions.regions[0].num_blocks,
            shape=desc.shape,
        )
        log.info("prefill_worker_ready", rank=rank, endpoint=self._handshake.endpoint)

    def handshake(self) -> RankHandshake | None:
        return self._handshake

    def _on_release(self, rel: ReleaseBlocks) -> None:
        with self._lock:
            self._released.add(rel.request_id)

    def step_started(self, meta: PushMetadata | None) -> None:
        """The transfers still held for their step's output (first-token hand-off) go to the
        writer now: vLLM schedules this step after it processed the last one's output, so the
        first token is on its way. With ``push_on_token_sent`` some may be gone already, released
        when their token left this process (``HANDOFF_HOLDS.token_sent``). Either way before this
        step's own hand-offs, so every transfer keeps its order."""
        if not self._after_output:
            return
        held, self._after_output = self._after_output, []
        HANDOFF_HOLDS.release(held)

    def _submit(self, fence: Fence, fp: FinishedPrefill, handled: threading.Event | None = None) -> None:
        agent = self.agent
        if agent is None:
            return

        def done() -> None:
            agent.prefill_done(
                fp.transfer_id,
                fp.request_id,
                fp.block_ids,
                fp.num_tokens,
                decode_engine_id=fp.decode_engine_id,
                handled=handled,
            )

        def failed() -> None:
            agent.prefill_aborted(fp.transfer_id, decode_engine_id=fp.decode_engine_id)

        self._gate.submit(fence, done, failed)

    def wait_for_save(self, meta: PushMetadata | None) -> None:
        """Runs right after the step's forward was launched: the KV of ``finished_prefills`` is
        in memory once this step's fence passes. Never blocks: the gate waits on the fence and
        then hands the transfers to the writer (aborts take the same path, so they keep their
        order relative to the transfers). A first-token hand-off's transfer is held until the next
        step starts (or, with ``push_on_token_sent``, its first token left this process, if that is
        sooner; connector/handoff_holds.py): its step's output is the client's first token."""
        if meta is None or self.agent is None or not (meta.finished_prefills or meta.aborted or meta.unreserved):
            return
        agent = self.agent
        fence = self._fence()
        at_sampling = self.cfg.first_token_at_sampling and sampler_state.bound()
        for fp in meta.finished_prefills:
            with self._lock:
                self._active.add(fp.request_id)
            sampling = fp.first_token and at_sampling
            until_sampled = sampling and self.cfg.push_at_sampling and not fp.after_output
            wait_s = self.cfg.push_first_wait_ms * 1e-3 if until_sampled else 0.0
            handled = threading.Event() if wait_s > 0 else None
            if sampling:
                # Before the push is handed on: its completions then wait for this token.
                awaited = AwaitedToken(fp.transfer_id, until_sampled, handled, wait_s)
                AWAITED_FIRST_TOKENS.await_token(fp.request_id, awaited, self.cfg.trace_steps)
            if fp.after_output or until_sampled:
                HANDOFF_HOLDS.hold(fp.transfer_id, functools.partial(self._submit, fence, fp, handled))
                self._after_output.append(fp.transfer_id)
            else:
                self._submit(fence, fp)
        for ab in meta.aborted:

            def aborted(ab: AbortedPrefill = ab) -> None:
                agent.prefill_aborted(ab.transfer_id, decode_engine_id=ab.decode_engine_id)

            self._gate.submit(fence, aborted)
        for un in meta.unreserved:

            def unreserved(un: UnreservedPrefill = un) -> None:
                agent.no_reservation(un.transfer_id, decode_engine_id=un.decode_engine_id)

            self._gate.submit(fence, unreserved)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks may be freed: released by the agent *and* finished by the
        scheduler (a WRITE can complete before the scheduler has finished the request)."""
        with self._lock:
            self._finished |= finished_req_ids & self._active
            ready = self._released & self._finished
            self._released -= ready
            self._finished -= ready
            self._active -= ready
        return ready

    def transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        return TransferResults(finished_sending=self.finished_sending(finished_req_ids))

    def shutdown(self) -> None:
        self.step_started(None)  # a held transfer is pushed (or refused by the writer), not dropped
        self._gate.stop()
        if self.agent is not None:
            self.agent.stop()
            self.agent = None

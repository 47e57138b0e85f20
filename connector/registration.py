"""Keeps one vLLM instance registered with the kvpush scheduler: ``Register`` once, then a load
stream whose reports renew the lease. Runs on its own daemon thread; reconnects with backoff.

First tokens (prefill, first-token hand-off) go to the scheduler at once in their own call
(``ReportFirstTokens``), from the thread that sampled them. A token that call cannot deliver rides
on the reports instead, and is delivered at least once: a report's tokens count as delivered only
when the scheduler acks that report (it relays them before it acks). Tokens of reports the stream
lost unacked (the scheduler restarted, or declared this engine dead while it was starved of CPU
and refused its report) go out again on the next stream, until ``first_token_wait_s`` after they
were sampled, when decode has given up on them anyway. A token relayed twice (a direct call whose
answer was lost, then the stream) is harmless: decode and Generate take the first one for a
transfer.

Prefills finished without the hand-off ride on the next report, each with its age then, so the
scheduler can learn this engine's speed for local prefill; they are an estimate's input, never
resent (a report lost with them only leaves the estimate less sure)."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvpush.connector.config import ConnectorConfig
from kvpush.services.common import limits
from kvpush.services.common.grpc_util import CHANNEL_OPTIONS
from kvpush.services.common.leg_macs import EngineKeyRing
from kvpush.services.common.logs import get_logger
from kvpush.services.common.security import Security
from kvpush.services.common.thread_names import name_native_thread
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvpush.connector.messages import RankHandshake

log = get_logger("kvpush.connector.registration")

DIRECT_TOKEN_TIMEOUT_S = 2.0  # a direct first-token send; then the load stream carries the token
_Sampled = tuple[pb.FirstToken, float]  # a first token and when it was sampled (monotonic)
MAX_AGE_US = (1 << 32) - 1  # PrefillDone.age_us (over an hour: the scheduler ignores it long before)


@dataclass
class _Stream:
    """One load stream's report bookkeeping. grpc keeps pulling reports from a stream's generator
    for a while after the stream broke, so each stream has its own: once it is over, its generator
    takes no more tokens, and the tokens it took and no ack confirmed go back in the queue."""

    unacked: deque[list[_Sampled]] = field(default_factory=deque)  # per sent report, oldest first
    over: bool = False


class Registration:
    def __init__(
        self,
        cfg: ConnectorConfig,
        info: pb.InstanceInfo,
        load: Callable[[], pb.LoadReport],
        security: Security | None = None,
        on_leg_failures: Callable[[list[pb.LegFailure]], None] | None = None,
        on_first_tokens: Callable[[list[pb.FirstToken]], None] | None = None,
        leg_keys: EngineKeyRing | None = None,
        on_tokens_sent: Callable[[list[str]], None] | None = None,
    ) -> None:
        """``leg_keys``: where the leg MAC key a registration brings goes (the connector's verifier).
        ``on_leg_failures``: called (on this thread) with what the scheduler pushes on the load
        stream: assignments of this engine whose other leg could not be delivered (to a decode
        engine, undelivered prefill legs; to a prefill engine, undelivered decode legs)."""
        self.cfg = cfg
        # mTLS with this engine's certificate: the scheduler takes registrations and load reports
        # only in the certificate's own name.
        self.security = security or cfg.security(f"registration {cfg.engine_id}")
        self.info = info
        self.load = load
        self.on_leg_failures = on_leg_failures
        self.on_first_tokens = on_first_tokens  # decode: relayed first tokens, on this thread
        # prefill: the transfer ids whose first tokens just left (on the engine thread once their
        # ReportFirstTokens call started, or on gRPC's request thread once a report carrying them
        # was sent; connector/handoff_holds.py)
        self.on_tokens_sent = on_tokens_sent
        self.leg_keys = leg_keys
        self._stop = threading.Event()
        self._wake = threading.Event()  # a report to send now: first tokens, or stop
        self._lock = threading.Lock()
        self._first_tokens: list[_Sampled] = []  # to send on the next report
        self._prefills_done: deque[tuple[str, float]] = deque(maxlen=limits.MAX_EXPECTATIONS_PER_CALL)
        # The registered stream's stub, for first tokens sent directly (None: not registered, or
        # the scheduler does not know ReportFirstTokens).
        self._direct: pb_grpc.SchedulerStub | None = None
        self._direct_ok = cfg.first_token_direct
        self._thread = threading.Thread(target=self._run, name="kvpush-registration", daemon=True)
        self.registered = threading.Event()

    def start(self) -> Registration:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)

    def first_token(self, token: pb.FirstToken) -> None:
        """Sends ``token`` (prefill: the first token of a hand-off transfer) to the scheduler now.

        Directly (``ReportFirstTokens``, started on the caller's thread, the engine's: the
        message leaves while that thread holds the core, instead of after the registration
        thread's wake-up, which waits behind the step's output on a busy core). Should that call
        not start or fail, on the load stream, and again on the next stream if this one ends
        before the scheduler acked the report carrying it. Thread-safe; dropped (and logged)
        beyond a bound of queued tokens, or ``first_token_wait_s`` after it was sampled."""
        sampled_at = time.monotonic()
        stub = self._direct if self._direct_ok else None
        if stub is not None:
            try:
                call = stub.ReportFirstTokens.future(
                    pb.FirstTokenReport(
                        engine_id=self.info.engine_id, incarnation=self.info.incarnation, first_tokens=[token]
                    ),
                    timeout=DIRECT_TOKEN_TIMEOUT_S,
                )
            except Exception as exc:  # a channel closed under us: the stream takes the token
                log.warning("first_token_direct_failed", transfer_id=token.transfer_id, reason=repr(exc))
            else:
                call.add_done_callback(functools.partial(self._direct_done, token, sampled_at))
                self._sent([token.transfer_id])
                return
        self._queue(token, sampled_at)

    def prefill_done(self, transfer_id: str) -> None:
        """Prefill: the transfer's prefill finished now (no hand-off: no first token tells it). Goes
        on the next report; thread-safe; beyond a report's bound the oldest are forgotten."""
        done = (transfer_id, time.monotonic())
        with self._lock:
            self._prefills_done.append(done)

    def _take_prefills_done(self) -> list[pb.PrefillDone]:
        now = time.monotonic()
        with self._lock:
            taken = list(self._prefills_done)
            self._prefills_done.clear()
        return [
            pb.PrefillDone(transfer_id=tid, age_us=min(MAX_AGE_US, max(0, int((now - at) * 1e6)))) for tid, at in taken
        ]

    def _direct_done(self, token: pb.FirstToken, sampled_at: float, call: grpc.Future) -> None:
        """A direct send ended (gRPC's thread): failed, the token goes on the load stream."""
        exc = call.exception()
        if exc is None:
            return
        code = exc.code() if isinstance(exc, grpc.Call) else None
        if code is grpc.StatusCode.UNIMPLEMENTED:
            self._direct_ok = False  # a scheduler without the call: the load stream from now on
        log.warning(
            "first_token_direct_failed",
            transfer_id=token.transfer_id,
            code=code.name if code is not None else None,
            reason=exc.details() if isinstance(exc, grpc.Call) else repr(exc),
        )
        self._queue(token, sampled_at)

    def _queue(self, token: pb.FirstToken, sampled_at: float) -> None:
        with self._lock:
            if len(self._first_tokens) >= limits.MAX_EXPECTATIONS_PER_CALL:
                log.warning("first_token_dropped", transfer_id=token.transfer_id, reason="too many queued")
                return
            self._first_tokens.append((token, sampled_at))
        self._wake.set()

    def _sent(self, transfer_ids: list[str]) -> None:
        if self.on_tokens_sent is None:
            return
        try:
            self.on_tokens_sent(transfer_ids)
        except Exception:
            log.exception("tokens_sent_not_handled", count=len(transfer_ids))

    def _take_first_tokens(self, stream: _Stream) -> list[pb.FirstToken] | None:
        """The tokens for ``stream``'s next report, remembered until the scheduler acks it; None
        once the stream is over."""
        with self._lock:
            if stream.over:
                return None
            out, self._first_tokens = self._first_tokens, []
            stream.unacked.append(out)
        return [t for t, _ in out]

    def _acked(self, stream: _Stream) -> None:
        """The scheduler acked ``stream``'s oldest unacked report: it relayed that report's tokens."""
        with self._lock:
            if stream.unacked:
                stream.unacked.popleft()

    def _end(self, stream: _Stream) -> None:
        """``stream`` is over: the tokens of its reports that no ack confirmed go out again on the
        next one, unless older than ``first_token_wait_s`` (decode failed those requests already)."""
        cutoff = time.monotonic() - self.cfg.first_token_wait_s
        with self._lock:
            stream.over = True
            keep: list[_Sampled] = []
            expired: list[pb.FirstToken] = []
            for report in stream.unacked:
                for token, sampled_at in report:
                    if sampled_at >= cutoff:
                        keep.append((token, sampled_at))
                    else:
                        expired.append(token)
            stream.unacked.clear()
            self._first_tokens = (keep + self._first_tokens)[: limits.MAX_EXPECTATIONS_PER_CALL]
        for token in expired:
            log.warning("first_token_dropped", transfer_id=token.transfer_id, reason="expired, never acked")
        if keep:
            log.info("first_tokens_resent", count=len(keep))

    def _take_leg_key(self, key: bytes) -> None:
        """Keeps the leg MAC key a registration brought (never logged: it is a secret)."""
        if not key:
            return
        if self.leg_keys is None:
            log.warning("leg_mac_key_unused", reason="this engine verifies no MACed legs (no mutual TLS)")
        elif not self.leg_keys.set(key):
            log.warning("leg_mac_key_refused", reason=f"{len(key)} bytes, not a key")

    def _reports(self, interval_s: float, stream: _Stream) -> Iterator[pb.LoadReport]:
        while not self._stop.is_set():
            report = self.load()
            report.engine_id = self.info.engine_id
            report.incarnation = self.info.incarnation
            tokens = self._take_first_tokens(stream)
            if tokens is None:
                return  # the stream is over (grpc may still pull from it)
            report.first_tokens.extend(tokens)
            report.prefills_done.extend(self._take_prefills_done())
            yield report
            if tokens:  # gRPC asks for the next report only once this one's send completed
                self._sent([t.transfer_id for t in tokens])
            self._wake.wait(interval_s)
            self._wake.clear()
        report = self.load()
        report.engine_id, report.incarnation, report.draining = self.info.engine_id, self.info.incarnation, True
        yield report  # goodbye: a clean deregistration

    def _run(self) -> None:
        name_native_thread("kv-register")
        backoff = 0.2
        while not self._stop.is_set():
            channel = self.security.sync_channel(self.cfg.scheduler_address, CHANNEL_OPTIONS)
            stream = _Stream()
            try:
                stub = pb_grpc.SchedulerStub(channel)
                resp = stub.Register(pb.RegisterRequest(instance=self.info), timeout=5)
                interval = min(self.cfg.load_report_ms / 1e3, max(0.05, resp.lease_interval_ms / 1e3 / 2))
                self._take_leg_key(resp.leg_mac_key)
                if self._direct_ok:
                    self._direct = stub
                self.registered.set()
                log.info("registered", scheduler=self.cfg.scheduler_address, engine_id=self.info.engine_id)
                backoff = 0.2
                for ack in stub.ReportLoad(self._reports(interval, stream)):
                    if ack.sequence:  # a report's ack (pushes between reports carry no sequence)
                        self._acked(stream)
                    if ack.leg_failures and self.on_leg_failures is not None:
                        failures = list(ack.leg_failures)[: limits.MAX_EXPECTATIONS_PER_CALL]
                        try:
                            self.on_leg_failures(failures)
                        except Exception:
                            log.exception("leg_failures_not_handled", count=len(failures))
                    if ack.first_tokens and self.on_first_tokens is not None:
                        tokens = list(ack.first_tokens)[: limits.MAX_EXPECTATIONS_PER_CALL]
                        try:
                            self.on_first_tokens(tokens)
                        except Exception:
                            log.exception("first_tokens_not_handled", count=len(tokens))
            except grpc.RpcError as exc:
                self.registered.clear()
                log.warning(
                    "registration_lost",
                    scheduler=self.cfg.scheduler_address,
                    code=exc.code().name,
                    detail=exc.details() if isinstance(exc, grpc.Call) else None,
                )
            finally:
                self._direct = None
                self._end(stream)
                channel.close()
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 2.0)  # a restarted scheduler hears from everyone within ~2 s


def engine_incarnation(handshakes: list[RankHandshake]) -> str:
    """The engine's incarnation: its ranks' own, in rank order (a restarted rank changes it)."""
    return ",".join(h.incarnation for h in handshakes)


def register_engine(
    cfg: ConnectorConfig,
    role: pb.Role.ValueType,
    tp_size: int,
    ranks: list[RankHandshake],
    load: Callable[[], pb.LoadReport],
    on_leg_failures: Callable[[list[pb.LegFailure]], None] | None = None,
    on_first_tokens: Callable[[list[pb.FirstToken]], None] | None = None,
    first_token_handoff: bool = False,
    vocab_size: int = 0,
    leg_keys: EngineKeyRing | None = None,
    on_tokens_sent: Callable[[list[str]], None] | None = None,
) -> Registration | None:
    """Registers the engine with the kvpush scheduler and keeps its load stream, when configured."""
    if not cfg.scheduler_address:
        return None
    shape = ranks[0].shape
    assert shape is not None
    info = pb.InstanceInfo(
        engine_id=cfg.engine_id,
        role=role,
        incarnation=engine_incarnation(ranks),
        tp_size=tp_size,
        agent_endpoints=[h.endpoint for h in ranks],
        agent_incarnations=[h.incarnation for h in ranks],
        total_kv_blocks=ranks[0].num_blocks,
        tokens_per_block=shape.tokens_per_block,
        http_endpoint=cfg.http_endpoint,
        first_token_handoff=first_token_handoff,
        vocab_size=vocab_size,
    )
    return Registration(
        cfg,
        info,
        load,
        on_leg_failures=on_leg_failures,
        on_first_tokens=on_first_tokens,
        leg_keys=leg_keys,
        on_tokens_sent=on_tokens_sent,
    ).start()


def model_vocab_size(vllm_config: Any) -> int:
    """The model's vocabulary size, registered so that Generate refuses token ids outside it (0:
    unknown)."""
    model_config = getattr(vllm_config, "model_config", None)
    return int(model_config.get_vocab_size()) if model_config is not None else 0

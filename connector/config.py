"""Connector settings, read from vLLM's ``kv_transfer_config`` (pure)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpush.services.common.security import Security

_metrics_started = False


class ConfigError(ValueError):
    pass


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "0", "false", "no", ""):
        return raw.lower() in ("1", "true", "yes")
    raise ValueError(f"expected a boolean, got {raw!r}")


# Field type annotation (a string: postponed annotations) -> parser of a raw config value.
_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "int": int,
    "float": float,
    "float | None": float,
    "str": str,
    "bool": _bool,
}
# The engine process's GIL switch interval unless configured, by role (``ConnectorConfig``).
GIL_SWITCH_INTERVAL_DEFAULT_US = {"prefill": 500.0, "decode": 0.0}


@dataclass(frozen=True)
class ConnectorConfig:
    engine_id: str
    role: str  # "prefill" or "decode"
    agent_host: str = "127.0.0.1"
    agent_base_port: int = 0  # rank r listens on base + r; 0 picks free ports
    advertise_host: str = ""  # host peers use to reach the agents; defaults to agent_host
    scheduler_address: str = ""  # host:port of the kvpush scheduler; empty: do not register
    http_endpoint: str = ""  # this instance's OpenAI server, for the scheduler registry
    auth_token_file: str = ""  # file holding the shared stream secret (never the secret itself)
    # mTLS: PEM files of the cluster CA, this engine's certificate (SAN spiffe://kvpush/<role>/<engine_id>)
    # and its key. Plaintext only with insecure=true (logged as a warning at start-up).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    insecure: bool = False
    # Public key (PEM, Ed25519) that verifies the scheduler-signed kv_transfer_params legs.
    leg_public_key_file: str = ""
    model_id: str = ""  # part of the compatibility hash; defaults to the model path's basename
    # The reuse fence (docs/fence.md). Prefill: WRITEs only under a write lease renewed on the
    # stream; a WRITE in flight after write_timeout_s is torn down. Decode: a lost stream's blocks
    # are reusable after the rank's lease + write timeout + grace_s; a prefill rank announcing
    # more than max_fence_s is refused; KV not arrived after transfer_timeout_s fails the request.
    grace_s: float = 0.5
    write_lease_s: float = 2.0
    write_timeout_s: float = 10.0
    max_fence_s: float = 60.0
    transfer_timeout_s: float = 120.0
    prefill_lease_s: float = 30.0
    reservation_lease_ms: int = 30_000
    # Decode: times a failed transfer is moved to another prefill (Scheduler.Reroute) before vLLM's
    # kv_load_failure_policy decides; 0 turns retry elsewhere off. Needs scheduler_address.
    max_reroutes: int = 1
    # Decode rank's NIXL progress cadence while transfers wait: with the engine idle, and while
    # it runs forwards on the same core, when the engine thread also progresses at every step's
    # end (services/decode_agent/cadence.py).
    poll_interval_us: float = 100.0
    busy_poll_interval_us: float = 5000.0
    # The engine process's GIL switch interval (sys.setswitchinterval), 0: Python's (5 ms); unset:
    # the role's default (GIL_SWITCH_INTERVAL_DEFAULT_US). With the model in the EngineCore process
    # (the uni executor), the connector's threads wait for the GIL behind the engine loop. On
    # prefill 500 µs cut the hand-off's paired TTFT cost from +6.0-7.9 to +4.1 ms. Decode takes
    # its NIXL notices on the engine thread at each step's end or while the engine idles, and with
    # 500 µs its plain decode steps were slower in 3 of 5 launches (median +3.7 % TPOT, -6.9 to
    # +11.3 %, the interval toggled between requests of one process), so it keeps Python's
    # (docs/bench_phases.md).
    gil_switch_interval_us: float | None = None
    # NIXL UCX backend's error handling: "" keeps NIXL's default ("peer": dead peers detected on
    # every transport); "none" lets cma WRITEs complete without the target calling into NIXL.
    ucx_error_handling_mode: str = ""
    load_report_ms: int = 500
    # Decode: wake vLLM's engine loop from its 1 ms idle wait when a transfer is released or a
    # first token arrives (connector/engine_wake.py); false keeps vLLM's fixed sleep.
    engine_wake: bool = True
    # Decode: offer the first-token hand-off (docs/first_token.md). Takes effect only with vLLM's
    # kv_load_failure_policy "fail" and --worker-cls kvpush.connector.vllm_worker.KvPushWorker.
    first_token_handoff: bool = True
    first_token_wait_s: float = 30.0  # KV landed, token not come: the request fails after this
    # Prefill: true holds a hand-off transfer's push until the next engine step starts (its step's
    # output, the client's first token, is then out) instead of starting it at the forward's end,
    # where it competes with that output for the core. Off: paired, runs 58-86 (eight held, twelve
    # at the forward's end), the gap before the second token is 2.1 ms shorter with the push at the
    # forward's end, for 1.0 ms of TTFT (docs/bench_phases.md).
    push_after_output: bool = False
    # Prefill, with push_after_output: start a held push as soon as its first token has left this
    # process, if that comes before the next step (the registration and the worker share a process:
    # vLLM's uni executor; connector/handoff_holds.py). Off: no gain measured on the gap before the
    # second token that outweighed the TTFT it cost (docs/bench_serving.md, runs X-Z).
    push_on_token_sent: bool = False
    # Prefill: send each first token in its own ReportFirstTokens call from the engine thread that
    # sampled it; false: on the load stream only (the registration thread's wake-up waits behind
    # the step's output on a busy core; docs/first_token.md).
    first_token_direct: bool = True
    # Prefill: an OK completion of a hand-off transfer carries the first token when this engine has
    # sampled it by then, so decode need not wait for the scheduler's relay of it
    # (connector/completion_tokens.py; decode takes it under vLLM's uni executor only).
    first_token_on_completion: bool = True
    # ... and how long a completion whose WRITE finished before the engine posted that token waits
    # for it (the token comes at the step's end; a completion that gives up goes without it).
    first_token_completion_wait_ms: float = 5.0
    # ... posted for them by the worker the moment it is sampled (needs --worker-cls
    # kvpush.connector.vllm_worker.KvPushWorker on prefill too); false: when the request ends.
    first_token_at_sampling: bool = True
    # ... and the push of such a transfer waits for that token (its step's sampling, right after
    # the forward) instead of competing with the engine thread for the core until then.
    push_at_sampling: bool = True
    # ... and the engine thread waits up to this long after sampling for the writer to have posted
    # that push before it processes the step's output (0: no wait; the two then share the core).
    push_first_wait_ms: float = 2.0
    # Both roles: an OK completion also goes ahead of its RPC as a MACed NIXL notification, from
    # the prefill writer thread at the WRITE's end and (with the first token) from the engine
    # thread that sampled it, so neither waits for the agent's loop on a busy prefill core
    # (services/common/completion_notice.py). Decode mints the per-epoch key; false on either side
    # turns them off.
    completion_notices: bool = True
    # Prefill: the Completion RPC of an OK completion whose notice went waits this long before it
    # is sent (0: at once); failures and completions without a notice go at once. The notice has
    # released decode by then; the RPC confirms it (and completes the transfer if the notice was
    # lost) without landing on decode's CPU during the steps right after the release: paired,
    # the gap before the second token 1.3 ms shorter (docs/bench_phases.md, runs 99-102).
    completion_rpc_delay_ms: float = 200.0
    # Prometheus: the engine-core process serves base, worker rank r serves base + 1 + r; 0: off.
    metrics_base_port: int = 0
    # Logs each request's first scheduling and its end (scheduler process) and the forward end of
    # each step that scheduled a new request (worker), for every request, kvpush or not: the
    # per-phase benchmark's timeline (benchmarks/phases.py). Off in production.
    trace_steps: bool = False

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> ConnectorConfig:
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv_transfer_config.kv_role)
        if role is None:
            raise ConfigError(
                f"KvPushConnector needs kv_role kv_producer or kv_consumer, not {kv_transfer_config.kv_role!r}"
            )
        if not kv_transfer_config.engine_id:
            raise ConfigError("KvPushConnector needs a fixed kv_transfer_config.engine_id")
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys: {unknown}")
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            typ = known[key].type
            try:
                values[key] = _CONVERTERS[str(typ)](raw)
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"kv_connector_extra_config[{key!r}]: {exc}") from exc
        cfg = cls(engine_id=str(kv_transfer_config.engine_id), role=role, **values)
        cfg.check_transport()
        for key in ("poll_interval_us", "busy_poll_interval_us"):
            if not 0 < getattr(cfg, key) <= 1e6:
                raise ConfigError(f"kv_connector_extra_config[{key!r}] must be in (0, 1e6] microseconds")
        if cfg.gil_switch_interval_us is not None and not 0 <= cfg.gil_switch_interval_us <= 1e6:
            raise ConfigError("kv_connector_extra_config['gil_switch_interval_us'] must be in [0, 1e6] microseconds")
        if not 0 <= cfg.first_token_completion_wait_ms <= 1000:
            raise ConfigError("kv_connector_extra_config['first_token_completion_wait_ms'] must be in [0, 1000] ms")
        if not 0 <= cfg.completion_rpc_delay_ms <= 10_000:
            raise ConfigError("kv_connector_extra_config['completion_rpc_delay_ms'] must be in [0, 10000] ms")
        return cfg

    def switch_interval_us(self) -> float:
        """The GIL switch interval this engine's process gets (0: Python's own)."""
        if self.gil_switch_interval_us is not None:
            return self.gil_switch_interval_us
        return GIL_SWITCH_INTERVAL_DEFAULT_US[self.role]

    _TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file")

    def check_transport(self) -> None:
        """mTLS needs all three TLS files; plaintext needs ``insecure=true`` and none of them."""
        given = [k for k in self._TLS_KEYS if getattr(self, k)]
        if not given and self.insecure:
            return
        if len(given) != len(self._TLS_KEYS):
            missing = [k for k in self._TLS_KEYS if not getattr(self, k)]
            raise ConfigError(
                f"kv_connector_extra_config needs {missing} for mutual TLS on the kvpush gRPC hops "
                "(or insecure=true for plaintext, development only)"
            )

    def security(self, component: str) -> Security:
        """The gRPC credentials of this engine's agents: mTLS with its certificate (whose SPIFFE id
        must name this engine and role), or plaintext with ``insecure`` and no TLS files (logged)."""
        from kvpush.services.common.security import PeerIdentity, Security, SecurityError, TlsFiles

        self.check_transport()
        if not self.tls_cert_file:
            return Security.insecure(component)
        try:
            sec = Security.mtls(TlsFiles(self.tls_ca_file, self.tls_cert_file, self.tls_key_file), component)
        except SecurityError as exc:
            raise ConfigError(str(exc)) from exc
        if sec.identity != PeerIdentity(self.role, self.engine_id):
            raise ConfigError(
                f"tls_cert_file {self.tls_cert_file} is for {sec.identity.spiffe_id if sec.identity else 'no kvpush'} "
                f"identity, this engine is spiffe://kvpush/{self.role}/{self.engine_id}"
            )
        return sec

    def auth_token(self) -> str:
        """The shared stream secret, read from ``auth_token_file`` (empty when none is configured)."""
        if not self.auth_token_file:
            return ""
        try:
            with open(self.auth_token_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise ConfigError(f"auth_token_file: {exc}") from exc

    def ucx_params(self) -> dict[str, str]:
        return {"ucx_error_handling_mode": self.ucx_error_handling_mode} if self.ucx_error_handling_mode else {}

    def port_for(self, rank: int) -> int:
        return self.agent_base_port + rank if self.agent_base_port else 0

    def serve_metrics(self, offset: int) -> None:
        """Starts the Prometheus endpoint of this process (idempotent per process)."""
        global _metrics_started
        if self.metrics_base_port and not _metrics_started:
            from prometheus_client import start_http_server

            start_http_server(self.metrics_base_port + offset, addr=self.agent_host)
            _metrics_started = True

    def advertised(self, port: int) -> str:
        return f"{self.advertise_host or self.agent_host}:{port}"

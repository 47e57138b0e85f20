"""The one place the connector's scheduler side reads a request's ``kv_transfer_params``.

``LegGate.of(request)`` returns the request's leg only when it is well formed (``parse``), for this
engine and role, and, with ``leg_public_key_file`` configured, signed by the scheduler and not
expired (or MACed with this engine's key: ``leg_macs``). Anything else is refused: one ``leg_refused`` log line, one count in
``kvpush_connector_legs_refused_total{role,reason}``, and the request is served as a plain instance
would (decode computes the prompt locally, prefill pushes nothing). It never raises: vLLM calls the
hooks from its engine loop, where an exception kills the EngineCore.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import Counter

from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.services.common.leg_macs import EngineKeyRing
from kvpush.services.common.leg_signing import LegRefused, LegVerifier, check_leg
from kvpush.services.common.logs import get_logger
from kvpush.services.common.transfer_params import KEY, MAX_ID_CHARS, Leg, LegError, parse

log = get_logger("kvpush.connector.legs")

REFUSED = Counter(
    "kvpush_connector_legs_refused_total",
    "Requests whose kvpush kv_transfer_params were refused (served as on a plain instance), by reason",
    ["role", "reason"],
)
_CACHE_LIMIT = 1 << 16  # verified legs kept per engine; entries go when their request finishes


def leg_verifier(cfg: ConnectorConfig) -> LegVerifier | None:
    """The verifier of this engine's legs: signed legs with ``cfg.leg_public_key_file``, MACed legs
    with the key its registration brings (only over mutual TLS to a scheduler: ``tls_*`` files and
    ``scheduler_address``). None with ``insecure=true`` and no key file. Raises ConfigError at
    start-up when nothing can verify a leg or the key cannot be loaded."""
    mac_keys = EngineKeyRing() if cfg.tls_cert_file and cfg.scheduler_address else None
    if cfg.leg_public_key_file:
        try:
            return LegVerifier.from_file(cfg.leg_public_key_file, mac_keys=mac_keys)
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config['leg_public_key_file']: {exc}") from exc
    if not cfg.insecure:
        if mac_keys is not None:
            return LegVerifier(None, mac_keys=mac_keys)  # MACed legs only (a scheduler with --leg-mac-key)
        raise ConfigError(
            "KvPushConnector needs kv_connector_extra_config['leg_public_key_file'] (the scheduler's leg "
            "signing public key, e.g. /etc/kvpush/leg-signing.pub), or a scheduler_address over mutual TLS "
            "(for MACed legs), to verify kv_transfer_params; set insecure=true to accept unsigned legs "
            "(development only)"
        )
    log.warning("legs_unverified", engine_id=cfg.engine_id, reason="insecure=true and no leg_public_key_file")
    return None


def _transfer_id_of(params: Any) -> str | None:
    """The transfer id for the refusal log, only when it is a short string."""
    try:
        tid = params[KEY]["transfer_id"]
    except Exception:  # hostile input: any shape at all
        return None
    return tid if isinstance(tid, str) and len(tid) <= MAX_ID_CHARS else None


class LegGate:
    """Parses and checks each request's leg once, and remembers the answer until ``forget``."""

    def __init__(self, cfg: ConnectorConfig, verifier: LegVerifier | None = None, *, verify: bool = True) -> None:
        self.engine_id = cfg.engine_id
        self.role = cfg.role
        self.verifier = leg_verifier(cfg) if verify and verifier is None else verifier
        self._legs: dict[str, Leg | None] = {}

    def of(self, request: Any) -> Leg | None:
        """The request's checked leg, or None (no kvpush params, or refused). Never raises."""
        try:
            rid = request.request_id
            if rid in self._legs:
                return self._legs[rid]
        except Exception:  # a request without a usable id: check it every time
            rid = None
        leg = self._check(request, rid)
        if rid is not None:
            if len(self._legs) >= _CACHE_LIMIT:
                self._legs.clear()  # only a leak upstream gets here; checking again is safe
            self._legs[rid] = leg
        return leg

    @property
    def mac_keys(self) -> EngineKeyRing | None:
        """Where this engine's registration puts its leg MAC key (None: MACed legs are not verified)."""
        return self.verifier.mac_keys if self.verifier is not None else None

    def forget(self, request_id: str) -> None:
        self._legs.pop(request_id, None)

    @staticmethod
    def claims_handoff(request: Any) -> tuple[bool, str | None]:
        """Whether a request's params say it takes the first-token hand-off (``first_token`` true),
        whatever became of its leg, and their transfer id (for logs). A request whose leg was
        refused is asked this: its frontend may have streamed prefill's token already, so it must
        never be computed as if there were none. Never raises."""
        try:
            params = request.kv_transfer_params
            fields = params.get(KEY) if isinstance(params, dict) else None
            claims = isinstance(fields, dict) and fields.get("first_token") is True
        except Exception:  # hostile input: any shape at all
            return False, None
        return claims, _transfer_id_of(params) if claims else None

    def _check(self, request: Any, rid: Any) -> Leg | None:
        params: Any = None
        error: Exception
        try:
            params = request.kv_transfer_params
            leg = parse(params)
            if leg is None:
                return None
            check_leg(leg, self.engine_id, self.role, self.verifier)
            return leg
        except LegRefused as exc:
            reason, error = exc.reason, exc
        except LegError as exc:
            reason, error = "malformed", exc
        except Exception as exc:  # never let a request's params reach the engine loop
            reason, error = "internal_error", exc
        with contextlib.suppress(Exception):  # nor the log line about them
            REFUSED.labels(self.role, reason).inc()
            log.warning(
                "leg_refused",
                request_id=rid if isinstance(rid, str) else None,
                transfer_id=_transfer_id_of(params),
                reason=reason,
                detail=f"{type(error).__name__}: {error}"[:300],
            )
        return None

"""Transport security of every kvpush gRPC hop: mutual TLS, peer identities and per-method policy.

Every component holds a certificate from the cluster CA whose one URI SAN is a SPIFFE id
``spiffe://kvpush/<role>/<name>``: role ``scheduler``, ``prefill``, ``decode`` or ``frontend``
(operator tools and frontends), name the engine id for prefill and decode. Servers require a
client certificate from the same CA (``require_client_auth``), and an interceptor checks, before
any handler runs, that the peer's role may call the method (:data:`SCHEDULER_POLICY`, ...);
handlers then bind what a message claims (an engine id) to the peer's name (:func:`claim_problem`).

Plaintext exists only as an explicit choice (:meth:`Security.insecure`), logged at start-up; then
there is no identity and every call is allowed.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvpush.services.common.logs import get_logger
from kvpush.v1 import kvpush_pb2 as pb


def _log() -> Any:
    # Not bound at import: the process configures logging (JSON or not) after importing this.
    return get_logger("security")


SCHEDULER = "scheduler"
PREFILL = "prefill"
DECODE = "decode"
FRONTEND = "frontend"
ROLES = (SCHEDULER, PREFILL, DECODE, FRONTEND)
TRUST_DOMAIN = "kvpush"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SPIFFE_RE = re.compile(rf"spiffe://{TRUST_DOMAIN}/([a-z]+)/({NAME_RE.pattern})")

ROLE_NAMES: dict[int, str] = {pb.ROLE_PREFILL: PREFILL, pb.ROLE_DECODE: DECODE}


class SecurityError(RuntimeError):
    """A TLS file is missing or unreadable, or a security setting is inconsistent."""


@dataclass(frozen=True)
class PeerIdentity:
    role: str
    name: str

    @property
    def spiffe_id(self) -> str:
        return spiffe_id(self.role, self.name)


def spiffe_id(role: str, name: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {ROLES}")
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"bad identity name {name!r}: letters, digits, '.', '_', '-' (at most 128)")
    return f"spiffe://{TRUST_DOMAIN}/{role}/{name}"


def parse_spiffe_id(uri: str) -> PeerIdentity | None:
    """``spiffe://kvpush/<role>/<name>`` -> identity; anything else (another trust domain, a
    deeper path, an unknown role) -> None."""
    m = _SPIFFE_RE.fullmatch(uri)
    if m is None or m.group(1) not in ROLES:
        return None
    return PeerIdentity(m.group(1), m.group(2))


def peer_identity(context: Any) -> PeerIdentity | None:
    """The authenticated peer of a server call: the SPIFFE id of its verified certificate. None
    on an insecure server, or when the certificate has no (single, valid) kvpush SPIFFE id."""
    try:
        values = context.auth_context().get("peer_spiffe_id") or []
    except (AttributeError, ValueError):
        return None
    if len(values) != 1:
        return None
    raw = values[0]
    return parse_spiffe_id(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw))


def claim_problem(peer: PeerIdentity | None, engine_id: str, role: str | None = None) -> str | None:
    """Why a message claiming to come from ``engine_id`` (in ``role``) may not come from ``peer``;
    None when it may (always on an insecure server, where there is no peer identity)."""
    if peer is None:
        return None
    if engine_id != peer.name:
        return f"peer {peer.spiffe_id} may not speak for engine {engine_id!r}"
    if role is not None and role != peer.role:
        return f"peer {peer.spiffe_id} may not act as a {role}"
    return None


# ----- files and credentials --------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    ca_file: str
    cert_file: str
    key_file: str

    @classmethod
    def in_dir(cls, directory: str | Path, name: str) -> TlsFiles:
        """The files ``make certs`` writes for ``name`` (an engine id, ``scheduler``, ``frontend``)."""
        d = Path(directory)
        return cls(str(d / "ca.pem"), str(d / f"{name}.pem"), str(d / f"{name}.key"))


def cert_identity(pem: bytes) -> PeerIdentity | None:
    """The kvpush SPIFFE identity of a PEM certificate: its single kvpush URI SAN, else None."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except (ValueError, x509.ExtensionNotFound):
        return None
    ids = [i for i in (parse_spiffe_id(u) for u in uris) if i is not None]
    return ids[0] if len(ids) == 1 and len(uris) == 1 else None


def _check_pair(cert_pem: bytes, key_pem: bytes, files: TlsFiles) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise SecurityError(f"cannot load {files.cert_file} / {files.key_file}: {exc}") from exc
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise SecurityError(f"the key {files.key_file} does not belong to the certificate {files.cert_file}")


def _read(kind: str, path: str) -> bytes:
    if not path:
        raise SecurityError(f"no {kind} file configured")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read the {kind} file {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise SecurityError(f"the {kind} file {path} holds no PEM data")
    return data


class Security:
    """Credentials of one component: mutual TLS, or plaintext chosen explicitly."""

    def __init__(self, component: str, ca: bytes = b"", cert: bytes = b"", key: bytes = b"") -> None:
        self.component = component
        self._ca, self._cert, self._key = ca, cert, key

    @classmethod
    def mtls(cls, files: TlsFiles, component: str = "") -> Security:
        """Reads the three PEM files once; a missing or unreadable one raises :class:`SecurityError`."""
        sec = cls(
            component or Path(files.cert_file).stem,
            _read("CA certificate", files.ca_file),
            _read("certificate", files.cert_file),
            _read("private key", files.key_file),
        )
        _check_pair(sec._cert, sec._key, files)
        return sec

    @classmethod
    def insecure(cls, component: str) -> Security:
        """Plaintext gRPC, no identities: only for tests and explicit ``--insecure`` set-ups."""
        _log().warning("plaintext_grpc", service=component, detail="mTLS is off: no peer is authenticated")
        return cls(component)

    @property
    def secure(self) -> bool:
        return bool(self._cert)

    @property
    def identity(self) -> PeerIdentity | None:
        """The kvpush identity in this component's own certificate (None in plaintext)."""
        if not self.secure:
            return None
        return cert_identity(self._cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        self._need_tls()
        return grpc.ssl_server_credentials(
            [(self._key, self._cert)], root_certificates=self._ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        self._need_tls()
        return grpc.ssl_channel_credentials(
            root_certificates=self._ca, private_key=self._key, certificate_chain=self._cert
        )

    def add_port(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        """Binds ``address`` (TLS with client certificates, or plaintext); returns the port."""
        if self.secure:
            port: int = server.add_secure_port(address, self.server_credentials())
        else:
            port = server.add_insecure_port(address)
        return port

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        if self.secure:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options)

    def sync_channel(self, target: str, options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
        if self.secure:
            return grpc.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.insecure_channel(target, options=options)

    def interceptors(self, policy: Mapping[str, Rule], own_name: str = "") -> list[grpc.aio.ServerInterceptor]:
        """The server interceptors enforcing ``policy``; none in plaintext (every call allowed)."""
        return [Authorizer(policy, own_name)] if self.secure else []

    def _need_tls(self) -> None:
        if not self.secure:
            raise SecurityError(f"{self.component}: plaintext security has no TLS credentials")


# ----- authorization ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Who may call one method: a peer whose role is in ``roles``; with ``same_name``, also only
    the peer whose name is the server's own engine id (the other half of the same engine)."""

    roles: frozenset[str]
    same_name: bool = False


def _rule(*roles: str, same_name: bool = False) -> Rule:
    return Rule(frozenset(roles), same_name)


ANY_PEER = _rule(*ROLES)
# Open to every authenticated peer (probes, grpcurl with a frontend certificate).
OPEN_SERVICE_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def _policy(service: str, rules: Mapping[str, Rule]) -> dict[str, Rule]:
    desc = pb.DESCRIPTOR.services_by_name[service]
    methods = {m.name for m in desc.methods}
    if set(rules) != methods:
        raise AssertionError(f"{service} policy must cover exactly {sorted(methods)}, not {sorted(rules)}")
    return {f"/{desc.full_name}/{name}": rule for name, rule in rules.items()}


SCHEDULER_POLICY = _policy(
    "Scheduler",
    {
        "Register": _rule(PREFILL, DECODE),
        "ReportLoad": _rule(PREFILL, DECODE),
        "ReportFirstTokens": _rule(PREFILL),
        "ListInstances": _rule(FRONTEND),
        "Watch": _rule(FRONTEND),
        "Assign": _rule(FRONTEND),
        "Release": _rule(FRONTEND),
        "AssignStream": _rule(FRONTEND),
        "Reroute": _rule(DECODE),
        "ReportLegFailure": _rule(FRONTEND),
        "AwaitFirstToken": _rule(FRONTEND),
        "Generate": _rule(FRONTEND),
    },
)
PREFILL_AGENT_POLICY = _policy("PrefillAgent", {"Reservations": _rule(DECODE)})
DECODE_RANK_POLICY = _policy(
    "DecodeRank",
    {
        "Complete": _rule(PREFILL),
        "Expect": _rule(DECODE, same_name=True),
        "Settle": _rule(DECODE, same_name=True),
    },
)


def decide(rule: Rule | None, peer: PeerIdentity | None, own_name: str) -> tuple[grpc.StatusCode, str] | None:
    """None when ``peer`` may make a call governed by ``rule`` (None: the method has no rule)."""
    if peer is None:
        return grpc.StatusCode.UNAUTHENTICATED, "no kvpush SPIFFE identity in the client certificate"
    if rule is None or peer.role not in rule.roles:
        return grpc.StatusCode.PERMISSION_DENIED, f"a {peer.role} may not call this method"
    if rule.same_name and peer.name != own_name:
        return grpc.StatusCode.PERMISSION_DENIED, f"only {own_name!r} itself may call this method"
    return None


class Authorizer(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """Checks every call against the policy before its handler runs (unary and streaming, async
    and sync handlers alike); refused calls end with PERMISSION_DENIED or UNAUTHENTICATED."""

    def __init__(self, policy: Mapping[str, Rule], own_name: str = "") -> None:
        self.policy = dict(policy)
        self.own_name = own_name

    def rule_for(self, method: str) -> Rule | None:
        rule = self.policy.get(method)
        if rule is None and method.startswith(OPEN_SERVICE_PREFIXES):
            return ANY_PEER
        return rule

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: UNIMPLEMENTED
        method = handler_call_details.method
        return _wrap(handler, method, self.rule_for(method), self.own_name)


def _refusal(context: Any, method: str, rule: Rule | None, own_name: str) -> tuple[grpc.StatusCode, str] | None:
    peer = peer_identity(context)
    problem = decide(rule, peer, own_name)
    if problem is not None:
        _log().warning(
            "rpc_denied",
            method=method,
            peer_role=peer.role if peer else None,
            peer_name=peer.name if peer else None,
            peer=context.peer(),
            code=problem[0].name,
            reason=problem[1],
        )
    return problem


def _wrap(handler: grpc.RpcMethodHandler, method: str, rule: Rule | None, own_name: str) -> grpc.RpcMethodHandler:
    if handler.unary_unary is not None:
        kind, fn, make = "unary", handler.unary_unary, grpc.unary_unary_rpc_method_handler
    elif handler.stream_unary is not None:
        kind, fn, make = "unary", handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.unary_stream is not None:
        kind, fn, make = "stream", handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        kind, fn, make = "stream", handler.stream_stream, grpc.stream_stream_rpc_method_handler
    wrapped: Callable[..., Any]

    if inspect.isasyncgenfunction(fn):

        async def wrapped(request: Any, context: Any) -> Any:
            problem = _refusal(context, method, rule, own_name)
            if problem is not None:
                await context.abort(*problem)
            async for item in fn(request, context):
                yield item

    elif inspect.iscoroutinefunction(fn):

        async def wrapped(request: Any, context: Any) -> Any:
            problem = _refusal(context, method, rule, own_name)
            if problem is not None:
                await context.abort(*problem)
            return await fn(request, context)

    elif kind == "stream":  # a sync generator (the health servicer's Watch), run in a thread

        def wrapped(request: Any, context: Any) -> Any:
            problem = _refusal(context, method, rule, own_name)
            if problem is not None:
                context.abort(*problem)
            yield from fn(request, context)

    else:

        def wrapped(request: Any, context: Any) -> Any:
            problem = _refusal(context, method, rule, own_name)
            if problem is not None:
                context.abort(*problem)
            return fn(request, context)

    return make(
        wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )

"""The ``kv_transfer_params`` contract between the scheduler (who mints them) and the connector.

Both legs of a request carry one dict under the key ``"kvpush"``; vLLM passes it through
``Request.kv_transfer_params`` untouched. Anyone who can reach a vLLM's HTTP port can send any JSON
there, so ``parse`` is total: every value is type- and bounds-checked, and anything malformed raises
``LegError`` (a ``ValueError``) and nothing else.

A leg minted by a scheduler with a signing key carries ``expires_at`` and ``sig``: an Ed25519
signature over ``canonical_bytes(leg)``, every field but ``sig`` and ``proof``
(``kvpush.services.common.leg_signing``). A leg minted in a batch (``AssignStream``) also carries
``proof``: its Merkle inclusion path, and ``sig`` is then the signature of the batch's root. A
scheduler with a MAC master instead of a signing key sets ``mac``: an HMAC of the same bytes under
the key of the engine the leg is for (``kvpush.services.common.leg_macs``).

Two kinds of epoch, on purpose: a leg's ``epoch`` is the scheduler's **assignment** epoch (which
version of the assignment the leg belongs to: what a frontend passes to ``Release``, and what the
signature binds the leg to; ``Reroute`` mints a new one). The epochs on the reservation stream are
the decode agent's own **reservation** epochs, the fence of docs/fence.md: they must grow with every
reservation decode publishes for a transfer, which only the decode engine can guarantee (it also
re-reserves on its own), so it mints them and the connector does not read the leg's epoch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from kvpush.services.common import limits

KEY = "kvpush"

# Bounds of every field (the scheduler never mints anything larger; see docs/security.md).
MAX_ID_CHARS = limits.MAX_ID_CHARS  # transfer ids, engine ids, incarnations
MAX_ENDPOINT_CHARS = limits.MAX_ENDPOINT_CHARS
MAX_LIST_ENTRIES = 1024
MAX_EPOCH = 1 << 53  # epochs are exact in a JSON/protobuf double
MAX_TP_SIZE = 1024
MAX_EXPIRES_AT = 1e11  # unix seconds (year 5138): bounds the float, not the policy
MAX_SIG_CHARS = 128  # base64url of a 64-byte Ed25519 signature is 86
# A batch-signed leg's Merkle inclusion proof: a version byte and up to MAX_PROOF_STEPS steps of
# 33 bytes (a side byte and a SHA-256 sibling), base64url: 1 + 20 * 33 bytes are 881 characters.
MAX_PROOF_STEPS = 20  # 2**20 legs in one batch; the scheduler signs at most 2 * MAX_ASSIGNS_PER_BATCH
MAX_PROOF_CHARS = 1024

_SIGNING_CONTEXT = b"kvpush.leg.v1\n"  # domain separation: these bytes sign nothing else
_ENDPOINT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")
_SIG = re.compile(r"[A-Za-z0-9_-]*")
MAX_MAC_CHARS = 64  # base64url of a 32-byte HMAC-SHA256 is 43
_UNSIGNED_FIELDS = frozenset({"sig", "proof", "mac"})  # the signature, the path to it and the MAC sign nothing


class LegError(ValueError):
    """Malformed kvpush params: the request is served as if it carried none."""


@dataclass(frozen=True)
class PrefillLeg:
    """Sent to the prefill instance (with ``max_tokens=1``)."""

    transfer_id: str
    decode_engine_id: str
    role: str = "prefill"
    prefill_engine_id: str = ""  # the engine this leg is for; empty only in unsigned, hand-built legs
    epoch: int = 0  # the scheduler's assignment epoch; 0: not given (unsigned, hand-built legs)
    expires_at: float = 0.0  # unix seconds; 0: no expiry (unsigned legs)
    sig: str = ""  # base64url Ed25519 signature of canonical_bytes(leg); empty: unsigned
    # First-token hand-off: prefill reports the token it samples to the scheduler, which relays it
    # to the decode engine (docs/first_token.md).
    first_token: bool = False
    proof: str = ""  # base64url Merkle inclusion proof; set: ``sig`` signs the batch's root
    mac: str = ""  # base64url HMAC-SHA256 of canonical_bytes(leg) under this engine's key (leg_macs)


@dataclass(frozen=True)
class DecodeLeg:
    """Sent to the decode instance: everything it needs to publish its reservation at once."""

    transfer_id: str
    epoch: int
    prefill_engine_id: str
    prefill_incarnation: str
    prefill_tp_size: int
    prefill_agent_endpoints: list[str] = field(default_factory=list)
    # Per prefill rank, aligned with the endpoints; a rank whose incarnation differs (it restarted
    # since the assignment) refuses the stream. Empty: not checked.
    prefill_rank_incarnations: list[str] = field(default_factory=list)
    role: str = "decode"
    decode_engine_id: str = ""  # the engine this leg is for; empty only in unsigned, hand-built legs
    expires_at: float = 0.0
    sig: str = ""
    # First-token hand-off: decode continues from the token its prefill sampled (appended to the
    # prompt once it arrives); the frontend sends this leg with one token less (docs/first_token.md).
    first_token: bool = False
    proof: str = ""
    mac: str = ""


Leg = PrefillLeg | DecodeLeg


def to_params(leg: Leg) -> dict[str, Any]:
    return {KEY: asdict(leg)}


def canonical_bytes(fields: Mapping[str, Any]) -> bytes:
    """The bytes a leg's signature covers: every field but ``sig`` and ``proof``, as sorted, compact,
    ASCII JSON (a batch-signed leg: the bytes of its Merkle leaf).

    ``fields`` is ``asdict(leg)`` of a parsed leg (or the scheduler's dict of the same fields, with
    the same Python types): values are normalised by ``parse`` (ints are ints, ``expires_at`` a
    float), so a leg that went through a protobuf Struct (every number a double) or another JSON
    encoder verifies the same. JSON strings, numbers and lists are unambiguous, so no two different
    legs share these bytes.
    """
    # ``first_token`` is signed only when set, so legs without the hand-off sign as they always did.
    body = {k: v for k, v in fields.items() if k not in _UNSIGNED_FIELDS and not (k == "first_token" and v is False)}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return _SIGNING_CONTEXT + text.encode("ascii")


class CanonicalTemplate:
    """``canonical_bytes`` of the legs that differ from ``fields`` only in ``transfer_id``, ``epoch``
    and ``expires_at``, by splicing those three values into the template's bytes (the scheduler's
    batch path: no JSON encoding per leg). ``render`` equals ``canonical_bytes`` of the same fields."""

    _VARIABLE = ("transfer_id", "epoch", "expires_at")

    def __init__(self, fields: Mapping[str, Any]) -> None:
        sentinels = {k: f"\x00kvpush-{k}\x00" for k in self._VARIABLE}
        text = canonical_bytes({**fields, **sentinels})
        marks = sorted((text.index(encode_basestring_ascii(v).encode("ascii")), k) for k, v in sentinels.items())
        self._order = [k for _, k in marks]
        parts: list[bytes] = []
        at = 0
        for pos, k in marks:
            parts.append(text[at:pos])
            at = pos + len(encode_basestring_ascii(sentinels[k]))
        parts.append(text[at:])
        # One bytes %-format with the values in text order (a literal % in the text doubled).
        self._format = b"%s".join(part.replace(b"%", b"%%") for part in parts)
        self._slots = tuple(self._VARIABLE.index(k) for k in self._order)

    def render(self, transfer_id: str, epoch: int, expires_at: float) -> bytes:
        if type(epoch) is not int or type(expires_at) is not float or not math.isfinite(expires_at):
            raise TypeError("epoch must be an int and expires_at a finite float")
        values = (
            encode_basestring_ascii(transfer_id).encode("ascii"),
            int.__repr__(epoch).encode("ascii"),  # what json.dumps writes for them
            float.__repr__(expires_at).encode("ascii"),
        )
        return self._format % tuple([values[i] for i in self._slots])


def params_json(canonical: bytes, sig: str = "", proof: str = "", mac: str = "") -> str:
    """A leg's ``kv_transfer_params`` as JSON text (``{"kvpush": {...}}``), from the leg's
    ``canonical_bytes`` and its ``sig``, ``proof`` and ``mac`` (base64url, so nothing to escape):
    what ``AssignStream``'s compact answers carry, for a frontend to put into the leg's HTTP body
    as is. ``parse(json.loads(text))`` is the leg those fields describe (``first_token`` false and
    empty ``sig``/``proof``/``mac`` are left out: they are the defaults)."""
    if not canonical.startswith(_SIGNING_CONTEXT) or not all(_SIG.fullmatch(v) for v in (sig, proof, mac)):
        raise ValueError("params_json needs canonical_bytes and base64url sig, proof and mac")
    return splice_params_json(canonical, sig, proof, mac)


def splice_params_json(canonical: bytes, sig: str, proof: str, mac: str) -> str:
    """``params_json`` without its checks, for the scheduler's batch path, whose inputs are
    ``canonical_bytes`` and base64url text it just made itself."""
    body = canonical[len(_SIGNING_CONTEXT) : -1].decode("ascii")
    tail = (
        (f',"mac":"{mac}"' if mac else "")
        + (f',"proof":"{proof}"' if proof else "")
        + (f',"sig":"{sig}"' if sig else "")
    )
    return f'{{"{KEY}":{body}{tail}}}}}'


def parse(params: Any) -> Leg | None:
    """Returns the leg in ``params``, None when the request carries no kvpush params.

    Raises ``LegError`` (and nothing else) for anything malformed: a value of the wrong type (bools
    are not ints; floats count as ints only when finite, integral and in range, since a protobuf
    Struct carries every number as a double), out of bounds, or inconsistent. Unknown keys are
    ignored: they are not part of the leg, so nothing acts on them.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise LegError("kv_transfer_params must be an object")
    if KEY not in params:
        return None
    raw = params[KEY]
    if not isinstance(raw, Mapping):
        raise LegError(f"kv_transfer_params[{KEY!r}] must be an object")
    role = raw.get("role")
    if role == "prefill":
        return PrefillLeg(
            transfer_id=_id(raw, "transfer_id", nonempty=True),
            decode_engine_id=_id(raw, "decode_engine_id", nonempty=True),
            prefill_engine_id=_id(raw, "prefill_engine_id", ""),
            epoch=_int(raw, "epoch", 0, MAX_EPOCH, 0),
            expires_at=_expiry(raw),
            sig=_sig(raw),
            first_token=_bool(raw, "first_token", False),
            proof=_proof(raw),
            mac=_mac(raw),
        )
    if role == "decode":
        tp = _int(raw, "prefill_tp_size", 1, MAX_TP_SIZE)
        endpoints = _list(raw, "prefill_agent_endpoints", _endpoint)
        incarnations = _list(raw, "prefill_rank_incarnations", _id_value, [])
        if len(endpoints) != tp:
            raise LegError(f"prefill_agent_endpoints has {len(endpoints)} entries for prefill_tp_size {tp}")
        if incarnations and len(incarnations) != tp:
            raise LegError(f"prefill_rank_incarnations has {len(incarnations)} entries for prefill_tp_size {tp}")
        return DecodeLeg(
            transfer_id=_id(raw, "transfer_id", nonempty=True),
            epoch=_int(raw, "epoch", 1, MAX_EPOCH),
            prefill_engine_id=_id(raw, "prefill_engine_id", nonempty=True),
            # The engine's incarnation is its ranks' incarnations joined by commas.
            prefill_incarnation=_id(raw, "prefill_incarnation", "", limit=(MAX_ID_CHARS + 1) * tp),
            prefill_tp_size=tp,
            prefill_agent_endpoints=endpoints,
            prefill_rank_incarnations=incarnations,
            decode_engine_id=_id(raw, "decode_engine_id", ""),
            expires_at=_expiry(raw),
            sig=_sig(raw),
            first_token=_bool(raw, "first_token", False),
            proof=_proof(raw),
            mac=_mac(raw),
        )
    raise LegError(f"unknown kvpush role {_show(role)}")


# ----- field checks (each raises LegError only) ------------------------------------------------

_MISSING: Any = object()


def _get(raw: Mapping[str, Any], key: str, default: Any) -> Any:
    value = raw.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise LegError(f"missing {key}")
        return default
    return value


def _show(value: Any) -> str:
    """A short description of a hostile value for error messages (never the value itself in full)."""
    if isinstance(value, str):
        text = repr(value[:41])
        return text if len(value) <= 40 else text[:40] + "..."
    if isinstance(value, int | float | bool) or value is None:
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "<huge int>"
        return text if len(text) <= 40 else text[:40] + "..."
    return f"<{type(value).__name__}>"


def _id_value(value: Any, key: str, limit: int = MAX_ID_CHARS, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise LegError(f"{key} must be a string, not {_show(value)}")
    if len(value) > limit:
        raise LegError(f"{key} is longer than {limit} characters")
    if not value.isprintable():
        raise LegError(f"{key} has non-printable characters")
    if nonempty and not value:
        raise LegError(f"{key} must not be empty")
    return value


def _id(
    raw: Mapping[str, Any], key: str, default: Any = _MISSING, limit: int = MAX_ID_CHARS, nonempty: bool = False
) -> str:
    return _id_value(_get(raw, key, default), key, limit, nonempty)


def _endpoint(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise LegError(f"{key} entries must be strings, not {_show(value)}")
    if len(value) > MAX_ENDPOINT_CHARS:
        raise LegError(f"{key} entry is longer than {MAX_ENDPOINT_CHARS} characters")
    m = _ENDPOINT.fullmatch(value)
    if m is None or not 0 < int(m.group(1)) < 65536:
        raise LegError(f"{key} entry {_show(value)} is not host:port")
    return value


def _list(raw: Mapping[str, Any], key: str, item: Any, default: Any = _MISSING) -> list[str]:
    value = _get(raw, key, default)
    if not isinstance(value, list):
        raise LegError(f"{key} must be a list, not {_show(value)}")
    if len(value) > MAX_LIST_ENTRIES:
        raise LegError(f"{key} has more than {MAX_LIST_ENTRIES} entries")
    return [item(v, key) for v in value]


def _int(raw: Mapping[str, Any], key: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    value = _get(raw, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LegError(f"{key} must be an integer, not {_show(value)}")
    if isinstance(value, float):
        # Only a finite, integral double in range is an integer here (math.isfinite first: no
        # conversion of inf or nan is ever attempted).
        if not math.isfinite(value) or not value.is_integer() or not lo <= value <= hi:
            raise LegError(f"{key} must be an integer in {lo}..{hi}, not {_show(value)}")
        return int(value)
    if not lo <= value <= hi:
        raise LegError(f"{key} must be in {lo}..{hi}, not {_show(value)}")
    return value


def _bool(raw: Mapping[str, Any], key: str, default: Any = _MISSING) -> bool:
    value = _get(raw, key, default)
    if not isinstance(value, bool):
        raise LegError(f"{key} must be a boolean, not {_show(value)}")
    return value


def _expiry(raw: Mapping[str, Any]) -> float:
    value = _get(raw, "expires_at", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LegError(f"expires_at must be a number, not {_show(value)}")
    if isinstance(value, int) and not 0 <= value <= MAX_EXPIRES_AT:
        raise LegError(f"expires_at must be in 0..{MAX_EXPIRES_AT:.0f}, not {_show(value)}")
    if not (math.isfinite(value) and 0.0 <= value <= MAX_EXPIRES_AT):
        raise LegError(f"expires_at must be in 0..{MAX_EXPIRES_AT:.0f}, not {_show(value)}")
    return float(value)


def _sig(raw: Mapping[str, Any]) -> str:
    value = _get(raw, "sig", "")
    if not isinstance(value, str) or len(value) > MAX_SIG_CHARS or not _SIG.fullmatch(value):
        raise LegError("sig must be a base64url string of at most 128 characters")
    return value


def _mac(raw: Mapping[str, Any]) -> str:
    value = _get(raw, "mac", "")
    if not isinstance(value, str) or len(value) > MAX_MAC_CHARS or not _SIG.fullmatch(value):
        raise LegError(f"mac must be a base64url string of at most {MAX_MAC_CHARS} characters")
    return value


def _proof(raw: Mapping[str, Any]) -> str:
    value = _get(raw, "proof", "")
    if not isinstance(value, str) or len(value) > MAX_PROOF_CHARS or not _SIG.fullmatch(value):
        raise LegError(f"proof must be a base64url string of at most {MAX_PROOF_CHARS} characters")
    return value

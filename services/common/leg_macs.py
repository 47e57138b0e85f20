"""Scheduler-MACed legs: HMAC-SHA256 with a key per engine, the cheap alternative to signed legs.

A leg is read by one engine only: the one it names (``prefill_engine_id`` on a prefill leg,
``decode_engine_id`` on a decode leg). So the scheduler need not sign legs for the world; it can
authenticate each leg for its one reader with a key only the two of them hold. The scheduler keeps
a master secret (``--leg-mac-key``); engine ``E``'s key is
``HMAC-SHA256(master, "kvpush.engine-key.v1\\n" || E)``, handed to ``E`` in its ``RegisterResponse``
over mutual TLS, and only to a peer whose certificate names ``E`` (the Register handler refuses any
other). Each leg carries ``mac``: base64url of ``HMAC-SHA256(key of the engine it names,
canonical_bytes(leg))``, the same bytes a signature covers. An engine holding its own key can forge
legs for itself only, which it could act on anyway; it cannot derive another engine's key.

Cost: one HMAC per leg (about 2 µs) where a signed batch costs an Ed25519 signature, a Merkle tree
and the proofs (about 45 µs a batch on the scheduler's event loop) and a signed leg an Ed25519
signature (about 30 µs): docs/scheduler.md has the measurements.

Several schedulers serving one fleet share the master secret (the key file), so every one of them
MACs with the key an engine got from any of them. An engine keeps its current and its previous key
(``EngineKeyRing``), so a master rotated by restarting the schedulers with a new file refuses no leg
minted just before: legs minted under an older master are refused as ``bad_signature``.

Make a master with ``python -m kvpush.services.common.leg_macs keygen DIR`` (``make certs`` does):
``DIR/leg-mac.key``, 32 random bytes as hex, mode 0600.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush.services.common.leg_signing import DEFAULT_TTL_S, LegAuth, keygen_cli, warn_if_exposed, write_private
from kvpush.services.common.logs import get_logger
from kvpush.services.common.transfer_params import canonical_bytes

MASTER_FILE = "leg-mac.key"
KEY_BYTES = 32  # engine keys and the master: SHA-256's output size
MAC_CHARS = 43  # base64url, unpadded, of a 32-byte HMAC-SHA256
_ENGINE_KEY_CONTEXT = b"kvpush.engine-key.v1\n"  # domain separation: an engine key, nothing else

log = get_logger("leg_macs")


def engine_key(master: bytes, engine_id: str) -> bytes:
    """Engine ``engine_id``'s key under ``master``."""
    return hmac.digest(master, _ENGINE_KEY_CONTEXT + engine_id.encode("utf-8"), "sha256")


def mac_of(key: bytes, canonical: bytes) -> str:
    """The ``mac`` of a leg given as its ``canonical_bytes``."""
    return _mac_text(hmac.digest(key, canonical, "sha256"))


def _mac_text(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _reader(fields: Mapping[str, Any]) -> str:
    """The engine a leg is for: the one that reads it."""
    return str(fields["prefill_engine_id"] if fields["role"] == "prefill" else fields["decode_engine_id"])


class LegMacer:
    """The scheduler's side: MACs each leg with the key of the engine it names. Same interface as
    ``LegSigner`` (``expiry``, ``seal``, ``seal_batch_bytes``), so the scheduler mints either kind."""

    def __init__(self, master: bytes, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> None:
        if len(master) < KEY_BYTES:
            raise ValueError(f"a leg MAC master secret needs at least {KEY_BYTES} bytes, got {len(master)}")
        if not ttl_s > 0:
            raise ValueError(f"leg ttl must be > 0, got {ttl_s}")
        self._master = master
        self.ttl_s = ttl_s
        self._clock = clock
        # Engine keys, derived once per engine (bounded: the registry holds at most a few thousand),
        # and each key's HMAC state after the key block, copied per leg (a quarter cheaper than
        # hmac.digest, which hashes the key block again every time).
        self.key_for: Callable[[str], bytes] = functools.lru_cache(maxsize=8192)(self._derive)
        self._keyed: Callable[[str], hmac.HMAC] = functools.lru_cache(maxsize=8192)(self._keyed_state)

    def _derive(self, engine_id: str) -> bytes:
        return engine_key(self._master, engine_id)

    def _keyed_state(self, engine_id: str) -> hmac.HMAC:
        return hmac.new(self.key_for(engine_id), digestmod=hashlib.sha256)

    def _mac(self, engine_id: str, canonical: bytes) -> str:
        h = self._keyed(engine_id).copy()
        h.update(canonical)
        return _mac_text(h.digest())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], ttl_s: float = DEFAULT_TTL_S) -> LegMacer:
        """Loads a master written by ``write_master`` (hex text). Raises ValueError with the file named."""
        try:
            text = Path(path).read_text("ascii").strip()
            mode = os.stat(path).st_mode
            master = bytes.fromhex(text)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"leg MAC key {path}: {exc}") from exc
        if len(master) < KEY_BYTES:
            raise ValueError(f"leg MAC key {path}: needs at least {KEY_BYTES} bytes (64 hex digits)")
        warn_if_exposed(path, mode, "leg_mac_key_permissions")
        return cls(master, ttl_s)

    def expiry(self) -> float:
        """``expires_at`` for a leg minted now (unix seconds, millisecond precision)."""
        return round(self._clock() + self.ttl_s, 3)

    def seal(self, fields: dict[str, Any], expires_at: float | None = None) -> dict[str, Any]:
        """Sets ``expires_at`` and ``mac`` of a leg's fields in place; returns them."""
        fields["expires_at"] = self.expiry() if expires_at is None else expires_at
        fields["mac"] = self._mac(_reader(fields), canonical_bytes(fields))
        return fields

    def seal_batch_bytes(self, canonical: Sequence[bytes], readers: Sequence[str]) -> list[LegAuth]:
        """Per leg given as its ``canonical_bytes`` and the engine it is for: its (sig, proof, mac)."""
        mac = self._mac
        return [("", "", mac(r, c)) for c, r in zip(canonical, readers, strict=True)]


class EngineKeyRing:
    """The engine's side: the keys its registrations were given, newest first (at most two: the
    current and the previous, so legs minted just before a master rotation still verify).
    Thread-safe: set by the registration thread, read by the engine loop."""

    def __init__(self) -> None:
        self._keys: tuple[bytes, ...] = ()
        self._lock = threading.Lock()

    def set(self, key: bytes) -> bool:
        """Takes a key from a RegisterResponse; False (and nothing changes) if it is not a key."""
        if len(key) != KEY_BYTES:
            return False
        with self._lock:
            if not self._keys or self._keys[0] != key:
                self._keys = (key, *self._keys[:1])
        return True

    def __bool__(self) -> bool:
        return bool(self._keys)

    def verify(self, canonical: bytes, mac_text: str) -> bool:
        """Whether ``mac_text`` is the MAC of ``canonical`` under one of the keys."""
        if len(mac_text) != MAC_CHARS:
            return False
        try:
            mac = base64.urlsafe_b64decode(mac_text + "=")
        except (binascii.Error, ValueError):
            return False
        keys = self._keys  # one read: a concurrent set swaps the whole tuple
        return any(hmac.compare_digest(hmac.digest(k, canonical, "sha256"), mac) for k in keys)


def write_master(out_dir: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Writes a new master secret to ``out_dir/leg-mac.key`` (0600); refuses to replace one unless
    ``overwrite``. Returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / MASTER_FILE
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists (overwrite=True / --force to replace)")
    write_private(path, (secrets.token_bytes(KEY_BYTES).hex() + "\n").encode("ascii"), 0o600)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    return keygen_cli(
        argv,
        "python -m kvpush.services.common.leg_macs",
        "master secret for scheduler-MACed legs",
        f"DIR/{MASTER_FILE} (0600)",
        lambda d, force: [write_master(d, overwrite=force)],
    )


if __name__ == "__main__":
    sys.exit(main())

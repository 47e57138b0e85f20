"""Scheduler-signed legs: Ed25519 over ``transfer_params.canonical_bytes``, one leg at a time or
one batch at a time.

A batch (``LegSigner.seal_batch``, the legs of one ``AssignStream`` answer) is signed once: its legs
are the leaves of a Merkle tree (SHA-256; leaf ``H(0x00 || canonical_bytes(leg))``, node
``H(0x01 || left || right)``, an odd node out moves up a level unchanged), the root is signed with
Ed25519 under its own domain (``kvpush.legbatch.v1``, so a root signature is never a leg signature
nor the reverse), and each leg carries that signature in ``sig`` and its inclusion path in
``proof``: base64url of a version byte (1) and, leaf to root, per level with a sibling, a side byte
(0: the sibling is on the right, 1: on the left) and the 32-byte sibling. The verifier folds the
path into a root and checks the signature of that root, so a leg whose path leads elsewhere, or
whose root signature is bad, is refused as ``bad_signature`` exactly as a tampered single-signed
leg; expiry and engine checks are the same for both. A verified (root, signature) pair is cached,
so an engine checks one Ed25519 signature per batch, not per leg.

The scheduler holds the private key (``LegSigner``) and signs both legs of every assignment; each
connector holds the public key (``LegVerifier``) and refuses a leg that is unsigned, tampered with,
expired or not for its engine before it dials or reserves anything (docs/security.md).

Key files are PEM: PKCS#8 for the private key, SubjectPublicKeyInfo for the public key. Make a pair
with ``python -m kvpush.services.common.leg_signing keygen DIR`` (or ``write_keypair``; ``make certs``
calls it): ``DIR/leg-signing.key`` (mode 0600) and ``DIR/leg-signing.pub``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import os
import stat
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvpush.services.common.logs import get_logger
from kvpush.services.common.transfer_params import (
    MAX_PROOF_STEPS,
    DecodeLeg,
    Leg,
    LegError,
    PrefillLeg,
    canonical_bytes,
)

KEY_FILE = "leg-signing.key"
PUB_FILE = "leg-signing.pub"
DEFAULT_TTL_S = 60.0
# A leg is accepted until expires_at + this: the scheduler's and the engines' clocks may differ by
# this much (NTP keeps them far closer). A leg lives ttl + skew at most.
DEFAULT_SKEW_S = 5.0

_ROOT_CONTEXT = b"kvpush.legbatch.v1\n"  # domain separation: a batch root, never a leg
_LEAF, _NODE = b"\x00", b"\x01"
_PROOF_VERSION = 1
_STEP = 33  # side byte + SHA-256
_VERIFIED_ROOTS = 4096  # (root, sig) pairs a verifier remembers as good

if TYPE_CHECKING:
    from kvpush.services.common.leg_macs import EngineKeyRing

log = get_logger("leg_signing")

LegAuth = tuple[str, str, str]  # what authenticates one leg: its (sig, proof, mac), "" where absent


class LegRefused(LegError):
    """A well-formed leg that must not be used. ``reason`` is a short label (metrics, logs):
    ``unsigned``, ``no_key``, ``bad_signature``, ``expired``, ``wrong_engine``, ``wrong_role``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _b64(sig: bytes) -> str:
    return base64.urlsafe_b64encode(sig).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _leaf(fields: Mapping[str, Any]) -> bytes:
    return hashlib.sha256(_LEAF + canonical_bytes(fields)).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def merkle_proofs(leaves: Sequence[bytes]) -> tuple[bytes, list[bytes]]:
    """The root over ``leaves`` (leaf hashes) and each leaf's proof bytes (version byte and steps)."""
    if not leaves:
        raise ValueError("a Merkle tree needs at least one leaf")
    paths = [bytearray([_PROOF_VERSION]) for _ in leaves]
    # Per node of the current level: the leaves under it.
    level: list[bytes] = list(leaves)
    under: list[list[int]] = [[i] for i in range(len(leaves))]
    while len(level) > 1:
        nxt: list[bytes] = []
        nxt_under: list[list[int]] = []
        for i in range(0, len(level) - 1, 2):
            left, right = level[i], level[i + 1]
            for leaf in under[i]:
                paths[leaf] += b"\x00" + right
            for leaf in under[i + 1]:
                paths[leaf] += b"\x01" + left
            nxt.append(_node(left, right))
            nxt_under.append(under[i] + under[i + 1])
        if len(level) % 2:
            nxt.append(level[-1])
            nxt_under.append(under[-1])
        level, under = nxt, nxt_under
    return level[0], [bytes(p) for p in paths]


def _root_of(leaf: bytes, proof: bytes) -> bytes:
    """Folds a proof into the root it leads to; raises LegRefused for a malformed proof."""
    if not proof or proof[0] != _PROOF_VERSION or (len(proof) - 1) % _STEP:
        raise LegRefused("bad_signature", "the proof is not a version 1 Merkle path")
    steps = (len(proof) - 1) // _STEP
    if steps > MAX_PROOF_STEPS:
        raise LegRefused("bad_signature", f"the proof has more than {MAX_PROOF_STEPS} steps")
    node = leaf
    for k in range(steps):
        at = 1 + k * _STEP
        side, sibling = proof[at], proof[at + 1 : at + _STEP]
        if side == 0:
            node = _node(node, sibling)
        elif side == 1:
            node = _node(sibling, node)
        else:
            raise LegRefused("bad_signature", "the proof has a step with no side")
    return node


class LegSigner:
    """Signs legs with the scheduler's private key. ``ttl_s``: how long a minted leg stays valid."""

    def __init__(
        self, private_key: Ed25519PrivateKey, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"leg ttl must be > 0, got {ttl_s}")
        self._key = private_key
        self.ttl_s = ttl_s
        self._clock = clock

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], ttl_s: float = DEFAULT_TTL_S) -> LegSigner:
        """Loads a PEM (PKCS#8) Ed25519 private key. Raises ValueError with the file named."""
        try:
            data = Path(path).read_bytes()
            mode = os.stat(path).st_mode
            key = serialization.load_pem_private_key(data, password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"leg signing key {path}: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"leg signing key {path}: not an Ed25519 private key")
        warn_if_exposed(path, mode, "leg_signing_key_permissions")
        return cls(key, ttl_s)

    def expiry(self) -> float:
        """``expires_at`` for a leg minted now (unix seconds, millisecond precision)."""
        return round(self._clock() + self.ttl_s, 3)

    def sign(self, fields: Mapping[str, Any]) -> str:
        """The ``sig`` of a leg given as its fields (``asdict(leg)``, ``sig`` ignored)."""
        return _b64(self._key.sign(canonical_bytes(fields)))

    def seal(self, fields: dict[str, Any], expires_at: float | None = None) -> dict[str, Any]:
        """Sets ``expires_at`` and ``sig`` of a leg's fields in place; returns them."""
        fields["expires_at"] = self.expiry() if expires_at is None else expires_at
        fields["sig"] = self.sign(fields)
        return fields

    def seal_batch(self, legs: Sequence[dict[str, Any]], expires_at: float | None = None) -> None:
        """Sets ``expires_at``, ``sig`` (the batch root's signature) and ``proof`` of every leg's
        fields in place: one Ed25519 signature for the whole batch."""
        if not legs:
            return
        at = self.expiry() if expires_at is None else expires_at
        for fields in legs:
            fields["expires_at"] = at
        sig, proofs = self.sign_batch([canonical_bytes(fields) for fields in legs])
        for fields, proof in zip(legs, proofs, strict=True):
            fields["sig"] = sig
            fields["proof"] = proof

    def sign_batch(self, canonical: Sequence[bytes]) -> tuple[str, list[str]]:
        """The ``sig`` and each leg's ``proof`` of a batch of legs given as their ``canonical_bytes``
        (``expires_at`` included)."""
        root, proofs = merkle_proofs([hashlib.sha256(_LEAF + c).digest() for c in canonical])
        return _b64(self._key.sign(_ROOT_CONTEXT + root)), [_b64(p) for p in proofs]

    def seal_batch_bytes(self, canonical: Sequence[bytes], readers: Sequence[str]) -> list[LegAuth]:
        """Per leg given as its ``canonical_bytes``: its (sig, proof, mac), the batch signed at once
        (``readers``, the engines the legs are for, matter only to ``LegMacer``)."""
        sig, proofs = self.sign_batch(canonical)
        return [(sig, proof, "") for proof in proofs]

    def sign_leg(self, leg: Leg, expires_at: float | None = None) -> Leg:
        """A signed copy of ``leg`` (tests and tools; the scheduler's hot path uses ``seal``)."""
        fields = self.seal(asdict(leg), expires_at)
        return type(leg)(**fields)

    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()


class LegVerifier:
    """Verifies legs: signed ones with the scheduler's public key, MACed ones with this engine's
    key from its registration (``kvpush.services.common.leg_macs``). Either may be absent; a leg
    authenticated by what this verifier lacks is refused as ``no_key``."""

    def __init__(
        self,
        public_key: Ed25519PublicKey | None,
        skew_s: float = DEFAULT_SKEW_S,
        clock: Callable[[], float] = time.time,
        mac_keys: EngineKeyRing | None = None,
    ) -> None:
        self._key = public_key
        self.mac_keys = mac_keys
        self.skew_s = skew_s
        self._clock = clock
        self._roots: set[tuple[bytes, bytes]] = set()  # (root, sig) pairs whose signature verified

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], skew_s: float = DEFAULT_SKEW_S, mac_keys: EngineKeyRing | None = None
    ) -> LegVerifier:
        """Loads a PEM (SubjectPublicKeyInfo) Ed25519 public key. Raises ValueError with the file named."""
        try:
            key = serialization.load_pem_public_key(Path(path).read_bytes())
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"leg public key {path}: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"leg public key {path}: not an Ed25519 public key")
        return cls(key, skew_s, mac_keys=mac_keys)

    def verify(self, leg: Leg) -> None:
        """Raises ``LegRefused`` unless ``leg`` carries a valid signature or MAC and has not expired."""
        if leg.mac:
            self._verify_mac(leg)
        elif leg.sig:
            self._verify_signature(leg)
        else:
            raise LegRefused("unsigned", "the leg carries no signature")
        now = self._clock()
        if leg.expires_at + self.skew_s < now:
            raise LegRefused("expired", f"expired {now - leg.expires_at:.1f} s ago")

    def _verify_mac(self, leg: Leg) -> None:
        if leg.sig or leg.proof:
            raise LegRefused("bad_signature", "the leg carries a MAC and a signature")
        if not self.mac_keys:
            raise LegRefused("no_key", "this engine holds no leg MAC key (none came with its registration)")
        if not self.mac_keys.verify(canonical_bytes(asdict(leg)), leg.mac):
            raise LegRefused("bad_signature", "the MAC does not match the leg under this engine's key")

    def _verify_signature(self, leg: Leg) -> None:
        if self._key is None:
            raise LegRefused("no_key", "this engine has no leg public key (leg_public_key_file) for signed legs")
        try:
            sig = _unb64(leg.sig)
        except (binascii.Error, ValueError) as exc:
            raise LegRefused("bad_signature", "the signature is not base64url") from exc
        fields = asdict(leg)
        if leg.proof:
            self._verify_batched(self._key, sig, fields, leg.proof)
            return
        try:
            self._key.verify(sig, canonical_bytes(fields))
        except InvalidSignature as exc:
            raise LegRefused("bad_signature", "the signature does not match the leg") from exc

    def _verify_batched(self, key: Ed25519PublicKey, sig: bytes, fields: Mapping[str, Any], proof_text: str) -> None:
        try:
            proof = _unb64(proof_text)
        except (binascii.Error, ValueError) as exc:
            raise LegRefused("bad_signature", "the proof is not base64url") from exc
        root = _root_of(_leaf(fields), proof)
        if (root, sig) in self._roots:
            return
        try:
            key.verify(sig, _ROOT_CONTEXT + root)
        except InvalidSignature as exc:
            raise LegRefused("bad_signature", "the proof does not lead to a root the signature signs") from exc
        if len(self._roots) >= _VERIFIED_ROOTS:
            self._roots.clear()  # checking a batch's signature again is only slower
        self._roots.add((root, sig))


def check_leg(leg: Leg, engine_id: str, role: str, verifier: LegVerifier | None) -> None:
    """Everything a connector checks before acting on a parsed leg; raises ``LegRefused``.

    ``role`` is this engine's (``prefill`` or ``decode``). With a verifier the leg must verify and
    name this engine; without one (insecure mode) an engine id, when given, must still match.
    """
    if leg.role != role:
        raise LegRefused("wrong_role", f"a {leg.role} leg sent to a {role} engine")
    if verifier is not None:
        verifier.verify(leg)
    named = leg.decode_engine_id if isinstance(leg, DecodeLeg) else leg.prefill_engine_id
    if (verifier is not None or named) and named != engine_id:
        raise LegRefused("wrong_engine", f"the leg is for engine {named!r}, this is {engine_id!r}")
    if verifier is not None and isinstance(leg, PrefillLeg) and leg.epoch < 1:
        raise LegRefused("bad_signature", "a signed prefill leg must carry its epoch")


def write_keypair(out_dir: str | os.PathLike[str], overwrite: bool = False) -> tuple[Path, Path]:
    """Writes a new Ed25519 pair: ``out_dir/leg-signing.key`` (0600) and ``out_dir/leg-signing.pub``
    (0644). Refuses to replace an existing key unless ``overwrite``. Returns (key path, pub path)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = out / KEY_FILE, out / PUB_FILE
    if not overwrite and (key_path.exists() or pub_path.exists()):
        raise FileExistsError(f"{key_path} or {pub_path} exists (overwrite=True / --force to replace)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    write_private(key_path, private_pem, 0o600)
    write_private(pub_path, public_pem, 0o644)
    return key_path, pub_path


def warn_if_exposed(path: str | os.PathLike[str], mode: int, event: str) -> None:
    """Logs ``event`` when a secret's file ``mode`` lets anyone but its owner (and its group, read
    only: root:kvpush 0640) at it."""
    if mode & (stat.S_IRWXG | stat.S_IRWXO) & ~stat.S_IRGRP:
        log.warning(event, path=str(path), mode=oct(stat.S_IMODE(mode)))


def write_private(path: Path, data: bytes, mode: int) -> None:
    """Writes ``data`` to ``path`` with exactly ``mode`` (whatever the umask), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode is masked by the umask, and a stale tmp keeps its own
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def keygen_cli(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    writes: str,
    write: Callable[[str, bool], Sequence[Path]],
) -> int:
    """``PROG keygen DIR [--force]``: calls ``write(DIR, force)`` and prints the paths it wrote."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    sub = p.add_subparsers(dest="command", required=True)
    keygen = sub.add_parser("keygen", help=f"write {writes}")
    keygen.add_argument("dir")
    keygen.add_argument("--force", action="store_true", help="replace what is there")
    args = p.parse_args(argv)
    try:
        paths = write(args.dir, args.force)
    except FileExistsError as exc:
        p.exit(1, f"keygen: {exc}\n")
    sys.stdout.write("".join(f"{path}\n" for path in paths))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return keygen_cli(
        argv,
        "python -m kvpush.services.common.leg_signing",
        "Ed25519 key pair for scheduler-signed legs",
        f"DIR/{KEY_FILE} (0600) and DIR/{PUB_FILE}",
        lambda d, force: write_keypair(d, overwrite=force),
    )


if __name__ == "__main__":
    sys.exit(main())

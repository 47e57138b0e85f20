"""Development PKI for kvpush's mutual TLS (``make certs``): a CA and one certificate per identity.

Writes into ``certs/`` (or ``--out``): ``ca.pem`` / ``ca.key``, then ``<name>.pem`` / ``<name>.key``
for ``scheduler``, each ``--frontend`` name and each engine given on the command line, as
``ROLE/ENGINE_ID`` or an engine id starting with ``prefill`` or ``decode`` (default:
``prefill-0 decode-0``). Every certificate carries the URI SAN ``spiffe://kvpush/<role>/<name>``,
DNS ``localhost``, IP ``127.0.0.1`` and each ``--host``; ECDSA P-256; keys are written 0600. Also the
scheduler's leg-signing pair ``leg-signing.key`` / ``leg-signing.pub`` (kvpush.services.common.leg_signing)
and its leg MAC master ``leg-mac.key`` (kvpush.services.common.leg_macs).

Idempotent: an existing CA is kept (``--force`` replaces it and every certificate), and an existing
certificate is kept when it is from this CA and already names every requested host. For tests,
:func:`make_certs` does the same into any directory. Not for production: there, certificates come
from the site's CA with the same SAN scheme.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvpush.services.common.security import DECODE, FRONTEND, PREFILL, ROLES, SCHEDULER, spiffe_id

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / "certs"
DEFAULT_ENGINES = ("prefill-0", "decode-0")
CA_DAYS = 3650
LEAF_DAYS = 825


def parse_engine(spec: str) -> tuple[str, str]:
    """``decode/d7`` -> (decode, d7); ``prefill-1`` -> (prefill, prefill-1)."""
    if "/" in spec:
        role, _, name = spec.partition("/")
    else:
        role, name = next((r for r in (PREFILL, DECODE) if spec.startswith(r)), ""), spec
    if role not in (PREFILL, DECODE):
        raise ValueError(f"engine {spec!r}: write ROLE/ENGINE_ID (role prefill or decode) or an id starting with one")
    if name in ("ca", SCHEDULER) or "/" in name:
        raise ValueError(f"engine id {name!r} is reserved")
    spiffe_id(role, name)  # validates the name
    return role, name


def _write(path: Path, data: bytes, mode: int) -> None:
    """Atomic: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)


def _make_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvpush"),
            x509.NameAttribute(NameOID.COMMON_NAME, "kvpush dev CA"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(out / "ca.key", _key_pem(key), 0o600)
    _write(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    try:
        cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None
    return cert, key


def _sans(role: str, name: str, hosts: Sequence[str]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_id(role, name))]
    for host in ["localhost", "127.0.0.1", *hosts]:
        try:
            entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            entry = x509.DNSName(host)
        if entry not in sans:
            sans.append(entry)
    return sans


def _current(path: Path, ca: x509.Certificate, sans: list[x509.GeneralName]) -> bool:
    """An existing certificate from this CA that already names every SAN wanted."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return set(sans) <= set(have) and cert.not_valid_after_utc > dt.datetime.now(dt.UTC) + dt.timedelta(days=1)


def _make_leaf(
    out: Path, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], role: str, name: str, hosts: Sequence[str]
) -> None:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvpush"), x509.NameAttribute(NameOID.COMMON_NAME, name)]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_sans(role, name, hosts)), critical=False)
        # Every component is a server and a client (the agents both serve and call).
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    # Key first: a reader that sees the new certificate also finds its key.
    _write(out / f"{name}.key", _key_pem(key), 0o600)
    _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)


def make_certs(
    out_dir: str | Path = DEFAULT_DIR,
    engines: Sequence[str] = DEFAULT_ENGINES,
    hosts: Sequence[str] = (),
    frontends: Sequence[str] = (FRONTEND,),
    force: bool = False,
) -> Path:
    """Creates (or completes) the development PKI in ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    wanted: list[tuple[str, str]] = [(SCHEDULER, SCHEDULER), *((FRONTEND, f) for f in frontends)]
    wanted += [parse_engine(e) for e in engines]
    names = [n for _, n in wanted]
    if len(set(names)) != len(names):
        raise ValueError(f"certificate names must be unique: {names}")
    for role, name in wanted:
        assert role in ROLES
        spiffe_id(role, name)
    ca = None if force else _load_ca(out)
    fresh = ca is None
    if ca is None:
        ca = _make_ca(out)
    for role, name in wanted:
        if fresh or not _current(out / f"{name}.pem", ca[0], _sans(role, name, hosts)):
            _make_leaf(out, ca, role, name, hosts)
    _leg_signing_keys(out, force)
    return out


def _leg_signing_keys(out: Path, force: bool) -> None:
    """The scheduler's Ed25519 pair for signed kv_transfer_params legs (kvpush.services.common.leg_signing),
    kept like the CA unless ``force``."""
    try:
        from kvpush.services.common import leg_signing
    except ImportError:  # a tree without signed legs
        return
    if force or not (out / leg_signing.KEY_FILE).exists():
        leg_signing.write_keypair(out, overwrite=True)
    from kvpush.services.common import leg_macs

    if force or not (out / leg_macs.MASTER_FILE).exists():
        leg_macs.write_master(out, overwrite=True)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="make certs", description=__doc__.split("\n\n")[0])
    p.add_argument("engines", nargs="*", default=list(DEFAULT_ENGINES), help="ROLE/ENGINE_ID or prefill-*/decode-* ids")
    p.add_argument("--out", type=Path, default=DEFAULT_DIR, help="output directory (default: certs/)")
    p.add_argument("--host", action="append", default=[], help="extra DNS name or IP in every certificate")
    p.add_argument("--frontend", action="append", default=None, help="frontend identity names (default: frontend)")
    p.add_argument("--force", action="store_true", help="replace the CA and every certificate")
    args = p.parse_args(argv)
    try:
        out = make_certs(args.out, args.engines, args.host, args.frontend or [FRONTEND], args.force)
    except ValueError as exc:
        p.error(str(exc))
    names = [SCHEDULER, *(args.frontend or [FRONTEND]), *(parse_engine(e)[1] for e in args.engines)]
    p.exit(0, f"certificates in {out}: ca.pem, {', '.join(n + '.pem' for n in names)}\n")


if __name__ == "__main__":
    main()

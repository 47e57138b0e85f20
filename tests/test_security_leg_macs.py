"""Scheduler-MACed legs (``--leg-mac-key``): each leg carries an HMAC under the key of the one
engine that reads it, a key that engine gets in its RegisterResponse over mutual TLS only.

A MAC for another engine, any tampered field, a MAC mixed with a signature, an expired leg, a key
from an older master than the engine's previous one: all refused, as a signed leg's faults are. The
key goes only to the engine its peer certificate names, never over plaintext, and never into a
log line."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import stat
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.json_format import MessageToDict
from leg_support import assert_every_tamper_refused, decode_fields, leg_of, prefill_fields, refusal
from test_scheduler_registry import spec

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.legs import LegGate, leg_verifier
from kvpush.connector.registration import Registration
from kvpush.services.common import leg_macs
from kvpush.services.common import transfer_params as tp
from kvpush.services.common.leg_macs import EngineKeyRing, LegMacer, engine_key, mac_of, write_master
from kvpush.services.common.leg_signing import LegRefused, LegSigner, LegVerifier, check_leg
from kvpush.services.common.security import Security, TlsFiles
from kvpush.services.common.transfer_params import parse
from kvpush.services.scheduler import convert
from kvpush.services.scheduler.main import leg_signer_from_args, parse_args
from kvpush.services.scheduler.model import AssignmentRecord, Role
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.scheduler_support import WAIT_S, info, run, scheduler

NOW = 1_700_000_000.0
MASTER = bytes(range(32))


def _macer(master: bytes = MASTER, ttl_s: float = 60.0) -> LegMacer:
    return LegMacer(master, ttl_s=ttl_s, clock=lambda: NOW)


def _engine(engine_id: str, *masters: bytes) -> LegVerifier:
    """The verifier of ``engine_id`` after registrations that brought the keys under ``masters``."""
    ring = EngineKeyRing()
    for m in masters:
        assert ring.set(engine_key(m, engine_id))
    return LegVerifier(None, skew_s=5.0, clock=lambda: NOW, mac_keys=ring)


def test_engine_keys_are_per_engine_and_per_master() -> None:
    keys = {engine_key(m, e) for m in (MASTER, MASTER[::-1]) for e in ("decode-0", "decode-1", "prefill-0")}
    assert len(keys) == 6 and all(len(k) == leg_macs.KEY_BYTES for k in keys)
    assert _macer().key_for("decode-0") == engine_key(MASTER, "decode-0")
    with pytest.raises(ValueError, match="32 bytes"):
        LegMacer(b"short")


def test_a_macd_leg_verifies_for_its_engine_only() -> None:
    macer = _macer()
    for fields, engine, role in ((decode_fields(), "decode-0", "decode"), (prefill_fields(), "prefill-0", "prefill")):
        macer.seal(fields)
        assert fields["expires_at"] == NOW + 60 and len(fields["mac"]) == leg_macs.MAC_CHARS
        assert not fields["sig"] and not fields["proof"]
        # The scheduler's copied HMAC state gives the MAC of the documented construction.
        assert fields["mac"] == mac_of(engine_key(MASTER, engine), tp.canonical_bytes(fields))
        leg = leg_of(json.loads(json.dumps(fields)))
        check_leg(leg, engine, role, _engine(engine, MASTER))
        as_doubles = {k: float(v) if type(v) is int else v for k, v in fields.items()}  # a Struct's numbers
        _engine(engine, MASTER).verify(leg_of(as_doubles))
        # The same leg reaching another engine (which holds its own key) is refused: its MAC is not
        # under that engine's key, whatever the leg's engine id says.
        other = "decode-1" if role == "decode" else "prefill-1"
        assert refusal(_engine(other, MASTER), fields) == "bad_signature"
        # An engine that names itself in a leg MACed for another engine cannot make it verify.
        renamed = {**fields, ("decode_engine_id" if role == "decode" else "prefill_engine_id"): other}
        assert refusal(_engine(other, MASTER), renamed) == "bad_signature"


def test_any_field_tamper_of_a_macd_leg_fails() -> None:
    macer = _macer()
    for fields, engine in ((macer.seal(decode_fields()), "decode-0"), (macer.seal(prefill_fields()), "prefill-0")):
        assert_every_tamper_refused(_engine(engine, MASTER), fields)


def test_mac_faults_are_refused_with_their_reason() -> None:
    fields = _macer().seal(decode_fields())
    verifier = _engine("decode-0", MASTER)
    mac = fields["mac"]
    raw = base64.urlsafe_b64decode(mac + "=")
    flipped = base64.urlsafe_b64encode(bytes([raw[0] ^ 1]) + raw[1:]).rstrip(b"=").decode()
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60, clock=lambda: NOW)
    signed = signer.seal(decode_fields())
    cases = {
        "a flipped bit": ({**fields, "mac": flipped}, "bad_signature"),
        "a MAC a byte short": ({**fields, "mac": mac[:-2]}, "bad_signature"),
        "a MAC too long to parse": ({**fields, "mac": "A" * (tp.MAX_MAC_CHARS + 1)}, "malformed"),
        "not base64url": ({**fields, "mac": "a+b/"}, "malformed"),
        "not a string": ({**fields, "mac": 7}, "malformed"),
        "a MAC and a signature": ({**fields, "sig": signed["sig"]}, "bad_signature"),
        "a MAC and a proof": ({**fields, "proof": "AQ"}, "bad_signature"),
        "the MAC under an older master": (_macer(MASTER[::-1]).seal(decode_fields()), "bad_signature"),
        "the MAC stripped": ({**fields, "mac": ""}, "unsigned"),
    }
    for what, (bad, reason) in cases.items():
        assert refusal(verifier, bad) == reason, what
    # Expired: beyond the skew, refused; within it, accepted.
    late = LegVerifier(None, skew_s=5.0, clock=lambda: NOW + 66, mac_keys=verifier.mac_keys)
    assert refusal(late, fields) == "expired"
    LegVerifier(None, skew_s=5.0, clock=lambda: NOW + 64, mac_keys=verifier.mac_keys).verify(leg_of(fields))


def test_an_engine_without_the_key_for_a_kind_of_leg_refuses_it_as_no_key() -> None:
    macd = _macer().seal(decode_fields())
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60, clock=lambda: NOW)
    signed = signer.seal(decode_fields())
    not_registered = LegVerifier(None, clock=lambda: NOW, mac_keys=EngineKeyRing())
    assert refusal(not_registered, macd) == "no_key"  # MAC verification before the key arrived
    assert refusal(not_registered, signed) == "no_key"  # no public key configured
    assert refusal(LegVerifier(signer.public_key(), clock=lambda: NOW), macd) == "no_key"  # no mTLS
    # An engine with both verifies both.
    both = LegVerifier(signer.public_key(), clock=lambda: NOW, mac_keys=_engine("decode-0", MASTER).mac_keys)
    both.verify(leg_of(macd))
    both.verify(leg_of(signed))


def test_the_ring_keeps_the_current_and_previous_key_only() -> None:
    new = MASTER[::-1]
    third = bytes(32)
    old_leg, new_leg, third_leg = (_macer(m).seal(decode_fields()) for m in (MASTER, new, third))
    verifier = _engine("decode-0", MASTER, new)  # rotated: registered again after a scheduler restart
    verifier.verify(leg_of(old_leg))  # minted just before the rotation: still good
    verifier.verify(leg_of(new_leg))
    assert refusal(verifier, third_leg) == "bad_signature"
    ring = verifier.mac_keys
    assert ring is not None
    assert ring.set(engine_key(new, "decode-0"))  # the same key again (every re-registration): no shift
    verifier.verify(leg_of(old_leg))
    assert ring.set(engine_key(third, "decode-0"))
    verifier.verify(leg_of(third_leg))
    verifier.verify(leg_of(new_leg))
    assert refusal(verifier, old_leg) == "bad_signature"  # two rotations ago
    for bad in (b"", b"x" * 31, b"x" * 33):
        assert not ring.set(bad)
    verifier.verify(leg_of(third_leg))  # a refused key changed nothing


def test_params_json_carries_the_mac_and_round_trips() -> None:
    fields = _macer().seal(prefill_fields())
    canonical = tp.canonical_bytes(fields)
    text = tp.params_json(canonical, mac=fields["mac"])
    leg = parse(json.loads(text))
    assert leg is not None and asdict(leg) == fields
    _engine("prefill-0", MASTER).verify(leg)
    with pytest.raises(ValueError):
        tp.params_json(canonical, mac='x","role":"decode')


def _rec(i: int, prefill: str = "p0", decode: str = "d0") -> AssignmentRecord:
    return AssignmentRecord(
        f"t{i}", 10 + i, spec(prefill, Role.PREFILL, tp=2), spec(decode), decode_blocks=3, created_at=0.0
    )


def test_every_assignment_path_macs_each_leg_for_its_engine() -> None:
    """Assign (Struct), AssignStream (Struct batches, compact JSON text) and Generate (dicts): each
    leg verifies on the engine it names, and on no other."""
    macer = LegMacer(MASTER, ttl_s=60)
    recs = [_rec(i, decode=f"d{i % 2}") for i in range(5)]
    legs: list[tuple[tp.Leg, str, str]] = []  # (leg, engine, role)
    for rec in recs:
        a = convert.assignment_to_pb(rec, macer)
        legs.append((_leg_of(MessageToDict(a.prefill_kv_transfer_params)), rec.prefill.engine_id, "prefill"))
        legs.append((_leg_of(MessageToDict(a.decode_kv_transfer_params)), rec.decode.engine_id, "decode"))
        p, d = convert.leg_params(rec, macer)
        legs.append((_leg_of(p), rec.prefill.engine_id, "prefill"))
        legs.append((_leg_of(d), rec.decode.engine_id, "decode"))
    for a, rec in zip(convert.assignments_to_pb(recs, macer), recs, strict=True):
        legs.append((_leg_of(MessageToDict(a.prefill_kv_transfer_params)), rec.prefill.engine_id, "prefill"))
        legs.append((_leg_of(MessageToDict(a.decode_kv_transfer_params)), rec.decode.engine_id, "decode"))
    compact = [(rec, pb.CompactAssignment()) for rec in recs]
    convert.fill_compact(compact, macer)
    for rec, c in compact:
        legs.append((_leg_of(json.loads(c.prefill_kv_transfer_params_json)), rec.prefill.engine_id, "prefill"))
        legs.append((_leg_of(json.loads(c.decode_kv_transfer_params_json)), rec.decode.engine_id, "decode"))
    assert len(legs) == 5 * 8
    engines = {"p0": _engine_now("p0"), "d0": _engine_now("d0"), "d1": _engine_now("d1")}
    for leg, engine, role in legs:
        assert leg.mac and not leg.sig and not leg.proof
        check_leg(leg, engine, role, engines[engine])
        for other, verifier in engines.items():
            if other != engine:
                with pytest.raises(LegRefused) as err:
                    verifier.verify(leg)
                assert err.value.reason == "bad_signature"


def _leg_of(params: dict[str, Any]) -> tp.Leg:
    leg = parse(params)
    assert leg is not None
    return leg


def _engine_now(engine_id: str) -> LegVerifier:
    ring = EngineKeyRing()
    ring.set(engine_key(MASTER, engine_id))
    return LegVerifier(None, mac_keys=ring)


# ----- the key's delivery ---------------------------------------------------------------------------


def sec(certs: Path, name: str) -> Security:
    return Security.mtls(TlsFiles.in_dir(certs, name))


def test_register_hands_an_engine_its_own_key_over_mtls_only(dev_certs: Path) -> None:
    macer = LegMacer(MASTER)

    async def body() -> None:
        async with scheduler(
            leg_signer=macer, security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")
        ) as (server, _, _):
            for engine, role in (("decode-1", pb.ROLE_DECODE), ("prefill-1", pb.ROLE_PREFILL)):
                ch = sec(dev_certs, engine).aio_channel(server.address)
                try:
                    resp = await pb_grpc.SchedulerStub(ch).Register(
                        pb.RegisterRequest(instance=info(engine, role)), timeout=WAIT_S
                    )
                finally:
                    await ch.close()
                assert resp.leg_mac_key == engine_key(MASTER, engine)
        # Plaintext (an --insecure scheduler that was given a MAC key anyway): the key is withheld.
        async with scheduler(leg_signer=macer) as (_, stub, _):
            resp = await stub.Register(pb.RegisterRequest(instance=info("decode-1")), timeout=WAIT_S)
            assert resp.leg_mac_key == b"" and resp.lease_interval_ms > 0
        # A signing scheduler hands out no key.
        signer = LegSigner(Ed25519PrivateKey.generate())
        async with scheduler(
            leg_signer=signer, security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")
        ) as (server, _, _):
            ch = sec(dev_certs, "decode-1").aio_channel(server.address)
            try:
                resp = await pb_grpc.SchedulerStub(ch).Register(
                    pb.RegisterRequest(instance=info("decode-1")), timeout=WAIT_S
                )
            finally:
                await ch.close()
            assert resp.leg_mac_key == b""

    run(body())


def test_the_connector_takes_its_key_from_its_registration_and_never_logs_it(
    dev_certs: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decode connector configured as an operator would (mTLS files, no public key) verifies the
    legs the scheduler MACs for it once registered, refuses them before, and logs no key."""
    files = TlsFiles.in_dir(dev_certs, "decode-1")
    macer = LegMacer(MASTER)
    prefill = spec("p0", Role.PREFILL)

    async def body() -> None:
        async with scheduler(
            leg_signer=macer, security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")
        ) as (server, _, _):
            extra = {
                "scheduler_address": server.address,
                "load_report_ms": 20,
                "tls_ca_file": files.ca_file,
                "tls_cert_file": files.cert_file,
                "tls_key_file": files.key_file,
            }
            cfg = ConnectorConfig.from_vllm(
                SimpleNamespace(kv_role="kv_consumer", engine_id="decode-1", kv_connector_extra_config=extra)
            )
            verifier = leg_verifier(cfg)
            assert verifier is not None and verifier.mac_keys is not None
            gate = LegGate(cfg, verifier)
            _, decode_params = convert.leg_params(_rec(1, prefill=prefill.engine_id, decode="decode-1"), macer)
            request = SimpleNamespace(request_id="r1", kv_transfer_params=decode_params)
            assert gate.of(request) is None  # not registered yet: no key, refused (no_key)
            reg = Registration(cfg, info("decode-1"), lambda: pb.LoadReport(free_blocks=10), leg_keys=gate.mac_keys)
            reg.start()
            try:
                assert await asyncio.to_thread(reg.registered.wait, WAIT_S)
                leg = gate.of(SimpleNamespace(request_id="r2", kv_transfer_params=decode_params))
                assert leg is not None and leg.mac
            finally:
                await asyncio.to_thread(reg.stop)

    with caplog.at_level(logging.DEBUG):
        run(body())
    key = engine_key(MASTER, "decode-1")
    logged = caplog.text + "".join(capsys.readouterr())
    for form in (
        key.hex(),
        base64.b64encode(key).decode(),
        base64.urlsafe_b64encode(key).decode().rstrip("="),
        repr(key),
    ):
        assert form not in logged


def test_a_registration_without_mtls_drops_a_key_it_is_given() -> None:
    """A connector without TLS has no ring; a key that arrives anyway is logged as unused, not kept."""
    cfg = ConnectorConfig.from_vllm(
        SimpleNamespace(kv_role="kv_consumer", engine_id="d", kv_connector_extra_config={"insecure": True})
    )
    assert leg_verifier(cfg) is None
    reg = Registration(cfg, info("d"), lambda: pb.LoadReport())
    reg._take_leg_key(b"k" * 32)  # no ring: nothing to keep it in, nothing raised
    ring = EngineKeyRing()
    Registration(cfg, info("d"), lambda: pb.LoadReport(), leg_keys=ring)._take_leg_key(b"short")
    assert not ring


def test_connector_without_public_key_needs_mtls_to_a_scheduler(dev_certs: Path) -> None:
    files = TlsFiles.in_dir(dev_certs, "decode-1")
    tls = {"tls_ca_file": files.ca_file, "tls_cert_file": files.cert_file, "tls_key_file": files.key_file}

    def cfg(**extra: Any) -> ConnectorConfig:
        return ConnectorConfig.from_vllm(
            SimpleNamespace(kv_role="kv_consumer", engine_id="decode-1", kv_connector_extra_config=extra)
        )

    with pytest.raises(Exception, match="leg_public_key_file"):
        leg_verifier(cfg(**tls))  # mTLS but no scheduler: no key would ever come
    verifier = leg_verifier(cfg(scheduler_address="127.0.0.1:1", **tls))
    assert verifier is not None and verifier.mac_keys is not None and not verifier.mac_keys


def test_master_file_and_scheduler_flags(tmp_path: Path, dev_certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TLS_CA", "TLS_CERT", "TLS_KEY", "INSECURE", "LEG_SIGNING_KEY", "LEG_MAC_KEY"):
        monkeypatch.delenv(f"KVPUSH_SCHEDULER_{var}", raising=False)
    path = write_master(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(bytes.fromhex(path.read_text())) == leg_macs.KEY_BYTES
    with pytest.raises(FileExistsError):
        write_master(tmp_path)
    assert LegMacer.from_file(path).key_for("d") != LegMacer.from_file(write_master(tmp_path, overwrite=True)).key_for(
        "d"
    )
    short = tmp_path / "short.key"
    short.write_text("ab" * 16)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        LegMacer.from_file(short)
    (tmp_path / "bad.key").write_text("not hex")
    with pytest.raises(ValueError, match="bad.key"):
        LegMacer.from_file(tmp_path / "bad.key")
    tls = TlsFiles.in_dir(dev_certs, "scheduler")
    tls_flags = ["--tls-ca", tls.ca_file, "--tls-cert", tls.cert_file, "--tls-key", tls.key_file]
    assert isinstance(leg_signer_from_args(parse_args(["--leg-mac-key", str(path), *tls_flags])), LegMacer)
    with pytest.raises(SystemExit, match="mutual TLS"):
        leg_signer_from_args(parse_args(["--leg-mac-key", str(path), "--insecure"]))
    with pytest.raises(SystemExit, match="exclude each other"):
        leg_signer_from_args(
            parse_args(
                ["--leg-mac-key", str(path), "--leg-signing-key", str(dev_certs / "leg-signing.key"), *tls_flags]
            )
        )
    with pytest.raises(SystemExit, match="short.key"):
        leg_signer_from_args(parse_args(["--leg-mac-key", str(short), *tls_flags]))
    assert (dev_certs / leg_macs.MASTER_FILE).exists()  # make certs writes one


def test_keygen_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert leg_macs.main(["keygen", str(tmp_path)]) == 0
    path = tmp_path / leg_macs.MASTER_FILE
    assert capsys.readouterr().out.split() == [str(path)]
    first = path.read_text()
    with pytest.raises(SystemExit) as refused:
        leg_macs.main(["keygen", str(tmp_path)])
    assert refused.value.code == 1 and path.read_text() == first
    assert leg_macs.main(["keygen", str(tmp_path), "--force"]) == 0
    assert path.read_text() != first

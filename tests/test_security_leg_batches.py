"""Batch-signed legs (AssignStream): one Ed25519 signature over a Merkle root of the batch's legs,
each leg with its inclusion proof. Every leg that does not lead to a root the scheduler signed, or
whose root signature is bad, or that expired, or is for another engine, is refused exactly as a
single-signed leg is; the connector's gate refuses it the same way."""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from leg_support import assert_every_tamper_refused, decode_fields, leg_of, prefill_fields, refusal

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.legs import LegGate
from kvpush.services.common import transfer_params as tp
from kvpush.services.common.leg_signing import LegRefused, LegSigner, LegVerifier, check_leg, merkle_proofs

NOW = 1_700_000_000.0


def _pair(ttl_s: float = 60.0) -> tuple[LegSigner, LegVerifier]:
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=ttl_s, clock=lambda: NOW)
    return signer, LegVerifier(signer.public_key(), skew_s=5.0, clock=lambda: NOW)


def _batch(signer: LegSigner, assignments: int, first: int = 0) -> list[dict[str, Any]]:
    """The legs of ``assignments`` assignments (prefill, decode, prefill, ...), sealed as one batch."""
    legs = [leg for i in range(first, first + assignments) for leg in (prefill_fields(i), decode_fields(i))]
    signer.seal_batch(legs)
    return legs


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@pytest.mark.parametrize("assignments", [1, 2, 3, 5, 8, 64, 256])
def test_every_leg_of_a_batch_verifies_through_json_and_doubles(assignments: int) -> None:
    signer, verifier = _pair()
    legs = _batch(signer, assignments)
    assert len({leg["sig"] for leg in legs}) == 1  # one signature for the whole batch
    assert len({leg["proof"] for leg in legs}) == len(legs)
    for fields in legs:
        assert fields["expires_at"] == NOW + 60
        verifier.verify(leg_of(json.loads(json.dumps(fields))))
        as_doubles = {k: float(v) if type(v) is int else v for k, v in fields.items()}
        fresh = LegVerifier(signer.public_key(), skew_s=5.0, clock=lambda: NOW)  # no cached root
        fresh.verify(leg_of(as_doubles))


def test_a_single_leg_batch_still_carries_a_proof() -> None:
    signer, verifier = _pair()
    (only,) = [prefill_fields(0)]
    signer.seal_batch([only])
    assert only["proof"]  # an empty proof would mean "signed alone"
    verifier.verify(leg_of(only))
    root, proofs = merkle_proofs([b"\x11" * 32])
    assert root == b"\x11" * 32 and proofs == [b"\x01"]


@pytest.mark.parametrize("index", [0, 1, 4])
def test_any_field_tamper_of_a_batched_leg_fails(index: int) -> None:
    signer, verifier = _pair()
    legs = _batch(signer, 3)
    assert_every_tamper_refused(verifier, legs[index])


def test_proofs_that_lead_elsewhere_are_refused() -> None:
    signer, verifier = _pair()
    legs = _batch(signer, 4)
    victim = legs[2]
    proof = _unb64(victim["proof"])
    verifier.verify(leg_of(victim))  # the genuine leg (its root is now cached: the cache must not help below)
    cases: dict[str, str] = {
        "another leg's proof": legs[3]["proof"],
        "truncated by a step": _b64(proof[:-33]),
        "a byte short": _b64(proof[:-1]),
        "an extra step": _b64(proof + b"\x00" + b"\x22" * 32),
        "no steps": _b64(proof[:1]),
        "version 2": _b64(b"\x02" + proof[1:]),
        "side byte 2": _b64(proof[:1] + b"\x02" + proof[2:]),
        "sides swapped": _b64(proof[:1] + bytes([proof[1] ^ 1]) + proof[2:]),
        "not base64": "A",
        "21 steps": _b64(b"\x01" + (b"\x00" + b"\x33" * 32) * 21),
    }
    for i in range(1, len(proof)):
        flipped = bytearray(proof)
        flipped[i] ^= 0x40
        cases[f"byte {i} flipped"] = _b64(bytes(flipped))
    for what, bad in cases.items():
        assert refusal(verifier, {**victim, "proof": bad}) in ("bad_signature", "malformed"), what
        if len(bad) <= tp.MAX_PROOF_CHARS:
            assert refusal(verifier, {**victim, "proof": bad}) == "bad_signature", what
    assert refusal(verifier, {**victim, "proof": "A" * (tp.MAX_PROOF_CHARS + 1)}) == "malformed"
    assert refusal(verifier, {**victim, "proof": "not/base64url"}) == "malformed"


def test_signatures_and_proofs_do_not_mix_across_batches_keys_or_modes() -> None:
    signer, verifier = _pair()
    # Batch b holds a's first assignment and another one: the same leaf, another root.
    a, b = _batch(signer, 2), _batch(signer, 2, first=1)
    b = [*_batch(signer, 1), *b]
    signer.seal_batch(b)
    assert b[0]["sig"] != a[0]["sig"] and {k: v for k, v in b[0].items() if k not in ("sig", "proof")} == {
        k: v for k, v in a[0].items() if k not in ("sig", "proof")
    }
    other, _ = _pair()
    foreign = _batch(other, 2)
    single = asdict(signer.sign_leg(leg_of(prefill_fields(0))))
    assert not single["proof"]
    cases = {
        "batch b's signature on batch a's leg": {**a[0], "sig": b[0]["sig"]},
        "batch b's proof on batch a's leg": {**a[0], "proof": b[0]["proof"]},
        "another key's batch": foreign[0],
        "proof stripped (the root's signature read as the leg's)": {**a[0], "proof": ""},
        "a single signature with a proof added": {**single, "proof": a[0]["proof"]},
        "a single signature read as a root's": {**a[0], "sig": single["sig"]},
        "unsigned": {**a[0], "sig": ""},
    }
    for what, fields in cases.items():
        reason = refusal(verifier, fields)
        assert reason == ("unsigned" if what == "unsigned" else "bad_signature"), what
    # A forged leaf: the genuine batch's signature and a proof built from its real siblings, over a
    # leg the scheduler never signed.
    forged = {**a[1], "decode_engine_id": "decode-9"}
    assert refusal(verifier, forged) == "bad_signature"


def test_the_verified_root_cache_never_accepts_a_bad_signature() -> None:
    signer, verifier = _pair()
    legs = _batch(signer, 2)
    verifier.verify(leg_of(legs[0]))
    sig = _unb64(legs[0]["sig"])
    bad_sig = _b64(bytes([sig[0] ^ 1]) + sig[1:])
    # Same root (the same leg and proof), another signature: not the cached pair, so it is checked.
    assert refusal(verifier, {**legs[1], "sig": bad_sig}) == "bad_signature"
    verifier.verify(leg_of(legs[1]))


def test_batched_legs_expire_and_name_their_engine_like_single_ones() -> None:
    signer, verifier = _pair(ttl_s=60.0)
    legs = _batch(signer, 1)
    prefill, decode = leg_of(legs[0]), leg_of(legs[1])
    check_leg(prefill, "prefill-0", "prefill", verifier)
    check_leg(decode, "decode-0", "decode", verifier)
    for at, ok in ((NOW + 64.9, True), (NOW + 65.1, False)):
        late = LegVerifier(signer.public_key(), skew_s=5.0, clock=lambda at=at: at)
        if ok:
            late.verify(decode)
        else:
            with pytest.raises(LegRefused, match="expired"):
                late.verify(decode)
    with pytest.raises(LegRefused, match="wrong_engine"):
        check_leg(decode, "decode-1", "decode", verifier)
    with pytest.raises(LegRefused, match="wrong_role"):
        check_leg(prefill, "prefill-0", "decode", verifier)
    # A batched leg re-sealed with expires_at moved forward is not the signed leg.
    with pytest.raises(LegRefused, match="bad_signature"):
        verifier.verify(replace(decode, expires_at=decode.expires_at + 3600))


def test_the_connector_gate_refuses_bad_batched_legs(tmp_path: Any) -> None:
    signer, verifier = _pair()
    legs = _batch(signer, 2)
    cfg = ConnectorConfig(engine_id="decode-0", role="decode", insecure=True)
    gate = LegGate(cfg, verifier)

    def req(rid: str, fields: dict[str, Any]) -> Any:
        return SimpleNamespace(request_id=rid, kv_transfer_params={"kvpush": fields})

    assert gate.of(req("ok", legs[1])) == leg_of(legs[1])
    assert gate.of(req("other-proof", {**legs[1], "proof": legs[3]["proof"]})) is None
    assert gate.of(req("stripped", {**legs[1], "proof": ""})) is None
    assert gate.of(req("prefill-leg", legs[0])) is None  # wrong role
    assert gate.of(req("ok-2", legs[3])) == leg_of(legs[3])


_legs = st.lists(st.sampled_from(["p", "d"]), min_size=1, max_size=40)


@settings(max_examples=100, deadline=None)
@given(kinds=_legs, data=st.data())
def test_property_batches_verify_and_any_proof_byte_change_fails(kinds: list[str], data: st.DataObject) -> None:
    signer, verifier = _pair()
    legs = [prefill_fields(i) if k == "p" else decode_fields(i) for i, k in enumerate(kinds)]
    signer.seal_batch(legs)
    for fields in legs:
        verifier.verify(leg_of(fields))
    target = data.draw(st.integers(0, len(legs) - 1))
    proof = _unb64(legs[target]["proof"])
    if len(proof) == 1:
        return  # a one-leg batch: its root is the leaf itself
    pos = data.draw(st.integers(0, len(proof) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(proof)
    flipped[pos] ^= 1 << bit
    assert refusal(verifier, {**legs[target], "proof": _b64(bytes(flipped))}) == "bad_signature"

"""Message conversions: the Assign fast path must equal the shared transfer_params contract."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.json_format import MessageToDict
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_registry import spec

from kvpush.services.common import transfer_params
from kvpush.services.common.leg_signing import LegRefused, LegSigner, LegVerifier
from kvpush.services.scheduler import convert
from kvpush.services.scheduler.model import AssignmentRecord, Role
from kvpush.v1 import kvpush_pb2 as pb


def _rec(transfer_id: str, epoch: int, incarnations: tuple[str, ...] = ()) -> AssignmentRecord:
    prefill = dataclasses.replace(spec("p0", Role.PREFILL, tp=2), agent_incarnations=incarnations)
    return AssignmentRecord(transfer_id, epoch, prefill, spec("d0"), decode_blocks=3, created_at=0.0)


def test_assignment_params_equal_to_params() -> None:
    for rec in (_rec("t1", (1 << 53) - 1), _rec("t2", 7, ("a", "b"))):
        a = convert.assignment_to_pb(rec)
        want_decode = transfer_params.to_params(
            transfer_params.DecodeLeg(
                transfer_id=rec.transfer_id,
                epoch=rec.epoch,
                prefill_engine_id="p0",
                prefill_incarnation="i1",
                prefill_tp_size=2,
                prefill_agent_endpoints=["p0:6000", "p0:6001"],
                prefill_rank_incarnations=list(rec.prefill.agent_incarnations),
                decode_engine_id="d0",
            )
        )
        want_prefill = transfer_params.to_params(
            transfer_params.PrefillLeg(
                transfer_id=rec.transfer_id, decode_engine_id="d0", prefill_engine_id="p0", epoch=rec.epoch
            )
        )
        got_decode = MessageToDict(a.decode_kv_transfer_params)
        got_prefill = MessageToDict(a.prefill_kv_transfer_params)
        for got in (got_decode, got_prefill):
            got[transfer_params.KEY]["epoch"] = int(got[transfer_params.KEY]["epoch"])
        got_decode[transfer_params.KEY]["prefill_tp_size"] = int(got_decode[transfer_params.KEY]["prefill_tp_size"])
        assert got_decode == want_decode  # the epoch survives the Struct's doubles exactly
        assert got_prefill == want_prefill
        assert convert.leg_params(rec) == (want_prefill, want_decode)
        assert a.prefill.engine_id == "p0" and list(a.prefill.agent_endpoints) == ["p0:6000", "p0:6001"]
        assert a.decode.engine_id == "d0" and a.transfer_id == rec.transfer_id and a.epoch == rec.epoch


def test_signed_legs_verify_through_both_paths() -> None:
    """Generate's dicts and Assign's Struct (every number a double) carry the same signed legs: both
    parse to the same leg, and it verifies with the public key."""
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60, clock=lambda: 1_000_000.0)
    verifier = LegVerifier(signer.public_key(), clock=lambda: 1_000_030.0)
    rec = _rec("t3", (1 << 53) - 1, ("a", "b"))
    prefill, decode = convert.leg_params(rec, signer)
    a = convert.assignment_to_pb(rec, signer)
    for params, via_struct in ((prefill, a.prefill_kv_transfer_params), (decode, a.decode_kv_transfer_params)):
        leg = transfer_params.parse(params)
        assert leg is not None and leg.expires_at == 1_000_060.0 and leg.sig
        assert transfer_params.parse(MessageToDict(via_struct)) == leg
        verifier.verify(leg)
    assert convert.leg_params(rec) != (prefill, decode)  # unsigned without a signer


def test_spec_round_trip() -> None:
    s = spec("d9", tp=2)
    assert convert.spec_from_pb(convert.spec_to_pb(s)) == s


@settings(max_examples=200, deadline=None)
@given(
    tid=st.text(max_size=40),
    epoch=st.integers(0, transfer_params.MAX_EPOCH),
    expires_at=st.floats(0, transfer_params.MAX_EXPIRES_AT),
)
def test_canonical_template_renders_canonical_bytes(tid: str, epoch: int, expires_at: float) -> None:
    """The batch path's spliced bytes are exactly canonical_bytes of the same leg (any id text,
    including quotes, backslashes and non-ASCII, any epoch, any expiry)."""
    rec = _rec("t", 1, ("a", "b"))
    prefill, decode = convert.leg_params(rec)
    # Ids holding %-format text must come out as they are (the template renders by %-formatting).
    odd = {**decode[transfer_params.KEY], "decode_engine_id": "d%s%%d", "prefill_incarnation": "%b,%"}
    for fields in (prefill[transfer_params.KEY], decode[transfer_params.KEY], odd):
        template = transfer_params.CanonicalTemplate(fields)
        want = transfer_params.canonical_bytes({**fields, "transfer_id": tid, "epoch": epoch, "expires_at": expires_at})
        assert template.render(tid, epoch, expires_at) == want


def test_batched_assignments_carry_the_unary_legs() -> None:
    """AssignStream's Assignments are Assign's, field for field, but for the batch signature and
    each leg's proof; every leg verifies."""
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60, clock=lambda: 1_000_000.0)
    verifier = LegVerifier(signer.public_key(), clock=lambda: 1_000_030.0)
    recs = [_rec(f"t{i}", 10 + i, ("a", "b")) for i in range(5)]
    batched = convert.assignments_to_pb(recs, signer)
    for rec, a in zip(recs, batched, strict=True):
        single = convert.assignment_to_pb(rec, signer)
        assert (a.transfer_id, a.epoch, a.prefill, a.decode) == (
            single.transfer_id,
            single.epoch,
            single.prefill,
            single.decode,
        )
        for got, want in (
            (a.prefill_kv_transfer_params, single.prefill_kv_transfer_params),
            (a.decode_kv_transfer_params, single.decode_kv_transfer_params),
        ):
            leg = transfer_params.parse(MessageToDict(got))
            one = transfer_params.parse(MessageToDict(want))
            assert leg is not None and one is not None and leg.proof and not one.proof
            assert dataclasses.replace(leg, sig="", proof="") == dataclasses.replace(one, sig="")
            verifier.verify(leg)
    assert len({transfer_params.parse(MessageToDict(a.decode_kv_transfer_params)).sig for a in batched}) == 1  # type: ignore[union-attr]
    unsigned = convert.assignments_to_pb(recs)
    assert all(not transfer_params.parse(MessageToDict(a.decode_kv_transfer_params)).sig for a in unsigned)  # type: ignore[union-attr]


def _compact(recs: list[AssignmentRecord], signer: LegSigner | None) -> list[pb.CompactAssignment]:
    out = [pb.CompactAssignment() for _ in recs]
    convert.fill_compact(list(zip(recs, out, strict=True)), signer)
    return out


def test_compact_assignments_carry_the_batched_legs_as_json_text() -> None:
    """A compact answer names the same instances and carries the same legs as a full one, as JSON
    text that parses (as a vLLM HTTP body would) into legs that verify; with the hand-off too."""
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60, clock=lambda: 1_000_000.0)
    verifier = LegVerifier(signer.public_key(), clock=lambda: 1_000_030.0)
    recs = [_rec(f"t{i}", 10 + i, ("a", "b")) for i in range(5)]
    recs[3].first_token = True
    full = convert.assignments_to_pb(recs, signer)
    compact = _compact(recs, signer)
    sigs = set()
    for rec, a, c in zip(recs, full, compact, strict=True):
        assert (c.transfer_id, c.epoch, c.first_token_from_prefill) == (a.transfer_id, a.epoch, rec.first_token)
        assert (c.prefill_engine_id, c.prefill_http_endpoint) == (a.prefill.engine_id, a.prefill.http_endpoint)
        assert (c.decode_engine_id, c.decode_http_endpoint) == (a.decode.engine_id, a.decode.http_endpoint)
        for text, struct in (
            (c.prefill_kv_transfer_params_json, a.prefill_kv_transfer_params),
            (c.decode_kv_transfer_params_json, a.decode_kv_transfer_params),
        ):
            leg = transfer_params.parse(json.loads(text))
            want = transfer_params.parse(MessageToDict(struct))
            assert leg is not None and want is not None and leg.proof and leg.sig
            assert dataclasses.replace(leg, sig="", proof="") == dataclasses.replace(want, sig="", proof="")
            assert leg.first_token is rec.first_token
            verifier.verify(leg)
            sigs.add(leg.sig)
    assert len(sigs) == 1  # one signature for the batch
    # Tampering with the text breaks the signature.
    tampered = compact[0].decode_kv_transfer_params_json.replace('"epoch":10', '"epoch":11')
    leg = transfer_params.parse(json.loads(tampered))
    assert leg is not None and leg.epoch == 11
    with pytest.raises(LegRefused):
        verifier.verify(leg)
    # Unsigned (insecure scheduler): the same legs without sig, proof or expiry.
    for c in _compact(recs, None):
        leg = transfer_params.parse(json.loads(c.prefill_kv_transfer_params_json))
        assert leg is not None and not leg.sig and not leg.proof and leg.expires_at == 0.0


def test_params_json_takes_only_canonical_bytes_and_base64url() -> None:
    canonical = transfer_params.canonical_bytes({"transfer_id": "t", "role": "prefill"})
    assert json.loads(transfer_params.params_json(canonical, "c2ln", "cHJvb2Y")) == {
        "kvpush": {"role": "prefill", "transfer_id": "t", "sig": "c2ln", "proof": "cHJvb2Y"}
    }
    for bad in ((b'{"a":1}', "", ""), (canonical, 'x","role":"decode', ""), (canonical, "", "p\\")):
        with pytest.raises(ValueError):
            transfer_params.params_json(*bad)

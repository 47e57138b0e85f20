"""Scheduler-signed legs and hostile ``kv_transfer_params``.

Unit and property tests of the contract (``transfer_params.parse`` is total and bounded), of the
signatures (``leg_signing``), of the connector's gate (``kvpush.connector.legs``: a refused leg is served
as on a plain instance and nothing is dialed), of the scheduler's flags; then one real-vLLM test
that posts hostile bodies to a prefill and a decode vLLM and checks that both stay healthy and
still serve through the scheduler.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import select
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.connector import legs as connector_legs
from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.connector.decode_scheduler import DecodeScheduler
from kvpush.connector.legs import LegGate, leg_verifier
from kvpush.connector.prefill_scheduler import PrefillScheduler
from kvpush.services.common import transfer_params as tp
from kvpush.services.common.leg_signing import LegRefused, LegSigner, LegVerifier, check_leg, write_keypair
from kvpush.services.common.transfer_params import DecodeLeg, LegError, PrefillLeg, parse, to_params
from kvpush.services.scheduler.main import leg_signer_from_args, parse_args

NOW = 1_700_000_000.0

GOOD_DECODE: dict[str, Any] = {
    "role": "decode",
    "transfer_id": "t-1",
    "epoch": 5,
    "prefill_engine_id": "prefill-0",
    "prefill_incarnation": "a,b",
    "prefill_tp_size": 2,
    "prefill_agent_endpoints": ["10.0.0.2:7100", "10.0.0.2:7101"],
    "prefill_rank_incarnations": ["a", "b"],
    "decode_engine_id": "decode-0",
}
GOOD_PREFILL: dict[str, Any] = {
    "role": "prefill",
    "transfer_id": "t-1",
    "epoch": 5,
    "prefill_engine_id": "prefill-0",
    "decode_engine_id": "decode-0",
}


def _nested(depth: int, leaf: Any = "x") -> Any:
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


INF = json.loads("1e400")  # what Python's JSON parser (and vLLM's) makes of an out-of-range number
# Bodies under the "kvpush" key; every one is malformed. On the code before this change, the first
# ones raised OverflowError/ValueError inside vLLM's scheduler hooks and killed the EngineCore.
HOSTILE: dict[str, Any] = {
    "epoch_1e400": {**GOOD_DECODE, "epoch": INF},
    "epoch_nan": {**GOOD_DECODE, "epoch": math.nan},
    "epoch_float": {**GOOD_DECODE, "epoch": 1.5},
    "epoch_huge_int": {**GOOD_DECODE, "epoch": 10**400},
    "epoch_zero": {**GOOD_DECODE, "epoch": 0},
    "epoch_bool": {**GOOD_DECODE, "epoch": True},
    "epoch_string": {**GOOD_DECODE, "epoch": "5"},
    "tp_minus_inf": {**GOOD_DECODE, "prefill_tp_size": -INF},
    "tp_huge": {**GOOD_DECODE, "prefill_tp_size": 1 << 40},
    "tp_mismatch": {**GOOD_DECODE, "prefill_tp_size": 3},
    "nested_transfer_id": {**GOOD_DECODE, "transfer_id": _nested(50)},
    "nested_kvpush": _nested(50),
    "big_transfer_id": {**GOOD_DECODE, "transfer_id": "x" * (2 << 20)},
    "empty_transfer_id": {**GOOD_DECODE, "transfer_id": ""},
    "control_chars": {**GOOD_DECODE, "transfer_id": "t\n\x00"},
    "endpoints_string": {**GOOD_DECODE, "prefill_agent_endpoints": "10.0.0.2:7100"},
    "endpoints_ints": {**GOOD_DECODE, "prefill_agent_endpoints": [1, 2]},
    "endpoint_unix_socket": {**GOOD_DECODE, "prefill_agent_endpoints": ["unix:/tmp/x", "10.0.0.2:1"]},
    "endpoint_port_zero": {**GOOD_DECODE, "prefill_agent_endpoints": ["10.0.0.2:0", "10.0.0.2:1"]},
    "endpoints_many": {**GOOD_DECODE, "prefill_agent_endpoints": ["h:1"] * 100_000},
    "incarnations_nested": {**GOOD_DECODE, "prefill_rank_incarnations": [_nested(50), "b"]},
    "expires_nan": {**GOOD_DECODE, "expires_at": math.nan},
    "expires_inf": {**GOOD_DECODE, "expires_at": INF},
    "sig_not_b64": {**GOOD_DECODE, "sig": "!!"},
    "sig_huge": {**GOOD_DECODE, "sig": "A" * (2 << 20)},
    "mac_not_b64": {**GOOD_DECODE, "mac": "a+b/"},
    "mac_huge": {**GOOD_DECODE, "mac": "A" * (2 << 20)},
    "mac_int": {**GOOD_DECODE, "mac": 7},
    "mac_null": {**GOOD_PREFILL, "mac": None},
    "mac_nested": {**GOOD_PREFILL, "mac": _nested(50)},
    "missing_epoch": {k: v for k, v in GOOD_DECODE.items() if k != "epoch"},
    "role_int": {**GOOD_DECODE, "role": 5},
    "role_unknown": {**GOOD_DECODE, "role": "prefill_done"},
    "kvpush_list": [GOOD_DECODE],
    "kvpush_string": "decode",
    "kvpush_null": None,
    "prefill_decode_engine_inf": {**GOOD_PREFILL, "decode_engine_id": INF},
    "prefill_epoch_1e400": {**GOOD_PREFILL, "epoch": INF},
    "prefill_epoch_negative": {**GOOD_PREFILL, "epoch": -1},
}


def assert_bounded(leg: Any) -> None:
    """Every field of a parsed leg has its exact type and is within the contract's bounds."""
    assert type(leg) in (PrefillLeg, DecodeLeg)
    ids = [leg.transfer_id, leg.decode_engine_id, leg.prefill_engine_id]
    for s in ids:
        assert type(s) is str and len(s) <= tp.MAX_ID_CHARS and s.isprintable()
    assert leg.transfer_id
    assert type(leg.epoch) is int and 0 <= leg.epoch <= tp.MAX_EPOCH
    assert type(leg.expires_at) is float and 0.0 <= leg.expires_at <= tp.MAX_EXPIRES_AT
    assert type(leg.sig) is str and len(leg.sig) <= tp.MAX_SIG_CHARS
    if isinstance(leg, DecodeLeg):
        assert leg.epoch >= 1 and leg.prefill_engine_id
        assert type(leg.prefill_tp_size) is int and 1 <= leg.prefill_tp_size <= tp.MAX_TP_SIZE
        assert len(leg.prefill_agent_endpoints) == leg.prefill_tp_size
        assert len(leg.prefill_rank_incarnations) in (0, leg.prefill_tp_size)
        assert len(leg.prefill_incarnation) <= (tp.MAX_ID_CHARS + 1) * leg.prefill_tp_size
        for e in leg.prefill_agent_endpoints:
            assert type(e) is str and len(e) <= tp.MAX_ENDPOINT_CHARS and "/" not in e
        for i in leg.prefill_rank_incarnations:
            assert type(i) is str and len(i) <= tp.MAX_ID_CHARS
    # A parsed leg always re-encodes: the canonical bytes never fail on it.
    tp.canonical_bytes(asdict(leg))


# ----- parse: total and bounded ------------------------------------------------------------------


def test_good_legs_parse_and_round_trip() -> None:
    d = parse({"kvpush": GOOD_DECODE})
    p = parse({"kvpush": GOOD_PREFILL})
    assert isinstance(d, DecodeLeg) and isinstance(p, PrefillLeg)
    assert parse(to_params(d)) == d and parse(to_params(p)) == p
    assert parse(None) is None and parse({}) is None and parse({"other": 1}) is None
    # Numbers through a protobuf Struct are doubles: integral ones in range are accepted as ints.
    via_struct = parse({"kvpush": {**GOOD_DECODE, "epoch": 5.0, "prefill_tp_size": 2.0}})
    assert via_struct == d and type(via_struct.epoch) is int  # type: ignore[union-attr]
    # Hand-built unsigned legs of the earlier contract (no engine id of the receiver) still parse.
    old = {k: v for k, v in GOOD_DECODE.items() if k not in ("decode_engine_id", "prefill_rank_incarnations")}
    assert parse({"kvpush": old}) == replace(d, decode_engine_id="", prefill_rank_incarnations=[])
    assert parse({"kvpush": {"role": "prefill", "transfer_id": "t", "decode_engine_id": "d"}}) == PrefillLeg("t", "d")


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_params_raise_only_leg_error(name: str) -> None:
    with pytest.raises(LegError):
        parse({"kvpush": HOSTILE[name]})


def test_non_object_params_raise_leg_error() -> None:
    for params in ([1], "x", 5, math.nan):
        with pytest.raises(LegError):
            parse(params)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(1 << 300), max_value=1 << 300)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.integers(min_value=0, max_value=70_000).map(lambda n: "x" * n)
)
json_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=40,
)
_good = st.sampled_from([GOOD_DECODE, GOOD_PREFILL])
_field_names = st.sampled_from(sorted(set(GOOD_DECODE) | {"expires_at", "sig", "proof", "mac"}))


def _parse_checked(params: Any) -> None:
    try:
        leg = parse(params)
    except LegError:
        return
    if leg is not None:
        assert_bounded(leg)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values)
def test_any_json_value_under_the_key_is_refused_cleanly(value: Any) -> None:
    _parse_checked({"kvpush": value})
    _parse_checked(value)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=_good, changes=st.dictionaries(_field_names, json_values, min_size=1, max_size=4))
def test_near_valid_legs_parse_only_within_bounds(base: dict[str, Any], changes: dict[str, Any]) -> None:
    """A valid leg with any fields replaced by arbitrary values: LegError or a bounded leg."""
    _parse_checked({"kvpush": {**base, **changes}})


# ----- signatures ---------------------------------------------------------------------------------


def _pair(ttl_s: float = 60.0, now: float = NOW) -> tuple[LegSigner, LegVerifier]:
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=ttl_s, clock=lambda: now)
    return signer, LegVerifier(signer.public_key(), skew_s=5.0, clock=lambda: now)


def _signed(signer: LegSigner, raw: dict[str, Any]) -> dict[str, Any]:
    leg = parse({"kvpush": raw})
    assert leg is not None
    return asdict(signer.sign_leg(leg))


def test_sign_verify_round_trip_through_json() -> None:
    signer, verifier = _pair()
    for raw in (GOOD_DECODE, GOOD_PREFILL):
        fields = _signed(signer, raw)
        assert fields["expires_at"] == NOW + 60 and len(fields["sig"]) == 86
        leg = parse(json.loads(json.dumps({"kvpush": fields})))
        assert leg is not None
        verifier.verify(leg)
        # The same leg with its ints as doubles (protobuf Struct) verifies: values are signed, not text.
        as_doubles = {k: float(v) if type(v) is int else v for k, v in fields.items()}
        verifier.verify(parse({"kvpush": as_doubles}))  # type: ignore[arg-type]


def _other_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 1.0
    if isinstance(value, str):
        return value + "x" if value not in ("decode", "prefill") else value
    if isinstance(value, list):
        return [*value[:-1], "10.0.0.66:7100"] if value and ":" in value[0] else [*value[:-1], "z"]
    raise AssertionError(value)


@pytest.mark.parametrize("raw", [GOOD_DECODE, GOOD_PREFILL], ids=["decode", "prefill"])
def test_any_single_field_tamper_fails(raw: dict[str, Any]) -> None:
    signer, verifier = _pair()
    fields = _signed(signer, raw)
    tampered_fields = 0
    for name, value in fields.items():
        if name in ("sig", "role"):
            continue
        tampered_fields += 1
        try:
            leg = parse({"kvpush": {**fields, name: _other_value(value)}})
        except LegError:
            assert name == "prefill_tp_size"  # inconsistent with the endpoints: refused before verifying
            continue
        assert leg is not None, name
        with pytest.raises(LegRefused) as err:
            verifier.verify(leg)
        assert err.value.reason == "bad_signature", name
    assert tampered_fields == len(fields) - 2
    # The role is signed too: a decode signature does not make a prefill leg (or the reverse).
    other_role = GOOD_PREFILL if raw is GOOD_DECODE else GOOD_DECODE
    swapped = parse({"kvpush": {**other_role, "expires_at": fields["expires_at"], "sig": fields["sig"]}})
    with pytest.raises(LegRefused, match="bad_signature"):
        verifier.verify(swapped)  # type: ignore[arg-type]


_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.,", min_size=1, max_size=20)
_endpoint = st.builds("{}:{}".format, st.sampled_from(["10.0.0.2", "h", "[::1]", "127.0.0.1"]), st.integers(1, 65535))
# Values of the right type and shape for each field, so that most tampered legs parse and reach
# the signature check (arbitrary JSON mostly stops at parse).
_VALID = {
    "role": st.sampled_from(["decode", "prefill"]),
    "transfer_id": _ids,
    "prefill_engine_id": _ids,
    "decode_engine_id": _ids,
    "prefill_incarnation": _ids,
    "epoch": st.integers(1, tp.MAX_EPOCH) | st.integers(1, 1 << 20).map(float),
    "prefill_tp_size": st.just(2) | st.just(2.0),
    "prefill_agent_endpoints": st.lists(_endpoint, min_size=2, max_size=2),
    "prefill_rank_incarnations": st.lists(_ids, min_size=2, max_size=2) | st.just([]),
    "expires_at": st.floats(0, tp.MAX_EXPIRES_AT) | st.integers(0, 1 << 33),
}


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(_VALID)), data=st.data())
def test_property_any_tamper_that_parses_fails_verification(name: str, data: st.DataObject) -> None:
    value = data.draw(_VALID[name] | json_values)
    signer, verifier = _pair()
    fields = _signed(signer, GOOD_DECODE)
    try:
        leg = parse({"kvpush": {**fields, name: value}})
    except LegError:
        return
    assert leg is not None
    if asdict(leg) == fields:
        verifier.verify(leg)  # the same value (e.g. 5 and 5.0): still the signed leg
        return
    with pytest.raises(LegRefused):
        verifier.verify(leg)


def test_unsigned_foreign_key_and_expired_legs_are_refused() -> None:
    signer, verifier = _pair(ttl_s=60.0)
    leg = parse({"kvpush": GOOD_DECODE})
    assert leg is not None
    with pytest.raises(LegRefused, match="unsigned"):
        verifier.verify(leg)
    other, _ = _pair()
    with pytest.raises(LegRefused, match="bad_signature"):
        verifier.verify(other.sign_leg(leg))
    signed = signer.sign_leg(leg)
    for at, ok in ((NOW + 60, True), (NOW + 64.9, True), (NOW + 65.1, False), (NOW + 3600, False)):
        late = LegVerifier(signer.public_key(), skew_s=5.0, clock=lambda at=at: at)
        if ok:
            late.verify(signed)
        else:
            with pytest.raises(LegRefused, match="expired"):
                late.verify(signed)
    # A signed leg without an expiry never passes: expires_at 0 is long past.
    no_expiry = replace(leg, expires_at=0.0)
    with pytest.raises(LegRefused, match="expired"):
        verifier.verify(replace(no_expiry, sig=signer.sign(asdict(no_expiry))))


def test_check_leg_engine_and_role() -> None:
    signer, verifier = _pair()
    d = signer.sign_leg(parse({"kvpush": GOOD_DECODE}))  # type: ignore[arg-type]
    p = signer.sign_leg(parse({"kvpush": GOOD_PREFILL}))  # type: ignore[arg-type]
    check_leg(d, "decode-0", "decode", verifier)
    check_leg(p, "prefill-0", "prefill", verifier)
    for leg, engine, role, reason in (
        (d, "decode-1", "decode", "wrong_engine"),
        (p, "prefill-1", "prefill", "wrong_engine"),
        (d, "decode-0", "prefill", "wrong_role"),
        (p, "prefill-0", "decode", "wrong_role"),
    ):
        with pytest.raises(LegRefused) as err:
            check_leg(leg, engine, role, verifier)
        assert err.value.reason == reason
    # Insecure mode: unsigned legs pass, but a named engine must still be this one.
    check_leg(replace(d, sig=""), "decode-0", "decode", None)
    check_leg(DecodeLeg("t", 1, "p", "", 1, ["h:1"]), "anyone", "decode", None)
    with pytest.raises(LegRefused, match="wrong_engine"):
        check_leg(replace(d, sig=""), "decode-1", "decode", None)
    # With a key, the receiver must be named.
    unnamed = signer.sign_leg(replace(d, decode_engine_id=""))
    with pytest.raises(LegRefused, match="wrong_engine"):
        check_leg(unnamed, "decode-0", "decode", verifier)


def test_keypair_files_and_cli(tmp_path: Path) -> None:
    key, pub = write_keypair(tmp_path / "k")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(pub.stat().st_mode) == 0o644
    signer, verifier = LegSigner.from_file(key, ttl_s=10), LegVerifier.from_file(pub)
    verifier.verify(signer.sign_leg(parse({"kvpush": GOOD_DECODE})))  # type: ignore[arg-type]
    with pytest.raises(FileExistsError):
        write_keypair(tmp_path / "k")
    with pytest.raises(ValueError, match="not an Ed25519 public key|leg public key"):
        LegVerifier.from_file(key)  # the private half is not a public key
    with pytest.raises(ValueError, match="leg signing key"):
        LegSigner.from_file(tmp_path / "missing.key")
    cli = [sys.executable, "-m", "kvpush.services.common.leg_signing", "keygen", str(tmp_path / "c")]
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "c" / "leg-signing.key"), str(tmp_path / "c" / "leg-signing.pub")]
    again = subprocess.run(cli, capture_output=True, text=True, timeout=60, cwd=root)
    assert again.returncode == 1 and "exists" in again.stderr


# ----- scheduler flags ----------------------------------------------------------------------------


def test_scheduler_refuses_to_start_without_a_key_unless_insecure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPUSH_SCHEDULER_INSECURE", raising=False)
    monkeypatch.delenv("KVPUSH_SCHEDULER_LEG_SIGNING_KEY", raising=False)
    with pytest.raises(SystemExit, match="refusing to start without --leg-signing-key"):
        leg_signer_from_args(parse_args([]))
    assert leg_signer_from_args(parse_args(["--insecure"])) is None
    key, _ = write_keypair(tmp_path)
    monkeypatch.setenv("KVPUSH_SCHEDULER_LEG_SIGNING_KEY", str(key))
    signer = leg_signer_from_args(parse_args(["--leg-ttl-s", "7"]))
    assert signer is not None and signer.ttl_s == 7
    with pytest.raises(SystemExit, match="leg signing key"):
        leg_signer_from_args(parse_args(["--leg-signing-key", str(tmp_path / "nope")]))
    with pytest.raises(SystemExit):
        parse_args(["--insecure", "--leg-ttl-s", "0"])


# ----- the connector's gate -----------------------------------------------------------------------


@dataclass
class _Req:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: Any
    num_computed_tokens: int = 0
    status: Any = field(default_factory=lambda: SimpleNamespace(name="FINISHED_ABORTED"))


class _Blocks:
    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[1, 2, 3]]

    def get_block_ids(self) -> list[list[int]]:
        return [[1, 2, 3]]


class _Agent:
    """Records what the decode scheduler asks its agent to do (every call would dial endpoints)."""

    def __init__(self) -> None:
        self.dialed: list[list[str]] = []

    def reserve(self, tid: str, rid: str, leg: DecodeLeg, *a: Any, **kw: Any) -> int:
        self.dialed.append(list(leg.prefill_agent_endpoints))
        return 1

    def release_prefill(self, tid: str, leg: DecodeLeg, reason: str) -> None:
        self.dialed.append(list(leg.prefill_agent_endpoints))


def _vllm() -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))


@pytest.fixture()
def keys(tmp_path: Path) -> tuple[LegSigner, str]:
    key, pub = write_keypair(tmp_path)
    return LegSigner.from_file(key), str(pub)


def _refused(role: str, reason: str) -> float:
    return connector_legs.REFUSED.labels(role, reason)._value.get()


def test_connector_needs_a_public_key_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="leg_public_key_file"):
        DecodeScheduler(ConnectorConfig(engine_id="d", role="decode"), _vllm())
    with pytest.raises(ConfigError, match="leg_public_key_file"):
        PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill"), _vllm())
    with pytest.raises(ConfigError, match="leg_public_key_file"):
        leg_verifier(ConnectorConfig(engine_id="d", role="decode", leg_public_key_file=str(tmp_path / "nope")))
    assert leg_verifier(ConnectorConfig(engine_id="d", role="decode", insecure=True)) is None


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("secure", [True, False], ids=["key", "insecure"])
def test_hostile_params_never_raise_from_the_hooks(name: str, secure: bool, keys: tuple[LegSigner, str]) -> None:
    """Each hook that reads params returns the plain-instance answer; decode dials nothing."""
    extra: dict[str, Any] = {"leg_public_key_file": keys[1]} if secure else {"insecure": True}
    d = DecodeScheduler(ConnectorConfig(engine_id="decode-0", role="decode", **extra), _vllm())
    agent = _Agent()
    d.agent = agent  # type: ignore[assignment]
    r = _Req("r", 300, {"kvpush": copy.deepcopy(HOSTILE[name])})
    before = _refused("decode", "malformed")
    assert d.get_num_new_matched_tokens(r, 0) == (0, False)
    d.update_state_after_alloc(r, _Blocks(), 0)
    assert d.request_finished(r) == (False, None)
    assert agent.dialed == [] and d.legs._legs == {}
    assert _refused("decode", "malformed") == before + 1  # checked once per request, then cached

    p = PrefillScheduler(ConnectorConfig(engine_id="prefill-0", role="prefill", **extra), _vllm())
    r = _Req("r", 300, {"kvpush": copy.deepcopy(HOSTILE[name])})
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)
    p.update_state_after_alloc(r, None, 0)
    assert p._requests == {}
    assert p.request_finished(r) == (False, None)
    assert p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": 300})).finished_prefills == []


def test_params_that_raise_on_access_do_not_escape() -> None:
    class Evil:
        request_id = "evil"

        @property
        def kv_transfer_params(self) -> Any:
            raise RuntimeError("boom")

    gate = LegGate(ConnectorConfig(engine_id="d", role="decode", insecure=True))
    before = _refused("decode", "internal_error")
    assert gate.of(Evil()) is None
    assert _refused("decode", "internal_error") == before + 1


def _tampered_cases(signer: LegSigner) -> dict[str, tuple[dict[str, Any], str]]:
    attacker = ["127.0.0.1:9", "127.0.0.1:10"]
    good = _signed(signer, GOOD_DECODE)
    expired = asdict(signer.sign_leg(parse({"kvpush": GOOD_DECODE}), expires_at=time.time() - 3600))  # type: ignore[arg-type]
    return {
        "unsigned": ({**GOOD_DECODE, "prefill_agent_endpoints": attacker}, "unsigned"),
        "tampered": ({**good, "prefill_agent_endpoints": attacker}, "bad_signature"),
        "expired": ({**expired, "prefill_agent_endpoints": attacker}, "bad_signature"),
        "expired_intact": (expired, "expired"),
        "other_engine": (_signed(signer, {**GOOD_DECODE, "decode_engine_id": "decode-1"}), "wrong_engine"),
        "prefill_leg": (_signed(signer, GOOD_PREFILL), "wrong_role"),
    }


def test_decode_dials_only_endpoints_of_verified_legs(keys: tuple[LegSigner, str]) -> None:
    signer, pub = keys
    d = DecodeScheduler(ConnectorConfig(engine_id="decode-0", role="decode", leg_public_key_file=pub), _vllm())
    agent = _Agent()
    d.agent = agent  # type: ignore[assignment]
    for name, (fields, reason) in _tampered_cases(signer).items():
        r = _Req(f"r-{name}", 300, {"kvpush": fields})
        before = _refused("decode", reason)
        assert d.get_num_new_matched_tokens(r, 0) == (0, False), name
        d.update_state_after_alloc(r, _Blocks(), 0)
        d.request_finished(r)  # also the abort path, which would release the prefill side
        assert _refused("decode", reason) == before + 1, name
    assert agent.dialed == []
    # The scheduler's own leg, untouched: reserved, with exactly the signed endpoints.
    ok = _Req("r-ok", 300, {"kvpush": _signed(signer, GOOD_DECODE)})
    assert d.get_num_new_matched_tokens(ok, 0) == (300, True)
    d.update_state_after_alloc(ok, _Blocks(), 300)
    assert agent.dialed == [GOOD_DECODE["prefill_agent_endpoints"]]


def test_prefill_pushes_only_for_verified_legs(keys: tuple[LegSigner, str]) -> None:
    signer, pub = keys
    p = PrefillScheduler(ConnectorConfig(engine_id="prefill-0", role="prefill", leg_public_key_file=pub), _vllm())
    p._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([1, 2],))
    cases = {
        "unsigned": {**GOOD_PREFILL},
        "tampered": {**_signed(signer, GOOD_PREFILL), "transfer_id": "t-2"},
        "other_engine": _signed(signer, {**GOOD_PREFILL, "prefill_engine_id": "prefill-1"}),
        "decode_leg": _signed(signer, GOOD_DECODE),
    }
    for name, fields in cases.items():
        p.update_state_after_alloc(_Req(f"r-{name}", 300, {"kvpush": fields}), None, 0)
    ok = _Req("r-ok", 300, {"kvpush": _signed(signer, GOOD_PREFILL)})
    p.update_state_after_alloc(ok, None, 0)
    scheduled = {f"r-{n}": 300 for n in [*cases, "ok"]}
    meta = p.build_connector_meta(SimpleNamespace(num_scheduled_tokens=scheduled))
    assert [(f.request_id, f.transfer_id) for f in meta.finished_prefills] == [("r-ok", "t-1")]


# ----- real vLLM ----------------------------------------------------------------------------------

BLOCK_PROMPT = 40
MAX_TOKENS = 6
_SOURCE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\}\s+([0-9.e+]+)$')


def _prompt(seed: int, n: int = BLOCK_PROMPT) -> list[int]:
    return [(53 * j + 17 * seed) % 1000 + 3 for j in range(n)]


def _sources(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SOURCE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _post_raw(base_url: str, model: str, prompt: list[int], params_json: str) -> tuple[int, dict[str, Any]]:
    """POSTs a completion whose kv_transfer_params is the given JSON text verbatim (it may hold NaN,
    1e400 or anything else no JSON encoder would write)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": "@PARAMS@",
        }
    ).replace('"@PARAMS@"', params_json)
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")[:300]}


def _health(base_url: str) -> int:
    with urllib.request.urlopen(f"{base_url}/health", timeout=10) as resp:
        return resp.status


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from scripts.cluster.pd import pd_cluster

    with pd_cluster(tiny_model_dir, tmp_path_factory.mktemp("security-logs"), max_num_seqs=8) as c:
        yield c


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_hostile_kv_transfer_params_do_not_crash_engines(cluster: Any) -> None:
    from google.protobuf.json_format import MessageToDict

    from kvpush.services.common.vllm_server import complete, model_name
    from kvpush.v1 import kvpush_pb2 as pb

    assert cluster.scheduler.leg_signing_key is not None
    signer = LegSigner.from_file(cluster.scheduler.leg_signing_key)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    trap = [f"127.0.0.1:{listener.getsockname()[1]}"]

    # Raw JSON texts: what no encoder would write, then every hostile body above.
    raw_texts = {
        "epoch_1e400": json.dumps({"kvpush": {**GOOD_DECODE, "epoch": "@"}}).replace('"@"', "1e400"),
        "epoch_NaN": json.dumps({"kvpush": {**GOOD_DECODE, "epoch": "@"}}).replace('"@"', "NaN"),
        "tp_Infinity": json.dumps({"kvpush": {**GOOD_DECODE, "prefill_tp_size": "@"}}).replace('"@"', "-Infinity"),
        "prefill_epoch_1e400": json.dumps({"kvpush": {**GOOD_PREFILL, "epoch": "@"}}).replace('"@"', "1e400"),
    }
    for name, value in HOSTILE.items():
        raw_texts[name] = json.dumps({"kvpush": value})  # Python writes NaN and Infinity as such

    # Legs that would make decode dial the trap if it trusted them.
    a = cluster.stub.Assign(pb.AssignRequest(prompt_tokens=BLOCK_PROMPT, max_tokens=MAX_TOKENS), timeout=10)
    minted = MessageToDict(a.decode_kv_transfer_params)["kvpush"]
    cluster.stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_FAILED))
    real = {**GOOD_DECODE, "prefill_engine_id": "prefill-0", "decode_engine_id": "decode-0"}
    n = len(trap)
    to_trap = {"prefill_tp_size": n, "prefill_agent_endpoints": trap, "prefill_rank_incarnations": []}
    expired = asdict(signer.sign_leg(parse({"kvpush": {**real, **to_trap}}), expires_at=time.time() - 600))  # type: ignore[arg-type]
    trap_legs = {
        "trap_unsigned": {**real, **to_trap},
        "trap_tampered": {**minted, **to_trap},
        "trap_expired": expired,
        "trap_other_engine": asdict(signer.sign_leg(parse({"kvpush": {**real, **to_trap, "decode_engine_id": "x"}}))),  # type: ignore[arg-type]
    }
    for name, leg in trap_legs.items():
        raw_texts[name] = json.dumps({"kvpush": leg})

    model = model_name(cluster.decode.base_url)
    before = _sources(cluster.decode.base_url)
    statuses: dict[str, tuple[int, int]] = {}
    started = time.monotonic()
    for i, (name, text) in enumerate(sorted(raw_texts.items())):
        prompt = _prompt(i)
        got = []
        for srv in (cluster.prefill, cluster.decode):
            status, resp = _post_raw(srv.base_url, model, prompt, text)
            assert status in (200, 400), (name, srv.base_url, status, resp)
            got.append(status)
            if name.startswith("trap_") and srv is cluster.decode:
                assert status == 200, (name, resp)
                # Refused, so served as a plain instance: the single-instance tokens.
                assert resp["choices"][0]["token_ids"] == complete(cluster.baseline.base_url, prompt, MAX_TOKENS)[0]
        statuses[name] = (got[0], got[1])
    hostile_s = time.monotonic() - started

    time.sleep(1.0)  # a dial, had one been started, would have reached the listener by now
    readable, _, _ = select.select([listener], [], [], 0)
    listener.close()
    assert not readable, "decode connected to an endpoint from an unverified leg"
    after_hostile = _sources(cluster.decode.base_url)
    assert after_hostile.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)

    for srv in (cluster.prefill, cluster.decode):
        assert _health(srv.base_url) == 200
    # A normal request through the scheduler: signed legs verified on both sides, KV pushed, and
    # the single-instance output.
    prompt = _prompt(999, 300)
    tokens, _ = cluster.generate(prompt, MAX_TOKENS)
    assert tokens == complete(cluster.baseline.base_url, prompt, MAX_TOKENS)[0]
    after = _sources(cluster.decode.base_url)
    assert after.get("external_kv_transfer", 0) > after_hostile.get("external_kv_transfer", 0)

    log = Path(cluster.decode.log_path).read_text(errors="replace")
    refused = [line for line in log.splitlines() if "leg_refused" in line]
    for reason in ("malformed", "unsigned", "bad_signature", "expired", "wrong_engine"):
        assert any(re.search(rf"reason=['\"]?{reason}\b", line) for line in refused), reason
    logging.getLogger(__name__).info("%d hostile bodies x 2 engines in %.1f s: %s", len(raw_texts), hostile_s, statuses)

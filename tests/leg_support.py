"""Helpers for the leg-authentication tests (signed, batch-signed and MACed legs). (Collected by
pytest, holds no tests.)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import pytest

from kvpush.services.common.leg_signing import LegRefused, LegVerifier
from kvpush.services.common.transfer_params import DecodeLeg, Leg, LegError, PrefillLeg, parse

AUTH_FIELDS = ("sig", "proof", "mac")


def field_tampers(fields: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each field a signature or MAC covers (all but the authenticators and ``role``) with one
    value changed to another of the same type: (field name, the other value)."""
    for name, value in fields.items():
        if name in AUTH_FIELDS or name == "role":
            continue
        if isinstance(value, str):
            other: Any = value + "x"
        elif isinstance(value, bool):
            other = not value
        elif isinstance(value, int | float):
            other = value + 1
        else:
            other = [*value[:-1], "10.0.0.66:7100"] if ":" in value[0] else [*value[:-1], "z"]
        yield name, other


def decode_fields(i: int = 0, engine: str = "decode-0") -> dict[str, Any]:
    """An unauthenticated TP-2 decode leg's fields for transfer ``t-i``, for ``engine``."""
    return asdict(
        DecodeLeg(
            transfer_id=f"t-{i}",
            epoch=100 + i,
            prefill_engine_id="prefill-0",
            prefill_incarnation="a,b",
            prefill_tp_size=2,
            prefill_agent_endpoints=["10.0.0.2:7100", "10.0.0.2:7101"],
            prefill_rank_incarnations=["a", "b"],
            decode_engine_id=engine,
        )
    )


def prefill_fields(i: int = 0, engine: str = "prefill-0") -> dict[str, Any]:
    """An unauthenticated prefill leg's fields for transfer ``t-i``, for ``engine``."""
    return asdict(
        PrefillLeg(transfer_id=f"t-{i}", decode_engine_id="decode-0", prefill_engine_id=engine, epoch=100 + i)
    )


def leg_of(fields: dict[str, Any]) -> Leg:
    """The leg ``fields`` describe (raises LegError when they do not parse)."""
    leg = parse({"kvpush": fields})
    assert leg is not None
    return leg


def refusal(verifier: LegVerifier, fields: dict[str, Any]) -> str:
    """Why ``verifier`` refuses the leg ``fields`` describe (``malformed`` when it does not
    parse); fails the test when it is accepted."""
    try:
        leg = leg_of(fields)
    except LegError:
        return "malformed"
    with pytest.raises(LegRefused) as err:
        verifier.verify(leg)
    return err.value.reason


def assert_every_tamper_refused(verifier: LegVerifier, fields: dict[str, Any]) -> None:
    """Each field of an authenticated leg changed in turn (``field_tampers``): refused as
    ``bad_signature``; ``malformed`` only for ``prefill_tp_size``, which then no longer matches the
    endpoints and fails to parse."""
    for name, other in field_tampers(fields):
        reason = refusal(verifier, {**fields, name: other})
        assert reason in ("bad_signature", "malformed"), name
        if name != "prefill_tp_size":
            assert reason == "bad_signature", name

"""Helpers for the leg-authentication tests (signed, batch-signed and MACed legs). (Collected by
pytest, holds no tests.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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

"""The ``kv_transfer_params`` contract between the scheduler (who mints them) and the connector.

Both legs of a request carry one dict under the key ``"kvpush"``; vLLM passes it through
``Request.kv_transfer_params`` untouched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KEY = "kvpush"


@dataclass(frozen=True)
class PrefillLeg:
    """Sent to the prefill instance (with ``max_tokens=1``)."""

    transfer_id: str
    decode_engine_id: str
    role: str = "prefill"


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


def to_params(leg: PrefillLeg | DecodeLeg) -> dict[str, Any]:
    return {KEY: asdict(leg)}


def parse(params: dict[str, Any] | None) -> PrefillLeg | DecodeLeg | None:
    """Returns the leg in ``params``, None when the request carries no kvpush params.

    Raises ValueError for a malformed dict.
    """
    if not params or KEY not in params:
        return None
    raw = params[KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"kv_transfer_params[{KEY!r}] must be an object")
    role = raw.get("role")
    try:
        if role == "prefill":
            return PrefillLeg(transfer_id=str(raw["transfer_id"]), decode_engine_id=str(raw["decode_engine_id"]))
        if role == "decode":
            return DecodeLeg(
                transfer_id=str(raw["transfer_id"]),
                epoch=int(raw["epoch"]),
                prefill_engine_id=str(raw["prefill_engine_id"]),
                prefill_incarnation=str(raw.get("prefill_incarnation", "")),
                prefill_tp_size=int(raw["prefill_tp_size"]),
                prefill_agent_endpoints=[str(e) for e in raw["prefill_agent_endpoints"]],
                prefill_rank_incarnations=[str(i) for i in raw.get("prefill_rank_incarnations", [])],
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed kvpush params: {exc}") from exc
    raise ValueError(f"unknown kvpush role {role!r}")

"""Message conversions: the Assign fast path must equal the shared transfer_params contract."""

from __future__ import annotations

import dataclasses

from google.protobuf.json_format import MessageToDict
from test_scheduler_registry import spec

from services.common import transfer_params
from services.scheduler import convert
from services.scheduler.model import AssignmentRecord, Role


def _rec(transfer_id: str, epoch: int, incarnations: tuple[str, ...] = ()) -> AssignmentRecord:
    prefill = dataclasses.replace(spec("p0", Role.PREFILL, tp=2), agent_incarnations=incarnations)
    return AssignmentRecord(transfer_id, epoch, prefill, spec("d0"), decode_blocks=3, created_at=0.0)


def test_assignment_params_equal_to_params() -> None:
    for rec in (_rec("t1", (1 << 53) - 1), _rec("t2", 7, ("a", "b"))):
        a = convert.assignment_to_pb(rec)
        fields = {f.name for f in dataclasses.fields(transfer_params.DecodeLeg)}
        extra = (
            {"prefill_rank_incarnations": list(rec.prefill.agent_incarnations)}
            if ("prefill_rank_incarnations" in fields)
            else {}
        )
        want_decode = transfer_params.to_params(
            transfer_params.DecodeLeg(
                transfer_id=rec.transfer_id,
                epoch=rec.epoch,
                prefill_engine_id="p0",
                prefill_incarnation="i1",
                prefill_tp_size=2,
                prefill_agent_endpoints=["p0:6000", "p0:6001"],
                **extra,
            )
        )
        want_prefill = transfer_params.to_params(
            transfer_params.PrefillLeg(transfer_id=rec.transfer_id, decode_engine_id="d0")
        )
        got_decode = MessageToDict(a.decode_kv_transfer_params)
        got_decode[transfer_params.KEY]["epoch"] = int(got_decode[transfer_params.KEY]["epoch"])
        assert got_decode == want_decode  # the epoch survives the Struct's doubles exactly
        assert MessageToDict(a.prefill_kv_transfer_params) == want_prefill
        assert convert.leg_params(rec) == (want_prefill, want_decode)
        assert a.prefill.engine_id == "p0" and list(a.prefill.agent_endpoints) == ["p0:6000", "p0:6001"]
        assert a.decode.engine_id == "d0" and a.transfer_id == rec.transfer_id and a.epoch == rec.epoch


def test_spec_round_trip() -> None:
    s = spec("d9", tp=2)
    assert convert.spec_from_pb(convert.spec_to_pb(s)) == s

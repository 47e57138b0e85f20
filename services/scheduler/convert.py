"""Conversions between kvpush.v1 messages and the scheduler's plain types."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from google.protobuf import struct_pb2

from kvpush.services.common import transfer_params
from kvpush.services.common.leg_macs import LegMacer
from kvpush.services.common.leg_signing import LegSigner
from kvpush.services.scheduler.errors import InvalidArgument
from kvpush.services.scheduler.model import (
    AssignmentRecord,
    Event,
    EventKind,
    Instance,
    InstanceSpec,
    Load,
    Outcome,
    Role,
)
from kvpush.v1 import kvpush_pb2 as pb

LegSealer = LegSigner | LegMacer  # what authenticates the legs the scheduler mints (None: unsigned legs)
_AUTH_FIELDS = ("sig", "proof", "mac")

_ROLE_FROM_PB = {pb.ROLE_PREFILL: Role.PREFILL, pb.ROLE_DECODE: Role.DECODE}
_ROLE_TO_PB = {v: k for k, v in _ROLE_FROM_PB.items()}
_EVENT_TO_PB = {
    EventKind.REGISTERED: pb.INSTANCE_EVENT_KIND_REGISTERED,
    EventKind.DEAD: pb.INSTANCE_EVENT_KIND_DEAD,
    EventKind.DRAINING: pb.INSTANCE_EVENT_KIND_DRAINING,
    EventKind.DEREGISTERED: pb.INSTANCE_EVENT_KIND_DEREGISTERED,
}
# Fields that appeared in later revisions of the shared schema / params contract.
_HAS_AGENT_INCARNATIONS = "agent_incarnations" in pb.InstanceInfo.DESCRIPTOR.fields_by_name
_DECODE_LEG_FIELDS = {f.name for f in dataclasses.fields(transfer_params.DecodeLeg)}
_OUTCOME_FROM_PB: dict[int, Outcome] = {
    pb.OUTCOME_OK: Outcome.OK,
    pb.OUTCOME_FAILED: Outcome.FAILED,
    pb.OUTCOME_CANCELLED: Outcome.CANCELLED,
}


def spec_from_pb(info: pb.InstanceInfo) -> InstanceSpec:
    role = _ROLE_FROM_PB.get(info.role)
    if role is None:
        raise InvalidArgument("instance.role must be ROLE_PREFILL or ROLE_DECODE")
    return InstanceSpec(
        engine_id=info.engine_id,
        role=role,
        incarnation=info.incarnation,
        tp_size=info.tp_size,
        agent_endpoints=tuple(info.agent_endpoints),
        total_kv_blocks=info.total_kv_blocks,
        tokens_per_block=info.tokens_per_block,
        http_endpoint=info.http_endpoint.rstrip("/"),
        agent_incarnations=tuple(getattr(info, "agent_incarnations", ())),
        first_token_handoff=info.role == pb.ROLE_DECODE and info.first_token_handoff,
        vocab_size=info.vocab_size,
    )


def spec_to_pb(spec: InstanceSpec) -> pb.InstanceInfo:
    info = pb.InstanceInfo(
        engine_id=spec.engine_id,
        role=_ROLE_TO_PB[spec.role],
        incarnation=spec.incarnation,
        tp_size=spec.tp_size,
        agent_endpoints=list(spec.agent_endpoints),
        total_kv_blocks=spec.total_kv_blocks,
        tokens_per_block=spec.tokens_per_block,
        http_endpoint=spec.http_endpoint,
        first_token_handoff=spec.first_token_handoff,
        vocab_size=spec.vocab_size,
    )
    if spec.agent_incarnations and _HAS_AGENT_INCARNATIONS:
        info.agent_incarnations.extend(spec.agent_incarnations)
    return info


def load_from_pb(r: pb.LoadReport) -> Load:
    return Load(
        free_blocks=r.free_blocks,
        reserved_unfilled_blocks=r.reserved_unfilled_blocks,
        running_requests=r.running_requests,
        waiting_requests=r.waiting_requests,
        write_bytes_in_flight=r.write_bytes_in_flight,
        draining=r.draining,
    )


def load_to_pb(inst: Instance) -> pb.LoadReport:
    load = inst.load or Load(free_blocks=inst.spec.total_kv_blocks)
    return pb.LoadReport(
        engine_id=inst.engine_id,
        incarnation=inst.spec.incarnation,
        free_blocks=load.free_blocks,
        reserved_unfilled_blocks=load.reserved_unfilled_blocks,
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        write_bytes_in_flight=load.write_bytes_in_flight,
        draining=load.draining,
    )


def status_to_pb(inst: Instance, now: float) -> pb.InstanceStatus:
    status = pb.InstanceStatus(
        instance=spec_to_pb(inst.spec), load=load_to_pb(inst), alive=True, open_assignments=len(inst.open)
    )
    backlog = inst.backlog
    if backlog is not None:
        status.prefill_queue.CopyFrom(
            pb.PrefillQueue(
                queued=len(backlog),
                samples=backlog.samples,
                seconds_per_token=backlog.s_per_token or 0.0,
                wait_s=backlog.wait_s(now) or 0.0,
            )
        )
    return status


def event_to_pb(event: Event) -> pb.InstanceEvent:
    return pb.InstanceEvent(kind=_EVENT_TO_PB[event.kind], instance=spec_to_pb(event.spec), reason=event.reason)


def outcome_from_pb(value: int) -> Outcome:
    outcome = _OUTCOME_FROM_PB.get(value)
    if outcome is None:
        raise InvalidArgument("outcome must be OUTCOME_OK, OUTCOME_FAILED or OUTCOME_CANCELLED")
    return outcome


def leg_params(rec: AssignmentRecord, signer: LegSealer | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The kv_transfer_params dicts of the prefill and decode legs (shared contract, to_params),
    signed by ``signer`` when given. Not for an assignment prefilled on its decode (no legs)."""
    prefill, decode = _leg_fields(rec, signer)
    return {transfer_params.KEY: prefill}, {transfer_params.KEY: decode}


def _leg_fields(rec: AssignmentRecord, signer: LegSealer | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both legs' fields: the cached templates patched with this assignment's transfer id and epoch,
    then, with a signer, the expiry and each leg's signature (over every field but ``sig``)."""
    key = transfer_params.KEY
    if rec.prefill is None:
        raise ValueError(f"transfer {rec.transfer_id} is prefilled on its decode: it has no legs")
    per_assignment: dict[str, Any] = {"transfer_id": rec.transfer_id, "epoch": rec.epoch}
    if rec.first_token:
        per_assignment["first_token"] = True
    prefill = {**_prefill_template(rec.decode, rec.prefill.engine_id)[0][key], **per_assignment}
    decode = {**_decode_template(rec.prefill, rec.decode.engine_id)[0][key], **per_assignment}
    if signer is not None:
        expires_at = signer.expiry()
        signer.seal(prefill, expires_at)
        signer.seal(decode, expires_at)
    return prefill, decode


@functools.lru_cache(maxsize=4096)
def _decode_template(prefill: InstanceSpec, decode_engine_id: str) -> tuple[dict[str, Any], struct_pb2.Struct]:
    """The decode leg for one (prefill instance, decode engine) with a blank transfer id, epoch and
    signature, as a dict and as a Struct: only those fields differ between assignments, so the hot
    path copies and patches."""
    extra: dict[str, Any] = {}
    if "prefill_rank_incarnations" in _DECODE_LEG_FIELDS:
        extra["prefill_rank_incarnations"] = list(prefill.agent_incarnations)
    params = transfer_params.to_params(
        transfer_params.DecodeLeg(
            transfer_id="",
            epoch=0,
            prefill_engine_id=prefill.engine_id,
            prefill_incarnation=prefill.incarnation,
            prefill_tp_size=prefill.tp_size,
            prefill_agent_endpoints=list(prefill.agent_endpoints),
            decode_engine_id=decode_engine_id,
            **extra,
        )
    )
    return params, _struct(params)


@functools.lru_cache(maxsize=4096)
def _prefill_template(decode: InstanceSpec, prefill_engine_id: str) -> tuple[dict[str, Any], struct_pb2.Struct]:
    params = transfer_params.to_params(
        transfer_params.PrefillLeg(
            transfer_id="", decode_engine_id=decode.engine_id, prefill_engine_id=prefill_engine_id
        )
    )
    return params, _struct(params)


@functools.lru_cache(maxsize=4096)
def _info(spec: InstanceSpec) -> pb.InstanceInfo:
    return spec_to_pb(spec)


def _struct(d: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


def _on_decode(rec: AssignmentRecord) -> pb.Assignment:
    """The answer for an assignment prefilled on its decode: the decode instance only, no legs."""
    a = pb.Assignment(transfer_id=rec.transfer_id, epoch=rec.epoch, prefill_on_decode=True)
    a.decode.CopyFrom(_info(rec.decode))
    return a


def assignment_to_pb(rec: AssignmentRecord, signer: LegSealer | None = None) -> pb.Assignment:
    if rec.prefill is None:
        return _on_decode(rec)
    a = pb.Assignment(transfer_id=rec.transfer_id, epoch=rec.epoch, first_token_from_prefill=rec.first_token)
    a.prefill.CopyFrom(_info(rec.prefill))
    a.decode.CopyFrom(_info(rec.decode))
    key = transfer_params.KEY
    a.prefill_kv_transfer_params.CopyFrom(_prefill_template(rec.decode, rec.prefill.engine_id)[1])
    a.decode_kv_transfer_params.CopyFrom(_decode_template(rec.prefill, rec.decode.engine_id)[1])
    prefill = a.prefill_kv_transfer_params.fields[key].struct_value.fields
    decode = a.decode_kv_transfer_params.fields[key].struct_value.fields
    for leg in (prefill, decode):
        leg["transfer_id"].string_value = rec.transfer_id
        leg["epoch"].number_value = rec.epoch  # exact: epochs stay below 2**53
        leg["first_token"].bool_value = rec.first_token
    if signer is not None:
        # Signed (or MACed) over the same fields as leg_params; the connector normalises the
        # Struct's doubles back to ints before it checks, so the signature covers values, not their
        # encoding.
        signed_prefill, signed_decode = _leg_fields(rec, signer)
        for leg, signed in ((prefill, signed_prefill), (decode, signed_decode)):
            leg["expires_at"].number_value = signed["expires_at"]
            for name in _AUTH_FIELDS:
                if signed.get(name):
                    leg[name].string_value = signed[name]
    return a


def assignments_to_pb(recs: list[AssignmentRecord], signer: LegSealer | None = None) -> list[pb.Assignment]:
    """The Assignments of one AssignStream answer, legs signed as one batch (``fill_assignments``)."""
    out = [pb.Assignment() for _ in recs]
    fill_assignments(list(zip(recs, out, strict=True)), signer)
    return out


def fill_assignments(pairs: list[tuple[AssignmentRecord, pb.Assignment]], signer: LegSealer | None = None) -> None:
    """Writes each record into its (empty) Assignment; with a signer, every leg of the batch is
    signed at once (``LegSigner.sign_batch``: one signature over the Merkle root of all the legs),
    or each MACed for its engine (``LegMacer``)."""
    key = transfer_params.KEY
    canonical: list[bytes] = []
    readers: list[str] = []
    patch: list[Any] = []  # per leg, the Struct fields to set expires_at, sig and proof in
    expires_at = signer.expiry() if signer is not None else 0.0
    for rec, a in pairs:
        if rec.prefill is None:
            a.CopyFrom(_on_decode(rec))
            continue
        template, prefill_bytes, decode_bytes = _pair_template(rec.prefill, rec.decode, rec.first_token)
        a.CopyFrom(template)
        a.transfer_id = rec.transfer_id
        a.epoch = rec.epoch
        for leg in (a.prefill_kv_transfer_params, a.decode_kv_transfer_params):
            fields = leg.fields[key].struct_value.fields
            fields["transfer_id"].string_value = rec.transfer_id
            fields["epoch"].number_value = rec.epoch  # exact: epochs stay below 2**53
            if signer is not None:
                fields["expires_at"].number_value = expires_at
                patch.append(fields)
        if signer is not None:
            canonical.append(prefill_bytes.render(rec.transfer_id, rec.epoch, expires_at))
            canonical.append(decode_bytes.render(rec.transfer_id, rec.epoch, expires_at))
            readers.append(rec.prefill.engine_id)
            readers.append(rec.decode.engine_id)
    if signer is None or not canonical:
        return
    for fields, auth in zip(patch, signer.seal_batch_bytes(canonical, readers), strict=True):
        for name, value in zip(_AUTH_FIELDS, auth, strict=True):
            if value:
                fields[name].string_value = value


def fill_compact(pairs: list[tuple[AssignmentRecord, pb.CompactAssignment]], signer: LegSealer | None = None) -> None:
    """Writes each record into its (empty) CompactAssignment: engine ids, HTTP endpoints and both
    legs as JSON text, spliced from the legs' canonical bytes (no Struct, no JSON encoding per
    leg); with a signer, every leg of the batch signed at once or MACed, as in ``fill_assignments``."""
    expires_at = signer.expiry() if signer is not None else 0.0
    canonical: list[bytes] = []
    readers: list[str] = []
    with_legs: list[tuple[AssignmentRecord, InstanceSpec, pb.CompactAssignment]] = []
    for rec, c in pairs:
        if rec.prefill is None:
            c.transfer_id = rec.transfer_id
            c.epoch = rec.epoch
            c.decode_engine_id = rec.decode.engine_id
            c.decode_http_endpoint = rec.decode.http_endpoint
            c.prefill_on_decode = True
            continue
        _, prefill_bytes, decode_bytes = _pair_template(rec.prefill, rec.decode, rec.first_token)
        canonical.append(prefill_bytes.render(rec.transfer_id, rec.epoch, expires_at))
        canonical.append(decode_bytes.render(rec.transfer_id, rec.epoch, expires_at))
        readers.append(rec.prefill.engine_id)
        readers.append(rec.decode.engine_id)
        with_legs.append((rec, rec.prefill, c))
    if not canonical:
        return
    auth = signer.seal_batch_bytes(canonical, readers) if signer is not None else [("", "", "")] * len(canonical)
    params_json = transfer_params.splice_params_json  # canonical bytes and base64url made just above
    for i, (rec, prefill, c) in enumerate(with_legs):
        decode = rec.decode
        c.transfer_id = rec.transfer_id
        c.epoch = rec.epoch
        c.prefill_engine_id = prefill.engine_id
        c.prefill_http_endpoint = prefill.http_endpoint
        c.decode_engine_id = decode.engine_id
        c.decode_http_endpoint = decode.http_endpoint
        c.first_token_from_prefill = rec.first_token
        c.prefill_kv_transfer_params_json = params_json(canonical[2 * i], *auth[2 * i])
        c.decode_kv_transfer_params_json = params_json(canonical[2 * i + 1], *auth[2 * i + 1])


@functools.lru_cache(maxsize=4096)
def _pair_template(
    prefill: InstanceSpec, decode: InstanceSpec, first_token: bool
) -> tuple[pb.Assignment, transfer_params.CanonicalTemplate, transfer_params.CanonicalTemplate]:
    """The Assignment of one (prefill, decode) pair, with or without the first-token hand-off, with
    a blank transfer id and epoch, and the canonical bytes templates of its two legs."""
    key = transfer_params.KEY
    a = pb.Assignment(first_token_from_prefill=first_token)
    a.prefill.CopyFrom(_info(prefill))
    a.decode.CopyFrom(_info(decode))
    prefill_dict, prefill_struct = _prefill_template(decode, prefill.engine_id)
    decode_dict, decode_struct = _decode_template(prefill, decode.engine_id)
    a.prefill_kv_transfer_params.CopyFrom(prefill_struct)
    a.decode_kv_transfer_params.CopyFrom(decode_struct)
    prefill_fields, decode_fields = prefill_dict[key], decode_dict[key]
    if first_token:
        prefill_fields, decode_fields = {**prefill_fields, "first_token": True}, {**decode_fields, "first_token": True}
        for leg in (a.prefill_kv_transfer_params, a.decode_kv_transfer_params):
            leg.fields[key].struct_value.fields["first_token"].bool_value = True
    return (
        a,
        transfer_params.CanonicalTemplate(prefill_fields),
        transfer_params.CanonicalTemplate(decode_fields),
    )

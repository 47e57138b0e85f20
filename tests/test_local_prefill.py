"""Local prefill (conditional disaggregation): the prefill queue estimate, the registry's rules, the
answers that carry the decision, and the gRPC surface (real server, fake engines). No sleeping:
time is passed in where it matters. Real vLLM: tests/test_pd_e2e.py (short prompts through
``Generate`` equal one instance's output)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.json_format import MessageToDict
from prometheus_client import generate_latest
from scheduler_support import (
    WAIT_S,
    FakeInstance,
    close_instances,
    handoff_engines,
    info,
    run,
    scheduler,
    status_code,
    wait_for,
)
from test_scheduler_generate import FakeVllm, _req, cluster
from test_scheduler_registry import Clock, spec

from kvpush.services.common import limits, transfer_params
from kvpush.services.common.leg_signing import LegSigner, LegVerifier
from kvpush.services.scheduler import convert
from kvpush.services.scheduler.errors import FailedPrecondition, NoCapacity
from kvpush.services.scheduler.local_prefill import LocalPrefillConfig, LocalQueue, PrefillBacklog
from kvpush.services.scheduler.model import AssignmentRecord, Demand, Outcome, Role, State
from kvpush.services.scheduler.policy import LeastBusy, PowerOfTwoChoices
from kvpush.services.scheduler.registry import LeaseConfig, Registry
from kvpush.services.scheduler.server import SchedulerServer
from kvpush.v1 import kvpush_pb2 as pb

# ----- the prefill queue estimate --------------------------------------------------------------


def test_backlog_wait_is_unknown_until_a_prefill_was_seen_to_finish() -> None:
    b = PrefillBacklog()
    b.add("t1", 1000, now=10.0)
    assert b.wait_s(10.0) is None and b.s_per_token is None
    assert b.finished("t1", now=10.2)  # 1000 tokens in 0.2 s, P idle before
    assert b.s_per_token == pytest.approx(0.2 / 1000)
    assert b.wait_s(10.2) == 0.0 and len(b) == 0
    assert not b.finished("t1", now=10.3), "a transfer is reported once"
    assert not b.finished("never-assigned", now=10.3)


def test_backlog_wait_counts_the_queue_and_what_is_left_of_its_head() -> None:
    b = PrefillBacklog()
    b.add("warm", 100, now=0.0)
    b.finished("warm", now=0.1)  # 1 ms a token
    for i in range(3):
        b.add(f"t{i}", 100, now=1.0)
    assert b.wait_s(1.0) == pytest.approx(0.3)
    assert b.wait_s(1.04) == pytest.approx(0.26)  # the head is 40 ms into its 100
    assert b.wait_s(1.5) == 0.0, "without reports the clock still runs down"
    b.drop("t2")  # released or moved without a report
    assert b.wait_s(1.0) == pytest.approx(0.2)
    b.add("late", 100, now=5.0)  # after an idle stretch: its own work only
    assert b.wait_s(5.0) == pytest.approx(0.1)


def test_a_report_retires_every_transfer_before_it_and_samples_only_a_head() -> None:
    b = PrefillBacklog()
    b.add("warm", 100, now=0.0)
    b.finished("warm", now=0.1)
    b.add("a", 100, now=1.0)
    b.add("b", 100, now=1.0)
    b.add("c", 100, now=1.0)
    speed = b.s_per_token
    assert b.finished("b", now=1.5)  # a's report never came (no hand-off): FIFO, it is done too
    assert b.s_per_token == speed, "b was not the head: its time includes a's, no sample"
    assert len(b) == 1
    assert b.finished("c", now=1.6)  # the head now: served from b's finish, 0.1 s for 100 tokens
    assert b.s_per_token == pytest.approx(speed + PrefillBacklog.ALPHA * (0.1 / 100 - speed))  # type: ignore[operator]
    assert b.samples == 2


def test_the_decodes_own_queue_is_a_virtual_clock() -> None:
    q = LocalQueue()
    assert q.wait_s(5.0) == 0.0
    q.add(1000, 1e-4, now=5.0)
    q.add(1000, 1e-4, now=5.0)
    assert q.wait_s(5.0) == pytest.approx(0.2)
    assert q.wait_s(5.15) == pytest.approx(0.05)
    assert q.wait_s(9.0) == 0.0


def test_config_bounds() -> None:
    assert not LocalPrefillConfig().enabled
    assert LocalPrefillConfig(max_tokens=1).enabled and LocalPrefillConfig(wait_ms=1).enabled
    assert LocalPrefillConfig(ttft_ms=1).enabled and not LocalPrefillConfig(max_tokens=1).queue_rules
    for bad in (
        LocalPrefillConfig(max_tokens=-1),
        LocalPrefillConfig(wait_ms=-1),
        LocalPrefillConfig(wait_ms=float("nan")),
        LocalPrefillConfig(ttft_ms=-1),
        LocalPrefillConfig(ttft_ms=float("inf")),
    ):
        with pytest.raises(ValueError):
            bad.validate()


# ----- the registry's rules -------------------------------------------------------------------


def _registry(clock: Clock, cfg: LocalPrefillConfig, prefills: int = 1) -> Registry:
    reg = Registry(
        lease=LeaseConfig(interval_s=0.1, misses=3, settle_s=0.2),
        decode_policy=PowerOfTwoChoices(random.Random(1)),
        prefill_policy=LeastBusy(random.Random(2)),
        clock=clock,
        first_epoch=1,
        local_prefill=cfg,
    )
    reg.register(spec("d0"))
    for k in range(prefills):
        reg.register(spec(f"p{k}", Role.PREFILL))
    return reg


def test_short_prompts_prefill_on_their_decode_only_where_the_frontend_allows_it() -> None:
    clock = Clock()
    reg = _registry(clock, LocalPrefillConfig(max_tokens=64))
    local = reg.assign(Demand(64, 16, local_ok=True))
    assert local.prefill is None and local.decode.engine_id == "d0"
    d0, p0 = reg.instances["d0"], reg.instances["p0"]
    assert local.transfer_id in d0.open and d0.pending_blocks == local.decode_blocks == 5
    assert local.transfer_id not in p0.open and not p0.pending, "prefill holds nothing of it"
    assert reg.assign(Demand(64, 16)).prefill is not None, "a frontend that did not allow it gets both legs"
    assert reg.assign(Demand(65, 16, local_ok=True)).prefill is not None, "longer prompts are pushed"
    reg.release(local.transfer_id, local.epoch, Outcome.OK)
    assert local.transfer_id not in d0.open and local.state is State.OK
    off = _registry(Clock(), LocalPrefillConfig())
    assert off.assign(Demand(1, 1, local_ok=True)).prefill is not None, "off by default"


def test_without_a_ready_prefill_the_decode_prefills_when_local_prefill_is_on() -> None:
    reg = _registry(Clock(), LocalPrefillConfig(max_tokens=1), prefills=0)
    rec = reg.assign(Demand(500, 16, local_ok=True))
    assert rec.prefill is None
    with pytest.raises(NoCapacity) as exc:
        reg.assign(Demand(500, 16))
    assert exc.value.reason == "no_prefill"
    off = _registry(Clock(), LocalPrefillConfig(), prefills=0)
    with pytest.raises(NoCapacity):
        off.assign(Demand(500, 16, local_ok=True))


def test_a_long_prefill_queue_overflows_to_the_decode_one_prefill_at_a_time() -> None:
    clock = Clock()
    reg = _registry(clock, LocalPrefillConfig(wait_ms=150))
    p0 = reg.instances["p0"]
    warm = reg.assign(Demand(1000, 16, local_ok=True))
    assert warm.prefill is not None, "speed unknown: never local"
    assert p0.backlog is not None
    clock.t += 0.1
    p0.backlog.finished(warm.transfer_id, clock.t)  # what a first-token report does: 0.1 ms a token
    where = ["P" if reg.assign(Demand(1000, 16, local_ok=True)).prefill else "D" for _ in range(4)]
    # P's queue when each comes: 0, 100 ms (not over the 150), 200 ms: to D (which then prefills
    # for 100 ms), 200 ms while D prefills: P.
    assert where == ["P", "P", "D", "P"]
    clock.t += 0.1001  # D is done with its prefill (by the estimate); P's queue is at 200 ms again
    assert reg.assign(Demand(1000, 16, local_ok=True)).prefill is None
    assert reg.assign(Demand(1000, 16)).prefill is not None, "not allowed: never local"
    clock.t += 10.0  # everything done
    assert reg.assign(Demand(1000, 16, local_ok=True)).prefill is not None


def test_the_ttft_target_moves_only_prompts_late_on_prefill_and_in_time_on_decode() -> None:
    """``ttft_ms``: the wait that sends a prompt to decode follows the prompt's own prefill time at
    the learned speed (a longer prompt goes sooner), and a prompt too long to be in time even on
    decode stays on prefill."""
    cfg = LocalPrefillConfig(ttft_ms=305)
    assert not cfg.overflows(0.2, 0.1) and cfg.overflows(0.21, 0.1)
    assert cfg.overflows(0.11, 0.2) and not cfg.overflows(5.0, 0.31), "over the target even alone: stays"
    clock = Clock()
    reg = _registry(clock, cfg)
    p0 = reg.instances["p0"]
    warm = reg.assign(Demand(1000, 16, local_ok=True))
    assert warm.prefill is not None and p0.backlog is not None
    clock.t += 0.1
    p0.backlog.finished(warm.transfer_id, clock.t)  # 0.1 ms a token
    # P's queue when each comes: 0, 100, 200 ms; the third would have its token at 300 ms: in time.
    where = ["P" if reg.assign(Demand(1000, 16, local_ok=True)).prefill else "D" for _ in range(3)]
    assert where == ["P", "P", "P"]
    # 300 ms of queue: a 1000-token prompt would be at 400 ms (to D), a 3100-token one over 305 even alone.
    assert reg.assign(Demand(3100, 16, local_ok=True)).prefill is not None
    clock.t += 0.31  # the queue's 610 ms of work, 310 ms on: 300 ms left
    assert reg.assign(Demand(1000, 16, local_ok=True)).prefill is None


def test_the_queue_rules_move_a_prompt_only_to_a_decode_decoding_few_enough() -> None:
    """``max_decoding``: the overflow goes to decode only while it decodes at most that many
    requests by the scheduler's books (open, prefill finished or on decode itself); those still
    queued at prefill do not count."""
    clock = Clock()
    reg = _registry(clock, LocalPrefillConfig(wait_ms=150, max_decoding=0))
    p0 = reg.instances["p0"]
    warm = reg.assign(Demand(1000, 16, local_ok=True))
    assert p0.backlog is not None
    clock.t += 0.1
    p0.backlog.finished(warm.transfer_id, clock.t)  # 0.1 ms a token; warm decodes on d0 now
    where = ["P" if reg.assign(Demand(1000, 16, local_ok=True)).prefill else "D" for _ in range(3)]
    assert where == ["P", "P", "P"], "the third is over the wait, but d0 decodes warm"
    reg.release(warm.transfer_id, warm.epoch, Outcome.OK)
    # d0 has three open assignments, all queued at p0: none decodes.
    assert reg.assign(Demand(1000, 16, local_ok=True)).prefill is None
    clock.t += 0.1001  # d0 is done with that prefill, which still decodes there: the next stays on P
    assert reg.assign(Demand(1000, 16, local_ok=True)).prefill is not None
    with pytest.raises(ValueError):
        LocalPrefillConfig(max_decoding=-2).validate()


def test_closed_assignments_leave_the_prefill_queue() -> None:
    clock = Clock()
    reg = _registry(clock, LocalPrefillConfig(wait_ms=150))
    p0 = reg.instances["p0"]
    warm = reg.assign(Demand(1000, 16, local_ok=True))
    assert p0.backlog is not None
    clock.t += 0.1
    p0.backlog.finished(warm.transfer_id, clock.t)
    recs = [reg.assign(Demand(1000, 16, local_ok=True)) for _ in range(2)]
    assert all(r.prefill is not None for r in recs) and len(p0.backlog) == 2
    reg.release(recs[0].transfer_id, recs[0].epoch, Outcome.FAILED)
    assert len(p0.backlog) == 1
    # Superseded (the same transfer id assigned again): the old entry goes, the new one queues.
    again = reg.assign(Demand(1000, 16, local_ok=True), transfer_id=recs[1].transfer_id)
    assert recs[1].state is State.SUPERSEDED and again.prefill is not None and len(p0.backlog) == 1
    reg.release(again.transfer_id, again.epoch, Outcome.OK)
    assert len(p0.backlog) == 0 and p0.backlog.wait_s(clock.t) == 0.0


def test_an_assignment_prefilled_on_decode_has_no_prefill_leg_to_reroute_or_fail() -> None:
    clock = Clock()
    reg = _registry(clock, LocalPrefillConfig(max_tokens=100), prefills=2)
    rec = reg.assign(Demand(10, 4, local_ok=True))
    with pytest.raises(FailedPrecondition):
        reg.reroute(rec.transfer_id, "d0", "p0", max_reroutes=3)
    reg.stream_closed("p0", "i1", clean=False)  # a prefill dies: not this assignment's business
    assert rec.state is State.OPEN


# ----- the answers ---------------------------------------------------------------------------


def _records() -> list[AssignmentRecord]:
    p = dataclasses.replace(spec("p0", Role.PREFILL, tp=2), agent_incarnations=("a", "b"))
    out = [AssignmentRecord(f"t{i}", 10 + i, p, spec("d0"), decode_blocks=3, created_at=0.0) for i in range(4)]
    out[1].prefill = None
    out[3].prefill = None
    return out


def test_answers_carry_no_legs_for_a_decode_that_prefills_and_the_others_still_verify() -> None:
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60, clock=lambda: 1_000_000.0)
    verifier = LegVerifier(signer.public_key(), clock=lambda: 1_000_030.0)
    recs = _records()
    unary = [convert.assignment_to_pb(r, signer) for r in recs]
    batched = convert.assignments_to_pb(recs, signer)
    compact = [pb.CompactAssignment() for _ in recs]
    convert.fill_compact(list(zip(recs, compact, strict=True)), signer)
    for rec, u, a, c in zip(recs, unary, batched, compact, strict=True):
        assert a.transfer_id == u.transfer_id == c.transfer_id == rec.transfer_id
        assert a.decode.engine_id == c.decode_engine_id == "d0"
        assert c.decode_http_endpoint == "http://d0:8000"
        if rec.prefill is None:
            for m in (u, a):
                assert m.prefill_on_decode and not m.HasField("prefill") and not m.first_token_from_prefill
                assert not m.HasField("prefill_kv_transfer_params") and not m.HasField("decode_kv_transfer_params")
            assert c.prefill_on_decode and not c.prefill_engine_id and not c.prefill_http_endpoint
            assert not c.prefill_kv_transfer_params_json and not c.decode_kv_transfer_params_json
            with pytest.raises(ValueError):
                convert.leg_params(rec, signer)
            continue
        assert not a.prefill_on_decode and not c.prefill_on_decode
        for struct in (a.prefill_kv_transfer_params, a.decode_kv_transfer_params):
            leg = transfer_params.parse(MessageToDict(struct))
            assert leg is not None and leg.transfer_id == rec.transfer_id
            verifier.verify(leg)
        for text in (c.prefill_kv_transfer_params_json, c.decode_kv_transfer_params_json):
            leg = transfer_params.parse(json.loads(text))
            assert leg is not None and leg.transfer_id == rec.transfer_id
            verifier.verify(leg)


# ----- gRPC -----------------------------------------------------------------------------------


def test_assign_grants_prefill_on_decode_to_a_frontend_that_allows_it() -> None:
    async def body() -> None:
        async with scheduler(local_prefill=LocalPrefillConfig(max_tokens=32)) as (server, stub, _):
            insts = [
                await FakeInstance(stub, info("d0", first_token_handoff=True)).start(),
                await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start(),
            ]
            await wait_for(lambda: all(i.acks for i in insts))
            asked = pb.AssignRequest(
                prompt_tokens=32, max_tokens=8, first_token_from_prefill=True, allow_prefill_on_decode=True
            )
            a = await stub.Assign(asked, timeout=5)
            assert a.prefill_on_decode and not a.HasField("prefill") and a.decode.engine_id == "d0"
            assert not a.first_token_from_prefill, "decode samples the first token itself"
            # No prefill leg: a report about one is refused, and there is nothing to await.
            failure = pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id="p0", reason="x", leg=pb.ROLE_DECODE)
            assert await status_code(stub.ReportLegFailure(failure, timeout=5)) == grpc.StatusCode.FAILED_PRECONDITION
            plain = await stub.Assign(pb.AssignRequest(prompt_tokens=32, max_tokens=8), timeout=5)
            assert not plain.prefill_on_decode and plain.prefill.engine_id == "p0"
            # AssignStream, compact and full, the same decision per item.
            call = stub.AssignStream()
            await call.write(
                pb.AssignStreamRequest(
                    batch_id=1,
                    compact=True,
                    assigns=[
                        pb.AssignRequest(prompt_tokens=8, max_tokens=4, allow_prefill_on_decode=True),
                        pb.AssignRequest(prompt_tokens=64, max_tokens=4, allow_prefill_on_decode=True),
                        pb.AssignRequest(prompt_tokens=8, max_tokens=4),
                    ],
                )
            )
            got = await asyncio.wait_for(call.read(), 5)
            assert [r.code for r in got.assigns] == [0, 0, 0]
            assert [r.compact.prefill_on_decode for r in got.assigns] == [True, False, False]
            assert [r.compact.prefill_engine_id for r in got.assigns] == ["", "p0", "p0"]
            await call.done_writing()
            decisions = {
                tuple(s.labels.values()): s.value
                for m in server.metrics.decisions.collect()
                for s in m.samples
                if s.name.endswith("_total")
            }
            assert decisions[("prefill_on_decode", "d0")] == 2
            for rec in (a, plain):
                await stub.Release(
                    pb.ReleaseRequest(transfer_id=rec.transfer_id, epoch=rec.epoch, outcome=pb.OUTCOME_OK), timeout=5
                )
            for i in insts:
                await i.close()

    run(body())


def test_generate_sends_one_plain_request_to_a_decode_that_prefills() -> None:
    """Generate with local prefill: a short prompt goes to decode alone, whole, without
    kv_transfer_params and without the hand-off though decode offers it (decode samples every token:
    with the hand-off the call would wait for a token from prefill); prefill sees nothing; the
    assignment is released OK. (A longer prompt still takes both legs: tests/test_pd_e2e.py.)"""

    async def body() -> None:
        decode = FakeVllm("decode", plain=True)
        async with cluster(decode=decode, handoff=True, local_prefill=LocalPrefillConfig(max_tokens=3)) as (
            server,
            stub,
            p,
            d,
            _,
        ):
            msgs = [m async for m in stub.Generate(_req(), timeout=WAIT_S)]
            assert [t for m in msgs for t in m.token_ids] == [11, 12, 13, 14]
            assert {(m.decode_engine_id, m.prefill_engine_id) for m in msgs} == {("d0", "")}
            assert not p.requests, "prefill saw nothing of it"
            (dec,) = d.requests
            assert "kv_transfer_params" not in dec and dec["max_tokens"] == 4 and dec["prompt"] == [1, 2, 3]
            rec = server.registry.closed[msgs[0].transfer_id]
            assert rec.state is State.OK and not server.registry.open

    run(body())


def test_the_prefill_queue_learns_its_speed_from_that_prefills_own_first_token_reports() -> None:
    """The wait rule's estimate is fed by ReportFirstTokens/load-stream reports, each only into the
    reporting engine's own queue: another prefill naming the transfer changes nothing."""

    async def body() -> None:
        async with scheduler(local_prefill=LocalPrefillConfig(wait_ms=150)) as (server, stub, _):
            insts = await handoff_engines(stub, prefills=("p0", "p1"))
            req = pb.AssignRequest(
                prompt_tokens=500, max_tokens=8, first_token_from_prefill=True, allow_prefill_on_decode=True
            )
            a = await stub.Assign(req, timeout=5)
            assert not a.prefill_on_decode and a.first_token_from_prefill, "speed unknown: both legs"
            own = server.registry.instances[a.prefill.engine_id]
            other = next(i for i in insts if i.info.role == pb.ROLE_PREFILL and i.info.engine_id != own.engine_id)
            assert own.backlog is not None and len(own.backlog) == 1 and own.backlog.s_per_token is None
            token = pb.FirstToken(transfer_id=a.transfer_id, decode_engine_id="d0", token_id=7)
            other.outgoing_first_tokens.append(token)
            acks = other.acks
            await wait_for(lambda: other.acks > acks + 1)
            assert len(own.backlog) == 1 and own.backlog.s_per_token is None
            mine = next(i for i in insts if i.info.engine_id == own.engine_id)
            mine.outgoing_first_tokens.append(token)
            await wait_for(lambda: own.backlog is not None and own.backlog.samples == 1)
            assert len(own.backlog) == 0 and own.backlog.s_per_token is not None and own.backlog.s_per_token > 0
            await close_instances(insts)

    run(body())


def _metric(server: SchedulerServer, name: str) -> dict[str, float]:
    """A scheduler gauge's samples by engine id, read as a scrape would."""
    text = generate_latest(server.metrics.registry).decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('engine_id="')[1].split('"')[0]] = float(value)
    return out


def test_the_prefill_queue_learns_from_prefills_finished_without_the_hand_off() -> None:
    """Frontends without the hand-off: the prefill engine reports each finished prefill with its age
    on its load stream, and only its own queue learns from it, at the finish time the age gives
    (report time minus age). Another prefill, a decode, a bad id, a stale age or an oversized report
    change nothing and the streams keep serving; the estimate shows in ListInstances and the
    metrics."""

    async def body() -> None:
        async with scheduler(local_prefill=LocalPrefillConfig(wait_ms=150)) as (server, stub, _):
            insts = await handoff_engines(stub, prefills=("p0", "p1"))
            req = pb.AssignRequest(prompt_tokens=500, max_tokens=8, allow_prefill_on_decode=True)
            a = await stub.Assign(req, timeout=5)
            assert not a.prefill_on_decode and not a.first_token_from_prefill
            own = server.registry.instances[a.prefill.engine_id]
            assert own.backlog is not None and len(own.backlog) == 1
            decode, *prefills = insts
            mine = next(i for i in prefills if i.info.engine_id == own.engine_id)
            other = next(i for i in prefills if i is not mine)
            done = pb.PrefillDone(transfer_id=a.transfer_id)
            other.outgoing_prefills_done.append(done)
            decode.outgoing_prefills_done.append(done)
            mine.outgoing_prefills_done.extend(
                [pb.PrefillDone(transfer_id="x" * 129), pb.PrefillDone(transfer_id=a.transfer_id, age_us=11_000_000)]
            )
            acks = [i.acks for i in insts]
            await wait_for(lambda: all(i.acks > n + 1 for i, n in zip(insts, acks, strict=True)))
            mine.outgoing_prefills_done.extend([done] * (limits.MAX_EXPECTATIONS_PER_CALL + 1))
            n = mine.acks
            await wait_for(lambda: mine.acks > n + 1)
            assert len(own.backlog) == 1 and own.backlog.samples == 0, "nothing taken from those reports"
            # Finished before it was assigned (a 9 s age): it leaves the queue, and is no sample.
            mine.outgoing_prefills_done.append(pb.PrefillDone(transfer_id=a.transfer_id, age_us=9_000_000))
            await wait_for(lambda: len(own.backlog or ()) == 0)
            assert own.backlog.samples == 0 and own.backlog.s_per_token is None
            b = await stub.Assign(req, timeout=5)
            ran = server.registry.instances[b.prefill.engine_id]  # whichever the policy chose
            reporter = next(i for i in prefills if i.info.engine_id == ran.engine_id)
            assert ran.backlog is not None and len(ran.backlog) == 1
            reporter.outgoing_prefills_done.append(pb.PrefillDone(transfer_id=b.transfer_id, age_us=1_000))
            await wait_for(lambda: ran.backlog is not None and ran.backlog.samples == 1)
            spt = ran.backlog.s_per_token
            assert len(ran.backlog) == 0 and spt is not None and spt > 0
            listed = await stub.ListInstances(pb.ListInstancesRequest(), timeout=5)
            status = next(s for s in listed.instances if s.instance.engine_id == ran.engine_id)
            assert status.prefill_queue.samples == 1 and status.prefill_queue.seconds_per_token == pytest.approx(spt)
            assert _metric(server, "kvpush_scheduler_prefill_seconds_per_token") == {ran.engine_id: pytest.approx(spt)}
            await close_instances(insts)

    run(body())

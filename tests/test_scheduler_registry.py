"""Pure scheduler logic: registry, leases, policies, admission. No grpc, no sleeping: time is passed in."""

from __future__ import annotations

import gc
import random
from collections import Counter

import pytest

from kvpush.services.scheduler.errors import FailedPrecondition, InvalidArgument, NoCapacity, NotFound
from kvpush.services.scheduler.model import Demand, EventKind, Instance, InstanceSpec, Load, Outcome, Role, State
from kvpush.services.scheduler.policy import LeastBusy, LeastPressure, PowerOfTwoChoices, PrefixAffinity, decode_policy
from kvpush.services.scheduler.registry import LeaseConfig, Registry


def spec(engine_id: str, role: Role = Role.DECODE, inc: str = "i1", blocks: int = 1000, tp: int = 1) -> InstanceSpec:
    return InstanceSpec(
        engine_id=engine_id,
        role=role,
        incarnation=inc,
        tp_size=tp,
        agent_endpoints=tuple(f"{engine_id}:{6000 + r}" for r in range(tp)),
        total_kv_blocks=blocks,
        tokens_per_block=16,
        http_endpoint=f"http://{engine_id}:8000",
    )


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reg(clock: Clock) -> Registry:
    return Registry(
        lease=LeaseConfig(interval_s=0.1, misses=3, settle_s=0.2),
        decode_policy=PowerOfTwoChoices(random.Random(1)),
        prefill_policy=LeastBusy(random.Random(2)),
        clock=clock,
        first_epoch=1,
    )


def events(reg: Registry) -> list[tuple[EventKind, str, str]]:
    out: list[tuple[EventKind, str, str]] = []
    reg.event_listeners.append(lambda e: out.append((e.kind, e.spec.engine_id, e.spec.incarnation)))
    return out


def test_reroute_moves_the_prefill_leg_once_per_failure(reg: Registry) -> None:
    for name in ("p1", "p2", "p3"):
        reg.register(spec(name, Role.PREFILL))
    reg.register(spec("d"))
    rec = reg.assign(Demand(10))
    first, first_epoch = rec.prefill.engine_id, rec.epoch
    with pytest.raises(NotFound):
        reg.reroute("unknown", "d", first, max_reroutes=3)
    with pytest.raises(FailedPrecondition):
        reg.reroute(rec.transfer_id, "other-decode", first, max_reroutes=3)
    moved, did = reg.reroute(rec.transfer_id, "d", first, max_reroutes=3)
    assert did and moved is rec and rec.prefill.engine_id != first and rec.epoch > first_epoch
    assert rec.transfer_id in reg.instances[rec.prefill.engine_id].open
    assert rec.transfer_id not in reg.instances[first].open
    again, did = reg.reroute(rec.transfer_id, "d", first, max_reroutes=3)  # a repeated report
    assert not did and again.prefill.engine_id == rec.prefill.engine_id
    second = rec.prefill.engine_id
    _, did = reg.reroute(rec.transfer_id, "d", second, max_reroutes=3)
    assert did and rec.prefill.engine_id not in (first, second)
    with pytest.raises(FailedPrecondition, match="already tried"):
        reg.reroute(rec.transfer_id, "d", rec.prefill.engine_id, max_reroutes=3)
    # The frontend releases with the epoch Assign gave it.
    assert reg.release(rec.transfer_id, first_epoch, Outcome.OK).state is State.OK


def test_register_validates(reg: Registry) -> None:
    with pytest.raises(InvalidArgument, match="engine_id"):
        reg.register(spec(""))
    with pytest.raises(InvalidArgument, match="agent_endpoints"):
        reg.register(InstanceSpec("d", Role.DECODE, "i", 2, ("a:1",), 10, 16, ""))
    with pytest.raises(InvalidArgument, match="tokens_per_block"):
        reg.register(InstanceSpec("d", Role.DECODE, "i", 1, ("a:1",), 10, 0, ""))
    with pytest.raises(InvalidArgument, match="http_endpoint"):
        reg.register(InstanceSpec("d", Role.DECODE, "i", 1, ("a:1",), 10, 16, "ftp://x"))


def test_reregistration_new_incarnation_replaces_and_fails_assignments(reg: Registry) -> None:
    seen = events(reg)
    reg.register(spec("p", Role.PREFILL))
    reg.register(spec("d"))
    rec = reg.assign(Demand(100))
    closed: list[str] = []
    reg.closed_listeners.append(lambda r: closed.append(r.transfer_id))
    reg.register(spec("d"))  # same incarnation: refresh only
    assert rec.state is State.OPEN
    reg.register(spec("d", inc="i2"))
    assert rec.state is State.FAILED and "replaced" in rec.reason
    assert closed == [rec.transfer_id]
    assert seen[-2:] == [(EventKind.DEAD, "d", "i1"), (EventKind.REGISTERED, "d", "i2")]
    with pytest.raises(FailedPrecondition, match="stale"):
        reg.report("d", "i1", Load(free_blocks=5))
    with pytest.raises(FailedPrecondition, match="registered as decode"):
        reg.register(spec("d", Role.PREFILL, inc="i3"))


def test_lease_expiry(reg: Registry, clock: Clock) -> None:
    seen = events(reg)
    reg.register(spec("p", Role.PREFILL))
    reg.register(spec("d"))
    rec = reg.assign(Demand(10))
    clock.t += 0.25
    reg.report("d", "i1", Load(free_blocks=900))
    assert reg.expire() == []
    clock.t += 0.06  # p: 0.31 s since registration > 3 x 0.1 s; d: 0.06 s since its report
    assert [i.engine_id for i in reg.expire()] == ["p"]
    # The decode engine still holds the reservation: it reroutes or fails, so the record stays open.
    assert rec.state is State.OPEN and "lease expired" in rec.prefill_lost
    assert (EventKind.DEAD, "p", "i1") in seen
    assert reg.next_expiry() == pytest.approx(clock.t - 0.06 + 0.3)
    with pytest.raises(NotFound):
        reg.report("p", "i1", Load())
    # With no other prefill, Reroute says so; the decode engine then fails the request and the
    # frontend releases.
    with pytest.raises(NoCapacity):
        reg.reroute(rec.transfer_id, "d", "p", max_reroutes=2)
    assert reg.release(rec.transfer_id, rec.epoch, Outcome.FAILED).state is State.FAILED


def test_stream_closed(reg: Registry) -> None:
    seen = events(reg)
    reg.register(spec("a"))
    reg.register(spec("b"))
    reg.stream_closed("a", "i1", clean=True)
    reg.stream_closed("b", "other-incarnation", clean=False)  # not this one: ignored
    reg.stream_closed("b", "i1", clean=False)
    assert seen[-2:] == [(EventKind.DEREGISTERED, "a", "i1"), (EventKind.DEAD, "b", "i1")]
    assert not reg.instances


def test_draining_excluded(reg: Registry) -> None:
    seen = events(reg)
    reg.register(spec("p", Role.PREFILL))
    reg.register(spec("d1"))
    reg.register(spec("d2"))
    reg.report("d1", "i1", Load(free_blocks=1000, draining=True))
    assert seen[-1] == (EventKind.DRAINING, "d1", "i1")
    for _ in range(20):
        assert reg.assign(Demand(10)).decode.engine_id == "d2"


def test_admission_reasons(reg: Registry) -> None:
    with pytest.raises(NoCapacity) as e:
        reg.assign(Demand(10))
    assert e.value.reason == "no_decode"
    reg.register(spec("d", blocks=10))
    with pytest.raises(NoCapacity) as e:
        reg.assign(Demand(10))
    assert e.value.reason == "no_prefill"
    reg.register(spec("p", Role.PREFILL))
    with pytest.raises(NoCapacity) as e:
        reg.assign(Demand(16 * 10))  # 160 prompt + 1 output token = 11 blocks > 10
    assert e.value.reason == "too_large"
    reg.report("d", "i1", Load(free_blocks=3))
    with pytest.raises(NoCapacity, match="best projected free: 3") as e:
        reg.assign(Demand(16 * 4))
    assert e.value.reason == "no_capacity"
    with pytest.raises(InvalidArgument):
        reg.assign(Demand(0))


def test_pending_blocks_count_until_reported(reg: Registry, clock: Clock) -> None:
    reg.register(spec("p", Role.PREFILL))
    reg.register(spec("d", blocks=10))
    a = reg.assign(Demand(16 * 5, max_tokens=16))  # 6 blocks
    assert reg.instances["d"].projected_free == 4
    with pytest.raises(NoCapacity):
        reg.assign(Demand(16 * 5))
    # A report right away does not include the assignment yet: still pending.
    reg.report("d", "i1", Load(free_blocks=10))
    assert reg.instances["d"].projected_free == 4
    # After the settle time the report includes it.
    clock.t += 0.21
    reg.report("d", "i1", Load(free_blocks=4, reserved_unfilled_blocks=6))
    assert reg.instances["d"].projected_free == 4
    # Release drops a pending entry at once.
    b = reg.assign(Demand(16 * 2))  # 3 blocks
    assert reg.instances["d"].projected_free == 1
    reg.release(b.transfer_id, b.epoch, Outcome.CANCELLED)
    assert reg.instances["d"].projected_free == 4
    reg.release(a.transfer_id, a.epoch, Outcome.OK)
    assert reg.instances["d"].open == set()


def test_release_errors_and_epochs(reg: Registry) -> None:
    reg.register(spec("p", Role.PREFILL))
    reg.register(spec("d"))
    a = reg.assign(Demand(10), transfer_id="t1")
    b = reg.assign(Demand(10), transfer_id="t1")  # re-assign: newer epoch supersedes
    assert b.epoch > a.epoch and a.state is State.SUPERSEDED
    with pytest.raises(FailedPrecondition, match="stale"):
        reg.release("t1", a.epoch, Outcome.OK)
    with pytest.raises(NotFound):
        reg.release("nope", 1, Outcome.OK)
    assert reg.release("t1", b.epoch, Outcome.OK).state is State.OK
    assert reg.release("t1", b.epoch, Outcome.FAILED).state is State.OK  # idempotent
    c = reg.assign(Demand(10))
    assert c.transfer_id and c.epoch > b.epoch


def test_closed_history_bounded(clock: Clock) -> None:
    reg = Registry(clock=clock, closed_history=3)
    reg.register(spec("p", Role.PREFILL))
    reg.register(spec("d"))
    recs = [reg.assign(Demand(1)) for _ in range(5)]
    for r in recs:
        reg.release(r.transfer_id, r.epoch, Outcome.OK)
    assert len(reg.closed) == 3
    with pytest.raises(NotFound):
        reg.release(recs[0].transfer_id, recs[0].epoch, Outcome.OK)


def test_closed_history_is_invisible_to_the_garbage_collector(clock: Clock) -> None:
    """A full collection walks every tracked object; the closed history must add none of its own,
    whatever its size, or the collector's pauses grow with it (they land in Assign's tail)."""
    reg = Registry(clock=clock, closed_history=1000)
    for name in ("p1", "p2"):
        reg.register(spec(name, Role.PREFILL))
    reg.register(spec("d"))
    rerouted = reg.assign(Demand(1))
    reg.reroute(rerouted.transfer_id, "d", rerouted.prefill.engine_id, max_reroutes=3)
    recs = [rerouted]
    reg.release(rerouted.transfer_id, rerouted.epoch, Outcome.FAILED, reason="r" * 40)
    gc.collect()
    tracked_before = len(gc.get_objects())
    for _ in range(2000):
        recs.append(reg.assign(Demand(1)))
        reg.release(recs[-1].transfer_id, recs[-1].epoch, Outcome.FAILED, reason="r" * 40)
    kept = recs[-1].transfer_id
    del recs[1:]
    gc.collect()
    assert len(reg.closed) == 1000
    assert len(gc.get_objects()) - tracked_before < 50
    # What it keeps still answers a repeated Release, under the current or an earlier epoch.
    last = reg.closed[kept]
    assert (last.state, last.reason) == (State.FAILED, "r" * 40)
    assert reg.release(kept, last.epoch, Outcome.OK).state is State.FAILED
    with pytest.raises(FailedPrecondition, match="stale"):
        reg.release(kept, last.epoch - 1, Outcome.OK)


def test_a_rerouted_assignment_is_released_under_an_earlier_epoch_after_it_closed(clock: Clock) -> None:
    reg = Registry(clock=clock)
    for name in ("p1", "p2"):
        reg.register(spec(name, Role.PREFILL))
    reg.register(spec("d"))
    rec = reg.assign(Demand(1))
    first_epoch = rec.epoch
    reg.reroute(rec.transfer_id, "d", rec.prefill.engine_id, max_reroutes=3)
    assert reg.release(rec.transfer_id, rec.epoch, Outcome.OK).state is State.OK
    closed = reg.closed[rec.transfer_id]
    assert closed.earlier_epochs == (first_epoch,)
    assert reg.release(rec.transfer_id, first_epoch, Outcome.FAILED).state is State.OK  # idempotent


def _inst(engine_id: str, free: int, total: int = 1000, **load: int) -> Instance:
    return Instance(spec=spec(engine_id, blocks=total), registered_at=0, last_seen=0, load=Load(free, **load))


def test_p2c_never_picks_the_most_loaded() -> None:
    cands = [_inst("a", 900), _inst("b", 800), _inst("c", 700), _inst("hot", 50)]
    pol = PowerOfTwoChoices(random.Random(7))
    got = Counter(pol.choose(cands, Demand(16)).engine_id for _ in range(600))  # type: ignore[union-attr]
    assert got["hot"] == 0
    assert got["a"] > got["b"] > got["c"] > 0  # spreads, biased to the emptiest
    assert pol.choose([], Demand(1)) is None


def test_least_pressure_counts_reserved_and_pending() -> None:
    a = _inst("a", 500, reserved_unfilled_blocks=400)
    b = _inst("b", 450)
    assert LeastPressure().choose([a, b], Demand(16)).engine_id == "b"  # type: ignore[union-attr]
    b.add_pending("t", 300, 0.0)
    assert LeastPressure().choose([a, b], Demand(16)).engine_id == "a"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown decode policy"):
        decode_policy("nope")


def test_prefill_least_busy() -> None:
    p1 = _inst("p1", 0, waiting_requests=5)
    p2 = _inst("p2", 0, running_requests=1, write_bytes_in_flight=1 << 20)
    assert LeastBusy().choose([p1, p2], Demand(1)).engine_id == "p2"  # type: ignore[union-attr]


def test_skewed_load_end_to_end(reg: Registry, clock: Clock) -> None:
    """Decode choice under skewed reported load, including the scheduler's own pending blocks."""
    reg.register(spec("p", Role.PREFILL))
    for name, free in [("d0", 950), ("d1", 900), ("d2", 200)]:
        reg.register(spec(name))
        reg.report(name, "i1", Load(free_blocks=free))
    got = Counter(reg.assign(Demand(16 * 3)).decode.engine_id for _ in range(120))  # 4 blocks each
    assert got["d2"] == 0
    assert got["d0"] > 0 and got["d1"] > 0
    # Pending blocks spread the burst: d0 stayed within reach of d1 instead of taking everything.
    assert abs(reg.instances["d0"].projected_free - reg.instances["d1"].projected_free) <= 8


def test_prefix_affinity() -> None:
    cands = [_inst(f"d{i}", 900) for i in range(4)]
    pol = PrefixAffinity(slack=0.1)
    homes = {h: pol.choose(cands, Demand(16, prefix_hint=h)).engine_id for h in ("sys-a", "sys-b", "sys-c", "x")}  # type: ignore[union-attr]
    for h, home in homes.items():
        for _ in range(5):
            assert pol.choose(cands, Demand(16, prefix_hint=h)).engine_id == home  # type: ignore[union-attr]
        # Spread: with the hint's home overloaded, the next in hash order takes it, consistently.
        loaded = [_inst(c.engine_id, 100 if c.engine_id == home else 900) for c in cands]
        other = pol.choose(loaded, Demand(16, prefix_hint=h)).engine_id  # type: ignore[union-attr]
        assert other != home and pol.choose(loaded, Demand(16, prefix_hint=h)).engine_id == other  # type: ignore[union-attr]
    assert len(set(homes.values())) > 1
    assert pol.choose(cands, Demand(16)) in cands  # no hint: p2c
    assert decode_policy("affinity").name == "affinity"


def test_instances_are_assignable_only_once_ready(clock: Clock) -> None:
    reg = Registry(lease=LeaseConfig(interval_s=0.1, misses=3), clock=clock, first_epoch=1, require_ready=True)
    reg.register(spec("d0"))
    reg.register(spec("p0", Role.PREFILL))
    with pytest.raises(NoCapacity, match="not serving yet"):
        reg.assign(Demand(100))
    assert {s.engine_id for s in reg.unready()} == {"d0", "p0"}
    assert reg.mark_ready("d0", "i1")
    assert not reg.mark_ready("d0", "i1")  # once
    assert not reg.mark_ready("p0", "stale-incarnation")
    with pytest.raises(NoCapacity, match="no live prefill"):
        reg.assign(Demand(100))
    assert reg.mark_ready("p0", "i1")
    assert reg.assign(Demand(100)).decode.engine_id == "d0"
    # A restart (new incarnation) starts unready again.
    reg.register(spec("p0", Role.PREFILL, inc="i2"))
    with pytest.raises(NoCapacity, match="not serving yet"):
        reg.assign(Demand(100))


def test_assignments_without_release_expire(reg: Registry, clock: Clock) -> None:
    reg.lease = LeaseConfig(interval_s=0.1, misses=3, settle_s=0.2, assignment_ttl_s=5.0)
    reg.register(spec("d0"))
    reg.register(spec("p0", Role.PREFILL))
    closed: list[str] = []
    reg.closed_listeners.append(lambda r: closed.append(r.transfer_id))
    forgotten = reg.assign(Demand(100))
    held = reg.assign(Demand(100))
    held.held = True
    clock.t += 4.0
    assert reg.expire_assignments() == []
    clock.t += 1.5
    assert [r.transfer_id for r in reg.expire_assignments()] == [forgotten.transfer_id]
    assert closed == [forgotten.transfer_id]
    assert forgotten.state is State.FAILED and "no Release" in forgotten.reason
    assert held.state is State.OPEN
    assert reg.instances["d0"].open == {held.transfer_id}

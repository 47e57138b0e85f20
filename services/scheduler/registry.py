"""Instance registry, load leases and assignments: the scheduler's pure state machine.

Single-threaded by design (the gRPC servicer drives it from one asyncio loop); time is passed in,
so tests can drive leases without sleeping. Changes are announced to listeners:

* ``on_event(Event)``: an instance registered, died, started draining or deregistered;
* ``on_assignment_closed(AssignmentRecord)``: an open assignment ended other than by Release
  (its instance died or was replaced, or it was superseded by a newer epoch);
* ``on_capacity()``: projected capacity may have grown (a report, release or registration), so
  queued admissions should try again.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpush.services.scheduler.closed_history import ClosedHistory
from kvpush.services.scheduler.errors import FailedPrecondition, InvalidArgument, NoCapacity, NotFound
from kvpush.services.scheduler.local_prefill import LocalPrefillConfig, LocalQueue, PrefillBacklog
from kvpush.services.scheduler.model import (
    AssignmentRecord,
    ClosedAssignment,
    Demand,
    Event,
    EventKind,
    Instance,
    InstanceSpec,
    Load,
    Outcome,
    Role,
    State,
)
from kvpush.services.scheduler.policy import DecodePolicy, LeastBusy, PowerOfTwoChoices, PrefillPolicy

_OUTCOME_STATE = {Outcome.OK: State.OK, Outcome.FAILED: State.FAILED, Outcome.CANCELLED: State.CANCELLED}


@dataclass(frozen=True)
class LeaseConfig:
    interval_s: float = 0.5
    misses: int = 3
    # A pending (not yet reported) assignment counts against its decode until a report arrives this
    # long after it was made; by then the decode has allocated the blocks and reports them.
    settle_s: float = 0.5
    # An assignment handed to a frontend (Assign) with no Release this long after is closed as
    # failed, so a frontend that forgets Release cannot hold decode capacity forever.
    assignment_ttl_s: float = 600.0

    @property
    def timeout_s(self) -> float:
        return self.interval_s * self.misses


class Registry:
    def __init__(
        self,
        lease: LeaseConfig | None = None,
        decode_policy: DecodePolicy | None = None,
        prefill_policy: PrefillPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        closed_history: int = 65536,
        first_epoch: int | None = None,
        require_ready: bool = False,
        local_prefill: LocalPrefillConfig | None = None,
    ) -> None:
        self.lease = lease or LeaseConfig()
        # When a request's prefill runs on its decode (off unless configured; local_prefill.py).
        self.local_prefill = local_prefill or LocalPrefillConfig()
        self._local = self.local_prefill.enabled
        # When set, an instance with an http_endpoint is assignable only after mark_ready.
        self.require_ready = require_ready
        self.decode_policy: DecodePolicy = decode_policy or PowerOfTwoChoices()
        self.prefill_policy: PrefillPolicy = prefill_policy or LeastBusy()
        self.clock = clock
        self.instances: dict[str, Instance] = {}
        self.open: dict[str, AssignmentRecord] = {}
        self.closed = ClosedHistory(closed_history)
        # Epochs grow across scheduler restarts too: start from the wall clock in microseconds.
        self._epochs = itertools.count(first_epoch if first_epoch is not None else time.time_ns() // 1000)
        self.event_listeners: list[Callable[[Event], None]] = []
        self.closed_listeners: list[Callable[[AssignmentRecord], None]] = []
        self.capacity_listeners: list[Callable[[], None]] = []

    # ---------------------------------------------------------------- notifications

    def _emit(self, event: Event) -> None:
        for fn in self.event_listeners:
            fn(event)

    def _capacity(self) -> None:
        for fn in self.capacity_listeners:
            fn()

    # ---------------------------------------------------------------- registration and leases

    def register(self, spec: InstanceSpec, now: float | None = None) -> Instance:
        """Adds or refreshes an instance. A new incarnation of a known engine replaces the old one
        (whose open assignments fail); the same incarnation only refreshes the lease."""
        try:
            spec.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        now = self.clock() if now is None else now
        old = self.instances.get(spec.engine_id)
        if old is not None:
            if old.spec.role != spec.role:
                raise FailedPrecondition(
                    f"engine {spec.engine_id!r} is registered as {old.spec.role.value}, not {spec.role.value}"
                )
            if old.spec.incarnation == spec.incarnation:
                old.last_seen = now
                if old.spec != spec:
                    old.spec = spec
                return old
            self._remove(old, EventKind.DEAD, f"replaced by incarnation {spec.incarnation}")
        inst = Instance(
            spec=spec, registered_at=now, last_seen=now, ready=not (self.require_ready and spec.http_endpoint)
        )
        self.instances[spec.engine_id] = inst
        self._emit(Event(EventKind.REGISTERED, spec))
        self._capacity()
        return inst

    def unready(self) -> list[InstanceSpec]:
        """Registered instances whose OpenAI server has not answered yet."""
        return [i.spec for i in self.instances.values() if not i.ready]

    def mark_ready(self, engine_id: str, incarnation: str) -> bool:
        """The instance's OpenAI server answered: it becomes assignable. False when it is gone."""
        inst = self.instances.get(engine_id)
        if inst is None or inst.spec.incarnation != incarnation or inst.ready:
            return False
        inst.ready = True
        self._capacity()
        return True

    def _lookup(self, engine_id: str, incarnation: str) -> Instance:
        inst = self.instances.get(engine_id)
        if inst is None:
            raise NotFound(f"engine {engine_id!r} is not registered (register first)")
        if inst.spec.incarnation != incarnation:
            # The current incarnation is not named: it is no business of whoever sent a stale one.
            raise FailedPrecondition(f"engine {engine_id!r}: stale incarnation; the engine registered again since")
        return inst

    def report(self, engine_id: str, incarnation: str, load: Load, now: float | None = None) -> int:
        """Records a load report and renews the lease. Returns the report sequence number."""
        now = self.clock() if now is None else now
        inst = self._lookup(engine_id, incarnation)
        was_draining = inst.draining
        inst.load = load
        inst.last_seen = now
        inst.reports += 1
        inst.settle_pending(now - self.lease.settle_s)
        if load.draining and not was_draining:
            self._emit(Event(EventKind.DRAINING, inst.spec, "instance reported draining"))
        self._capacity()
        return inst.reports

    def stream_closed(self, engine_id: str, incarnation: str, clean: bool) -> None:
        """The instance's load stream ended: after a draining report (a goodbye) it deregisters,
        otherwise it is declared dead. Either way its open assignments fail now, not at lease expiry."""
        inst = self.instances.get(engine_id)
        if inst is None or inst.spec.incarnation != incarnation:
            return
        if clean:
            self._remove(inst, EventKind.DEREGISTERED, "load stream closed after draining")
        else:
            self._remove(inst, EventKind.DEAD, "load stream lost")

    def expire(self, now: float | None = None) -> list[Instance]:
        """Declares dead every instance whose lease ran out; returns them."""
        now = self.clock() if now is None else now
        timeout = self.lease.timeout_s
        dead = [i for i in self.instances.values() if now - i.last_seen > timeout]
        for inst in dead:
            self._remove(inst, EventKind.DEAD, f"lease expired: no load report for {now - inst.last_seen:.3f}s")
        return dead

    def expire_assignments(self, now: float | None = None) -> list[AssignmentRecord]:
        """Closes, as failed, assignments handed out by Assign that saw no Release within the TTL."""
        now = self.clock() if now is None else now
        cutoff = now - self.lease.assignment_ttl_s
        stale = [r for r in self.open.values() if not r.held and r.created_at <= cutoff]
        for rec in stale:
            self._close(rec, State.FAILED, f"no Release within {self.lease.assignment_ttl_s:g}s")
            self._notify_closed(rec)
        if stale:
            self._capacity()
        return stale

    def next_expiry(self) -> float | None:
        if not self.instances:
            return None
        return min(i.last_seen for i in self.instances.values()) + self.lease.timeout_s

    def _remove(self, inst: Instance, kind: EventKind, reason: str) -> None:
        del self.instances[inst.engine_id]
        for transfer_id in sorted(inst.open):
            rec = self.open.get(transfer_id)
            if rec is None:
                continue
            why = f"{inst.spec.role.value} {inst.engine_id} {kind.value}: {reason}"
            if inst.spec.role is Role.PREFILL and rec.prefill is not None and rec.prefill.engine_id == inst.engine_id:
                # The decode engine still holds the reservation: it reroutes the transfer to another
                # prefill (Reroute) or fails the request itself, so the assignment stays open.
                rec.prefill_lost = why
                continue
            self._close(rec, State.FAILED, why)
            self._notify_closed(rec)
        self._emit(Event(kind, inst.spec, reason))
        self._capacity()

    # ---------------------------------------------------------------- assignment

    def live(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.spec.role is role]

    def assign(self, demand: Demand, transfer_id: str = "", now: float | None = None) -> AssignmentRecord:
        """Chooses decode (load-aware, must hold the demand) and then prefill. Raises NoCapacity
        with a reason when admission fails, InvalidArgument for a bad demand."""
        if demand.prompt_tokens < 1:
            raise InvalidArgument("prompt_tokens must be >= 1")
        now = self.clock() if now is None else now
        decodes: list[Instance] = []
        prefills: list[Instance] = []
        fitting: list[Instance] = []
        blocks_by_tpb: dict[int, int] = {}
        unready = 0
        prefill_role = Role.PREFILL
        # The hot path of every assignment: Instance.draining and .projected_free, inlined.
        for inst in self.instances.values():
            load = inst.load
            if load is not None and load.draining:
                continue
            if not inst.ready:
                unready += 1
                continue
            spec = inst.spec
            if spec.role is prefill_role:
                prefills.append(inst)
                continue
            decodes.append(inst)
            tpb = spec.tokens_per_block
            need = blocks_by_tpb.get(tpb)
            if need is None:
                need = blocks_by_tpb[tpb] = demand.blocks_on(tpb)
            total = spec.total_kv_blocks
            free = total if load is None else min(load.free_blocks, total)
            if free - inst.pending_blocks >= need:
                fitting.append(inst)
        starting = f" ({unready} registered, not serving yet)" if unready else ""
        local = self._local and demand.local_ok
        if not decodes:
            raise NoCapacity("no_decode", f"no live decode instance is ready{starting}")
        if not prefills and not local:
            raise NoCapacity("no_prefill", f"no live prefill instance is ready{starting}")
        if not fitting:
            best = max(decodes, key=lambda d: d.projected_free)
            need = demand.blocks_on(best.spec.tokens_per_block)
            if need > best.spec.total_kv_blocks:
                raise NoCapacity(
                    "too_large",
                    f"request needs {need} KV blocks; the largest decode instance has {best.spec.total_kv_blocks}",
                )
            raise NoCapacity(
                "no_capacity",
                f"no decode instance can hold {need} KV blocks "
                f"(best projected free: {best.projected_free} on {best.engine_id})",
            )
        decode = self.decode_policy.choose(fitting, demand)
        if decode is None:
            raise NoCapacity("no_capacity", f"decode policy {self.decode_policy.name} chose no instance")
        prefill = self.prefill_policy.choose(prefills, demand) if prefills else None
        if prefill is None and not local:
            raise NoCapacity("no_prefill", f"prefill policy {self.prefill_policy.name} chose no instance")
        if local and prefill is not None and not self._prefills_on_decode(demand, prefill, decode, now):
            local = False
        leg = None if local else prefill  # the prefill the request goes to (None: its decode prefills it)

        if transfer_id:
            previous = self.open.get(transfer_id)
            if previous is not None:
                self._close(previous, State.SUPERSEDED, "re-assigned with a newer epoch")
                self._notify_closed(previous)
        else:
            transfer_id = os.urandom(16).hex()  # as unique as a uuid4's hex, a fifth of its cost
        blocks = demand.blocks_on(decode.spec.tokens_per_block)
        rec = AssignmentRecord(
            transfer_id=transfer_id,
            epoch=next(self._epochs),
            prefill=leg.spec if leg is not None else None,
            decode=decode.spec,
            decode_blocks=blocks,
            created_at=now,
        )
        self.open[transfer_id] = rec
        self.closed.discard(transfer_id)
        decode.open.add(transfer_id)
        decode.add_pending(transfer_id, blocks, now)
        if leg is not None:
            leg.open.add(transfer_id)
            leg.add_pending(transfer_id, 0, now)
            if leg.backlog is not None:
                leg.backlog.add(transfer_id, demand.prompt_tokens, now)
        return rec

    def _prefills_on_decode(self, demand: Demand, prefill: Instance, decode: Instance, now: float) -> bool:
        """Local prefill's rules (local_prefill.py) for a request that could go to ``prefill``:
        a short prompt, or a prefill queue longer than the configured wait (or one that would make
        the request's first token later than the configured target) while the decode is not
        prefilling another such request (each one stalls the decodes it runs beside, so a decode
        takes them one at a time). A decode that takes one counts it in its own queue."""
        cfg = self.local_prefill
        if demand.prompt_tokens <= cfg.max_tokens:
            return True
        if not cfg.queue_rules:
            return False
        backlog = prefill.backlog
        if backlog is None:
            backlog = prefill.backlog = PrefillBacklog()
        wait = backlog.wait_s(now)
        spt = backlog.s_per_token
        if wait is None or spt is None or not cfg.overflows(wait, demand.prompt_tokens * spt):
            return False
        if cfg.max_decoding >= 0 and self._decoding(decode) > cfg.max_decoding:
            return False
        own = decode.local_queue
        if own is None:
            own = decode.local_queue = LocalQueue()
        if own.wait_s(now) > 0:
            return False
        own.add(demand.prompt_tokens, spt, now)
        return True

    def _decoding(self, decode: Instance) -> int:
        """How many requests ``decode`` decodes now by the scheduler's books: its open assignments
        whose prefill no prefill instance's queue holds (finished, or prefilled on decode). Only
        asked when a queue rule would move a prompt: O(open assignments x prefill instances)."""
        queues = [p.backlog for p in self.live(Role.PREFILL) if p.backlog is not None and len(p.backlog)]
        return sum(1 for tid in decode.open if not any(tid in q for q in queues))

    def reroute(
        self, transfer_id: str, decode_engine_id: str, failed_prefill_engine_id: str, max_reroutes: int
    ) -> tuple[AssignmentRecord, bool]:
        """Moves an open assignment's prefill leg to another ready prefill (a new epoch) after its
        transfer failed on ``failed_prefill_engine_id``. Returns (record, moved): when the record's
        prefill is already another engine (a repeated report), it is returned unmoved. Raises NotFound,
        FailedPrecondition (not this decode's, or out of retries) or NoCapacity("no_prefill")."""
        rec = self.open.get(transfer_id)
        if rec is None:
            raise NotFound(f"no open assignment for transfer {transfer_id!r}")
        if rec.decode.engine_id != decode_engine_id:
            raise FailedPrecondition(f"transfer {transfer_id!r} is not assigned to decode {decode_engine_id!r}")
        if rec.prefill is None:
            raise FailedPrecondition(f"transfer {transfer_id!r} is prefilled on its decode; there is no prefill leg")
        if rec.prefill.engine_id != failed_prefill_engine_id:
            return rec, False
        tried = rec.tried_prefills | {rec.prefill.engine_id}
        if len(tried) >= max_reroutes:
            raise FailedPrecondition(f"transfer {transfer_id!r} was already tried on {len(tried)} prefill engines")
        demand = Demand(1, 0)
        candidates = [
            i
            for i in self.instances.values()
            if i.spec.role is Role.PREFILL and i.ready and not i.draining and i.engine_id not in tried
        ]
        prefill = self.prefill_policy.choose(candidates, demand) if candidates else None
        if prefill is None:
            raise NoCapacity("no_prefill", f"no other ready prefill instance for {transfer_id!r}")
        old = self.instances.get(rec.prefill.engine_id)
        if old is not None and old.spec.incarnation == rec.prefill.incarnation:
            old.open.discard(transfer_id)
            old.drop_pending(transfer_id)
            if old.backlog is not None:
                old.backlog.drop(transfer_id)
        rec.tried_prefills = frozenset(tried)
        rec.prefill, rec.prefill_lost = prefill.spec, ""
        rec.earlier_epochs = rec.earlier_epochs | {rec.epoch}
        rec.epoch = next(self._epochs)
        prefill.open.add(transfer_id)
        prefill.add_pending(transfer_id, 0, self.clock())
        return rec, True

    def release(
        self, transfer_id: str, epoch: int, outcome: Outcome, reason: str = ""
    ) -> AssignmentRecord | ClosedAssignment:
        """Ends an assignment. Idempotent for an already closed one with the same epoch."""
        rec: AssignmentRecord | ClosedAssignment | None = self.open.get(transfer_id)
        if rec is None:
            rec = self.closed.get(transfer_id)
            if rec is None:
                raise NotFound(f"unknown transfer {transfer_id!r}")
        if rec.epoch != epoch and epoch not in rec.earlier_epochs:
            raise FailedPrecondition(
                f"transfer {transfer_id!r} epoch {epoch} is stale; the current epoch is {rec.epoch}"
            )
        if isinstance(rec, AssignmentRecord) and rec.state is State.OPEN:
            self._close(rec, _OUTCOME_STATE[outcome], reason)
            self._capacity()
        return rec

    def _close(self, rec: AssignmentRecord, state: State, reason: str) -> None:
        rec.state = state
        rec.reason = reason
        if self.open.get(rec.transfer_id) is rec:
            del self.open[rec.transfer_id]
        for spec in (rec.decode, rec.prefill):
            if spec is None:
                continue
            inst = self.instances.get(spec.engine_id)
            if inst is not None and inst.spec.incarnation == spec.incarnation:
                inst.open.discard(rec.transfer_id)
                inst.drop_pending(rec.transfer_id)
                if inst.backlog is not None:
                    inst.backlog.drop(rec.transfer_id)
        if state is not State.SUPERSEDED:
            self.closed.add(rec)

    def _notify_closed(self, rec: AssignmentRecord) -> None:
        for fn in self.closed_listeners:
            fn(rec)

    # ---------------------------------------------------------------- views

    def vocab_size(self) -> int:
        """The smallest vocabulary size a registered instance reported (0: none reported one)."""
        return min((i.spec.vocab_size for i in self.instances.values() if i.spec.vocab_size), default=0)

    def snapshot(self) -> Iterable[Instance]:
        return list(self.instances.values())

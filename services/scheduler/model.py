"""Plain data types of the scheduler: instances, load, events, assignments. No grpc here."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvpush.services.common import limits
from kvpush.services.scheduler.local_prefill import LocalQueue, PrefillBacklog


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class EventKind(enum.Enum):
    REGISTERED = "registered"
    DEAD = "dead"
    DRAINING = "draining"
    DEREGISTERED = "deregistered"


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"


class State(enum.Enum):
    OPEN = "open"
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance registers (mirror of ``kvpush.v1.InstanceInfo``)."""

    engine_id: str
    role: Role
    incarnation: str
    tp_size: int
    agent_endpoints: tuple[str, ...]
    total_kv_blocks: int
    tokens_per_block: int
    http_endpoint: str
    # Per TP rank, aligned with agent_endpoints; empty when the instance does not report them.
    agent_incarnations: tuple[str, ...] = ()
    first_token_handoff: bool = False  # decode: continues from the prefill's first token
    vocab_size: int = 0  # the model's; prompt token ids must be below it (0: unknown)

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if not self.engine_id:
            raise ValueError("instance.engine_id is required")
        if not self.incarnation:
            raise ValueError("instance.incarnation is required")
        if self.tp_size < 1:
            raise ValueError("instance.tp_size must be >= 1")
        if self.tp_size > limits.MAX_TP:
            raise ValueError(f"instance.tp_size must be <= {limits.MAX_TP}")
        if max(len(self.engine_id), len(self.incarnation), *map(len, self.agent_incarnations)) > limits.MAX_ID_CHARS:
            raise ValueError(f"instance ids and incarnations are at most {limits.MAX_ID_CHARS} characters")
        if any(len(e) > limits.MAX_ENDPOINT_CHARS for e in (self.http_endpoint, *self.agent_endpoints)):
            raise ValueError(f"instance endpoints are at most {limits.MAX_ENDPOINT_CHARS} characters")
        if len(self.agent_endpoints) != self.tp_size:
            raise ValueError(
                f"instance.agent_endpoints has {len(self.agent_endpoints)} entries, tp_size is {self.tp_size}"
            )
        if any(not e for e in self.agent_endpoints):
            raise ValueError("instance.agent_endpoints must not contain empty entries")
        if self.agent_incarnations and len(self.agent_incarnations) != self.tp_size:
            raise ValueError(
                f"instance.agent_incarnations has {len(self.agent_incarnations)} entries, tp_size is {self.tp_size}"
            )
        if self.total_kv_blocks < 1:
            raise ValueError("instance.total_kv_blocks must be >= 1")
        if self.tokens_per_block < 1:
            raise ValueError("instance.tokens_per_block must be >= 1")
        if self.http_endpoint and not self.http_endpoint.startswith(("http://", "https://")):
            raise ValueError("instance.http_endpoint must start with http:// or https://")


@dataclass(frozen=True)
class Load:
    """One load report (mirror of ``kvpush.v1.LoadReport`` without the identity)."""

    free_blocks: int = 0
    reserved_unfilled_blocks: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    write_bytes_in_flight: int = 0
    draining: bool = False


_NO_LOAD = Load()  # what an instance counts as before its first report: entirely free


@dataclass(frozen=True)
class Event:
    kind: EventKind
    spec: InstanceSpec
    reason: str = ""


@dataclass(frozen=True)
class Demand:
    """What one request needs from its decode instance."""

    prompt_tokens: int
    max_tokens: int = 0
    prefix_hint: str = ""
    # The frontend can serve an assignment whose prefill runs on its decode (local_prefill.py).
    local_ok: bool = False

    def blocks_on(self, tokens_per_block: int) -> int:
        """Blocks the request projects to hold on an instance: the prompt plus its output budget
        (at least one token, the first decoded one)."""
        return math.ceil((self.prompt_tokens + max(1, self.max_tokens)) / tokens_per_block)


@dataclass
class Instance:
    """Registry state of one live instance. ``load`` is None until the first report, and the
    instance then counts as entirely free."""

    spec: InstanceSpec
    registered_at: float
    last_seen: float
    load: Load | None = None
    reports: int = 0
    # Open assignments touching this instance (transfer ids).
    open: set[str] = field(default_factory=set)
    # Assignments the instance's reports do not reflect yet: transfer id -> (blocks, assigned at).
    pending: dict[str, tuple[int, float]] = field(default_factory=dict)
    pending_blocks: int = 0
    # Assignable only once its OpenAI server answers (the scheduler probes ``http_endpoint``);
    # an instance without one (Assign-only deployments) is ready when it registers.
    ready: bool = False
    # Local prefill's estimates (with its queue rule on): a prefill's queue, a decode's own prefills.
    backlog: PrefillBacklog | None = None
    local_queue: LocalQueue | None = None

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    @property
    def draining(self) -> bool:
        return self.load is not None and self.load.draining

    @property
    def reported_free(self) -> int:
        if self.load is None:
            return self.spec.total_kv_blocks
        return min(self.load.free_blocks, self.spec.total_kv_blocks)

    @property
    def projected_free(self) -> int:
        """Free blocks after the scheduler's own not-yet-reported assignments."""
        return self.reported_free - self.pending_blocks

    def pressure(self, extra_blocks: int = 0) -> float:
        """Projected KV pressure in [0, ~1.x]: used plus pending blocks over total, plus a share of
        the reserved-but-unfilled blocks (transfers about to land and start decoding) and a small
        queueing term, so that equal memory breaks ties towards the less busy instance."""
        total = self.spec.total_kv_blocks
        used = total - self.reported_free + self.pending_blocks + extra_blocks
        load = self.load or _NO_LOAD
        return (
            used / total
            + 0.5 * load.reserved_unfilled_blocks / total
            + 0.001 * (load.waiting_requests + 0.5 * load.running_requests)
        )

    def busyness(self) -> float:
        """Prefill load: queued and running work, unreported assignments, WRITE bytes in flight."""
        load = self.load or _NO_LOAD
        return (
            load.waiting_requests
            + load.running_requests
            + len(self.pending)
            + load.write_bytes_in_flight / float(256 << 20)
        )

    def add_pending(self, transfer_id: str, blocks: int, now: float) -> None:
        self.drop_pending(transfer_id)
        self.pending[transfer_id] = (blocks, now)
        self.pending_blocks += blocks

    def drop_pending(self, transfer_id: str) -> None:
        entry = self.pending.pop(transfer_id, None)
        if entry is not None:
            self.pending_blocks -= entry[0]

    def settle_pending(self, before: float) -> None:
        """Forget pending assignments made before ``before``: reports now include them."""
        stale = [t for t, (_, at) in self.pending.items() if at <= before]
        for t in stale:
            self.drop_pending(t)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A hand-off transfer's first token as one of its prefill engines reported it."""

    token_id: int
    stopped: bool
    prefill_engine_id: str


# slots and frozensets: one GC-tracked object per open record instead of three. Closed records are
# not kept (see ClosedHistory), so the collector walks open assignments only.
@dataclass(slots=True)
class AssignmentRecord:
    transfer_id: str
    epoch: int
    prefill: InstanceSpec | None  # None: the decode instance prefills the request itself
    decode: InstanceSpec
    decode_blocks: int
    created_at: float
    state: State = State.OPEN
    reason: str = ""
    # Generate owns the record and releases it itself; others expire without a Release.
    held: bool = False
    # Prefill engines this transfer was sent to (retry elsewhere never sends it back to one), and
    # why the current prefill is gone when it died under the open assignment (decode reroutes).
    tried_prefills: frozenset[str] = frozenset()
    prefill_lost: str = ""
    earlier_epochs: frozenset[int] = frozenset()  # before reroutes; Release may name them
    # First-token hand-off granted: both legs say so, and the frontend streams prefill's token.
    first_token: bool = False
    # That token, once one of the assignment's prefill engines reported it (the first one wins).
    sampled: SampledToken | None = None


@dataclass(frozen=True, slots=True)
class ClosedAssignment:
    """What the registry remembers of a closed assignment: enough to answer a repeated Release."""

    transfer_id: str
    epoch: int
    earlier_epochs: tuple[int, ...]
    state: State
    reason: str

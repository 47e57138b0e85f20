"""Objects that cross vLLM's process boundaries (pickled): handshake and per-step metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvpush.services.common.layout import ModelShape


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """What a worker rank tells its engine's scheduler-side connector at start-up."""

    tp_rank: int
    endpoint: str  # prefill: PrefillAgent server; decode: DecodeRank server
    incarnation: str
    layout: bytes = b""  # decode: serialized kvpush.v1.RankLayout
    num_blocks: int = 0
    shape: ModelShape | None = None


@dataclass(frozen=True)
class FinishedPrefill:
    transfer_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    decode_engine_id: str  # from the request's prefill leg: only its reservations may match
    # First-token hand-off: the client's first token is this step's output, so the push waits for
    # the step's output to be out (the next step's start) instead of competing with it for the core.
    after_output: bool = False
    # First-token hand-off whose token the push's completions carry: the worker posts it the
    # moment it is sampled (connector/completion_tokens.py, AwaitedFirstTokens).
    first_token: bool = False


@dataclass(frozen=True)
class AbortedPrefill:
    transfer_id: str
    decode_engine_id: str


@dataclass(frozen=True)
class UnreservedPrefill:
    """No reservation will come for this transfer (its decode leg was not delivered): its KV is
    freed as soon as it is done, not at the prefill lease."""

    transfer_id: str
    decode_engine_id: str


@dataclass
class PushMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step. Prefill: transfers whose KV this step completes, transfers
    whose prefill was aborted before it finished, and transfers that will never get a reservation.
    Decode (first-token hand-off): requests reserved this step that wait for their first token as
    well as for their KV, those whose token was appended to their prompt this step, and those
    whose seeded sampler is advanced past that token in this step (their first on decode)."""

    finished_prefills: list[FinishedPrefill] = field(default_factory=list)
    aborted: list[AbortedPrefill] = field(default_factory=list)
    unreserved: list[UnreservedPrefill] = field(default_factory=list)
    awaiting_first_token: list[str] = field(default_factory=list)
    first_token_delivered: list[str] = field(default_factory=list)
    first_token_abandoned: list[str] = field(default_factory=list)  # ended before their token came
    advance_sampler: list[str] = field(default_factory=list)
    # Decode: requests whose load the workers report failed at once (never reserved: a hand-off leg
    # whose transfer id another live request holds; docs/first_token.md).
    fail_loads: list[str] = field(default_factory=list)
    # Decode: one block of each hand-off request vLLM scheduled before its first token was appended
    # (never expected: the workers hold its KV release until then). The workers report these blocks
    # as failed to load in this step's output, so vLLM fails the request and drops what this step
    # sampled for it, rather than stream decode's own first token after the frontend's.
    veto_blocks: list[int] = field(default_factory=list)
    # Decode: tokens this step's forward computes (0: a step without a forward), so the decode
    # rank's NIXL poller naps longer while the engine decodes on its core (cadence.py).
    forward_tokens: int = 0
    # With ``trace_steps``: this step schedules a new request, so its forward's end is logged
    # (``forward_done``): the per-phase benchmark reads only those (benchmarks/phases.py).
    trace_forward: bool = False

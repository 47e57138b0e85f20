"""Every explicit bound of the control plane, in one place (pure: no gRPC, NIXL or vLLM).

Each gRPC edge checks what it receives against these before acting on it, answers a breach with
``INVALID_ARGUMENT`` (the message itself is out of bounds) or ``RESOURCE_EXHAUSTED`` (a queue,
table or pool is full), logs one structlog warning line, and writes nothing. docs/security.md
("Ownership and bounds") lists each bound with its status.
"""

from __future__ import annotations

# ----- transport ------------------------------------------------------------------------------

# Largest gRPC message any server or channel accepts or sends; a larger one is refused by gRPC
# itself with RESOURCE_EXHAUSTED. The largest legitimate message is a decode Hello: one RankLayout
# per decode rank, each with NIXL agent metadata that grows with the registered regions. Measured
# with real NIXL (UCX, loopback): a TP-8 Hello is 4 KB with one region per rank, 43 KB with 80 and
# 83 KB with 160; RDMA adds remote keys per region and device, so 4 MiB leaves two orders of
# magnitude of headroom while bounding what one message can make a server allocate.
MAX_MESSAGE_BYTES = 4 << 20

# ----- identities and strings -----------------------------------------------------------------

MAX_ID_CHARS = 128  # transfer, engine, request ids; incarnations; NIXL agent names
MAX_ENDPOINT_CHARS = 256  # host:port of an agent or rank, and an instance's http(s) URL
MAX_HASH_CHARS = 128  # a compatibility hash ("kvpush1-" + 24 hex digits today)
MAX_REASON_CHARS = 1024  # free-text reasons are cut to this before they are logged or stored
MAX_PREFIX_HINT_CHARS = 4096  # AssignRequest.prefix_hint

# ----- topology and memory layout -------------------------------------------------------------

MAX_TP = 256  # tensor-parallel size of any engine (Hello, Register, expectations)
MAX_REGIONS_PER_RANK = 4096  # LayerRegions in one RankLayout (layers x KV-cache groups)
MAX_KV_GROUPS = 16  # KV-cache groups in one reservation
# Block ids in one group of one reservation; also never more than the destination region holds.
MAX_BLOCK_IDS_PER_GROUP = 1 << 17

# ----- the reservations stream (prefill rank) -------------------------------------------------

MAX_LEASE_MS = 600_000  # Reservation.lease_ms: a reservation waits at most 10 min for its KV
# Messages queued towards one decode stream that it does not read; one more ends the stream with
# RESOURCE_EXHAUSTED (a decode that reads keeps this near zero: acks and rejections are rare).
MAX_OUTBOX = 4096
# Unfinished transfers one decode engine may hold on one prefill rank (waiting for KV or being
# written); a reservation beyond it is rejected with RESOURCE_EXHAUSTED. vLLM runs a few hundred
# requests at once; this is an order of magnitude above.
MAX_OPEN_TRANSFERS_PER_DECODE = 8192
# Entries, including finished ones kept as tombstones, one decode engine may hold on a prefill
# rank; past it a Cancel of an unknown transfer is acked without leaving a tombstone.
MAX_ENTRIES_PER_DECODE = 65536

# ----- decode rank ----------------------------------------------------------------------------

MAX_EXPECTATIONS_PER_CALL = 4096  # ExpectRequest.expectations
MAX_PENDING_BARRIERS = 65536  # transfers a decode rank waits for at once (RESOURCE_EXHAUSTED past it)
MAX_REFUSED_REMEMBERED = 65536  # refused expectations kept so their Settle can fail the request

# ----- scheduler ------------------------------------------------------------------------------

MAX_PROMPT_TOKENS = 1 << 22  # Assign.prompt_tokens, Generate.prompt_token_ids
MAX_MAX_TOKENS = 1 << 20  # Assign.max_tokens, Generate.max_tokens
MAX_WATCH_SUBSCRIBERS = 256  # Watch streams open at once
MAX_CONCURRENT_GENERATE = 4096  # Generate calls in flight at once
MAX_FIRST_TOKEN_AWAITS = 4096  # AwaitFirstToken calls waiting at once
MAX_INSTANCES = 4096  # registered instances (a Register of a new engine id past it is refused)
# AssignStreamRequest.assigns and .releases: one batch's answer (an Assignment is about 1.5 KB with
# TP-2 instances, its legs' proofs included) stays far below MAX_MESSAGE_BYTES.
MAX_ASSIGNS_PER_BATCH = 256
MAX_RELEASES_PER_BATCH = 1024


def too_long(value: str, limit: int) -> bool:
    return len(value) > limit


def clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` cut to ``limit`` characters (free text from a peer, before logging or storing it)."""
    return text if len(text) <= limit else text[:limit] + "..."

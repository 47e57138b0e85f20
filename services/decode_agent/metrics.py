"""Prometheus metrics of the decode agent and decode ranks."""

from prometheus_client import Counter, Gauge, Histogram

_LAT = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10)

RESERVATIONS = Counter("kvpush_decode_reservations_total", "Reservations published")
PUBLISH_SECONDS = Histogram(
    "kvpush_decode_publish_seconds", "reserve() call to reservation written on every prefill stream", buckets=_LAT
)
SETTLED = Counter("kvpush_decode_transfers_total", "Transfers ended at the agent, by outcome", ["outcome"])
FENCE_SECONDS = Histogram(
    "kvpush_decode_fence_seconds", "Cancel or failure to settlement (blocks reusable)", buckets=_LAT
)
LINKS = Gauge("kvpush_decode_prefill_links", "Open reservation streams to prefill ranks")
LINK_LOSSES = Counter("kvpush_decode_link_losses_total", "Reservation streams lost")
RELEASED = Counter("kvpush_decode_rank_released_total", "Transfers released by a rank barrier, by outcome", ["outcome"])
BARRIER_SECONDS = Histogram("kvpush_decode_rank_barrier_seconds", "Expectation to barrier release", buckets=_LAT)
BYTES = Counter("kvpush_decode_rank_bytes_received_total", "Bytes reported written into this process")
DEADLINES = Counter("kvpush_decode_transfer_deadlines_total", "Published transfers failed because the KV never came")
REROUTES = Counter(
    "kvpush_decode_reroutes_total", "Failed transfers the decode agent asked to retry elsewhere, by result", ["result"]
)
FIRST_TOKENS = Counter(
    "kvpush_decode_first_tokens_total",
    "First-token hand-off: tokens by outcome (appended to a waiting request; refused; expired, "
    "unclaimed for a minute; late, for a request that had ended)",
    ["outcome"],
)
FIRST_TOKEN_PATHS = Counter(
    "kvpush_decode_first_token_paths_total",
    "First-token hand-off: appended tokens by the path that delivered them first "
    "(relay: the scheduler's; completion: with the push's completion)",
    ["via"],
)
COMPLETION_NOTICES = Counter(
    "kvpush_decode_completion_notices_total",
    "Completion notices (NIXL notifications) by what the rank did with them: accepted (recorded a "
    "rank's completion, or repeated one); early (held for the expectation it overtook, then counted "
    "again when taken); unknown (no expectation with a key for its transfer and epoch, or none came "
    "in time: the RPC decides); refused (malformed, bad MAC, misdirected)",
    ["outcome"],
)

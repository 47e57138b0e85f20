"""Prometheus metrics of the prefill agent."""

from prometheus_client import Counter, Gauge, Histogram

WRITES = Counter("kvpush_prefill_writes_total", "Transfers written, by outcome", ["outcome"])
BYTES = Counter("kvpush_prefill_bytes_written_total", "Bytes written into decode memory")
DESCRIPTORS = Histogram(
    "kvpush_prefill_write_descriptors", "NIXL descriptors per transfer", buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384)
)
WRITE_SECONDS = Histogram(
    "kvpush_prefill_write_seconds",
    "NIXL post to DONE, per transfer",
    buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3),
)
MATCH_WAIT_SECONDS = Histogram(
    "kvpush_prefill_match_wait_seconds",
    "From the first of (reservation, prefill done) to the second",
    buckets=(1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.3, 1, 3, 10),
)
REJECTED = Counter("kvpush_prefill_rejected_total", "Reservations rejected, by status code", ["code"])
PEERS = Gauge("kvpush_prefill_peers", "Connected decode engines")
LEASE_EXPIRED = Counter(
    "kvpush_prefill_lease_expired_total", "Transfers not written because the decode stream's write lease had expired"
)
WRITES_HELD = Counter(
    "kvpush_prefill_writes_held_total",
    "Transfers whose KV was ready while the write lease was out: held for the next renewal",
)
TEARDOWNS = Counter(
    "kvpush_prefill_teardowns_total", "Decode peers whose NIXL connection was torn down because a WRITE did not end"
)
COMPLETION_NOTICES = Counter(
    "kvpush_prefill_completion_notices_total",
    "Completion notices sent as NIXL notifications, by sender (writer: at the WRITE's end; "
    "engine: with the first token) and result (sent; busy: NIXL was in use, left to the RPC; failed)",
    ["sender", "result"],
)

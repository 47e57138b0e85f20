"""The soak's connector counters (benchmarks/soak.py): scraped from a real Prometheus endpoint, and
added up over the restarts of the instance that serves them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from benchmarks.soak import CounterTotals, scrape_counters
from kvpush.services.common.vllm_server import free_port


@pytest.fixture
def endpoint() -> Iterator[tuple[int, Counter, Counter]]:
    registry = CollectorRegistry()
    notices = Counter(
        "kvpush_prefill_completion_notices", "test", ["sender", "result"], registry=registry
    )  # exposed as ..._total
    other = Counter("kvpush_prefill_writes", "not scraped", ["outcome"], registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield port, notices, other
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_scrape_takes_only_the_named_counters_with_their_labels(endpoint: tuple[int, Counter, Counter]) -> None:
    port, notices, other = endpoint
    notices.labels(sender="writer", result="sent").inc(3)
    notices.labels(sender="engine", result="busy").inc()
    other.labels(outcome="ok").inc(7)
    got = scrape_counters(port)
    assert got == {
        'kvpush_prefill_completion_notices_total{result="sent",sender="writer"}': 3.0,
        'kvpush_prefill_completion_notices_total{result="busy",sender="engine"}': 1.0,
    }


def test_scrape_of_an_instance_that_is_down_is_none() -> None:
    assert scrape_counters(free_port(), timeout_s=1.0) is None


def test_totals_add_up_over_a_restart() -> None:
    totals = CounterTotals()
    key = 'kvpush_decode_first_token_paths_total{path="completion"}'
    totals.add("decode-0", {key: 5.0})
    totals.add("decode-0", {key: 9.0})
    totals.add("decode-0", {key: 2.0})  # restarted: counting from zero again
    totals.add("decode-0", {key: 4.0})
    totals.add("prefill-0", {key: 1.0})
    assert totals.totals == {"decode-0": {key: 13.0}, "prefill-0": {key: 1.0}}

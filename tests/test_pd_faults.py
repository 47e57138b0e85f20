"""Faults on real vLLM: two prefill instances and one decode (2P1D) behind the scheduler, with a
plain vLLM as the single-instance reference. A prefill killed with SIGKILL while requests are in
flight must cost nothing but time: every request still completes token for token, its KV pushed
by the surviving prefill (retry elsewhere), never recomputed on decode."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from kvpush.services.common.leg_macs import write_master
from kvpush.services.common.vllm_server import complete
from kvpush.v1 import kvpush_pb2 as pb
from scripts.cluster.pd import PDCluster, pd_cluster
from tests.test_pd_e2e import (
    _decode_load,
    _wait_free_blocks,
    assert_pushed,
    idle_all_free,
    prompt_of,
    prompt_sources,
)

pytestmark = pytest.mark.vllm

N_TOKENS = 900
MAX_TOKENS = 8
REQUESTS = 6
# Short fence bounds, so a killed prefill's transfers are fenced in ~2 s instead of ~12 s.
FENCE = {"write_lease_s": 0.5, "write_timeout_s": 1.5, "grace_s": 0.2}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    with pd_cluster(tiny_model_dir, tmp_path_factory.mktemp("pd-faults"), prefills=2, extra=FENCE, legs="mac") as c:
        yield c


def _open_on(c: PDCluster, engine_id: str) -> int:
    listing = c.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances
    return sum(s.open_assignments for s in listing if s.instance.engine_id == engine_id)


def _idle_free_blocks(c: PDCluster) -> int:
    """Decode's free blocks once idle: every block but vLLM's null block."""
    return idle_all_free(c, pb.ROLE_DECODE)


def _prefill_free(c: PDCluster, engine_id: str) -> tuple[int, bool]:
    """(free blocks, idle) of a prefill instance, from its latest load report."""
    for s in c.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances:
        if s.instance.engine_id == engine_id and s.alive:
            return s.load.free_blocks, not (s.load.running_requests or s.load.waiting_requests)
    return -1, False


def _prefill_idle_free(c: PDCluster, engine_id: str, timeout_s: float = 30.0) -> int:
    """A prefill's free blocks once idle: every block but vLLM's null block."""
    return idle_all_free(c, pb.ROLE_PREFILL, engine_id, timeout_s)


def _prefill_blocks_back(c: PDCluster, engine_id: str, want: int, timeout_s: float = 30.0) -> int:
    """Polls the prefill's load reports until it is idle with ``want`` free blocks (or the bound)."""
    deadline = time.monotonic() + timeout_s
    free, idle = _prefill_free(c, engine_id)
    while not (idle and free == want) and time.monotonic() < deadline:
        time.sleep(0.1)  # load reports come every 500 ms; polled under a deadline
        free, idle = _prefill_free(c, engine_id)
    return free


def _generate_once_ready(c: PDCluster, prompt: list[int], want: list[int], timeout_s: float = 15.0) -> None:
    """After a scheduler restart: instances register, then become assignable once the scheduler's
    probe saw their /health; until then Generate answers RESOURCE_EXHAUSTED. Asserts the first
    answer after that is ``want``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert c.generate(prompt, MAX_TOKENS, timeout_s=60)[0] == want
            return
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
            time.sleep(0.1)  # polling the scheduler, bounded by the deadline


def test_scheduler_restart_with_requests_in_flight(cluster: PDCluster) -> None:
    """The scheduler is SIGKILLed and restarted on its address with requests in flight: Generate
    streams end with UNAVAILABLE; a request whose legs a frontend already handed to vLLM finishes
    token for token without it; instances re-register within seconds; new requests work; decode's
    blocks all come back."""
    assert cluster.baseline is not None
    prompt = prompt_of(N_TOKENS, seed=7)
    want = complete(cluster.baseline.base_url, prompt, MAX_TOKENS)[0]
    assert cluster.generate(prompt, MAX_TOKENS, timeout_s=60)[0] == want
    free_before = _idle_free_blocks(cluster)
    prefill_before = {e: _prefill_idle_free(cluster, e) for e in ("prefill-0", "prefill-1")}

    a = cluster.stub.Assign(pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS), timeout=10)
    legs = [
        json_format.MessageToDict(a.prefill_kv_transfer_params),
        json_format.MessageToDict(a.decode_kv_transfer_params),
    ]
    prefill_url = a.prefill.http_endpoint

    streams: dict[int, grpc.RpcError | list[int]] = {}

    def stream(i: int) -> None:
        try:
            streams[i] = cluster.generate(prompt_of(N_TOKENS, seed=60 + i), 256, timeout_s=60)[0]
        except grpc.RpcError as exc:
            streams[i] = exc

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while (
        sum(s.open_assignments for s in cluster.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances) < 4
    ):
        assert time.monotonic() < deadline, "the Generate calls were not assigned"
        time.sleep(0.01)  # polling the scheduler, bounded by the deadline
    cluster.scheduler.restart()
    restarted = time.monotonic()

    # The custom frontend's request: both legs go straight to vLLM while the scheduler restarts.
    out: dict[str, list[int]] = {}
    pre = threading.Thread(target=lambda: complete(prefill_url, prompt, 1, legs[0]))
    pre.start()
    out["decode"] = complete(cluster.decode.base_url, prompt, MAX_TOKENS, legs[1], timeout=60)[0]
    pre.join(60)
    assert out["decode"] == want, "a request handed to vLLM before the restart did not finish token-exact"

    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a Generate stream hung across the scheduler restart"
    for i, r in streams.items():
        assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE, (i, r)

    cluster.wait_registered(timeout_s=15)
    assert time.monotonic() - restarted < 15
    _generate_once_ready(cluster, prompt, want)
    assert _wait_free_blocks(cluster, free_before) == free_before
    for engine, free in prefill_before.items():
        assert _prefill_blocks_back(cluster, engine, free) == free, f"{engine} kept blocks"


def test_mac_master_rotation_refuses_no_leg_minted_before_it(cluster: PDCluster) -> None:
    """An operator rotates the scheduler's leg MAC master: a new key file, then a restart. A
    request whose legs were minted under the old master and handed to vLLM after the rotation is
    still pushed and token-exact (each engine keeps its previous key next to the one its new
    registration brought); requests minted under the new master work as well."""
    assert cluster.baseline is not None and cluster.scheduler.leg_mac_key is not None
    master = cluster.scheduler.leg_mac_key
    old_prompt, new_prompt = prompt_of(N_TOKENS, seed=31), prompt_of(N_TOKENS, seed=32)
    a = cluster.stub.Assign(pb.AssignRequest(prompt_tokens=len(old_prompt), max_tokens=MAX_TOKENS), timeout=10)
    legs = [
        json_format.MessageToDict(a.prefill_kv_transfer_params),
        json_format.MessageToDict(a.decode_kv_transfer_params),
    ]
    assert all(leg["kvpush"].get("mac") and not leg["kvpush"].get("sig") for leg in legs)
    old_master = master.read_text()
    write_master(master.parent, overwrite=True)
    assert master.read_text() != old_master
    cluster.scheduler.restart()
    cluster.wait_registered(timeout_s=15)
    want_new = complete(cluster.baseline.base_url, new_prompt, MAX_TOKENS)[0]
    _generate_once_ready(cluster, new_prompt, want_new)

    before = prompt_sources(cluster.decode)
    pre = threading.Thread(target=lambda: complete(a.prefill.http_endpoint, old_prompt, 1, legs[0]))
    pre.start()
    got = complete(cluster.decode.base_url, old_prompt, MAX_TOKENS, legs[1], timeout=60)[0]
    pre.join(60)
    assert got == complete(cluster.baseline.base_url, old_prompt, MAX_TOKENS)[0]
    assert_pushed(before, prompt_sources(cluster.decode), [len(old_prompt)])
    for log_path in (cluster.decode.log_path, *(p.log_path for p in cluster.prefills)):
        refused = [line for line in Path(log_path).read_text(errors="replace").splitlines() if "leg_refused" in line]
        assert not any(a.transfer_id in line for line in refused), refused


def test_undelivered_prefill_leg_fails_over_at_once(cluster: PDCluster) -> None:
    """A custom frontend gets an assignment, sends the decode leg, but cannot deliver the prefill
    leg and says so (ReportLegFailure): decode fails that transfer at once and the scheduler
    sends the prefill leg to the other prefill, instead of decode waiting for the reservation lease
    (30 s). Reported before and after decode reserved; both finish token for token, pushed."""
    assert cluster.baseline is not None
    # Runs before the test that kills prefill-0 (tests run in file order): it needs both.
    assert all(p.running for p in cluster.prefills), "both prefills must be up"
    lease_s = 30.0
    prefill_before = {e: _prefill_idle_free(cluster, e) for e in ("prefill-0", "prefill-1")}
    for k, when in enumerate(("before-reserve", "after-reserve")):
        prompt = prompt_of(N_TOKENS, seed=80 + k)
        want = complete(cluster.baseline.base_url, prompt, MAX_TOKENS)[0]
        sources_before = prompt_sources(cluster.decode)
        a = cluster.stub.Assign(pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS), timeout=10)
        leg = json_format.MessageToDict(a.decode_kv_transfer_params)
        out: dict[str, list[int] | Exception] = {}

        def decode_leg(leg: dict = leg, prompt: list[int] = prompt, out: dict = out) -> None:
            try:
                out["tokens"] = complete(cluster.decode.base_url, prompt, MAX_TOKENS, leg, timeout=60)[0]
            except Exception as exc:  # reported below
                out["tokens"] = exc

        start = time.monotonic()
        t = threading.Thread(target=decode_leg)
        t.start()
        if when == "after-reserve":
            deadline = time.monotonic() + 20
            while _decode_load(cluster).reserved_unfilled_blocks == 0:
                assert time.monotonic() < deadline, "decode never reserved the transfer"
                time.sleep(0.01)  # polling the scheduler, bounded by the deadline
        ack = cluster.stub.ReportLegFailure(
            pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id=a.prefill.engine_id, reason="test: refused"),
            timeout=10,
        )
        assert ack.delivered
        t.join(60)
        assert not t.is_alive(), "the decode leg hung"
        assert out["tokens"] == want, (when, out["tokens"])
        assert time.monotonic() - start < lease_s / 2, f"{when}: waited for the reservation lease"
        sources_after = prompt_sources(cluster.decode)
        assert sources_after.get("local_compute", 0.0) - sources_before.get("local_compute", 0.0) == 0, when
        cluster.stub.Release(
            pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=10
        )
    for engine, free in prefill_before.items():
        assert _prefill_blocks_back(cluster, engine, free) == free, f"{engine} kept blocks"


def test_an_assign_frontends_first_token_survives_an_undelivered_prefill_leg(cluster: PDCluster) -> None:
    """The first-token hand-off through ``Assign`` (docs/first_token.md, custom frontends): the
    frontend waits for the token with ``AwaitFirstToken``, sends the decode leg, cannot deliver the
    prefill leg and says so. The transfer moves to the other prefill, whose token the scheduler
    answers and decode continues from: the client gets one instance's tokens, no prefill answer
    needed, nothing recomputed on decode."""
    assert cluster.baseline is not None
    assert all(p.running for p in cluster.prefills), "both prefills must be up"
    prompt = prompt_of(N_TOKENS, seed=85)
    want = complete(cluster.baseline.base_url, prompt, MAX_TOKENS)[0]
    sources_before = prompt_sources(cluster.decode)
    a = cluster.stub.Assign(
        pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS, first_token_from_prefill=True), timeout=10
    )
    assert a.first_token_from_prefill
    first = cluster.stub.AwaitFirstToken.future(
        pb.AwaitFirstTokenRequest(transfer_id=a.transfer_id, epoch=a.epoch), timeout=60
    )
    leg = json_format.MessageToDict(a.decode_kv_transfer_params)
    out: dict[str, list[int] | Exception] = {}

    def decode_leg() -> None:
        try:
            out["tokens"] = complete(cluster.decode.base_url, prompt, MAX_TOKENS - 1, leg, timeout=60)[0]
        except Exception as exc:  # reported below
            out["tokens"] = exc

    t = threading.Thread(target=decode_leg)
    t.start()
    ack = cluster.stub.ReportLegFailure(
        pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id=a.prefill.engine_id, reason="test: refused"),
        timeout=10,
    )
    assert ack.delivered
    token = first.result(timeout=60)
    t.join(60)
    assert not t.is_alive(), "the decode leg hung"
    assert token.prefill_engine_id not in ("", a.prefill.engine_id)  # the other prefill sampled it
    assert isinstance(out["tokens"], list), out["tokens"]
    assert [token.token_id, *out["tokens"]] == want
    sources_after = prompt_sources(cluster.decode)
    assert sources_after.get("local_compute", 0.0) - sources_before.get("local_compute", 0.0) == 0
    cluster.stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=10)


def test_undelivered_decode_leg_frees_prefill_kv_at_once(cluster: PDCluster) -> None:
    """A custom frontend gets an assignment and delivers the prefill leg, but not the decode leg,
    and says so: the prefill engine frees the KV it holds for a reservation that will never come at
    once, not at its prefill lease (30 s); decode never hears of the transfer."""
    assert all(p.running for p in cluster.prefills), "both prefills must be up"
    lease_s = 30.0
    prompt = prompt_of(N_TOKENS, seed=90)
    a = cluster.stub.Assign(pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS), timeout=10)
    engine = a.prefill.engine_id
    before = _prefill_idle_free(cluster, engine)
    decode_before = _idle_free_blocks(cluster)
    leg = json_format.MessageToDict(a.prefill_kv_transfer_params)
    assert len(complete(a.prefill.http_endpoint, prompt, 1, leg, timeout=60)[0]) == 1
    held, _ = _prefill_free(cluster, engine)
    deadline = time.monotonic() + 10
    while held >= before:  # the KV waits for its reservation
        assert time.monotonic() < deadline, "prefill did not hold the KV for the reservation"
        time.sleep(0.1)  # load reports come every 500 ms; polled under a deadline
        held, _ = _prefill_free(cluster, engine)
    start = time.monotonic()
    ack = cluster.stub.ReportLegFailure(
        pb.LegFailure(transfer_id=a.transfer_id, prefill_engine_id=engine, leg=pb.ROLE_DECODE, reason="test: refused"),
        timeout=10,
    )
    assert ack.delivered
    assert _prefill_blocks_back(cluster, engine, before, timeout_s=lease_s) == before, "prefill kept the KV"
    assert time.monotonic() - start < lease_s / 3, "prefill held the KV until its lease"
    assert _idle_free_blocks(cluster) == decode_before
    cluster.stub.Release(
        pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_FAILED), timeout=10
    )


def test_killed_prefill_is_retried_elsewhere_token_exact(cluster: PDCluster) -> None:
    assert cluster.baseline is not None
    prompts = [prompt_of(N_TOKENS, seed=40 + i) for i in range(REQUESTS)]
    expected = [complete(cluster.baseline.base_url, p, MAX_TOKENS)[0] for p in prompts]
    # Warm both prefills and the decode, and take the free-block baseline.
    for p, want in zip(prompts[:2], expected[:2], strict=True):
        assert cluster.generate(p, MAX_TOKENS, timeout_s=60)[0] == want
    free_before = _idle_free_blocks(cluster)
    survivor_before = _prefill_idle_free(cluster, "prefill-1")
    sources_before = prompt_sources(cluster.decode)

    results: dict[int, list[int] | grpc.RpcError] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            out: list[int] | grpc.RpcError = cluster.generate(prompts[i], MAX_TOKENS, timeout_s=90)[0]
        except grpc.RpcError as exc:
            out = exc
        with lock:
            results[i] = out

    threads = [threading.Thread(target=one, args=(i,)) for i in range(REQUESTS)]
    for t in threads:
        t.start()
    # Kill prefill-0 once it holds part of the load (bounded wait; the policy spreads the six).
    deadline = time.monotonic() + 30
    while _open_on(cluster, "prefill-0") == 0:
        assert time.monotonic() < deadline, "no request was assigned to prefill-0"
        time.sleep(0.01)  # polling the scheduler, bounded by the deadline
    log_before = len(cluster.scheduler.log_path.read_bytes())
    cluster.prefills[0].kill()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a request hung after its prefill was killed"

    failed = {i: r for i, r in results.items() if isinstance(r, grpc.RpcError)}
    assert not failed, {i: f"{r.code().name}: {r.details()}" for i, r in failed.items()}
    for i in range(REQUESTS):
        assert results[i] == expected[i], f"request {i} differs from the single instance"
    # Retried elsewhere, not recomputed: decode computed no prompt token locally...
    sources_after = prompt_sources(cluster.decode)
    local = sources_after.get("local_compute", 0.0) - sources_before.get("local_compute", 0.0)
    assert local == 0, f"decode recomputed {local} prompt tokens: a transfer was not retried elsewhere"
    # ...and at least one transfer really moved off the killed prefill.
    log = cluster.scheduler.log_path.read_bytes()[log_before:].decode(errors="replace")
    assert "transfer_rerouted" in log, "no transfer was rerouted off the killed prefill"
    # Decode's blocks all came back; the survivor keeps serving.
    assert _wait_free_blocks(cluster, free_before) == free_before
    assert _prefill_blocks_back(cluster, "prefill-1", survivor_before) == survivor_before
    assert cluster.generate(prompts[0], MAX_TOKENS, timeout_s=60)[0] == expected[0]

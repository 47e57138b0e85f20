"""1P1D on real vLLM: scheduler + prefill vLLM + decode vLLM with KvPushConnector, against one
plain vLLM. Greedy outputs through ``Generate`` must equal the single instance token for token."""

from __future__ import annotations

import base64
import re
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.json_format import MessageToDict

from kvpush.services.common import transfer_params
from kvpush.services.common.leg_macs import LegMacer, engine_key, mac_of
from kvpush.services.common.leg_signing import LegSigner
from kvpush.services.common.vllm_server import VllmServer, complete
from kvpush.v1 import kvpush_pb2 as pb
from scripts.cluster.pd import PDCluster, pd_cluster

pytestmark = pytest.mark.vllm

BLOCK = 128  # vLLM's CPU block size
# One block, many blocks, exact multiples and not, up to the model length.
LENGTHS = [50, 127, 128, 129, 200, 255, 256, 257, 300, 383, 384, 450, 512, 640, 777, 900]
MAX_TOKENS = 12


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(37 * j + 11 * seed) % 1000 + 3 for j in range(n)]


LOCAL_PREFILL_MAX = 40  # prompts this short prefill on decode (local prefill); LENGTHS are all longer


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    with pd_cluster(
        tiny_model_dir,
        tmp_path_factory.mktemp("pd-logs"),
        legs="mac",
        # The wait rule on with a wait no queue here reaches: the scheduler estimates prefill's queue.
        scheduler_args=("--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX), "--local-prefill-wait-ms", "600000"),
    ) as c:
        yield c


@pytest.fixture(scope="module")
def expected(cluster: PDCluster) -> dict[int, list[int]]:
    assert cluster.baseline is not None
    return {n: complete(cluster.baseline.base_url, prompt_of(n), MAX_TOKENS)[0] for n in LENGTHS}


_SOURCE_LINE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\}\s+([0-9.e+]+)$')


def prompt_sources(server: VllmServer) -> dict[str, float]:
    """vLLM's prompt-token counters by source (``local_compute``, ``local_cache_hit``,
    ``external_kv_transfer``), read from the server's Prometheus endpoint."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SOURCE_LINE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    assert out, "decode exports no vllm:prompt_tokens_by_source counters"
    return out


def _delta(after: dict[str, float], before: dict[str, float], source: str) -> float:
    return after.get(source, 0.0) - before.get(source, 0.0)


def assert_pushed(before: dict[str, float], after: dict[str, float], lengths: list[int]) -> None:
    """Decode computed no prompt token itself: every one came from the push, or from decode's own
    prefix cache of earlier pushed KV (vLLM counts the last prompt token, which it re-runs to
    sample from, with the loaded ones)."""
    assert _delta(after, before, "local_compute") == 0, (before, after)
    loaded = _delta(after, before, "external_kv_transfer") + _delta(after, before, "local_cache_hit")
    assert loaded == sum(lengths), (before, after)
    assert _delta(after, before, "external_kv_transfer") > 0


def _decode_load(c: PDCluster) -> pb.LoadReport:
    for s in c.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances:
        if s.instance.role == pb.ROLE_DECODE:
            return s.load
    raise AssertionError("no decode instance registered")


def _decode_free_blocks(c: PDCluster) -> int:
    return _decode_load(c).free_blocks


def _wait_free_blocks(c: PDCluster, want: int, timeout_s: float = 30.0) -> int:
    """Polls the decode load reports (sent every 500 ms) until they show ``want`` free blocks."""
    deadline = time.monotonic() + timeout_s
    got = _decode_free_blocks(c)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.25)
        got = _decode_free_blocks(c)
    return got


def _instance_status(c: PDCluster, role: int, engine_id: str | None = None) -> pb.InstanceStatus | None:
    for s in c.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances:
        if s.alive and s.instance.role == role and engine_id in (None, s.instance.engine_id):
            return s
    return None


def idle_all_free(c: PDCluster, role: int, engine_id: str | None = None, timeout_s: float = 30.0) -> int:
    """An instance's free blocks once idle, asserted to be all of them: polls its load reports
    (every 500 ms) until one shows no request and every KV block free but the null block vLLM's
    block pool keeps out of its free queue. The first report without requests is not enough: a
    request leaves the connector's books (``request_finished``) before vLLM frees its blocks, and
    a report taken between the two counts them held."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = _instance_status(c, role, engine_id)
        idle = s is not None and not (s.load.running_requests or s.load.waiting_requests)
        if s is not None and idle and s.load.free_blocks == s.instance.total_kv_blocks - 1:
            return s.load.free_blocks
        assert time.monotonic() < deadline, f"never idle with every block free: {s}"
        time.sleep(0.1)  # load reports come every 500 ms; polled under a deadline


@pytest.fixture(scope="module")
def free_baseline(cluster: PDCluster) -> int:
    """Decode's free blocks once idle after a warm-up request: every block but vLLM's null block."""
    cluster.generate(prompt_of(100, seed=99), 2)
    return idle_all_free(cluster, pb.ROLE_DECODE)


def test_sequential_outputs_equal_single_instance(cluster: PDCluster, expected: dict[int, list[int]]) -> None:
    before = prompt_sources(cluster.decode)
    for n in LENGTHS:
        tokens, ttft = cluster.generate(prompt_of(n), MAX_TOKENS)
        assert tokens == expected[n], f"prompt of {n} tokens"
        assert ttft > 0
    assert_pushed(before, prompt_sources(cluster.decode), LENGTHS)


def test_concurrent_outputs_equal_single_instance(cluster: PDCluster, expected: dict[int, list[int]]) -> None:
    before = prompt_sources(cluster.decode)
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(lambda n: cluster.generate(prompt_of(n), MAX_TOKENS)[0], LENGTHS))
    assert results == [expected[n] for n in LENGTHS]
    assert_pushed(before, prompt_sources(cluster.decode), LENGTHS)


def test_generate_refuses_a_token_outside_the_vocabulary_and_the_engines_live_on(
    cluster: PDCluster, expected: dict[int, list[int]]
) -> None:
    """Both engines register the model's vocabulary (1024 ids); a prompt with id 1024 would crash
    vLLM's engine (no tokenizer, so nothing checks it): Generate refuses it, and serves on."""
    vocab = {
        s.instance.role: s.instance.vocab_size for s in cluster.stub.ListInstances(pb.ListInstancesRequest()).instances
    }
    assert vocab == {pb.ROLE_PREFILL: 1024, pb.ROLE_DECODE: 1024}
    with pytest.raises(grpc.RpcError) as e:
        cluster.generate([*prompt_of(40), 1024], MAX_TOKENS)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert cluster.prefill.running and cluster.decode.running
    tokens, _ = cluster.generate(prompt_of(50), MAX_TOKENS)
    assert tokens == expected[50]


def _all_prompt_tokens(server: VllmServer) -> float:
    """Every prompt token the server counted, whatever its source (0 before its first request)."""
    try:
        return sum(prompt_sources(server).values())
    except AssertionError:  # no counters exported yet
        return 0.0


def test_short_prompts_prefill_on_decode_and_equal_one_instance(cluster: PDCluster, free_baseline: int) -> None:
    """Local prefill (--local-prefill-max-tokens): Generate sends a prompt this short to decode
    alone, as a plain request; the output is one instance's, prefill sees nothing of it, and
    decode's blocks all come back. A longer prompt in the same stretch is still pushed."""
    lengths = [1, 17, LOCAL_PREFILL_MAX]
    want = {n: complete(cluster.baseline.base_url, prompt_of(n, seed=61), MAX_TOKENS)[0] for n in lengths}  # type: ignore[union-attr]
    prefill_before, decode_before = _all_prompt_tokens(cluster.prefill), prompt_sources(cluster.decode)
    for n in lengths:
        req = pb.GenerateRequest(prompt_token_ids=prompt_of(n, seed=61), max_tokens=MAX_TOKENS, ignore_eos=True)
        msgs = list(cluster.stub.Generate(req, timeout=60))
        assert [t for m in msgs for t in m.token_ids] == want[n], n
        assert {m.prefill_engine_id for m in msgs} == {""}, "a prompt prefilled on decode names no prefill"
        assert {m.decode_engine_id for m in msgs} == {"decode-0"}
    decode_after = prompt_sources(cluster.decode)
    assert _all_prompt_tokens(cluster.prefill) == prefill_before, "prefill computed a short prompt"
    assert _delta(decode_after, decode_before, "local_compute") >= sum(lengths) - len(lengths), (
        decode_before,
        decode_after,
    )
    # One token over the limit goes through prefill and the push, as before.
    n = LOCAL_PREFILL_MAX + 1
    before = prompt_sources(cluster.decode)
    req = pb.GenerateRequest(prompt_token_ids=prompt_of(n, seed=62), max_tokens=MAX_TOKENS, ignore_eos=True)
    msgs = list(cluster.stub.Generate(req, timeout=60))
    assert [t for m in msgs for t in m.token_ids] == complete(
        cluster.baseline.base_url, prompt_of(n, seed=62), MAX_TOKENS
    )[0]  # type: ignore[union-attr]
    assert {m.prefill_engine_id for m in msgs} == {"prefill-0"}
    assert_pushed(before, prompt_sources(cluster.decode), [n])
    assert idle_all_free(cluster, pb.ROLE_DECODE) == free_baseline


def test_prefill_reports_prefills_finished_without_the_hand_off(
    cluster: PDCluster, expected: dict[int, list[int]]
) -> None:
    """A request through ``Assign`` without the first-token hand-off: the prefill engine reports the
    prefill it finished on its load stream, and the scheduler's estimate of its queue retires the
    request and learns the engine's speed from it (``ListInstances``' ``prefill_queue``)."""

    def queue() -> pb.PrefillQueue:
        s = _instance_status(cluster, pb.ROLE_PREFILL)
        assert s is not None and s.HasField("prefill_queue"), "the wait rule estimates prefill's queue"
        return s.prefill_queue

    n = 300
    before = queue().samples
    a = cluster.stub.Assign(
        pb.AssignRequest(prompt_tokens=n, max_tokens=MAX_TOKENS, allow_prefill_on_decode=True), timeout=10
    )
    assert not a.prefill_on_decode and not a.first_token_from_prefill
    with ThreadPoolExecutor(1) as pool:
        decode_params = MessageToDict(a.decode_kv_transfer_params)
        decoded = pool.submit(lambda: complete(a.decode.http_endpoint, prompt_of(n), MAX_TOKENS, decode_params))
        complete(a.prefill.http_endpoint, prompt_of(n), 1, MessageToDict(a.prefill_kv_transfer_params))
        assert decoded.result(timeout=60)[0] == expected[n]
    deadline = time.monotonic() + 10.0  # the next load report, every 250 ms
    while queue().samples == before and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=10)
    got = queue()
    assert got.samples == before + 1 and got.seconds_per_token > 0 and got.queued == 0


def test_transferred_kv_is_what_decode_uses(cluster: PDCluster) -> None:
    """Decode never recomputes the prompt: a decode-only request with the same params and no
    prefill would wait; here the prefill leg's KV is the only source. Different prompts give
    different outputs, so equality with the baseline cannot be a coincidence."""
    a, _ = cluster.generate(prompt_of(300, seed=1), MAX_TOKENS)
    b, _ = cluster.generate(prompt_of(300, seed=2), MAX_TOKENS)
    assert a != b


def test_aborts_mid_flight_leave_no_blocks_behind(cluster: PDCluster, free_baseline: int) -> None:
    # 320 tokens take 0.5 s or more to decode here (1.5-2 ms a token on a fast core): every deadline
    # ends its request mid-flight (before, during or after the transfer, or while decoding).
    for i, deadline_ms in enumerate([5, 20, 50, 100, 200]):
        req = pb.GenerateRequest(
            prompt_token_ids=prompt_of(700, seed=10 + i), max_tokens=320, temperature=0.0, ignore_eos=True
        )
        with pytest.raises(grpc.RpcError) as err:
            for _ in cluster.stub.Generate(req, timeout=deadline_ms / 1e3):
                pass
        assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
    # The cluster still serves correctly, and decode's free blocks come back to the idle count.
    tokens, _ = cluster.generate(prompt_of(129), MAX_TOKENS)
    assert tokens == complete(cluster.baseline.base_url, prompt_of(129), MAX_TOKENS)[0]  # type: ignore[union-attr]
    assert _wait_free_blocks(cluster, free_baseline) == free_baseline


def test_free_blocks_return_to_baseline_after_load(cluster: PDCluster, free_baseline: int) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: cluster.generate(prompt_of(200 + 37 * i, seed=i), 4), range(16)))
    assert _wait_free_blocks(cluster, free_baseline) == free_baseline


def test_decode_refuses_legs_maced_for_another_engine_or_master(cluster: PDCluster) -> None:
    """This cluster's scheduler MACs legs (``--leg-mac-key``) and the engines hold no public key.
    A decode leg whose MAC is under another engine's key or another master, whose fields changed
    under a genuine MAC, or that is signed instead, is refused: decode dials nothing, pushes
    nothing, and serves the single instance's tokens. A leg straight from the scheduler is pushed,
    and the engine's key shows in no log line."""
    assert cluster.scheduler.leg_mac_key is not None and cluster.baseline is not None
    macer = LegMacer.from_file(cluster.scheduler.leg_mac_key)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    trap = [f"127.0.0.1:{listener.getsockname()[1]}"]
    a = cluster.stub.Assign(pb.AssignRequest(prompt_tokens=300, max_tokens=MAX_TOKENS), timeout=10)
    cluster.stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_FAILED))
    minted = transfer_params.parse(MessageToDict(a.decode_kv_transfer_params))
    assert isinstance(minted, transfer_params.DecodeLeg) and minted.mac and not minted.sig
    assert minted.decode_engine_id == "decode-0"

    def trapped(tag: str, **extra: Any) -> dict[str, Any]:
        fields = asdict(minted)
        fields.update(transfer_id=f"mac-{tag}", prefill_tp_size=1, prefill_agent_endpoints=trap)
        fields.update(prefill_rank_incarnations=[], mac="", **extra)
        return fields

    def maced(fields: dict[str, Any], key: bytes) -> dict[str, Any]:
        return {**fields, "mac": mac_of(key, transfer_params.canonical_bytes(fields))}

    signed = LegSigner(Ed25519PrivateKey.generate()).sign_leg(transfer_params.parse({"kvpush": trapped("signed")}))  # type: ignore[arg-type]
    legs = {
        "prefill_key": maced(trapped("prefill-key"), macer.key_for("prefill-0")),
        "other_master": maced(trapped("other-master"), engine_key(bytes(range(32)), "decode-0")),
        "for_decode_1": maced(trapped("decode-1", decode_engine_id="decode-1"), macer.key_for("decode-1")),
        "tampered": {**trapped("tampered"), "mac": minted.mac},
        "signed": asdict(signed),
    }
    before = prompt_sources(cluster.decode)
    for i, (name, leg) in enumerate(sorted(legs.items())):
        prompt = prompt_of(260 + i, seed=40 + i)
        got, _ = complete(cluster.decode.base_url, prompt, MAX_TOKENS, {"kvpush": leg})
        assert got == complete(cluster.baseline.base_url, prompt, MAX_TOKENS)[0], name
    readable, _, _ = select.select([listener], [], [], 1.0)  # a dial would have arrived by now
    listener.close()
    assert not readable, "decode dialed an endpoint from a leg it should have refused"
    after = prompt_sources(cluster.decode)
    assert _delta(after, before, "external_kv_transfer") == 0
    # The scheduler's own legs still verify and push.
    tokens, _ = cluster.generate(prompt_of(333, seed=77), MAX_TOKENS)
    assert tokens == complete(cluster.baseline.base_url, prompt_of(333, seed=77), MAX_TOKENS)[0]
    assert _delta(prompt_sources(cluster.decode), after, "external_kv_transfer") > 0
    log = Path(cluster.decode.log_path).read_text(errors="replace")
    refused = [line for line in log.splitlines() if "leg_refused" in line]
    for reason in ("bad_signature", "no_key"):
        assert any(re.search(rf"reason=['\"]?{reason}\b", line) for line in refused), reason
    key = macer.key_for("decode-0")
    for text in (key.hex(), base64.b64encode(key).decode(), base64.urlsafe_b64encode(key).decode().rstrip("=")):
        assert text not in log


def test_killed_prefill_fails_requests_fast(cluster: PDCluster, expected: dict[int, list[int]]) -> None:
    """Runs last in this module: it kills the prefill instance while requests are in flight. Every
    request ends (the right tokens, or a clear error) well within its deadline; a request after the
    kill does not wait for a lease: decode prefills it (local prefill)."""
    n = 900
    results: list[list[int] | grpc.RpcError] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            tokens, _ = cluster.generate(prompt_of(n), MAX_TOKENS, timeout_s=60)
            out: list[int] | grpc.RpcError = tokens
        except grpc.RpcError as exc:
            out = exc
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    cluster.prefill.stop(timeout=1.0)
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung after its prefill died"
    assert len(results) == 4
    assert time.monotonic() - started < 45, "in-flight requests took longer than their deadline allows"
    for r in results:
        if isinstance(r, grpc.RpcError):
            assert r.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), r
            assert r.details(), "a failed request must say why"
        else:
            assert r == expected[n]
    # The scheduler drops the prefill as soon as its load stream closes (not at a lease). This
    # cluster has local prefill on, so with no prefill left the next request is prefilled by decode
    # itself, token-exact, instead of failing (without local prefill it fails at once with
    # RESOURCE_EXHAUSTED: tests/test_local_prefill.py).
    t0 = time.monotonic()
    while any(
        s.instance.role == pb.ROLE_PREFILL
        for s in cluster.stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances
    ):
        assert time.monotonic() - t0 < 10, "the scheduler still lists the killed prefill"
        time.sleep(0.05)  # polled under a deadline
    prompt = prompt_of(300, seed=78)
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True)
    msgs = list(cluster.stub.Generate(req, timeout=60))
    assert [t for m in msgs for t in m.token_ids] == complete(cluster.baseline.base_url, prompt, 8)[0]  # type: ignore[union-attr]
    assert {m.prefill_engine_id for m in msgs} == {""}, "served without a prefill instance"
    assert time.monotonic() - t0 < 30

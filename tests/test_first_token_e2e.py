"""First-token hand-off on real vLLM (1P1D through ``Generate``, against one plain vLLM): the first
token is prefill's and decode continues from it, and the output is still exactly the single
instance's, greedy on prompts chosen for near ties and seeded sampling."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.services.common.vllm_server import VllmServer, model_name
from scripts.cluster.pd import PDCluster, pd_cluster

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
SCREENED = 48  # random prompts screened for near ties on the single instance
NEAR_TIES = 6  # the closest of them go through P/D


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    with pd_cluster(tiny_model_dir, tmp_path_factory.mktemp("first-token-logs")) as c:
        yield c


def _complete(server: VllmServer, prompt: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
    body = {
        "model": model_name(server.base_url),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    req = urllib.request.Request(
        f"{server.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.load(resp)
    return out


def _tokens(resp: dict[str, Any]) -> list[int]:
    return [int(t) for t in resp["choices"][0]["token_ids"]]


def _gap(resp: dict[str, Any], position: int) -> float:
    """Log-probability margin of the greedy token over the runner-up at ``position``."""
    top = sorted(resp["choices"][0]["logprobs"]["top_logprobs"][position].values(), reverse=True)
    return float(top[0] - top[1])


def _appended(server: VllmServer) -> int:
    """First tokens the decode engine appended to a waiting request's prompt (its log events)."""
    return server.log_path.read_text(errors="replace").count("first_token_appended")


def _random_prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randrange(40, 700))]


def test_near_ties_greedy_equal_single_instance_and_continue_from_prefills_token(cluster: PDCluster) -> None:
    """The prompts whose first two tokens are the closest calls on the single instance (where
    batch-dependent numerics would most likely flip a token): P/D outputs equal it exactly, and
    decode ran each with the first token appended to its prompt, so it continued from prefill's
    token instead of sampling its own."""
    assert cluster.baseline is not None
    rng = random.Random(20261201)
    screened = []
    for _ in range(SCREENED):
        prompt = _random_prompt(rng, 1000)
        resp = _complete(cluster.baseline, prompt, 2, logprobs=2, return_tokens_as_token_ids=True)
        screened.append((min(_gap(resp, 0), _gap(resp, 1)), prompt))
    screened.sort(key=lambda x: x[0])
    chosen = [p for _, p in screened[:NEAR_TIES]]
    assert screened[NEAR_TIES - 1][0] < screened[-1][0]  # they are the closer calls
    before = _appended(cluster.decode)
    for prompt in chosen:
        want = _tokens(_complete(cluster.baseline, prompt, MAX_TOKENS))
        got, ttft = cluster.generate(prompt, MAX_TOKENS)
        assert got == want, f"prompt of {len(prompt)} tokens"
        assert ttft > 0
    # Decode appended prefill's first token to each request's prompt: it continued from it.
    assert _appended(cluster.decode) - before == len(chosen)
    # ... with its engine loop woken by releases (connector/engine_wake.py) on this vLLM.
    assert "engine_wake_on" in cluster.decode.log_path.read_text(errors="replace")
    # Prefill sent every token in its own call from the engine thread, none fell back to the stream.
    assert "first_token_direct_failed" not in cluster.prefill.log_path.read_text(errors="replace")


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_seeded_sampling_equals_single_instance(cluster: PDCluster, temperature: float) -> None:
    """Decode's sampler is advanced past prefill's draw, so every later token is drawn as on one
    instance: a seeded request gives the same tokens, and different seeds different ones."""
    assert cluster.baseline is not None
    rng = random.Random(7)
    outputs = set()
    for i in range(4):
        prompt = _random_prompt(rng, 1000)
        seed = 1000 + i
        want = _tokens(_complete(cluster.baseline, prompt, MAX_TOKENS, temperature=temperature, seed=seed))
        got = cluster.generate_timed(prompt, MAX_TOKENS, temperature=temperature, seed=seed).tokens
        assert got == want, f"seed {seed}, prompt of {len(prompt)} tokens"
        outputs.add(tuple(got))
    assert len(outputs) > 1


def test_an_assign_frontend_takes_the_first_token_from_the_scheduler(cluster: PDCluster) -> None:
    """A custom frontend's recipe (docs/first_token.md): ``Assign`` with the hand-off, both legs at
    once, and ``AwaitFirstToken`` for the first token. The scheduler answers with the token
    prefill sampled (the prefill leg's own answer says the same), decode continues from it, and
    the whole output is one instance's."""
    from concurrent.futures import ThreadPoolExecutor

    from google.protobuf.json_format import MessageToDict

    from kvpush.services.common.vllm_server import complete
    from kvpush.v1 import kvpush_pb2 as pb

    assert cluster.baseline is not None
    prompt = _random_prompt(random.Random(2026), 1000)
    want = _tokens(_complete(cluster.baseline, prompt, MAX_TOKENS))
    a = cluster.stub.Assign(
        pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS, first_token_from_prefill=True), timeout=10
    )
    assert a.first_token_from_prefill
    waiting = cluster.stub.AwaitFirstToken.future(
        pb.AwaitFirstTokenRequest(transfer_id=a.transfer_id, epoch=a.epoch), timeout=60
    )
    with ThreadPoolExecutor(1) as pool:
        decode_params = MessageToDict(a.decode_kv_transfer_params)
        rest = pool.submit(lambda: complete(a.decode.http_endpoint, prompt, MAX_TOKENS - 1, decode_params, timeout=60))
        answered, _ = complete(a.prefill.http_endpoint, prompt, 1, MessageToDict(a.prefill_kv_transfer_params))
        decoded = rest.result(timeout=60)[0]
    first = waiting.result(timeout=60)
    cluster.stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=10)
    assert (first.prefill_engine_id, first.stopped) == (a.prefill.engine_id, False)
    assert [first.token_id] == answered
    assert [first.token_id, *decoded] == want


def test_an_assign_stream_frontend_takes_the_first_token_on_its_stream(cluster: PDCluster) -> None:
    """The same recipe at fleet rates: the assign on an ``AssignStream`` whose batches ask for
    first tokens (compact answers, legs as JSON text), the token on the same stream, no call for
    it; it is the prefill leg's answer, and the output one instance's."""
    import asyncio
    import json

    from kvpush.services.common.vllm_server import complete
    from kvpush.services.scheduler.assign_client import AssignStreamClient
    from kvpush.v1 import kvpush_pb2 as pb
    from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

    assert cluster.baseline is not None
    prompt = _random_prompt(random.Random(2027), 1000)
    want = _tokens(_complete(cluster.baseline, prompt, MAX_TOKENS))

    async def body() -> tuple[Any, list[int], list[int], Any]:
        channel = cluster.scheduler.security().aio_channel(cluster.scheduler.address)
        try:
            stub = pb_grpc.SchedulerStub(channel)
            async with AssignStreamClient(stub, compact=True, first_tokens=True) as client:
                req = pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS, first_token_from_prefill=True)
                a = await client.assign_compact(req)
                assert a.first_token_from_prefill
                prefill_params = json.loads(a.prefill_kv_transfer_params_json)
                decode_params = json.loads(a.decode_kv_transfer_params_json)
                answered = asyncio.to_thread(complete, a.prefill_http_endpoint, prompt, 1, prefill_params, timeout=60)
                rest = asyncio.to_thread(
                    complete, a.decode_http_endpoint, prompt, MAX_TOKENS - 1, decode_params, timeout=60
                )
                first, (answer, _), (decoded, _) = await asyncio.wait_for(
                    asyncio.gather(client.first_token(a.transfer_id), answered, rest), 90
                )
                client.release(a.transfer_id, a.epoch, pb.OUTCOME_OK)
            return first, answer, decoded, a
        finally:
            await channel.close()

    first, answered, decoded, a = asyncio.run(body())
    assert (first.prefill_engine_id, first.stopped) == (a.prefill_engine_id, False)
    assert [first.token_id] == answered
    assert [first.token_id, *decoded] == want


def test_a_duplicate_handoff_decode_leg_fails_and_never_repeats_the_first_token(cluster: PDCluster) -> None:
    """The same hand-off decode leg sent twice (a frontend's retry, a replay) while the first is
    live: one of the two fails at once (its load is reported failed) instead of being computed
    locally, which would stream decode's own first token after the one the frontend streamed from
    prefill; the other continues from prefill's token, exactly as one instance."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from google.protobuf.json_format import MessageToDict

    from kvpush.services.common.vllm_server import VllmServerError, complete
    from kvpush.v1 import kvpush_pb2 as pb

    assert cluster.baseline is not None
    prompt = _random_prompt(random.Random(99), 1000)
    want = _tokens(_complete(cluster.baseline, prompt, MAX_TOKENS))
    a = cluster.stub.Assign(
        pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS, first_token_from_prefill=True), timeout=10
    )
    assert a.first_token_from_prefill
    decode_params = MessageToDict(a.decode_kv_transfer_params)
    refused_before = cluster.decode.log_path.read_text(errors="replace").count("first_token_handoff_refused")

    def decode_leg() -> list[int]:
        return complete(a.decode.http_endpoint, prompt, MAX_TOKENS - 1, decode_params, timeout=60)[0]

    with ThreadPoolExecutor(2) as pool:
        legs = {pool.submit(decode_leg), pool.submit(decode_leg)}
        # Nothing is pushed before the prefill leg: the one that ends now is the refused duplicate.
        done, live = wait(legs, timeout=30, return_when=FIRST_COMPLETED)
        assert len(done) == 1 and len(live) == 1, "neither decode leg ended without its KV"
        with pytest.raises(VllmServerError):
            done.pop().result()
        first, _ = complete(a.prefill.http_endpoint, prompt, 1, MessageToDict(a.prefill_kv_transfer_params))
        rest = live.pop().result(timeout=60)
    cluster.stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=10)
    assert first + rest == want
    log = cluster.decode.log_path.read_text(errors="replace")
    assert log.count("first_token_handoff_refused") == refused_before + 1


def test_an_expired_handoff_decode_leg_fails_instead_of_repeating_the_first_token(cluster: PDCluster) -> None:
    """A hand-off decode leg that expired while its request queued (or any leg decode refuses) is
    not served as on a plain instance, where decode would sample a first token of its own after the
    one the frontend streamed from prefill: the request fails at once. The same expired leg without
    the hand-off is computed locally, as before, and gives one instance's tokens."""
    from dataclasses import asdict, replace

    from google.protobuf.json_format import MessageToDict

    from kvpush.services.common.leg_signing import LegSigner
    from kvpush.services.common.transfer_params import parse
    from kvpush.services.common.vllm_server import VllmServerError, complete
    from kvpush.v1 import kvpush_pb2 as pb

    assert cluster.baseline is not None and cluster.scheduler.leg_signing_key is not None
    signer = LegSigner.from_file(cluster.scheduler.leg_signing_key)
    prompt = _random_prompt(random.Random(123), 1000)
    want = _tokens(_complete(cluster.baseline, prompt, MAX_TOKENS))
    a = cluster.stub.Assign(
        pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=MAX_TOKENS, first_token_from_prefill=True), timeout=10
    )
    assert a.first_token_from_prefill
    leg = parse(MessageToDict(a.decode_kv_transfer_params))
    assert leg is not None and leg.first_token
    log_before = cluster.decode.log_path.read_text(errors="replace")
    expired = {"kvpush": asdict(signer.sign_leg(leg, expires_at=time.time() - 600))}
    with pytest.raises(VllmServerError):
        complete(a.decode.http_endpoint, prompt, MAX_TOKENS - 1, expired, timeout=60)
    plain = {"kvpush": asdict(signer.sign_leg(replace(leg, first_token=False), expires_at=time.time() - 600))}
    assert complete(a.decode.http_endpoint, prompt, MAX_TOKENS, plain, timeout=60)[0] == want
    cluster.stub.Release(
        pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_FAILED), timeout=10
    )
    log = cluster.decode.log_path.read_text(errors="replace")[len(log_before) :]
    refused = [line for line in log.splitlines() if "first_token_handoff_refused" in line]
    assert len(refused) == 1 and "its leg was refused" in refused[0]
    assert log.count("leg_refused") == 2 and "first_token_handoff_computed_locally" not in log
    # The engine keeps serving: the next request through the scheduler is one instance's.
    assert cluster.generate_timed(prompt, MAX_TOKENS).tokens == want

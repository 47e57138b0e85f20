"""A plain vLLM server on the tiny seeded Llama: greedy token-id completions work and are deterministic.

Two servers are started independently (side by side, one core each) and must produce identical greedy
outputs: this is the single-instance baseline that the P/D tests compare against.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from kvpush.services.common.vllm_server import VllmServer, acomplete, complete

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)

VOCAB = 1024
MAX_TOKENS = 24
# Lengths around the CPU block size (128), including partial last blocks.
PROMPT_LENGTHS = (17, 127, 128, 129, 300, 517)


def make_prompt(length: int, salt: int) -> list[int]:
    """Deterministic token ids in [3, VOCAB) (0-2 are pad/bos/eos)."""
    return [(31 * j + 97 * salt + 7) % (VOCAB - 3) + 3 for j in range(length)]


def test_greedy_outputs_match_across_servers(plain_vllm_pair: tuple[VllmServer, VllmServer]) -> None:
    a, b = plain_vllm_pair
    log.info("servers ready after %s s", [srv.ready_after_s for srv in (a, b)])
    for salt, length in enumerate(PROMPT_LENGTHS):
        prompt = make_prompt(length, salt)
        tokens_a, resp_a = complete(a.base_url, prompt, MAX_TOKENS, timeout=60)
        tokens_b, _ = complete(b.base_url, prompt, MAX_TOKENS, timeout=60)
        assert len(tokens_a) == MAX_TOKENS
        assert all(0 <= t < VOCAB for t in tokens_a)
        assert resp_a["choices"][0]["prompt_token_ids"] == prompt
        assert resp_a["choices"][0]["finish_reason"] == "length"
        assert tokens_a == tokens_b, f"prompt len {length}: servers disagree"
        # Random (not dummy) weights: greedy output must not collapse into a short cycle.
        assert len(set(tokens_a)) > 4, tokens_a


def test_stream_matches_non_stream(plain_vllm_server: VllmServer) -> None:
    prompt = make_prompt(200, 11)
    tokens, _ = complete(plain_vllm_server.base_url, prompt, MAX_TOKENS, timeout=60)
    streamed, merged = complete(plain_vllm_server.base_url, prompt, MAX_TOKENS, stream=True, timeout=60)
    assert streamed == tokens
    assert merged["chunks"] >= 1


def test_kv_transfer_params_ignored_without_connector(plain_vllm_server: VllmServer) -> None:
    prompt = make_prompt(150, 12)
    tokens, resp = complete(
        plain_vllm_server.base_url,
        prompt,
        4,
        kv_transfer_params={"kvpush": {"transfer_id": "t-1"}},
        request_id="baseline-ktp",
        timeout=60,
    )
    assert len(tokens) == 4
    assert resp.get("kv_transfer_params") is None


def test_batch_of_16_concurrent_requests(plain_vllm_pair: tuple[VllmServer, VllmServer]) -> None:
    prompts = [make_prompt(100 + 37 * i, 100 + i) for i in range(16)]

    async def run_batch(srv: VllmServer) -> tuple[float, list[list[int]]]:
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(acomplete(session, srv.base_url, p, MAX_TOKENS, timeout=60) for p in prompts)
            )
            return time.monotonic() - t0, [tokens for tokens, _ in results]

    async def both() -> list[tuple[float, list[list[int]]]]:
        return list(await asyncio.gather(*(run_batch(srv) for srv in plain_vllm_pair)))

    (dt_a, out_a), (dt_b, out_b) = asyncio.run(both())
    log.info("16 concurrent requests x %d tokens: %.2f s / %.2f s", MAX_TOKENS, dt_a, dt_b)
    assert all(len(t) == MAX_TOKENS for t in out_a + out_b)
    # Same prompts, same arrival pattern: both engines must agree request by request.
    assert out_a == out_b


def test_one_rank_server_runs_its_model_in_the_engine_process(plain_vllm_server: VllmServer) -> None:
    """The default executor (``uni``, services/common/vllm_server.py) leaves no Worker process that
    would busy-wait next to the model: the tree is the API server and its EngineCore only."""
    import psutil

    if plain_vllm_server.executor == "mp":
        pytest.skip("KVPUSH_VLLM_EXECUTOR=mp: the worker runs in its own process")
    assert plain_vllm_server.pid is not None
    tree = psutil.Process(plain_vllm_server.pid).children(recursive=True)
    names = sorted(" ".join(p.cmdline()) for p in tree)  # vLLM titles them VLLM::EngineCore, VLLM::Worker…
    assert not any("Worker" in n for n in names), names
    assert any("EngineCore" in n for n in names), names

"""First tokens from prefill to decode without the scheduler, on real vLLM (1P1D through
``Generate``, against one plain vLLM): with every relayed first token lost on decode (a test fault,
tests/fault_site/sitecustomize.py ``relay_lost``), each request still continues from prefill's
token, carried by its push's completions (prefill's call to decode off) or sent in prefill's own
``DecodeRank.FirstTokens`` call (the completion's copy off); connector/first_token_paths.py."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.services.common.vllm_server import complete
from scripts.cluster.pd import PDCluster, pd_cluster

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
FAULT_SITE = Path(__file__).resolve().parent / "fault_site"
MAX_TOKENS = 8


PATHS = {
    "completion": {"first_token_to_decode": "false"},
    "prefill_call": {"first_token_on_completion": "false"},
}


@pytest.fixture(scope="module", params=sorted(PATHS))
def cluster(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, PDCluster]]:
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAULT_SITE), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "KVPUSH_TEST_FAULT": "relay_lost",
    }
    # A request whose token never comes fails after first_token_wait_s: short, so a broken path
    # fails the test quickly instead of at the Generate deadline. A completion waits for its token
    # up to first_token_completion_wait_ms (5 ms by default): on a busy test machine the engine
    # thread can end the request later than that after the WRITE, and the completion would then go
    # without it (the relay, dropped here, carries it in production).
    extra = {**PATHS[request.param], "first_token_wait_s": 10, "first_token_completion_wait_ms": 1000}
    with pd_cluster(tiny_model_dir, tmp_path_factory.mktemp(f"{request.param}-logs"), env=env, extra=extra) as c:
        yield request.param, c


def _prompt(seed: int, n: int) -> list[int]:
    return [(37 * j + 11 * seed) % 1000 + 3 for j in range(n)]


def _appended(log: str) -> list[str]:
    return re.findall(r"first_token_appended.* via='(\w+)'", log)


def test_prefills_token_reaches_decode_without_the_scheduler(cluster: tuple[str, PDCluster]) -> None:
    path, c = cluster
    assert c.baseline is not None
    log_path = Path(c.decode.log_path)
    assert "patched kvpush.connector.decode_scheduler" in log_path.read_text(errors="replace"), "the fault is not in"
    # Decode dials prefill's agent on its first transfer; prefill's own call needs that stream
    # (the endpoint comes from it), so a first request without the hand-off opens it.
    assert c.generate(_prompt(0, 40), 1, timeout_s=60)[0]
    before = len(_appended(log_path.read_text(errors="replace")))
    prompts = [_prompt(seed, n) for seed, n in ((1, 40), (2, 300), (3, 700))]
    for prompt in prompts:
        want, _ = complete(c.baseline.base_url, prompt, MAX_TOKENS)
        got, ttft = c.generate(prompt, MAX_TOKENS, timeout_s=60)
        assert got == want, f"prompt of {len(prompt)} tokens"
        assert ttft > 0
    log = log_path.read_text(errors="replace")
    assert _appended(log)[before:] == [path] * len(prompts)
    assert "first_token_timeout" not in log and "first_token_refused" not in log

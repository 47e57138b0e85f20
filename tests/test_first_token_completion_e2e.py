"""The first token carried by the push's own completion, on real vLLM (1P1D through ``Generate``,
against one plain vLLM), with every relayed first token lost on decode (test faults,
tests/fault_site/sitecustomize.py):

- the Completion RPC (completion notices off, ``relay_lost``): each request still continues from
  prefill's token, because the RPCs of its push carry it (connector/completion_tokens.py); with the
  push held for the step's output, where the token is in before the WRITE ends;
- the completion notices alone (``relay_and_completion_rpcs_lost``: every Complete RPC is lost
  too): the NIXL notifications release the KV and bring the token (services/common/
  completion_notice.py); with the push started when prefill's worker samples the token (the
  default), where the writer's notice carries it, and with the push at the forward's end and no
  sampler tap, where the writer's notice goes before the token and the engine thread sends the
  token after it."""

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


@pytest.fixture(
    scope="module",
    params=["rpc", "notices", "notices-at-sampling"],
    ids=["rpc-push-after-output", "notices-push-at-forward-end", "notices-push-at-sampling"],
)
def cluster(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDCluster]:
    notices = request.param != "rpc"
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAULT_SITE), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "KVPUSH_TEST_FAULT": "relay_and_completion_rpcs_lost" if notices else "relay_lost",
    }
    # A request whose token never comes fails after first_token_wait_s: short, so a broken
    # completion path fails the test quickly instead of at the Generate deadline. A completion
    # waits for its token up to first_token_completion_wait_ms (5 ms by default): on a busy test
    # machine the engine thread can end the request later than that after the WRITE, and the
    # completion would then go without it (the relay, dropped here, carries it in production).
    extra = {
        "push_after_output": str(not notices).lower(),
        "completion_notices": str(notices).lower(),
        "first_token_wait_s": 10,
        "first_token_completion_wait_ms": 1000,
    }
    if request.param == "notices":  # the token posted when the request ends, as without the tap
        extra["first_token_at_sampling"] = "false"
    with pd_cluster(tiny_model_dir, tmp_path_factory.mktemp("carried-logs"), env=env, extra=extra) as c:
        yield c


def _prompt(seed: int, n: int) -> list[int]:
    return [(37 * j + 11 * seed) % 1000 + 3 for j in range(n)]


def _appended(log: str) -> list[str]:
    return re.findall(r"first_token_appended.* via='(\w+)'", log)


def test_the_completion_carries_prefills_token_when_the_relay_is_lost(cluster: PDCluster) -> None:
    assert cluster.baseline is not None
    log_path = Path(cluster.decode.log_path)
    started = log_path.read_text(errors="replace")
    assert "patched kvpush.connector.decode_scheduler" in started, "the fault is not in"
    if "relay_and_completion_rpcs_lost" in started:
        assert "patched kvpush.services.decode_agent.rank" in started, "the RPC fault is not in"
    before = len(_appended(log_path.read_text(errors="replace")))
    prompts = [_prompt(seed, n) for seed, n in ((1, 40), (2, 300), (3, 700))]
    for prompt in prompts:
        want, _ = complete(cluster.baseline.base_url, prompt, MAX_TOKENS)
        got, ttft = cluster.generate(prompt, MAX_TOKENS, timeout_s=60)
        assert got == want, f"prompt of {len(prompt)} tokens"
        assert ttft > 0
    log = log_path.read_text(errors="replace")
    assert _appended(log)[before:] == ["completion"] * len(prompts)
    assert "first_token_timeout" not in log and "first_token_refused" not in log

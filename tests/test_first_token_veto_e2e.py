"""The last guard of the first-token hand-off on real vLLM: should a decode engine ever schedule a
hand-off request before prefill's token was appended to it, the request fails; it never streams
decode's own first token after the one the frontend already streamed (docs/first_token.md).

The state cannot arise with the connector as shipped (its workers hold the KV release until the
token is in), so the engines here run with a test fault (tests/fault_site/sitecustomize.py) that
removes the hold and drops every relayed token."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpush.services.common.vllm_server import complete
from kvpush.v1 import kvpush_pb2 as pb
from scripts.cluster.pd import PDCluster, pd_cluster

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
FAULT_SITE = Path(__file__).resolve().parent / "fault_site"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAULT_SITE), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "KVPUSH_TEST_FAULT": "handoff_release_early",
    }
    with pd_cluster(tiny_model_dir, tmp_path_factory.mktemp("veto-logs"), with_baseline=False, env=env) as c:
        yield c


def _prompt(seed: int, n: int = 300) -> list[int]:
    return [(41 * j + 13 * seed) % 1000 + 3 for j in range(n)]


def test_a_handoff_request_scheduled_before_its_token_fails_instead_of_repeating_it(cluster: PDCluster) -> None:
    log_path = Path(cluster.decode.log_path)
    assert "patched kvpush.connector.workers" in log_path.read_text(errors="replace"), "the fault is not in"
    for seed in range(3):
        streamed: list[int] = []
        req = pb.GenerateRequest(prompt_token_ids=_prompt(seed), max_tokens=6, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as err:
            for msg in cluster.stub.Generate(req, timeout=60):
                streamed.extend(msg.token_ids)
        # Prefill's token went out (the hand-off's point); nothing of decode's after it.
        assert len(streamed) <= 1, streamed
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), err.value
    log = log_path.read_text(errors="replace")
    missing = [line for line in log.splitlines() if "first_token_missing_at_schedule" in line]
    assert len(missing) >= 3 and all("failed" in line for line in missing), missing
    # The engine keeps serving: a request without the hand-off on the same decode engine.
    tokens, _ = complete(cluster.decode.base_url, _prompt(99, 40), 4)
    assert len(tokens) == 4

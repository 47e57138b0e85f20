"""First-token hand-off, the parts that need no running engine: the leg field, the decode
scheduler-half taking relayed tokens (on vLLM's own ``Request``), and the decode worker holding a
landed transfer until its token came."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.decode_scheduler import DecodeScheduler, append_first_token
from kvpush.connector.legs import LegGate
from kvpush.connector.roles import TransferResults
from kvpush.connector.sampler_state import WORKER_QUALNAME
from kvpush.connector.workers import DecodeWorker
from kvpush.services.common import transfer_params
from kvpush.services.common.leg_signing import LegSigner, LegVerifier
from kvpush.services.common.transfer_params import DecodeLeg, LegError, PrefillLeg, canonical_bytes, to_params
from kvpush.services.decode_agent.barrier import Outcome, Released
from kvpush.services.decode_agent.cadence import PollCadence
from kvpush.v1 import kvpush_pb2 as pb

BLOCK = 16


def _results(w: DecodeWorker) -> TransferResults:
    """The worker's report for a step; None (nothing to report) as an empty one."""
    return w.transfer_results() or TransferResults()


def _vllm(worker_cls: str = WORKER_QUALNAME, policy: str = "fail", vocab: int = 1000) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, worker_cls=worker_cls),
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
        cache_config=SimpleNamespace(block_size=BLOCK),
    )


def _request(rid: str, prompt: list[int], leg: DecodeLeg | None, seed: int | None = None) -> Request:
    init_none_hash(sha256)
    extra = {"kv_transfer_params": to_params(leg)} if leg is not None else None
    sp = SamplingParams(max_tokens=8, temperature=1.0 if seed is not None else 0.0, seed=seed, extra_args=extra)
    return Request(rid, list(prompt), sp, None, block_hasher=get_request_block_hasher(BLOCK, sha256))


class _Agent:
    """What the decode scheduler asks of its agent; ``prefill`` is the transfer's current prefill."""

    def __init__(self, prefill: str = "p0") -> None:
        self.prefill = prefill
        self.cancelled: list[str] = []
        self.prompts: dict[str, Any] = {}  # transfer id -> prompt_token_ids given to reserve

    def reserve(self, tid: str, rid: str, leg: DecodeLeg, *a: Any, **kw: Any) -> int:
        self.prompts[tid] = kw.get("prompt_token_ids")
        return 1

    def prefill_of(self, tid: str) -> str | None:
        return self.prefill

    def cancel(self, tid: str, reason: str, epoch: int | None = None) -> None:
        self.cancelled.append(tid)

    def finished(self, tid: str, epoch: int) -> None:
        pass


class _Blocks:
    """A request's blocks: ``cached`` from the local prefix cache first, then ``new`` ones."""

    def __init__(self, new: tuple[int, ...] = (1, 2), cached: tuple[int, ...] = ()) -> None:
        self.new, self.cached = list(new), list(cached)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [self.new]

    def get_block_ids(self) -> list[list[int]]:
        return [self.cached + self.new]


def _leg(tid: str = "t", first_token: bool = True) -> DecodeLeg:
    return DecodeLeg(tid, 1, "p0", "", 1, ["127.0.0.1:1"], first_token=first_token)


def _decode(**kw: Any) -> tuple[DecodeScheduler, _Agent]:
    s = DecodeScheduler(ConnectorConfig(engine_id="d0", role="decode", insecure=True), _vllm(**kw))
    agent = _Agent()
    s.agent = agent  # type: ignore[assignment]
    return s, agent


def _step(s: DecodeScheduler, new: tuple[str, ...] = ()) -> Any:
    return s.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new], total_num_scheduled_tokens=len(new)
        )
    )


def _token(tid: str = "t", token: int = 7, prefill: str = "p0") -> pb.FirstToken:
    return pb.FirstToken(transfer_id=tid, decode_engine_id="d0", prefill_engine_id=prefill, token_id=token)


# ----- the leg ----------------------------------------------------------------------------------


def test_first_token_is_a_strict_bool_and_signed_only_when_set() -> None:
    for leg in (_leg(), PrefillLeg("t", "d0", first_token=True)):
        parsed = transfer_params.parse(to_params(leg))
        assert parsed is not None and parsed.first_token
        raw = to_params(leg)
        raw["kvpush"]["first_token"] = 1
        with pytest.raises(LegError, match="first_token must be a boolean"):
            transfer_params.parse(raw)
    off = to_params(_leg(first_token=False))["kvpush"]
    without = {k: v for k, v in off.items() if k != "first_token"}
    # A leg without the hand-off signs exactly as before the field existed; one with it differs.
    assert canonical_bytes(off) == canonical_bytes(without)
    assert canonical_bytes(to_params(_leg())["kvpush"]) != canonical_bytes(off)


# ----- decode scheduler-half ----------------------------------------------------------------------


def test_appended_token_becomes_the_last_prompt_token() -> None:
    r = _request("r", list(range(3, 3 + 2 * BLOCK - 1)), _leg())  # one short of two blocks
    shared = r.prompt_token_ids
    assert len(r.block_hashes) == 1
    append_first_token(r, 99)
    assert r.prompt_token_ids is shared and shared[-1] == 99  # the list vLLM gives the workers
    assert r.num_prompt_tokens == r.num_tokens == 2 * BLOCK and list(r.all_token_ids)[-1] == 99
    assert r.num_output_tokens == 0
    assert len(r.block_hashes) == 2  # the block it completed is hashed with it


def test_relayed_token_is_appended_before_the_kv_is_released() -> None:
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s._first_tokens([_token(token=7)])  # before the reservation: waits
    assert _step(s).first_token_delivered == []
    assert s.get_num_new_matched_tokens(r, 0) == (37, True)
    s.update_state_after_alloc(r, _Blocks(), 37)
    meta = _step(s)
    assert meta.awaiting_first_token == ["r"] and meta.first_token_delivered == ["r"]
    assert r.prompt_token_ids[-1] == 7 and r.num_prompt_tokens == 38
    # Exactly once: a second relay (say, a rerouted prefill's) changes nothing.
    s._first_tokens([_token(token=8)])
    assert _step(s).first_token_delivered == [] and r.num_prompt_tokens == 38
    assert not s._advance  # greedy: no sampler to advance


@pytest.mark.parametrize(
    ("token", "why"),
    [(_token(prefill="p9"), "another prefill"), (_token(token=1000), "out of the vocabulary")],
)
def test_a_token_decode_cannot_trust_is_never_appended(token: pb.FirstToken, why: str) -> None:
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    s._first_tokens([token])
    assert _step(s).first_token_delivered == [], why
    assert r.num_prompt_tokens == 37 and "r" in s._want_token


def test_a_rerouted_transfer_takes_its_new_prefills_token() -> None:
    s, agent = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    agent.prefill = "p1"
    s._first_tokens([_token(prefill="p1", token=5)])
    assert _step(s).first_token_delivered == ["r"] and r.prompt_token_ids[-1] == 5


def test_a_retry_after_the_first_token_sends_the_prompt_the_reservation_holds() -> None:
    """The reservation holds the prompt's KV; once prefill's token is appended to the request, a
    retry elsewhere (its prefill died mid-transfer) must still send that prompt, not the prompt and
    the token: the new prefill would compute one token more than decode reserved (the soak's
    'token count mismatch: prefill computed 388, decode expects 387')."""
    s, agent = _decode()
    prompt = list(range(3, 40))
    r = _request("r", prompt, _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    s._first_tokens([_token(token=5)])
    assert _step(s).first_token_delivered == ["r"] and r.num_prompt_tokens == 38
    assert list(agent.prompts["t"]) == prompt


def test_a_rerouted_prefills_token_that_overtakes_the_new_leg_waits_for_it() -> None:
    """Retry elsewhere: the scheduler sends the new prefill its leg itself, so that prefill's token
    can be relayed before decode has moved the transfer to it; it is kept, and taken once the
    transfer is published there."""
    s, agent = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    s._first_tokens([_token(prefill="p1", token=5)])
    assert _step(s).first_token_delivered == []
    agent.prefill = "p1"  # the reroute's new epoch is published to p1
    assert _step(s).first_token_delivered == ["r"] and r.prompt_token_ids[-1] == 5
    assert not s._tokens and s._pending_tokens == 0


def test_the_earliest_relayed_acceptable_token_wins() -> None:
    s, agent = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    agent.prefill = "p1"
    s._first_tokens([_token(prefill="p1", token=5), _token(prefill="p0", token=6)])
    assert _step(s).first_token_delivered == ["r"] and r.prompt_token_ids[-1] == 5


def test_unclaimed_tokens_expire() -> None:
    s, _ = _decode()
    s._first_tokens([_token(tid="nobody")])
    _step(s)
    assert s._pending_tokens == 1
    s._take_tokens(time.monotonic() + 61)
    assert not s._tokens and s._pending_tokens == 0


def test_a_seeded_request_advances_its_sampler_in_its_first_step() -> None:
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg(), seed=11)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    s._first_tokens([_token()])
    assert _step(s).advance_sampler == []  # delivered, not scheduled yet
    assert _step(s, new=("other",)).advance_sampler == []
    assert _step(s, new=("r",)).advance_sampler == ["r"]
    assert _step(s, new=("r",)).advance_sampler == []  # once


def test_a_request_ending_while_waiting_for_its_token_is_abandoned() -> None:
    s, agent = _decode()
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    _step(s)
    s.request_finished(r)
    assert _step(s).first_token_abandoned == ["r"]
    assert agent.cancelled == ["t"]  # not received yet: the usual cancel path


@pytest.mark.parametrize("kw", [{"policy": "recompute"}, {"worker_cls": "auto"}])
def test_a_decode_that_cannot_continue_from_the_token_refuses_the_leg(kw: dict[str, Any]) -> None:
    """Not offered at registration; a leg that asks anyway fails (its frontend would repeat the
    token), it is never served as if the token did not exist."""
    s, agent = _decode(**kw)
    assert s._handoff_problem is not None
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    assert agent.cancelled == ["t"] and _step(s).awaiting_first_token == []


def test_a_duplicate_handoff_leg_fails_instead_of_repeating_the_token() -> None:
    """A second live request with the same hand-off leg (a frontend's retry, a replay) is never
    computed locally: it would stream its own first token after the one the frontend streamed.
    Its load is reported failed at once; the first request keeps its transfer and its token."""
    s, agent = _decode()
    first, dup = _request("r1", list(range(3, 40)), _leg()), _request("r2", list(range(3, 40)), _leg())
    assert s.get_num_new_matched_tokens(first, 0) == (37, True)
    s.update_state_after_alloc(first, _Blocks(), 37)
    assert s.get_num_new_matched_tokens(dup, 0) == (37, True)  # an async load, never a local compute
    s.update_state_after_alloc(dup, _Blocks(), 37)
    meta = _step(s)
    assert meta.fail_loads == ["r2"] and meta.awaiting_first_token == ["r1"]
    assert s._holders == {"t": "r1"} and list(agent.prompts) == ["t"]  # the duplicate reserved nothing
    w, _ = _worker()
    w.wait_for_save(meta)
    out = _results(w)
    assert out.finished_recving == {"r2"} and out.failed_recving == {"r2"}
    assert _step(s).fail_loads == []  # once
    s.request_finished(dup)
    s._first_tokens([_token(token=7)])
    assert _step(s).first_token_delivered == ["r1"] and first.prompt_token_ids[-1] == 7
    assert dup.prompt_token_ids[-1] != 7


def _signed_decode() -> tuple[DecodeScheduler, _Agent, LegSigner]:
    """A decode scheduler half that verifies legs with a scheduler key, as deployed."""
    signer = LegSigner(Ed25519PrivateKey.generate(), ttl_s=60)
    s, agent = _decode()
    s.legs = LegGate(s.cfg, verifier=LegVerifier(signer.public_key()))
    return s, agent, signer


def _with_leg(rid: str, fields: dict[str, Any]) -> Request:
    r = _request(rid, list(range(3, 40)), None)
    r.kv_transfer_params = {"kvpush": fields}
    return r


@pytest.mark.parametrize("refusal", ["expired", "tampered", "unsigned"])
def test_a_refused_handoff_leg_fails_instead_of_repeating_the_token(refusal: str) -> None:
    """A hand-off leg this engine refuses (expired while its request queued, tampered, unsigned)
    would otherwise be computed as on a plain instance: decode would sample a first token of its
    own after the one the frontend streamed. It is claimed as a load that fails at once instead;
    nothing is reserved and nothing of it is dialed."""
    from structlog.testing import capture_logs

    s, agent, signer = _signed_decode()
    leg = replace(_leg(), decode_engine_id="d0")
    signed = asdict(signer.sign_leg(leg, expires_at=time.time() - 600 if refusal == "expired" else None))
    fields = {
        "expired": signed,
        "tampered": {**signed, "prefill_agent_endpoints": ["127.0.0.1:9"]},
        "unsigned": asdict(leg),
    }[refusal]
    r = _with_leg("r", fields)
    with capture_logs() as logs:
        assert s.legs.of(r) is None
    reason = {"expired": "expired", "tampered": "bad_signature", "unsigned": "unsigned"}[refusal]
    assert [(e["event"], e["reason"]) for e in logs] == [("leg_refused", reason)]
    assert s.get_num_new_matched_tokens(r, 0) == (37, True)
    assert s.get_num_new_matched_tokens(r, 0) == (37, True)  # asked again while vLLM finds blocks
    s.update_state_after_alloc(r, _Blocks(), 37)
    meta = _step(s)
    assert meta.fail_loads == ["r"] and meta.awaiting_first_token == [] and agent.prompts == {}
    w, _ = _worker()
    w.wait_for_save(meta)
    out = _results(w)
    assert out.finished_recving == {"r"} and out.failed_recving == {"r"}
    s.request_finished(r)
    assert s._handoff_refused == {} and s._tried == set()


def test_a_refused_leg_without_the_handoff_is_still_computed_locally() -> None:
    s, agent, signer = _signed_decode()
    expired = asdict(signer.sign_leg(replace(_leg(first_token=False), decode_engine_id="d0"), expires_at=1.0))
    r = _with_leg("r", expired)
    assert s.legs.of(r) is None
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, _Blocks(), 0)
    assert _step(s).fail_loads == [] and s._handoff_refused == {}
    # A well-formed signed hand-off leg is claimed as a transfer, as before.
    ok = _with_leg("ok", asdict(signer.sign_leg(replace(_leg(tid="t2"), decode_engine_id="d0"))))
    assert s.get_num_new_matched_tokens(ok, 0) == (37, True)
    s.update_state_after_alloc(ok, _Blocks(), 37)
    assert list(agent.prompts) == ["t2"] and _step(s).awaiting_first_token == ["ok"]


def test_a_handoff_leg_before_the_agent_is_up_fails_too() -> None:
    from structlog.testing import capture_logs

    s, _ = _decode()
    s.agent = None
    plain, handoff = (
        _request("p", list(range(3, 40)), _leg(first_token=False)),
        _request("h", list(range(3, 40)), _leg()),
    )
    assert s.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert s.get_num_new_matched_tokens(handoff, 0) == (37, True)
    with capture_logs() as logs:
        s.update_state_after_alloc(handoff, _Blocks(), 37)
    assert _step(s).fail_loads == ["h"]
    assert [(e["event"], e["reason"]) for e in logs] == [("first_token_handoff_refused", "no decode agent yet")]
    # All of its prompt cached here already: vLLM computes the last token itself, never silently.
    whole = _request("w", list(range(3, 40)), _leg(tid="t3"))
    assert s.get_num_new_matched_tokens(whole, 37) == (0, False)
    with capture_logs() as logs:
        s.update_state_after_alloc(whole, _Blocks(), 0)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["first_token_handoff_computed_locally"]


def test_a_duplicate_leg_without_the_handoff_is_still_computed_locally() -> None:
    s, _ = _decode()
    first = _request("r1", list(range(3, 40)), _leg(first_token=False))
    dup = _request("r2", list(range(3, 40)), _leg(first_token=False))
    s.get_num_new_matched_tokens(first, 0)
    s.update_state_after_alloc(first, _Blocks(), 37)
    assert s.get_num_new_matched_tokens(dup, 0) == (0, False)
    s.update_state_after_alloc(dup, _Blocks(), 0)
    assert _step(s).fail_loads == []


def test_a_handoff_request_vllm_loads_nothing_for_is_logged_as_an_error() -> None:
    """vLLM may load nothing for a request (prompt logprobs asked): decode then samples its own first
    token; nothing here can stop it, but it is never silent."""
    from structlog.testing import capture_logs

    s, _ = _decode()
    s.agent.release_prefill = lambda *a: None  # type: ignore[union-attr]
    r = _request("r", list(range(3, 40)), _leg())
    s.get_num_new_matched_tokens(r, 0)
    with capture_logs() as logs:
        s.update_state_after_alloc(r, _Blocks(), 0)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["first_token_handoff_computed_locally"]
    plain = _request("p", list(range(3, 40)), _leg("t2", first_token=False))
    s.get_num_new_matched_tokens(plain, 0)
    with capture_logs() as logs:
        s.update_state_after_alloc(plain, _Blocks(), 0)
    assert not [e for e in logs if e["log_level"] == "error"]


def test_a_handoff_request_scheduled_before_its_token_is_failed_not_computed() -> None:
    """Should vLLM ever schedule a hand-off request before its token was appended (the workers
    hold its KV release, so never expected), decode would sample a first token of its own after
    the frontend's: the step reports one of its own blocks as failed to load, so vLLM fails the
    request and drops what the step sampled; it no longer waits for a token."""
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg())  # 37 tokens: blocks 0-2, position 35 in block 2
    assert s.get_num_new_matched_tokens(r, 0) == (37, True)
    s.update_state_after_alloc(r, _Blocks(new=(11, 12, 13)), 37)
    assert _step(s).veto_blocks == []  # waiting for its KV and its token: nothing to veto
    meta = _step(s, ("r",))
    assert meta.veto_blocks == [13] and meta.first_token_abandoned == ["r"]
    s._first_tokens([_token(token=7)])  # too late: never appended to a request that fails
    assert _step(s).first_token_delivered == [] and r.num_prompt_tokens == 37
    s.request_finished(r)
    assert not s._want_token  # its veto block went with it


def test_a_vetoed_request_never_names_a_block_another_request_may_share() -> None:
    s, _ = _decode()
    # The whole prompt but its last block came from the local prefix cache: the block to report
    # would be a cached (shareable) one, so nothing is reported; the error is still logged.
    r = _request("r", list(range(3, 3 + 2 * BLOCK + 1)), _leg())
    s.get_num_new_matched_tokens(r, 2 * BLOCK)
    s.update_state_after_alloc(r, _Blocks(new=(13,), cached=(11, 12)), 1)
    assert _step(s, ("r",)).veto_blocks == []
    # A token appended in time leaves nothing to veto.
    r2 = _request("r2", list(range(3, 40)), _leg("t2"))
    s.get_num_new_matched_tokens(r2, 0)
    s.update_state_after_alloc(r2, _Blocks(new=(21, 22, 23)), 37)
    s._first_tokens([_token("t2", token=7)])
    assert _step(s).first_token_delivered == ["r2"]
    assert _step(s, ("r2",)).veto_blocks == [] and "r2" not in s._want_token


def test_worker_reports_vetoed_blocks_as_failed_loads_once() -> None:
    w, _ = _worker()
    w.wait_for_save(_meta(veto_blocks=[13, 21]))
    assert _results(w).invalid_block_ids == {13, 21}
    assert _results(w).invalid_block_ids == set()


def test_legs_without_the_handoff_wait_for_nothing() -> None:
    s, _ = _decode()
    r = _request("r", list(range(3, 40)), _leg(first_token=False))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks(), 37)
    assert _step(s).awaiting_first_token == []


# ----- decode worker ------------------------------------------------------------------------------


class _Rank:
    def __init__(self) -> None:
        self.released: list[Released] = []
        self.cadence = PollCadence()
        self.tokens_awaited = False
        self.awaited_calls: list[bool] = []  # every report, to tell "not called" from "called with False"

    def awaiting_first_tokens(self, awaited: bool) -> None:
        self.tokens_awaited = awaited
        self.awaited_calls.append(awaited)

    def forward_started(self) -> None:
        self.cadence.forward_started()

    def step_ended(self, now: float) -> None:
        self.cadence.step_ended(now)

    def take_released(self) -> list[Released]:
        out, self.released = self.released, []
        return out


def _worker(wait_s: float = 30.0) -> tuple[DecodeWorker, _Rank]:
    w = DecodeWorker(ConnectorConfig(engine_id="d0", role="decode", insecure=True, first_token_wait_s=wait_s), "m")
    rank = _Rank()
    w.rank = rank  # type: ignore[assignment]
    return w, rank


def _meta(**kw: Any) -> Any:
    from kvpush.connector.messages import PushMetadata

    return PushMetadata(**kw)


def _released(rid: str, outcome: Outcome = Outcome.OK) -> Released:
    return Released("t-" + rid, 1, rid, outcome, "")


def test_worker_releases_a_landed_transfer_only_with_its_token() -> None:
    w, rank = _worker()
    w.wait_for_save(_meta(awaiting_first_token=["a", "b"]))
    assert rank.tokens_awaited  # the rank keeps NIXL progressing for the tokens' notices
    rank.released = [_released("a"), _released("b"), _released("c")]
    out = _results(w)
    assert out.finished_recving == {"c"}  # a and b wait for their tokens
    w.wait_for_save(_meta(first_token_delivered=["a"]))
    out = _results(w)
    assert out.finished_recving == {"a"} and not out.failed_recving
    # Token first, KV after: released at once.
    w.wait_for_save(_meta(awaiting_first_token=["d"]))
    w.wait_for_save(_meta(first_token_delivered=["d"]))
    rank.released = [_released("d")]
    assert _results(w).finished_recving == {"d"}
    # Ended while waiting: reported (vLLM frees its blocks), as failed only if the load failed.
    w.wait_for_save(_meta(first_token_abandoned=["b"]))
    out = _results(w)
    assert out.finished_recving == {"b"} and not out.failed_recving
    assert not rank.tokens_awaited  # no request waits for a token any more


def test_worker_fails_a_transfer_whose_token_never_came() -> None:
    w, rank = _worker(wait_s=0.0)
    w.wait_for_save(_meta(awaiting_first_token=["a"]))
    rank.released = [_released("a")]
    assert _results(w).finished_recving == set()  # held until the deadline passes
    out = _results(w)
    assert out.finished_recving == {"a"} and out.failed_recving == {"a"}
    assert not w._held and not w._needs_token and not rank.tokens_awaited


def test_worker_reports_a_failed_load_at_once_even_without_its_token() -> None:
    w, rank = _worker()
    w.wait_for_save(_meta(awaiting_first_token=["a"]))
    rank.released = [_released("a", Outcome.FAILED)]
    out = _results(w)
    assert out.finished_recving == {"a"} and out.failed_recving == {"a"}


def test_decode_metadata_says_whether_the_step_runs_a_forward() -> None:
    s, _ = _decode()
    assert _step(s).forward_tokens == 0  # only requests waiting for their KV: no forward
    assert _step(s, ("a", "b")).forward_tokens == 2

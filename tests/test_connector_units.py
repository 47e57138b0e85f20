"""Connector logic that needs no running engine: config parsing, KV layout description, the
prefill scheduler's per-step flags, and the prefill worker's release gating."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.connector.decode_scheduler import DecodeScheduler
from kvpush.connector.kv_layout import describe, merge_spans
from kvpush.connector.prefill_scheduler import PrefillScheduler
from kvpush.connector.workers import PrefillWorker
from kvpush.services.common.transfer_params import DecodeLeg, PrefillLeg, to_params
from kvpush.services.prefill_agent.table import ReleaseBlocks


def _kv_cfg(role: str = "kv_producer", engine_id: str = "p0", **extra: Any) -> Any:
    extra.setdefault("insecure", True)  # mTLS settings are tested in test_security_mtls.py
    return SimpleNamespace(kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra)


def _vllm_cfg(tp: int = 1) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp))


def test_config_roles_types_and_errors() -> None:
    cfg = ConnectorConfig.from_vllm(_kv_cfg("kv_consumer", agent_base_port="7000", grace_s=1))
    assert (cfg.role, cfg.agent_base_port, cfg.grace_s) == ("decode", 7000, 1.0)
    assert cfg.port_for(2) == 7002 and ConnectorConfig.from_vllm(_kv_cfg()).port_for(2) == 0
    with pytest.raises(ConfigError, match="kv_role"):
        ConnectorConfig.from_vllm(_kv_cfg("kv_both"))
    with pytest.raises(ConfigError, match="engine_id"):
        ConnectorConfig.from_vllm(_kv_cfg(engine_id=None))
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorConfig.from_vllm(_kv_cfg(typo_key=1))
    assert cfg.ucx_params() == {}
    assert ConnectorConfig.from_vllm(_kv_cfg(ucx_error_handling_mode="none")).ucx_params() == {
        "ucx_error_handling_mode": "none"
    }
    with pytest.raises(ConfigError, match="agent_base_port"):
        ConnectorConfig.from_vllm(_kv_cfg(agent_base_port="x"))
    for wait in ("-1", "1001", "nan"):
        with pytest.raises(ConfigError, match="first_token_completion_wait_ms"):
            ConnectorConfig.from_vllm(_kv_cfg(first_token_completion_wait_ms=wait))
    assert ConnectorConfig.from_vllm(_kv_cfg(first_token_completion_wait_ms="0")).first_token_completion_wait_ms == 0


def test_describe_cpu_kv_layout_views_of_one_buffer() -> None:
    torch = pytest.importorskip("torch")
    buf = torch.zeros(2 * 8 * 2 * 16 * 64, dtype=torch.bfloat16)
    layers = {f"l{i}": buf[i * 8 * 2048 : (i + 1) * 8 * 2048].view(8, 2, 16, 64) for i in range(2)}
    desc = describe(layers, tp_size=2, model_id="tiny")
    assert desc.ranges == [(buf.data_ptr(), buf.numel() * 2)]  # one registration for both layers
    assert [r.base_addr for r in desc.regions.regions] == [buf.data_ptr(), buf.data_ptr() + 8 * 2048 * 2]
    assert desc.regions.block_bytes == 2 * 16 * 64 * 2 and desc.regions.num_heads == 2
    assert (desc.shape.total_kv_heads, desc.shape.head_bytes, desc.shape.tokens_per_block) == (4, 2048, 16)
    assert desc.shape.dtype == "bfloat16"


def test_merge_spans() -> None:
    assert merge_spans([(100, 10), (0, 50), (50, 10), (200, 1)]) == [(0, 60), (100, 10), (200, 1)]


@dataclass
class _Req:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0
    status: Any = field(default_factory=lambda: SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))


class _Blocks:
    def __init__(self, ids: dict[str, tuple[list[int], ...]]) -> None:
        self.ids = ids

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self.ids[rid]


def test_prefill_scheduler_flags_the_step_with_the_last_chunk() -> None:
    s = PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill", insecure=True), _vllm_cfg())
    s._kv_cache_manager = _Blocks({"r1": ([4, 5, 6],)})
    r = _Req("r1", 300, to_params(PrefillLeg("t1", "d")))
    s.update_state_after_alloc(r, None, 0)
    first = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 256}))
    assert first.finished_prefills == []  # chunked prefill: more to come
    r.num_computed_tokens = 256
    second = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 44}))
    (fp,) = second.finished_prefills
    assert (fp.transfer_id, fp.request_id, fp.block_ids, fp.num_tokens) == ("t1", "r1", ((4, 5, 6),), 300)
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 1})).finished_prefills == []
    held, params = s.request_finished(r)
    assert held and params == {"kvpush": {"role": "prefill_done", "transfer_id": "t1"}}
    assert s.has_pending_push_work()
    s.update_connector_output({"r1"})
    assert not s.has_pending_push_work()


@pytest.mark.parametrize("push_after_output", ["true", "false"])
def test_prefill_scheduler_holds_only_handoff_pushes_for_the_step_output(push_after_output: str) -> None:
    cfg = ConnectorConfig.from_vllm(_kv_cfg("kv_producer", insecure=True, push_after_output=push_after_output))
    s = PrefillScheduler(cfg, _vllm_cfg())
    s._kv_cache_manager = _Blocks({"r1": ([4],), "r2": ([5],)})
    for rid, tid, handoff in (("r1", "t1", True), ("r2", "t2", False)):
        s.update_state_after_alloc(_Req(rid, 10, to_params(PrefillLeg(tid, "d", first_token=handoff))), None, 0)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 10, "r2": 10}))
    held = {fp.transfer_id: fp.after_output for fp in meta.finished_prefills}
    assert held == {"t1": push_after_output == "true", "t2": False}
    assert ConnectorConfig.from_vllm(_kv_cfg(trace_steps=push_after_output)).trace_steps is (
        push_after_output == "true"
    )


def test_prefill_scheduler_reports_kv_bytes_still_to_push() -> None:
    """The load report's write_bytes_in_flight (the scheduler's prefill busyness): KV handed to the
    writers and not yet sent, one block of every layer on every rank per block."""
    s = PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill", insecure=True), _vllm_cfg())
    s._kv_cache_manager = SimpleNamespace(
        get_block_ids=lambda rid: ([1, 2],), block_pool=SimpleNamespace(get_num_free_blocks=lambda: 7)
    )
    s._block_bytes = 1000
    r = _Req("r1", 20, to_params(PrefillLeg("t1", "d")))
    s.update_state_after_alloc(r, None, 0)
    assert s._load().write_bytes_in_flight == 0
    s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 20}))
    s.request_finished(r)
    assert s._load().write_bytes_in_flight == 2000 and s._load().free_blocks == 7
    s.update_connector_output({"r1"})
    assert s._load().write_bytes_in_flight == 0


def test_prefill_scheduler_abort_before_kv_tells_the_agents() -> None:
    s = PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill", insecure=True), _vllm_cfg())
    r = _Req("r2", 300, to_params(PrefillLeg("t2", "d")))
    s.update_state_after_alloc(r, None, 0)
    assert s.request_finished(r) == (False, None)
    from kvpush.connector.messages import AbortedPrefill

    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).aborted == [AbortedPrefill("t2", "d")]
    plain = _Req("r3", 10, None)
    s.update_state_after_alloc(plain, None, 0)
    assert s.request_finished(plain) == (False, None)


def test_prefill_scheduler_frees_kv_whose_decode_leg_failed() -> None:
    """The scheduler says a transfer's decode leg was not delivered: the workers are told (next
    step's metadata) that no reservation will come, for a held transfer and for one still being
    prefilled; failures for unknown transfers, prefill legs or after release change nothing."""
    from kvpush.connector.messages import UnreservedPrefill
    from kvpush.v1 import kvpush_pb2 as pb

    s = PrefillScheduler(ConnectorConfig(engine_id="p", role="prefill", insecure=True), _vllm_cfg())
    s._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([1, 2],))
    held, running = _Req("r1", 20, to_params(PrefillLeg("t1", "d"))), _Req("r2", 20, to_params(PrefillLeg("t2", "d2")))
    for r in (held, running):
        s.update_state_after_alloc(r, None, 0)
    s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 20}))
    assert s.request_finished(held)[0]  # KV pushed-to-be, blocks held
    s._leg_failures(
        [
            pb.LegFailure(transfer_id="t1", prefill_engine_id="p", leg=pb.ROLE_DECODE),
            pb.LegFailure(transfer_id="t2", prefill_engine_id="p", leg=pb.ROLE_DECODE),
            pb.LegFailure(transfer_id="t1", prefill_engine_id="p", leg=pb.ROLE_PREFILL),  # not for prefill
            pb.LegFailure(transfer_id="nope", prefill_engine_id="p", leg=pb.ROLE_DECODE),
        ]
    )
    assert s.has_pending_push_work()
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.unreserved == [UnreservedPrefill("t1", "d"), UnreservedPrefill("t2", "d2")]
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).unreserved == []
    s.update_connector_output({"r1"})
    s._leg_failures([pb.LegFailure(transfer_id="t1", leg=pb.ROLE_DECODE)])  # released already
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).unreserved == []


def test_prefill_worker_reports_only_finished_and_released_requests() -> None:
    w = PrefillWorker(ConnectorConfig(engine_id="p", role="prefill"), "m")
    w.agent = SimpleNamespace(prefill_done=lambda *a, **kw: None, prefill_aborted=lambda *a, **kw: None)  # type: ignore[assignment]
    from kvpush.connector.messages import FinishedPrefill, PushMetadata

    w.wait_for_save(PushMetadata(finished_prefills=[FinishedPrefill("t", "r", ((1,),), 5, "d")]))
    w._on_release(ReleaseBlocks("t", "r", "done"))
    assert w.finished_sending(set()) == set()  # the scheduler has not finished r yet
    assert w.finished_sending({"r", "someone-else"}) == {"r"}
    assert w.finished_sending({"r"}) == set()  # exactly once


def test_decode_scheduler_claims_only_its_requests_once() -> None:
    s = DecodeScheduler(ConnectorConfig(engine_id="d", role="decode", insecure=True), _vllm_cfg())
    leg = DecodeLeg("t", 1, "p", "", 1, ["127.0.0.1:1"])
    assert s.get_num_new_matched_tokens(_Req("a", 300, to_params(leg)), 0) == (0, False)  # no agent yet
    s.agent = SimpleNamespace()  # type: ignore[assignment]
    assert s.get_num_new_matched_tokens(_Req("a", 300, to_params(leg)), 0) == (300, True)
    assert s.get_num_new_matched_tokens(_Req("a", 300, to_params(leg)), 128) == (172, True)
    assert s.get_num_new_matched_tokens(_Req("a", 300, to_params(leg)), 300) == (0, False)
    assert s.get_num_new_matched_tokens(_Req("b", 300, None), 0) == (0, False)
    assert s.get_num_new_matched_tokens(_Req("c", 300, {"kvpush": {"role": "bogus"}}), 0) == (0, False)
    s._tried.add("a")
    assert s.get_num_new_matched_tokens(_Req("a", 300, to_params(leg)), 0) == (0, False)


def test_connector_processes_serve_prometheus_metrics() -> None:
    import urllib.request

    from kvpush.services.common.vllm_server import free_port
    from kvpush.services.decode_agent import metrics as decode_metrics

    port = free_port()
    ConnectorConfig(engine_id="d", role="decode", metrics_base_port=port - 1).serve_metrics(1)
    decode_metrics.RESERVATIONS.inc()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    assert "kvpush_decode_reservations_total" in body
    assert "kvpush_prefill_writes_total" in body or "kvpush_decode_transfers_total" in body


def test_plugin_registers_the_connector_by_name_idempotently() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvpush.connector.plugin import CONNECTOR_NAME, register

    register()
    register()  # vLLM loads plugins once per process, but a second call must not raise
    assert CONNECTOR_NAME in KVConnectorFactory._registry
    assert CONNECTOR_NAME != "NixlPushConnector"

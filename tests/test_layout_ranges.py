"""Range derivation from KV tensors' shapes and strides, write planning for every layout, the
compute fence, KV-cache groups and NIXL registration (no gRPC; NIXL only in-process)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpush.connector.compute_fence import FenceGate, NoFence, fence_factory  # noqa: E402
from kvpush.connector.kv_groups import KvGroupsError, require_single_group  # noqa: E402
from kvpush.connector.kv_layout import describe, tensor_pattern  # noqa: E402
from kvpush.services.common.block_ranges import BlockPattern, pair_ranges, slice_ranges  # noqa: E402
from kvpush.services.common.descs import mem_type_of  # noqa: E402
from kvpush.services.common.layout import LayoutError, ModelShape, layout_message, regions_of  # noqa: E402
from kvpush.services.common.tp import HeadSlice, head_slices  # noqa: E402
from kvpush.services.prefill_agent.plan import PlanError, plan_writes  # noqa: E402
from kvpush.v1 import kvpush_pb2 as pb  # noqa: E402
from tests.layout_cases import CASES, HEAD_SLICEABLE, build, fill, mismatches  # noqa: E402

E = 2  # bytes per element (int16)


def _pattern(t: Any, dims: str) -> Any:
    return tensor_pattern(tuple(t.shape), tuple(t.stride()), t.element_size(), dims)


# ----- hand-computed offsets (B=16 blocks, H=2 heads, N=4 tokens, D=8, int16) ------------------


def test_cpu_layout_is_one_range_per_head() -> None:
    p = _pattern(build("cpu", 16, 2)["layer.0"], "BHNC")
    assert (p.kind, p.block_stride, p.head_stride, p.pieces) == (
        pb.KV_LAYOUT_HEAD_MAJOR,
        2 * 4 * 16 * E,
        4 * 16 * E,
        ((0, 128),),
    )


def test_kv_split_nhd_is_one_range_per_token_and_half() -> None:
    p = _pattern(build("kv_split_nhd", 16, 2)["layer.0"], "KBNHC")
    half = 16 * 4 * 2 * 8 * E  # K/V stride: a whole K cache of the layer
    assert (p.kind, p.block_stride, p.head_stride) == (pb.KV_LAYOUT_KV_SPLIT_NHD, 4 * 2 * 8 * E, 8 * E)
    assert p.pieces == tuple((k * half + n * 2 * 8 * E, 8 * E) for k in range(2) for n in range(4))


def test_kv_split_hnd_is_one_range_per_half() -> None:
    p = _pattern(build("kv_split_hnd", 16, 2)["layer.0"], "KBNHC")
    assert (p.kind, p.block_stride, p.head_stride) == (pb.KV_LAYOUT_KV_SPLIT_HND, 2 * 4 * 8 * E, 4 * 8 * E)
    assert p.pieces == ((0, 64), (2048, 64))


def test_blocks_first_hnd_keeps_k_and_v_in_the_block() -> None:
    p = _pattern(build("blocks_first_hnd", 16, 2)["layer.0"], "BKNHC")
    assert (p.kind, p.block_stride, p.head_stride, p.pieces) == (
        pb.KV_LAYOUT_BLOCKS_FIRST_HND,
        256,
        64,
        ((0, 64), (128, 64)),
    )
    nhd = _pattern(build("blocks_first_nhd", 16, 2)["layer.0"], "BKNHC")
    assert nhd.kind == pb.KV_LAYOUT_BLOCKS_FIRST_NHD and len(nhd.pieces) == 8


def test_mla_cross_layer_token_major_and_head_outer() -> None:
    mla = _pattern(build("mla", 16, 1)["layer.0"], "BNC")
    assert (mla.kind, mla.num_heads, mla.block_stride, mla.pieces) == (pb.KV_LAYOUT_MLA, 1, 64, ((0, 64),))
    cross = build("cross_layer", 16, 2)
    p = _pattern(cross["layer.1"], "BHNC")
    assert (p.kind, p.block_stride, p.pieces) == (pb.KV_LAYOUT_HEAD_MAJOR, 2 * 256, ((0, 128),))
    assert cross["layer.1"].data_ptr() - cross["layer.0"].data_ptr() == 256
    tm = _pattern(build("token_major", 16, 2)["layer.0"], "BHNC")
    assert (tm.kind, tm.head_stride, tm.pieces) == (pb.KV_LAYOUT_TOKEN_MAJOR, 32, tuple((n * 64, 32) for n in range(4)))
    ho = _pattern(build("head_outer", 16, 2)["layer.0"], "BHNC")
    assert (ho.kind, ho.block_stride, ho.head_stride, ho.pieces) == (
        pb.KV_LAYOUT_HEAD_OUTER,
        128,
        16 * 128,
        ((0, 128),),
    )


def test_slice_and_pair_ranges_by_hand() -> None:
    hnd = BlockPattern(((0, 64), (2048, 64)), 64, 2)
    assert [x.tolist() for x in slice_ranges(hnd, 1, 1)] == [[64, 2112], [64, 64]]
    assert [x.tolist() for x in slice_ranges(hnd, 0, 2)] == [[0, 2048], [128, 128]]
    src = (np.array([0], dtype=np.uint64), np.array([128], dtype=np.uint64))
    dst = (np.array([10, 100], dtype=np.uint64), np.array([64, 64], dtype=np.uint64))
    assert [x.tolist() for x in pair_ranges(src, dst)] == [[0, 64], [10, 100], [64, 64]]


def test_plan_hnd_head_slice_by_hand() -> None:
    # prefill TP1 (2 heads) -> decode TP2: decode rank 1 gets head 1 of src block 3 in dst block 5.
    src = describe(build("kv_split_hnd", 16, 2), 1, "m").regions
    dst = describe(build("kv_split_hnd", 16, 1), 2, "m").regions
    plan = plan_writes(src, dst, [[3]], [[5]], HeadSlice(0, 1, 1, 0, 1))
    s0, d0 = src.regions[0].base_addr, dst.regions[0].base_addr
    assert plan.local[:2].tolist() == [[s0 + 3 * 128 + 64, 64, 0], [s0 + 2048 + 3 * 128 + 64, 64, 0]]
    assert plan.remote[:2].tolist() == [[d0 + 5 * 64, 64, 0], [d0 + 16 * 64 + 5 * 64, 64, 0]]
    assert plan.num_descriptors == 4 and mem_type_of(plan.local) == "DRAM" == mem_type_of(plan.remote)


# ----- planning end to end in memory: every layout, TP both ways, fragmented ids ----------------


def _simulate(case: str, p_tp: int, d_tp: int, src_ids: list[int], dst_ids: list[int]) -> tuple[list[Any], int]:
    """Plans every head slice and applies its descriptors with memmove; returns the mismatching
    (rank, layer, block, head) and the descriptor count."""
    total, blocks = 4, 32
    hp, hd = (1, 1) if case == "mla" else (total // p_tp, total // d_tp)
    prefill = []
    for p in range(p_tp):
        caches = build(case, blocks, hp)
        fill(case, caches, p, hp)
        prefill.append((caches, describe(caches, p_tp, "m")))
    decode = [(c := build(case, blocks, hd), describe(c, d_tp, "m")) for _ in range(d_tp)]
    shape = prefill[0][1].shape
    descriptors = 0
    for s in head_slices(shape.total_kv_heads, p_tp, d_tp):
        plan = plan_writes(
            prefill[s.prefill_rank][1].regions, decode[s.decode_rank][1].regions, [src_ids], [dst_ids], s
        )
        for (la, n, _), (ra, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
            ctypes.memmove(ra, la, n)
        descriptors += plan.num_descriptors
    bad = [m for d, (caches, _) in enumerate(decode) for m in mismatches(case, caches, d, hd, dst_ids, src_ids)]
    return bad, descriptors


FRAG_SRC, FRAG_DST = [5, 6, 7, 20, 3, 31], [9, 10, 11, 0, 30, 1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layout_equal_tp_fragmented(case: str) -> None:
    bad, _ = _simulate(case, 2, 2, FRAG_SRC, FRAG_DST)
    assert bad == []


@pytest.mark.parametrize("case", HEAD_SLICEABLE)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (1, 4)])
def test_head_sliceable_layouts_heterogeneous_tp(case: str, p_tp: int, d_tp: int) -> None:
    bad, _ = _simulate(case, p_tp, d_tp, FRAG_SRC, FRAG_DST)
    assert bad == []


@pytest.mark.parametrize("case", ["kv_split_nhd", "blocks_first_nhd", "token_major", "cross_layer_blnhc"])
def test_token_major_layouts_refuse_heterogeneous_tp_with_a_reason(case: str) -> None:
    with pytest.raises(PlanError, match="cannot be split by heads.*HND"):
        _simulate(case, 2, 1, [1], [2])
    # ... and at the handshake: the compatibility hash carries the heads per rank.
    one, two = describe(build(case, 8, 4), 1, "m").shape, describe(build(case, 8, 2), 2, "m").shape
    assert one.compatibility_hash() != two.compatibility_hash()


def test_mla_is_refused_across_different_tp_at_the_handshake() -> None:
    one, two = describe(build("mla", 8, 1), 1, "m").shape, describe(build("mla", 8, 1), 2, "m").shape
    assert one.compatibility_hash() != two.compatibility_hash()


def test_merging_contiguous_runs_per_layout() -> None:
    # Contiguous ids: CPU packs a run of blocks into one descriptor per layer; cross-layer caches
    # hold every layer in a block, so the run is one descriptor for all layers.
    ids = list(range(4, 12))
    assert _simulate("cpu", 1, 1, ids, ids) == ([], 2)
    assert _simulate("cross_layer", 1, 1, ids, ids) == ([], 1)
    assert _simulate("blocks_first_nhd", 1, 1, ids, ids) == ([], 2)
    assert _simulate("kv_split_nhd", 1, 1, ids, ids) == ([], 4)  # K and V runs per layer


def test_sliceable_hash_is_tp_independent_and_cpu_hash_unchanged() -> None:
    one, two = describe(build("kv_split_hnd", 8, 4), 1, "m").shape, describe(build("kv_split_hnd", 8, 2), 2, "m").shape
    assert one.compatibility_hash() == two.compatibility_hash()
    shape = ModelShape("m", "bfloat16", 2, 4, 2048, 16)
    old = {k: v for k, v in vars(shape).items() if k != "rank_heads"}
    expected = "kvpush1-" + hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:24]
    assert shape.compatibility_hash() == expected


def test_plan_refuses_mixed_layout_kinds() -> None:
    src = describe(build("kv_split_hnd", 8, 2), 1, "m").regions
    dst = describe(build("blocks_first_hnd", 8, 2), 1, "m").regions
    with pytest.raises(PlanError, match="layout kinds differ: KV_SPLIT_HND here, BLOCKS_FIRST_HND"):
        plan_writes(src, dst, [[0]], [[0]], head_slices(2, 1, 1)[0])


# ----- region descriptors over the wire --------------------------------------------------------


def test_layout_message_round_trips_and_inconsistent_peers_are_refused() -> None:
    desc = describe(build("kv_split_hnd", 8, 2), 2, "m")
    msg = layout_message(desc.regions, desc.shape, 1, "n", b"md", "h:1")
    assert msg.regions[0].mem_type == "DRAM" and msg.regions[0].layout == pb.KV_LAYOUT_KV_SPLIT_HND
    assert regions_of(pb.RankLayout.FromString(msg.SerializeToString()), 2) == desc.regions
    bad = pb.RankLayout.FromString(msg.SerializeToString())
    bad.regions[1].piece_lengths[0] += 2
    with pytest.raises(LayoutError, match="do not add up"):
        regions_of(bad, 2)
    bad = pb.RankLayout.FromString(msg.SerializeToString())
    bad.regions[0].mem_type = "HBM"
    with pytest.raises(LayoutError, match="unknown memory type"):
        regions_of(bad, 2)
    bad = pb.RankLayout.FromString(msg.SerializeToString())
    bad.regions[1].mem_type = "VRAM"
    with pytest.raises(LayoutError, match="several memories"):
        regions_of(bad, 2)


def test_registration_spans_cover_both_kv_halves() -> None:
    caches = build("kv_split_hnd", 8, 2)
    buf_bytes = 2 * 2 * 8 * 2 * 4 * 8 * E  # layers x K/V x blocks x heads x tokens x D
    desc = describe(caches, 1, "m")
    assert desc.ranges == [(caches["layer.0"].data_ptr(), buf_bytes)]


def test_nixl_registers_each_range_once() -> None:
    pytest.importorskip("nixl_cu12")
    from kvpush.services.common.nixl_engine import NixlEngine

    buf = np.zeros(1 << 16, dtype=np.uint8)
    engine = NixlEngine("register-once")
    try:
        assert engine.register([(buf.ctypes.data, buf.nbytes)]) == 1
        assert engine.register([(buf.ctypes.data, buf.nbytes)]) == 0  # what the decode worker used to do
        assert engine.register([(buf.ctypes.data + 4096, 4096)]) == 0  # inside an earlier registration
        assert len(engine._registrations) == 1
    finally:
        engine.close()


# ----- the compute fence -----------------------------------------------------------------------


class _ManualFence:
    """Stands for a CUDA event: ``wait`` returns once the test releases it."""

    def __init__(self, fail: bool = False) -> None:
        self.entered, self.released, self.fail = threading.Event(), threading.Event(), fail

    def wait(self) -> None:
        self.entered.set()
        assert self.released.wait(10)
        if self.fail:
            raise RuntimeError("kernel failed")


def test_gate_runs_callbacks_only_after_their_fence_and_in_order() -> None:
    gate, log, finished = FenceGate("test-gate"), [], threading.Event()
    first, second = _ManualFence(), _ManualFence(fail=True)
    gate.submit(first, lambda: log.append("first"))
    gate.submit(second, lambda: log.append("second"), on_fail=lambda: log.append("second failed"))
    gate.submit(NoFence(), finished.set)
    assert first.entered.wait(10)
    assert log == []  # the gate is inside the first fence: nothing may have run
    first.released.set()
    assert second.entered.wait(10)
    assert log == ["first"]
    second.released.set()
    assert finished.wait(10)
    assert log == ["first", "second failed"]
    gate.stop()


def test_gate_runs_a_no_fence_on_the_caller_until_it_has_a_thread() -> None:
    gate, ran_on = FenceGate("test-gate"), []
    gate.submit(NoFence(), lambda: ran_on.append(threading.get_ident()))
    assert ran_on == [threading.get_ident()]  # inline: no hand-off to the gate's thread
    assert not gate._thread.is_alive()
    held, done = _ManualFence(), threading.Event()
    gate.submit(held, lambda: ran_on.append(threading.get_ident()))
    gate.submit(NoFence(), done.set)  # queued behind the held fence: order is kept
    assert held.entered.wait(10)
    assert not done.is_set()
    held.released.set()
    assert done.wait(10)
    assert ran_on[1] == gate._thread.ident
    gate.stop()


def test_prefill_worker_hands_transfers_to_the_writer_after_the_fence() -> None:
    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.messages import AbortedPrefill, FinishedPrefill, PushMetadata
    from kvpush.connector.workers import PrefillWorker

    calls: list[tuple[str, str]] = []
    aborted = threading.Event()
    w = PrefillWorker(ConnectorConfig(engine_id="p", role="prefill"), "m")
    w.agent = SimpleNamespace(  # type: ignore[assignment]
        prefill_done=lambda tid, *a, **kw: calls.append(("done", tid)),
        prefill_aborted=lambda tid, **kw: (calls.append(("aborted", tid)), aborted.set()),
        stop=lambda: None,
    )
    fence = _ManualFence()
    w._fence = lambda: fence
    w.wait_for_save(
        PushMetadata(
            finished_prefills=[FinishedPrefill("t1", "r1", ((1,),), 5, "d")], aborted=[AbortedPrefill("t0", "d")]
        )
    )
    assert fence.entered.wait(10) and calls == []  # the engine thread returned; nothing posted yet
    fence.released.set()
    assert aborted.wait(10)
    assert calls == [("done", "t1"), ("aborted", "t0")]
    w.shutdown()


def test_prefill_worker_holds_a_handoff_transfer_until_the_next_step_starts() -> None:
    """First-token hand-off: the push waits for the step's output (the next step's start), then
    goes to the writer before that step's own transfers; a plain transfer goes at once."""
    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.messages import FinishedPrefill, PushMetadata
    from kvpush.connector.workers import PrefillWorker

    calls: list[str] = []
    w = PrefillWorker(ConnectorConfig(engine_id="p", role="prefill"), "m")
    w.agent = SimpleNamespace(  # type: ignore[assignment]
        prefill_done=lambda tid, *a, **kw: calls.append(tid),
        prefill_aborted=lambda tid, **kw: calls.append(f"aborted {tid}"),
        stop=lambda: None,
    )

    def fp(tid: str, after_output: bool) -> FinishedPrefill:
        return FinishedPrefill(tid, f"r-{tid}", ((1,),), 5, "d", after_output=after_output)

    w.wait_for_save(PushMetadata(finished_prefills=[fp("held", True), fp("plain", False)]))
    assert calls == ["plain"]  # NoFence: handed over on the engine thread, the hand-off one held
    w.step_started(None)
    assert calls == ["plain", "held"]
    w.step_started(None)  # nothing held: nothing again
    w.wait_for_save(PushMetadata(finished_prefills=[fp("held2", True)]))
    w.wait_for_save(PushMetadata(finished_prefills=[fp("plain2", False)]))
    assert calls == ["plain", "held", "plain2"]
    w.shutdown()  # a held transfer is handed over at shutdown, never dropped
    assert calls == ["plain", "held", "plain2", "held2"]
    assert w._active == {"r-held", "r-plain", "r-held2", "r-plain2"}  # freed only once released


def test_prefill_worker_pushes_a_held_transfer_once_its_first_token_left_the_process() -> None:
    """The registration sent the token (``HANDOFF_HOLDS.token_sent``, another thread): the held
    push goes to the writer then, not again at the next step; tokens of transfers this worker does
    not hold change nothing."""
    import threading

    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.handoff_holds import HANDOFF_HOLDS
    from kvpush.connector.messages import FinishedPrefill, PushMetadata
    from kvpush.connector.workers import PrefillWorker

    calls: list[tuple[str, str]] = []
    w = PrefillWorker(ConnectorConfig(engine_id="p", role="prefill"), "m")
    w.agent = SimpleNamespace(  # type: ignore[assignment]
        prefill_done=lambda tid, *a, **kw: calls.append((tid, threading.current_thread().name)),
        prefill_aborted=lambda tid, **kw: calls.append((f"aborted {tid}", "")),
        stop=lambda: None,
    )
    held = [FinishedPrefill(t, f"r-{t}", ((1,),), 5, "d", after_output=True) for t in ("h1", "h2")]
    w.wait_for_save(PushMetadata(finished_prefills=held))
    assert calls == [] and HANDOFF_HOLDS.held() == 2
    sender = threading.Thread(target=HANDOFF_HOLDS.token_sent, args=(["other", "h2"],), name="registration")
    sender.start()
    sender.join(10)
    assert calls == [("h2", "registration")]  # pushed by the thread that sent its token
    w.step_started(None)  # the next step: only what is still held
    assert [c[0] for c in calls] == ["h2", "h1"]
    HANDOFF_HOLDS.token_sent(["h1", "h2"])  # late: both gone already
    w.step_started(None)
    w.shutdown()
    assert [c[0] for c in calls] == ["h2", "h1"] and HANDOFF_HOLDS.held() == 0


def test_handoff_holds_run_each_push_once_and_outlive_a_failing_one() -> None:
    from kvpush.connector.handoff_holds import HandoffHolds

    holds, ran = HandoffHolds(), []

    def boom() -> None:
        raise RuntimeError("writer gone")

    holds.hold("a", boom)
    holds.hold("b", lambda: ran.append("b"))
    holds.hold("c", lambda: ran.append("c"))
    holds.token_sent(["a", "b", "zz"])  # a's push raises: b still runs, the caller does not see it
    assert ran == ["b"] and holds.held() == 1
    holds.release(["c", "b", "a"])
    holds.release(["c"])
    assert ran == ["b", "c"] and holds.held() == 0


def test_fence_kind_follows_the_kv_memory() -> None:
    assert isinstance(fence_factory("DRAM", 0)(), NoFence)
    assert fence_factory("VRAM", 0) is not NoFence  # a CUDA event per step (not creatable here)


# ----- KV-cache groups -------------------------------------------------------------------------


def test_more_than_one_kv_cache_group_is_refused_and_hma_not_declared() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvpush.connector.push_connector import KvPushConnector

    require_single_group(SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=1)]))
    require_single_group(None)
    with pytest.raises(KvGroupsError, match="single KV-cache group, but this engine has 2"):
        require_single_group(SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=1)] * 2))
    assert not supports_hma(KvPushConnector)

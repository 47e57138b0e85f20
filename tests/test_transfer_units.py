"""Unit tests of the pure transfer-core logic: TP mapping, run merging, planning, matching,
the completion barrier and the decode-side fence."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.services.common.layout import ModelShape, RankRegions, Region
from kvpush.services.common.refusal import RefusalCode
from kvpush.services.common.tp import TopologyError, head_slices, prefill_ranks_into, slices_from_prefill_rank
from kvpush.services.decode_agent.barrier import BarrierState, BarrierTable, CompletionError, Outcome
from kvpush.services.decode_agent.transfers import DecodeState, DecodeTransfer
from kvpush.services.prefill_agent.plan import BlockRun, PlanError, merge_runs, plan_writes
from kvpush.services.prefill_agent.table import (
    AckCancel,
    PrefillDone,
    PrefillState,
    Reject,
    ReleaseBlocks,
    Reservation,
    StartWrite,
    TransferTable,
)

# ----- TP mapping ----------------------------------------------------------------------------


def test_same_tp_maps_rank_to_rank() -> None:
    s = head_slices(8, 2, 2)
    assert [(x.prefill_rank, x.decode_rank, x.src_head, x.dst_head, x.num_heads) for x in s] == [
        (0, 0, 0, 0, 4),
        (1, 1, 0, 0, 4),
    ]


def test_prefill_tp2_to_decode_tp1_writes_halves() -> None:
    s = head_slices(4, 2, 1)
    assert [(x.prefill_rank, x.decode_rank, x.src_head, x.dst_head, x.num_heads) for x in s] == [
        (0, 0, 0, 0, 2),
        (1, 0, 0, 2, 2),
    ]
    assert prefill_ranks_into(4, 2, 1, 0) == [0, 1]


def test_prefill_tp1_to_decode_tp2_splits() -> None:
    s = slices_from_prefill_rank(4, 1, 2, 0)
    assert [(x.decode_rank, x.src_head, x.dst_head, x.num_heads) for x in s] == [(0, 0, 0, 2), (1, 2, 0, 2)]
    assert prefill_ranks_into(4, 1, 2, 1) == [0]


def test_replicated_heads_are_refused() -> None:
    with pytest.raises(TopologyError):
        head_slices(2, 4, 1)


# ----- runs and plans -------------------------------------------------------------------------


def test_merge_runs_contiguous_and_fragmented() -> None:
    assert merge_runs([1, 2, 3], [10, 11, 12]) == [BlockRun(1, 10, 3)]
    assert merge_runs([1, 2, 3, 7], [10, 11, 40, 41]) == [BlockRun(1, 10, 2), BlockRun(3, 40, 1), BlockRun(7, 41, 1)]
    assert merge_runs([], []) == []
    with pytest.raises(PlanError, match="block count mismatch"):
        merge_runs([1], [1, 2])


def _regions(base: int, blocks: int, block_bytes: int, heads: int, layers: int = 2) -> RankRegions:
    return RankRegions(
        tuple(Region(base + layer * blocks * block_bytes, blocks, block_bytes) for layer in range(layers)),
        block_bytes,
        heads,
    )


def test_plan_merges_whole_blocks_per_layer() -> None:
    src, dst = _regions(1000, 16, 64, 2), _regions(90_000, 16, 64, 2)
    (sl,) = head_slices(2, 1, 1)
    plan = plan_writes(src, dst, [[1, 2, 3]], [[5, 6, 7]], sl)
    assert plan.num_descriptors == 2  # one run per layer
    assert plan.local.tolist() == [[1000 + 64, 192, 0], [1000 + 16 * 64 + 64, 192, 0]]
    assert plan.remote[:, 0].tolist() == [90_000 + 5 * 64, 90_000 + 16 * 64 + 5 * 64]
    assert plan.num_bytes == 2 * 192


def test_plan_head_slices_one_descriptor_per_block() -> None:
    # prefill TP1 (2 heads) -> decode TP2 (1 head each): rank 1 gets the second head of each block.
    src, dst = _regions(0, 8, 64, 2), _regions(50_000, 8, 32, 1)
    sl = [s for s in slices_from_prefill_rank(2, 1, 2, 0) if s.decode_rank == 1][0]
    plan = plan_writes(src, dst, [[0, 1]], [[3, 4]], sl)
    assert plan.num_descriptors == 4
    assert plan.local[:2].tolist() == [[32, 32, 0], [64 + 32, 32, 0]]
    assert plan.remote[:2].tolist() == [[50_000 + 3 * 32, 32, 0], [50_000 + 4 * 32, 32, 0]]


def test_plan_rejects_out_of_range_and_layout_mismatch() -> None:
    src, dst = _regions(0, 8, 64, 2), _regions(50_000, 8, 64, 2)
    (sl,) = head_slices(2, 1, 1)
    with pytest.raises(PlanError, match="outside the registered region"):
        plan_writes(src, dst, [[0]], [[8]], sl)
    with pytest.raises(PlanError, match="layout mismatch"):
        plan_writes(src, _regions(50_000, 8, 64, 2, layers=3), [[0]], [[1]], sl)


def test_plan_large_fragmented_is_vectorised() -> None:
    n = 16384
    src, dst = _regions(0, n, 16384, 1, layers=1), _regions(1 << 40, n, 16384, 1, layers=1)
    (sl,) = head_slices(1, 1, 1)
    perm = np.random.default_rng(0).permutation(n)
    plan = plan_writes(src, dst, [list(range(n))], [perm.tolist()], sl)
    assert plan.num_bytes == n * 16384
    assert plan.num_descriptors > n // 2


# ----- prefill matching table ----------------------------------------------------------------


def _res(epoch: int = 1, blocks: tuple[int, ...] = (10, 11), skip: int = 0, tid: str = "t") -> Reservation:
    return Reservation("peer", tid, epoch, (blocks,), 32, skip, lease_s=5.0, decode_engine="D")


def _done(blocks: tuple[int, ...] = (1, 2), tid: str = "t") -> PrefillDone:
    return PrefillDone(tid, "req", (blocks,), 32, decode_engine="D")


@pytest.mark.parametrize("reservation_first", [True, False])
def test_either_arrival_order_starts_the_write(reservation_first: bool) -> None:
    t = TransferTable()
    first = t.on_reservation(_res(), 0) if reservation_first else t.on_prefill_done(_done(), 0)
    assert first == []
    second = t.on_prefill_done(_done(), 1) if reservation_first else t.on_reservation(_res(), 1)
    assert len(second) == 1 and isinstance(second[0], StartWrite)
    assert second[0].src_block_ids == ((1, 2),)
    assert t.state("D", "t") is PrefillState.WRITING
    done = t.on_write_finished("D", "t", 1, True, "", 2)
    assert done == [ReleaseBlocks("t", "req", "done")]
    assert t.state("D", "t") is PrefillState.DONE


def test_partial_prefix_writes_only_the_tail() -> None:
    t = TransferTable()
    t.on_prefill_done(_done(blocks=(1, 2, 3, 4)), 0)
    (start,) = t.on_reservation(_res(blocks=(20, 21), skip=2), 0)
    assert isinstance(start, StartWrite) and start.src_block_ids == ((3, 4),)


def test_block_count_mismatch_is_rejected_and_prefill_released() -> None:
    t = TransferTable()
    t.on_prefill_done(_done(blocks=(1, 2, 3)), 0)
    actions = t.on_reservation(_res(blocks=(20, 21)), 0)
    assert isinstance(actions[0], Reject) and actions[0].code is RefusalCode.INVALID_ARGUMENT
    assert "block count mismatch" in actions[0].message
    assert isinstance(actions[1], ReleaseBlocks)
    assert t.state("D", "t") is PrefillState.FAILED


def test_stale_and_duplicate_epochs() -> None:
    t = TransferTable()
    t.on_reservation(_res(epoch=2), 0)
    assert t.on_reservation(_res(epoch=2), 0) == []
    (rej,) = t.on_reservation(_res(epoch=1), 0)
    assert isinstance(rej, Reject) and rej.code is RefusalCode.FAILED_PRECONDITION


def test_cancel_while_writing_acks_after_the_write() -> None:
    t = TransferTable()
    t.on_reservation(_res(), 0)
    t.on_prefill_done(_done(), 0)
    assert t.on_cancel("peer", "D", "t", 1, 0) == []  # ack must wait for the WRITE in flight
    actions = t.on_write_finished("D", "t", 1, True, "", 1)
    assert AckCancel("peer", "t", 1, data_written=True) in actions


def test_cancel_before_prefill_then_late_done_releases_at_once() -> None:
    t = TransferTable()
    t.on_reservation(_res(), 0)
    assert t.on_cancel("peer", "D", "t", 1, 0) == [AckCancel("peer", "t", 1, data_written=False)]
    assert t.on_prefill_done(_done(), 1) == [ReleaseBlocks("t", "req", "transfer already cancelled")]


def test_unknown_cancel_is_acked_and_remembered() -> None:
    t = TransferTable()
    assert t.on_cancel("peer", "D", "x", 3, 0) == [AckCancel("peer", "x", 3, data_written=False)]
    assert isinstance(t.on_prefill_done(_done(tid="x"), 0)[0], ReleaseBlocks)


def test_leases_expire_both_ways() -> None:
    t = TransferTable(prefill_lease_s=1.0)
    t.on_reservation(_res(tid="a"), 0)
    t.on_prefill_done(_done(tid="b"), 0)
    actions = t.expire(10)
    kinds = {type(a) for a in actions}
    assert kinds == {Reject, ReleaseBlocks}
    rej = next(a for a in actions if isinstance(a, Reject))
    assert rej.code is RefusalCode.DEADLINE_EXCEEDED
    assert t.active_count() == 0


def test_peer_lost_drops_its_unmatched_reservations() -> None:
    t = TransferTable()
    t.on_reservation(_res(), 0)
    t.on_peer_lost("peer", 0)
    assert t.state("D", "t") is PrefillState.CANCELLED


def test_newer_epoch_while_writing_is_written_next() -> None:
    t = TransferTable()
    t.on_reservation(_res(epoch=1), 0)
    t.on_prefill_done(_done(), 0)
    assert t.on_reservation(_res(epoch=2, blocks=(30, 31)), 0) == []
    (start,) = t.on_write_finished("D", "t", 1, True, "", 1)
    assert isinstance(start, StartWrite) and start.reservation.epoch == 2


# ----- completion barrier --------------------------------------------------------------------


def test_barrier_releases_when_all_ranks_ok_and_is_idempotent() -> None:
    b = BarrierTable()
    b.expect("t", 1, "r", [0, 1], "P", 0)
    assert b.complete("t", 1, 0, "P", True, "", 0) is None
    assert b.complete("t", 1, 0, "P", True, "", 0) is None  # duplicate
    rel = b.complete("t", 1, 1, "P", True, "", 0)
    assert rel is not None and rel.outcome is Outcome.OK
    assert b.complete("t", 1, 1, "P", True, "", 0) is None  # duplicate after release


def test_barrier_failure_waits_for_the_agent_to_settle() -> None:
    b = BarrierTable()
    b.expect("t", 1, "r", [0, 1], "P", 0)
    assert b.complete("t", 1, 0, "P", False, "boom", 0) is None
    assert b.complete("t", 1, 1, "P", True, "", 0) is None  # every rank reported: still held
    barrier = b.get("t")
    assert barrier is not None and barrier.state is BarrierState.FAILING
    rel = b.settle("t", 1, Outcome.FAILED, "fenced", 0)
    assert rel is not None and rel.outcome is Outcome.FAILED and b.pending_count() == 0


def test_barrier_retry_epoch_replaces_a_failing_barrier() -> None:
    b = BarrierTable()
    b.expect("t", 1, "r", [0], "P", 0)
    assert b.complete("t", 1, 0, "P", False, "WRITE failed", 0) is None
    b.expect("t", 5, "r", [0, 1], "P2", 0)  # the agent fenced epoch 1 and retries on P2
    assert b.pending_count() == 1
    with pytest.raises(CompletionError) as e:
        b.complete("t", 1, 0, "P", True, "", 0)  # the failed prefill's late word
    assert e.value.code is RefusalCode.FAILED_PRECONDITION
    assert b.complete("t", 5, 0, "P2", True, "", 0) is None
    rel = b.complete("t", 5, 1, "P2", True, "", 0)
    assert rel is not None and rel.outcome is Outcome.OK and rel.epoch == 5 and b.pending_count() == 0


def test_barrier_refuses_a_retry_where_the_transfer_completed() -> None:
    b = BarrierTable()
    b.expect("t", 1, "r", [0], "P", 0)
    assert b.complete("t", 1, 0, "P", True, "", 0) is not None
    with pytest.raises(CompletionError) as e:
        b.expect("t", 2, "r", [0], "P2", 0)
    assert e.value.code is RefusalCode.FAILED_PRECONDITION


def test_barrier_retry_from_another_request_is_refused() -> None:
    b = BarrierTable()
    b.expect("t", 1, "r", [0], "P", 0)
    with pytest.raises(CompletionError) as e:
        b.expect("t", 2, "other-request", [0], "P2", 0)
    assert e.value.code is RefusalCode.ALREADY_EXISTS


def test_barrier_settle_releases_and_later_completions_error() -> None:
    b = BarrierTable()
    b.expect("t", 1, "r", [0], "P", 0)
    rel = b.settle("t", 1, Outcome.CANCELLED, "abort", 0)
    assert rel is not None and rel.outcome is Outcome.CANCELLED
    with pytest.raises(CompletionError) as e:
        b.complete("t", 1, 0, "P", True, "", 0)
    assert e.value.code is RefusalCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    ("tid", "epoch", "rank", "engine", "code"),
    [
        ("nope", 1, 0, "P", RefusalCode.NOT_FOUND),
        ("t", 7, 0, "P", RefusalCode.FAILED_PRECONDITION),
        ("t", 2, 5, "P", RefusalCode.INVALID_ARGUMENT),
        ("t", 2, 0, "other", RefusalCode.PERMISSION_DENIED),
    ],
)
def test_barrier_bad_completions(tid: str, epoch: int, rank: int, engine: str, code: RefusalCode) -> None:
    b = BarrierTable()
    b.expect("t", 1, "r", [0], "P", 0)
    b.settle("t", 1, Outcome.CANCELLED, "", 0)
    b.expect("t", 2, "r", [0], "P", 0)
    with pytest.raises(CompletionError) as e:
        b.complete(tid, epoch, rank, engine, True, "", 0)
    assert e.value.code is code


# ----- decode fence --------------------------------------------------------------------------


def _transfer() -> DecodeTransfer:
    t = DecodeTransfer("t", 1, "r", "P", ("a", "b"), 4, 0.0)
    t.mark_published(0.0)
    return t


def test_fence_waits_for_every_ack() -> None:
    t = _transfer()
    assert sorted(t.start_fence(DecodeState.CANCELLED, "abort", {})) == ["a", "b"]
    t.on_cancel_ack("a")
    assert not t.fenced(0.0)
    t.on_cancel_ack("b")
    assert t.fenced(0.0) and t.settle() is DecodeState.CANCELLED


def test_fence_lost_link_waits_for_grace() -> None:
    t = _transfer()
    assert t.start_fence(DecodeState.FAILED, "lost", {"b": 5.0}) == ["a"]
    t.on_cancel_ack("a")
    assert not t.fenced(4.9)
    assert t.fenced(5.0) and t.settle() is DecodeState.FAILED


def test_fence_before_publish_needs_no_acks() -> None:
    t = DecodeTransfer("t", 1, "r", "P", (), 4, 0.0)
    assert t.start_fence(DecodeState.CANCELLED, "abort", {}) == []
    assert t.fenced(0.0)


def test_model_shape_hash_changes_with_layout() -> None:
    a = ModelShape("m", "bf16", 2, 4, 512, 16)
    assert a.compatibility_hash() == ModelShape("m", "bf16", 2, 4, 512, 16).compatibility_hash()
    assert a.compatibility_hash() != ModelShape("m", "bf16", 2, 4, 512, 32).compatibility_hash()


def test_done_after_cancel_consumes_the_kv_so_newer_epochs_fail_fast() -> None:
    t = TransferTable()
    t.on_reservation(_res(epoch=1), 0)
    t.on_cancel("peer", "D", "t", 1, 0)
    assert isinstance(t.on_prefill_done(_done(), 0)[0], ReleaseBlocks)
    (rej,) = t.on_reservation(_res(epoch=2), 0)
    assert isinstance(rej, Reject) and rej.code is RefusalCode.FAILED_PRECONDITION


def test_newer_epoch_reopens_a_cancelled_transfer_before_prefill() -> None:
    t = TransferTable()
    t.on_reservation(_res(epoch=1), 0)
    t.on_cancel("peer", "D", "t", 1, 0)
    assert t.on_reservation(_res(epoch=1), 0)[0].code is RefusalCode.FAILED_PRECONDITION  # type: ignore[union-attr]
    assert t.on_reservation(_res(epoch=2), 0) == []
    assert isinstance(t.on_prefill_done(_done(), 0)[0], StartWrite)


def test_prefill_abort_rejects_the_waiting_reservation_and_later_ones() -> None:
    t = TransferTable()
    t.on_reservation(_res(), 0)
    (rej,) = t.on_prefill_aborted("D", "t", 0)
    assert isinstance(rej, Reject) and rej.code is RefusalCode.ABORTED
    assert t.on_prefill_aborted("D", "u", 0) == []
    (late,) = t.on_reservation(_res(tid="u"), 0)
    assert isinstance(late, Reject) and late.code is RefusalCode.FAILED_PRECONDITION


def test_plan_reuses_the_layout_part_and_still_checks_each_transfers_ids() -> None:
    from kvpush.services.prefill_agent.plan import _plan_shape

    src, dst = _regions(1000, 16, 64, 2), _regions(90_000, 16, 64, 2)
    (sl,) = head_slices(2, 1, 1)
    first = plan_writes(src, dst, [[1, 2, 3]], [[5, 6, 7]], sl)
    hits = _plan_shape.cache_info().hits
    again = plan_writes(src, dst, [[1, 2, 3]], [[5, 6, 7]], sl)
    assert _plan_shape.cache_info().hits == hits + 1
    assert again.local.tolist() == first.local.tolist() and again.remote.tolist() == first.remote.tolist()
    other = plan_writes(src, dst, [[1, 2, 9]], [[5, 6, 7]], sl)  # same shape, other ids: planned anew
    assert other.num_descriptors == 4
    with pytest.raises(PlanError, match="outside the registered region"):
        plan_writes(src, dst, [[1]], [[16]], sl)
    with pytest.raises(PlanError, match="outside the registered region"):
        plan_writes(src, dst, [[-1]], [[0]], sl)

"""Write planning (pure): block ids -> merged byte ranges -> NIXL descriptor arrays.

A ``BlockRun`` is a stretch of blocks contiguous on both sides. When a head slice covers whole
blocks on both sides and blocks are packed (stride == block bytes), a run becomes a single
descriptor; otherwise each block contributes one descriptor for its head slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpush.services.common.layout import RankRegions, Region
from kvpush.services.common.tp import HeadSlice


class PlanError(ValueError):
    """The transfer cannot be planned: the message says why (block ids, counts, layout)."""


@dataclass(frozen=True)
class BlockRun:
    src_start: int
    dst_start: int
    length: int


@dataclass
class WritePlan:
    """Descriptors for one destination rank: rows of (addr, length, dev_id)."""

    decode_rank: int
    local: np.ndarray
    remote: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum()) if len(self.local) else 0

    @property
    def num_descriptors(self) -> int:
        return len(self.local)


@dataclass(frozen=True)
class BlockRuns:
    """Runs as parallel arrays: run i copies ``lengths[i]`` blocks from ``src_starts[i]`` to ``dst_starts[i]``."""

    src_starts: np.ndarray
    dst_starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def as_list(self) -> list[BlockRun]:
        return [
            BlockRun(int(s), int(d), int(n))
            for s, d, n in zip(self.src_starts, self.dst_starts, self.lengths, strict=True)
        ]


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> BlockRuns:
    """Splits paired block ids into runs contiguous on both sides (vectorised)."""
    if len(src_ids) != len(dst_ids):
        raise PlanError(f"block count mismatch: {len(src_ids)} source vs {len(dst_ids)} destination blocks")
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if not len(src):
        empty = np.zeros(0, dtype=np.uint64)
        return BlockRuns(empty, empty, empty)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return BlockRuns(src[starts].astype(np.uint64), dst[starts].astype(np.uint64), (ends - starts).astype(np.uint64))


def merge_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[BlockRun]:
    return block_runs(src_ids, dst_ids).as_list()


def check_block_ids(ids: Sequence[int], regions: Sequence[Region], group: int, side: str) -> None:
    if not len(ids):
        return
    arr = np.asarray(ids, dtype=np.int64)
    limit = min((r.num_blocks for r in regions if r.group == group), default=0)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= limit:
        raise PlanError(f"{side} block id {hi if hi >= limit else lo} outside the registered region (0..{limit - 1})")


def plan_writes(
    src: RankRegions,
    dst: RankRegions,
    src_ids: Sequence[Sequence[int]],
    dst_ids: Sequence[Sequence[int]],
    head_slice: HeadSlice,
) -> WritePlan:
    """Plans the descriptors that copy ``head_slice`` of every block pair, layer by layer.

    ``src_ids``/``dst_ids`` are per KV-cache group and already aligned (same length per group).
    """
    if len(src.regions) != len(dst.regions):
        raise PlanError(f"layout mismatch: {len(src.regions)} local vs {len(dst.regions)} remote layers")
    if len(src_ids) != len(dst_ids):
        raise PlanError(f"group count mismatch: {len(src_ids)} vs {len(dst_ids)}")
    head_bytes = src.block_bytes // src.num_heads
    if dst.block_bytes // dst.num_heads != head_bytes:
        raise PlanError(f"layout mismatch: head bytes {head_bytes} vs {dst.block_bytes // dst.num_heads}")
    for g, (s_ids, d_ids) in enumerate(zip(src_ids, dst_ids, strict=True)):
        if len(s_ids) != len(d_ids):
            raise PlanError(f"block count mismatch in group {g}: {len(s_ids)} source vs {len(d_ids)} destination")
        check_block_ids(s_ids, src.regions, g, "source")
        check_block_ids(d_ids, dst.regions, g, "destination")

    src_off = head_slice.src_head * head_bytes
    dst_off = head_slice.dst_head * head_bytes
    nbytes = head_slice.num_heads * head_bytes
    whole = nbytes == src.block_bytes == dst.block_bytes
    runs_per_group = [block_runs(s, d) for s, d in zip(src_ids, dst_ids, strict=True)] if whole else []
    ids_per_group = [
        (np.asarray(s, dtype=np.uint64), np.asarray(d, dtype=np.uint64)) for s, d in zip(src_ids, dst_ids, strict=True)
    ]

    local_parts: list[np.ndarray] = []
    remote_parts: list[np.ndarray] = []
    for s_reg, d_reg in zip(src.regions, dst.regions, strict=True):
        if s_reg.group != d_reg.group:
            raise PlanError("layout mismatch: layer groups differ")
        g = s_reg.group
        if g >= len(ids_per_group):
            raise PlanError(f"no block ids for KV-cache group {g}")
        packed = whole and s_reg.block_stride == src.block_bytes and d_reg.block_stride == dst.block_bytes
        if packed:
            runs = runs_per_group[g]
            if not len(runs):
                continue
            lens = runs.lengths * np.uint64(nbytes)
            s_addr = np.uint64(s_reg.base_addr) + runs.src_starts * np.uint64(s_reg.block_stride)
            d_addr = np.uint64(d_reg.base_addr) + runs.dst_starts * np.uint64(d_reg.block_stride)
        else:
            s_blocks, d_blocks = ids_per_group[g]
            if not len(s_blocks):
                continue
            s_addr = np.uint64(s_reg.base_addr + src_off) + s_blocks * np.uint64(s_reg.block_stride)
            d_addr = np.uint64(d_reg.base_addr + dst_off) + d_blocks * np.uint64(d_reg.block_stride)
            lens = np.full(len(s_blocks), nbytes, dtype=np.uint64)
        zeros = np.zeros(len(lens), dtype=np.uint64)
        local_parts.append(np.stack((s_addr, lens, zeros), axis=1))
        remote_parts.append(np.stack((d_addr, lens, zeros), axis=1))
    empty = np.zeros((0, 3), dtype=np.uint64)
    local = np.concatenate(local_parts) if local_parts else empty
    remote = np.concatenate(remote_parts) if remote_parts else empty
    return WritePlan(head_slice.decode_rank, local, remote)

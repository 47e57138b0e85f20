"""Write planning (pure): block ids -> merged byte ranges -> NIXL descriptor arrays.

Per layer, the head slice's byte ranges inside one block are derived on each side from the
region's block pattern (:mod:`kvpush.services.common.block_ranges`), paired byte for byte, and
repeated for every block pair; descriptors that continue each other on both sides are merged (a
run of blocks packed on both sides becomes one descriptor; with cross-layer caches, whose blocks
hold every layer, a block run of all layers becomes one). A ``BlockRun`` is a stretch of blocks
contiguous on both sides.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpush.services.common.block_ranges import (
    BlockPattern,
    RangeError,
    merge_descriptors,
    pair_ranges,
    slice_ranges,
)
from kvpush.services.common.descs import MemDescs, mem_descs
from kvpush.services.common.layout import HEAD_SLICEABLE, LayoutError, RankRegions, Region, region_pieces
from kvpush.services.common.tp import HeadSlice
from kvpush.v1 import kvpush_pb2 as pb


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
    local: np.ndarray  # a MemDescs when planned: it carries the list's NIXL memory type
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


def check_block_ids(ids: Sequence[int] | np.ndarray, regions: Sequence[Region], group: int, side: str) -> None:
    if not len(ids):
        return
    arr = np.asarray(ids, dtype=np.int64)
    limit = min((r.num_blocks for r in regions if r.group == group), default=0)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= limit:
        raise PlanError(f"{side} block id {hi if hi >= limit else lo} outside the registered region (0..{limit - 1})")


def layout_name(kind: int) -> str:
    if kind not in pb.KvLayout.values():
        return str(kind)
    return pb.KvLayout.Name(pb.KvLayout.ValueType(kind)).removeprefix("KV_LAYOUT_")


def slice_problem(src: RankRegions, dst: RankRegions, head_slice: HeadSlice) -> str | None:
    """Why ``head_slice`` cannot be written from ``src`` into ``dst``, or None."""
    if src.kind != dst.kind:
        return f"layout kinds differ: {layout_name(src.kind)} here, {layout_name(dst.kind)} on decode"
    partial = head_slice.num_heads != src.num_heads or head_slice.num_heads != dst.num_heads
    if partial and src.kind not in HEAD_SLICEABLE:
        return (
            f"the {layout_name(src.kind)} layout cannot be split by heads (a head slice of a block is not one "
            "range per K/V half), so prefill and decode TP must be equal; heterogeneous TP needs a head-major "
            "layout (HND: VLLM_KV_CACHE_LAYOUT=HND, or LBHNC)"
        )
    return None


def _pattern(regions: RankRegions, region: Region) -> BlockPattern:
    pieces, head_stride = region_pieces(region, regions.block_bytes // regions.num_heads)
    return BlockPattern(tuple(sorted(pieces)), head_stride, regions.num_heads)


def _gapped(regions: RankRegions, region: Region, pattern: BlockPattern) -> bool:
    """Blocks with room between them (other layers' blocks in a cross-layer cache, or padding)."""
    return pattern.head_bytes * regions.num_heads < region.block_stride


@dataclass(frozen=True)
class _LayerPair:
    """One layer's id-independent part of a plan: where its blocks start and how far apart they
    are on each side, and the paired byte ranges of the head slice inside one block."""

    group: int
    src_base: np.uint64
    src_stride: np.uint64
    dst_base: np.uint64
    dst_stride: np.uint64
    src_off: np.ndarray
    dst_off: np.ndarray
    lengths: np.ndarray


@dataclass(frozen=True)
class _PlanShape:
    """Everything in a plan that does not depend on the block ids (one per peer and head slice)."""

    layers: tuple[_LayerPair, ...]
    gapped: bool
    local_mem: tuple[str, int]
    remote_mem: tuple[str, int]


@functools.lru_cache(maxsize=256)
def _plan_shape(src: RankRegions, dst: RankRegions, head_slice: HeadSlice) -> _PlanShape:
    """The layout checks and per-layer ranges of ``plan_writes``, computed once per (source,
    destination, head slice): a writer plans every transfer of a peer with the same ones."""
    if len(src.regions) != len(dst.regions):
        raise PlanError(f"layout mismatch: {len(src.regions)} local vs {len(dst.regions)} remote layers")
    if not src.num_heads or not dst.num_heads:
        raise PlanError("layout mismatch: a side holds no KV heads")
    head_bytes = src.block_bytes // src.num_heads
    if dst.block_bytes // dst.num_heads != head_bytes:
        raise PlanError(f"layout mismatch: head bytes {head_bytes} vs {dst.block_bytes // dst.num_heads}")
    problem = slice_problem(src, dst, head_slice)
    if problem is not None:
        raise PlanError(problem)
    try:
        local_mem, remote_mem = src.memory(), dst.memory()
    except LayoutError as exc:
        raise PlanError(str(exc)) from exc
    segments: dict[tuple[BlockPattern, BlockPattern], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    layers: list[_LayerPair] = []
    gapped = False
    for s_reg, d_reg in zip(src.regions, dst.regions, strict=True):
        if s_reg.group != d_reg.group:
            raise PlanError("layout mismatch: layer groups differ")
        sp, dp = _pattern(src, s_reg), _pattern(dst, d_reg)
        gapped = gapped or _gapped(src, s_reg, sp) or _gapped(dst, d_reg, dp)
        key = (sp, dp)
        if key not in segments:
            try:
                segments[key] = pair_ranges(
                    slice_ranges(sp, head_slice.src_head, head_slice.num_heads),
                    slice_ranges(dp, head_slice.dst_head, head_slice.num_heads),
                )
            except RangeError as exc:
                raise PlanError(f"layout mismatch: {exc}") from exc
        s_off, d_off, lens = segments[key]
        layers.append(
            _LayerPair(
                s_reg.group,
                np.uint64(s_reg.base_addr),
                np.uint64(s_reg.block_stride),
                np.uint64(d_reg.base_addr),
                np.uint64(d_reg.block_stride),
                s_off,
                d_off,
                lens,
            )
        )
    return _PlanShape(tuple(layers), gapped, local_mem, remote_mem)


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
    shape = _plan_shape(src, dst, head_slice)
    if len(src_ids) != len(dst_ids):
        raise PlanError(f"group count mismatch: {len(src_ids)} vs {len(dst_ids)}")
    ids_per_group: list[tuple[np.ndarray, np.ndarray]] = []
    for g, (s_ids, d_ids) in enumerate(zip(src_ids, dst_ids, strict=True)):
        if len(s_ids) != len(d_ids):
            raise PlanError(f"block count mismatch in group {g}: {len(s_ids)} source vs {len(d_ids)} destination")
        s_arr, d_arr = np.asarray(s_ids, dtype=np.int64), np.asarray(d_ids, dtype=np.int64)
        check_block_ids(s_arr, src.regions, g, "source")
        check_block_ids(d_arr, dst.regions, g, "destination")
        ids_per_group.append((s_arr.astype(np.uint64), d_arr.astype(np.uint64)))  # checked: none negative
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for layer in shape.layers:
        if layer.group >= len(ids_per_group):
            raise PlanError(f"no block ids for KV-cache group {layer.group}")
        s_blocks, d_blocks = ids_per_group[layer.group]
        if not len(s_blocks):
            continue
        s_addr = (layer.src_base + s_blocks * layer.src_stride)[:, None] + layer.src_off[None, :]
        d_addr = (layer.dst_base + d_blocks * layer.dst_stride)[:, None] + layer.dst_off[None, :]
        # Range by range, then block by block: a run of blocks then continues in each range (the
        # K half of block b+1 follows the K half of block b, not its V half).
        parts.append((s_addr.T.ravel(), d_addr.T.ravel(), np.repeat(layer.lengths, len(s_blocks))))
    if shape.gapped and parts:
        # Cross-layer blocks: order every layer's ranges by source address so a block's layers meet.
        s_all, d_all, n_all = (np.concatenate(x) for x in zip(*parts, strict=True))
        order = np.argsort(s_all, kind="stable")
        parts = [(s_all[order], d_all[order], n_all[order])]
    merged = [merge_descriptors(*p) for p in parts]
    return WritePlan(
        head_slice.decode_rank,
        _rows(merged, 0, *shape.local_mem),
        _rows(merged, 1, *shape.remote_mem),
    )


def _rows(
    merged: list[tuple[np.ndarray, np.ndarray, np.ndarray]], side: int, mem_type: str, device_id: int
) -> MemDescs:
    if not merged:
        return mem_descs(np.zeros((0, 3), dtype=np.uint64), mem_type)
    addr = np.concatenate([m[side] for m in merged])
    lens = np.concatenate([m[2] for m in merged])
    return mem_descs(np.stack((addr, lens, np.full(len(addr), device_id, dtype=np.uint64)), axis=1), mem_type)

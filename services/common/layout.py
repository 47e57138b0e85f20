"""KV memory layout of a rank and the compatibility hash of two engines (pure).

A :class:`Region` is one registered KV tensor of one layer: where block 0 is, how far apart blocks
are, which memory (DRAM or VRAM, which device), which KV-cache group indexes it, and where the
bytes of each head lie inside a block (``pieces`` of head 0, shifted by ``head_stride`` per head;
:mod:`kvpush.services.common.block_ranges` turns that into byte ranges).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import asdict, dataclass

from kvpush.services.common import limits
from kvpush.v1 import kvpush_pb2 as pb

DRAM = "DRAM"
VRAM = "VRAM"
MEM_TYPES = (DRAM, VRAM)

# Layout kinds whose head slice is one range per block (per K/V half, per head for HEAD_OUTER):
# heterogeneous TP can split them by heads. The others are written whole-block only.
HEAD_SLICEABLE = frozenset(
    {pb.KV_LAYOUT_HEAD_MAJOR, pb.KV_LAYOUT_KV_SPLIT_HND, pb.KV_LAYOUT_BLOCKS_FIRST_HND, pb.KV_LAYOUT_HEAD_OUTER}
)
KNOWN_LAYOUTS = HEAD_SLICEABLE | {
    pb.KV_LAYOUT_TOKEN_MAJOR,
    pb.KV_LAYOUT_KV_SPLIT_NHD,
    pb.KV_LAYOUT_BLOCKS_FIRST_NHD,
    pb.KV_LAYOUT_MLA,
}
MAX_PIECES = 8192  # pieces of one head in one block (NHD: 2 x block_size)


class LayoutError(ValueError):
    """A layout description is inconsistent or cannot be used; the message says what."""


@dataclass(frozen=True)
class Region:
    """One registered KV region (one layer's KV tensor) of a rank.

    ``pieces`` (offset, length) locate head 0's bytes inside block 0, relative to the block's
    address; head h's are at ``+ h * head_stride``. Empty: head-major blocks of
    ``RankRegions.block_bytes / num_heads`` bytes per head (the CPU layout).
    """

    base_addr: int
    num_blocks: int
    block_stride: int
    group: int = 0
    mem_type: str = DRAM
    device_id: int = 0
    pieces: tuple[tuple[int, int], ...] = ()
    head_stride: int = 0


@dataclass(frozen=True)
class RankRegions:
    regions: tuple[Region, ...]
    block_bytes: int  # bytes of one block of one layer on this rank (all its heads)
    num_heads: int  # KV heads on this rank
    kind: int = pb.KV_LAYOUT_HEAD_MAJOR

    def memory(self) -> tuple[str, int]:
        """The (memory type, device id) of every region; a rank lives on one device."""
        kinds = {(r.mem_type, r.device_id) for r in self.regions}
        if len(kinds) > 1:
            raise LayoutError(f"regions of one rank span several memories: {sorted(kinds)}")
        return kinds.pop() if kinds else (DRAM, 0)


@dataclass(frozen=True)
class ModelShape:
    """What must match between a prefill and a decode engine for their KV to be interchangeable."""

    model: str
    dtype: str
    num_layers: int
    total_kv_heads: int
    head_bytes: int  # bytes of one head of one block of one layer (K and V, all its tokens)
    tokens_per_block: int
    layout: int = pb.KV_LAYOUT_HEAD_MAJOR
    # Heads per rank when the layout cannot be split by heads (token-major, MLA), else 0: then
    # engines whose TP differs get different hashes and are refused at the handshake.
    rank_heads: int = 0

    def compatibility_hash(self) -> str:
        fields = asdict(self)
        if not self.rank_heads:
            del fields["rank_heads"]  # the hash of head-sliceable layouts is unchanged
        blob = json.dumps(fields, sort_keys=True).encode()
        return "kvpush1-" + hashlib.sha256(blob).hexdigest()[:24]


def new_incarnation() -> str:
    return uuid.uuid4().hex


def region_pieces(region: Region, head_bytes: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """(pieces, head_stride) of a region, with the head-major default filled in."""
    if region.pieces:
        return region.pieces, region.head_stride
    return ((0, head_bytes),), head_bytes


def region_extent(region: Region, head_bytes: int, num_heads: int) -> int:
    """Bytes from the region's base to the end of its last byte (for registration)."""
    pieces, head_stride = region_pieces(region, head_bytes)
    last_piece = max(off + length for off, length in pieces)
    return (region.num_blocks - 1) * region.block_stride + (num_heads - 1) * head_stride + last_piece


def register_spans(regions: RankRegions) -> list[tuple[int, int]]:
    """Memory to register with NIXL for these regions, merged where ranges touch or overlap."""
    head_bytes = regions.block_bytes // regions.num_heads if regions.num_heads else 0
    spans = sorted((r.base_addr, region_extent(r, head_bytes, regions.num_heads)) for r in regions.regions)
    out: list[list[int]] = []
    for addr, length in spans:
        if out and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + length - out[-1][0])
        else:
            out.append([addr, length])
    return [(a, n) for a, n in out]


def _check_region(r: pb.LayerRegion, num_heads: int, block_bytes: int, kind: int, rank: int) -> str | None:
    if r.mem_type not in ("", *MEM_TYPES):
        return f"decode rank {rank}: unknown memory type {r.mem_type[:16]!r}"
    if r.layout not in (pb.KV_LAYOUT_UNSPECIFIED, kind):
        return f"decode rank {rank}: regions disagree on the layout kind"
    if len(r.piece_offsets) != len(r.piece_lengths) or len(r.piece_offsets) > MAX_PIECES:
        return f"decode rank {rank}: malformed head pieces"
    if r.piece_offsets:
        if any(n == 0 for n in r.piece_lengths):
            return f"decode rank {rank}: empty head piece"
        if sum(r.piece_lengths) * num_heads != block_bytes:
            return f"decode rank {rank}: head pieces do not add up to the block bytes"
        if num_heads > 1 and r.head_stride < max(r.piece_lengths):
            return f"decode rank {rank}: heads overlap (a head piece is longer than the head stride)"
    return None


def regions_of(layout: pb.RankLayout, tp_size: int) -> RankRegions:
    """A peer's regions, checked for consistency (raises :class:`LayoutError` with the reason)."""
    heads = layout.total_kv_heads // tp_size if tp_size else 0
    kind = layout.layout or pb.KV_LAYOUT_HEAD_MAJOR
    if kind not in KNOWN_LAYOUTS:
        raise LayoutError(f"decode rank {layout.tp_rank}: unknown KV layout kind {kind}")
    if len(layout.regions) > limits.MAX_REGIONS_PER_RANK:
        raise LayoutError(f"decode rank {layout.tp_rank}: more than {limits.MAX_REGIONS_PER_RANK} regions")
    for r in layout.regions:
        problem = _check_region(r, heads, layout.block_bytes, kind, layout.tp_rank)
        if problem is not None:
            raise LayoutError(problem)
    regions = RankRegions(
        regions=tuple(
            Region(
                r.base_addr,
                r.num_blocks,
                r.block_stride,
                r.group,
                r.mem_type or DRAM,
                r.device_id,
                tuple(zip(r.piece_offsets, r.piece_lengths, strict=True)),
                r.head_stride,
            )
            for r in layout.regions
        ),
        block_bytes=layout.block_bytes,
        num_heads=heads,
        kind=kind,
    )
    regions.memory()  # one memory per rank
    return regions


def layout_message(
    regions: RankRegions,
    shape: ModelShape,
    tp_rank: int,
    nixl_name: str,
    nixl_metadata: bytes,
    completion_endpoint: str = "",
) -> pb.RankLayout:
    return pb.RankLayout(
        tp_rank=tp_rank,
        nixl_agent_metadata=nixl_metadata,
        nixl_agent_name=nixl_name,
        regions=[
            pb.LayerRegion(
                base_addr=r.base_addr,
                num_blocks=r.num_blocks,
                block_stride=r.block_stride,
                group=r.group,
                mem_type=r.mem_type,
                device_id=r.device_id,
                layout=regions.kind,  # type: ignore[arg-type]
                piece_offsets=[o for o, _ in r.pieces],
                piece_lengths=[n for _, n in r.pieces],
                head_stride=r.head_stride,
                num_heads=regions.num_heads,
            )
            for r in regions.regions
        ],
        block_bytes=regions.block_bytes,
        tokens_per_block=shape.tokens_per_block,
        total_kv_heads=shape.total_kv_heads,
        layout=shape.layout,  # type: ignore[arg-type]
        dtype=shape.dtype,
        completion_endpoint=completion_endpoint,
    )


def engine_identity(
    engine_id: str, role: pb.Role.ValueType, tp_size: int, shape: ModelShape, incarnation: str | None = None
) -> pb.EngineIdentity:
    """How an agent presents its engine to peers; a new incarnation unless one is given."""
    return pb.EngineIdentity(
        engine_id=engine_id,
        incarnation=incarnation or new_incarnation(),
        compatibility_hash=shape.compatibility_hash(),
        role=role,
        tp_size=tp_size,
    )

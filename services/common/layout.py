"""KV memory layout of a rank and the compatibility hash of two engines (pure)."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import asdict, dataclass

from kvpush.v1 import kvpush_pb2 as pb


@dataclass(frozen=True)
class Region:
    """One registered KV region (one layer) of a rank."""

    base_addr: int
    num_blocks: int
    block_stride: int
    group: int = 0


@dataclass(frozen=True)
class RankRegions:
    regions: tuple[Region, ...]
    block_bytes: int  # bytes of one block of one layer on this rank (all its heads)
    num_heads: int  # KV heads on this rank


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

    def compatibility_hash(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return "kvpush1-" + hashlib.sha256(blob).hexdigest()[:24]


def new_incarnation() -> str:
    return uuid.uuid4().hex


def regions_of(layout: pb.RankLayout, tp_size: int) -> RankRegions:
    return RankRegions(
        regions=tuple(Region(r.base_addr, r.num_blocks, r.block_stride, r.group) for r in layout.regions),
        block_bytes=layout.block_bytes,
        num_heads=layout.total_kv_heads // tp_size if tp_size else 0,
    )


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
            pb.LayerRegion(base_addr=r.base_addr, num_blocks=r.num_blocks, block_stride=r.block_stride, group=r.group)
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

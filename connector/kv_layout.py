"""Describes vLLM's CPU KV-cache tensors as kvpush regions (pure apart from reading tensors).

vLLM's CPU backend hands one tensor per attention layer shaped
``[num_blocks, kv_heads_on_rank, block_size, 2 * head_size]`` (head-major inside a block, K tile
then V tile per head), all layers views of one buffer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from kvpush.services.common.layout import ModelShape, RankRegions, Region


@dataclass(frozen=True)
class KvDescription:
    regions: RankRegions
    ranges: list[tuple[int, int]]  # memory to register with NIXL, merged
    shape: ModelShape


def describe(kv_caches: dict[str, Any], tp_size: int, model_id: str) -> KvDescription:
    if not kv_caches:
        raise ValueError("no KV caches to register")
    regions: list[Region] = []
    spans: list[tuple[int, int]] = []
    first = None
    for name, t in kv_caches.items():
        if t.dim() != 4:
            raise ValueError(
                f"layer {name}: expected a 4-D [blocks, heads, block_size, 2*head] tensor, got {tuple(t.shape)}"
            )
        if first is None:
            first = t
        elif tuple(t.shape[1:]) != tuple(first.shape[1:]) or t.dtype != first.dtype:
            raise ValueError(f"layer {name}: all layers must share one block shape and dtype")
        elt = t.element_size()
        block_bytes = math.prod(t.shape[1:]) * elt
        if not t[0].is_contiguous():
            raise ValueError(f"layer {name}: a block is not contiguous")
        stride = t.stride(0) * elt
        regions.append(Region(t.data_ptr(), t.shape[0], stride, 0))
        spans.append((t.data_ptr(), t.shape[0] * stride))
    assert first is not None
    heads = first.shape[1]
    block_bytes = math.prod(first.shape[1:]) * first.element_size()
    shape = ModelShape(
        model=model_id,
        dtype=str(first.dtype).removeprefix("torch."),
        num_layers=len(regions),
        total_kv_heads=heads * tp_size,
        head_bytes=block_bytes // heads,
        tokens_per_block=first.shape[2],
    )
    return KvDescription(RankRegions(tuple(regions), block_bytes, heads), merge_spans(spans), shape)


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merges overlapping or touching (address, length) ranges."""
    out: list[list[int]] = []
    for addr, length in sorted(spans):
        if out and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + length - out[-1][0])
        else:
            out.append([addr, length])
    return [(a, n) for a, n in out]


def default_model_id(model_path: str) -> str:
    return os.path.basename(os.path.normpath(model_path))

"""Describes vLLM's KV-cache tensors as kvpush regions, from their shapes and strides (pure apart
from reading tensors).

Each layer's tensor is read through its logical axes, named by letters: ``B`` blocks, ``K`` the
K/V split (size 2), ``H`` KV heads, ``N`` tokens of a block, ``C`` content (head size, 2 x head
size, or the MLA latent; contiguous). vLLM hands out, by default:

- 4-D ``[B, H, N, C]`` (``BHNC``): the CPU backend (``[blocks, heads, block_size, 2*head]``, a K
  tile then a V tile per head) and vLLM's per-layer views of any ``KVCacheLayout`` (LBHNC,
  LBNHC, LHBNC, and the cross-layer BLHNC, where one block holds every layer);
- 5-D ``[2, B, N, H, D]`` (``KBNHC``, FlashAttention) and ``[B, 2, N, H, D]`` (``BKNHC``,
  FlashInfer), NHD or, through strides, HND;
- 3-D ``[B, N, latent]`` (``BNC``, MLA: no head axis, replicated on every rank).

Other orders can be named with ``dims``. The strides, not the shape, decide the physical order,
hence the layout kind, and where each head's bytes lie inside a block (the region's ``pieces``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.services.common.block_ranges import merge_touching
from kvpush.services.common.layout import (
    DRAM,
    HEAD_SLICEABLE,
    VRAM,
    LayoutError,
    ModelShape,
    RankRegions,
    Region,
    register_spans,
)
from kvpush.v1 import kvpush_pb2 as pb

# Physical order of the axes (outermost first) -> layout kind.
KIND_BY_ORDER = {
    "BHNC": pb.KV_LAYOUT_HEAD_MAJOR,
    "BNHC": pb.KV_LAYOUT_TOKEN_MAJOR,
    "KBNHC": pb.KV_LAYOUT_KV_SPLIT_NHD,
    "KBHNC": pb.KV_LAYOUT_KV_SPLIT_HND,
    "BKNHC": pb.KV_LAYOUT_BLOCKS_FIRST_NHD,
    "BKHNC": pb.KV_LAYOUT_BLOCKS_FIRST_HND,
    "BNC": pb.KV_LAYOUT_MLA,
    "HBNC": pb.KV_LAYOUT_HEAD_OUTER,
}


@dataclass(frozen=True)
class KvDescription:
    regions: RankRegions
    ranges: list[tuple[int, int]]  # memory to register with NIXL, merged
    shape: ModelShape


@dataclass(frozen=True)
class TensorPattern:
    """One layer's tensor as byte geometry (relative to its data pointer)."""

    kind: int
    num_blocks: int
    block_stride: int
    pieces: tuple[tuple[int, int], ...]
    head_stride: int
    num_heads: int
    tokens_per_block: int

    @property
    def head_bytes(self) -> int:
        return sum(n for _, n in self.pieces)


def default_dims(shape: tuple[int, ...]) -> str:
    """vLLM's logical axis order for a KV tensor of this shape."""
    if len(shape) == 3:
        return "BNC"
    if len(shape) == 4:
        return "BHNC"
    if len(shape) == 5:
        return "KBNHC" if shape[0] == 2 and shape[1] != 2 else "BKNHC"
    raise LayoutError(f"a KV tensor has 3 to 5 axes, got shape {tuple(shape)}")


def tensor_pattern(shape: tuple[int, ...], strides: tuple[int, ...], elt: int, dims: str) -> TensorPattern:
    """Byte geometry of a tensor given its shape, element strides, element size and axis names."""
    if len(dims) != len(shape) or len(set(dims)) != len(dims) or not set(dims) <= set("BKHNC"):
        raise LayoutError(f"axis names {dims!r} do not fit shape {tuple(shape)} (letters from BKHNC, each once)")
    if not {"B", "N", "C"} <= set(dims):
        raise LayoutError(f"axis names {dims!r} need B (blocks), N (tokens) and C (content)")
    size = dict(zip(dims, shape, strict=True))
    stride = {d: s * elt for d, s in zip(dims, strides, strict=True)}
    if "K" in size and size["K"] != 2:
        raise LayoutError(f"the K/V axis has size {size['K']}, not 2")
    if size["C"] > 1 and stride["C"] != elt:
        raise LayoutError("the content axis is not contiguous")
    if any(s < 0 for s in stride.values()):
        raise LayoutError("negative strides are not supported")
    order = "".join(sorted(dims, key=lambda d: (-stride[d], dims.index(d))))
    kind = KIND_BY_ORDER.get(order)
    if kind is None:
        raise LayoutError(f"unsupported physical axis order {order} (known: {', '.join(KIND_BY_ORDER)})")
    k_offsets = np.arange(size.get("K", 1), dtype=np.uint64) * np.uint64(stride.get("K", 0))
    n_offsets = np.arange(size["N"], dtype=np.uint64) * np.uint64(stride["N"])
    offsets = (k_offsets[:, None] + n_offsets[None, :]).ravel()
    lengths = np.full(len(offsets), size["C"] * elt, dtype=np.uint64)
    off, n = merge_touching(offsets, lengths)
    return TensorPattern(
        kind=kind,
        num_blocks=size["B"],
        block_stride=stride["B"],
        pieces=tuple((int(o), int(x)) for o, x in zip(off, n, strict=True)),
        head_stride=stride.get("H", 0),
        num_heads=size.get("H", 1),
        tokens_per_block=size["N"],
    )


def _memory(t: Any) -> tuple[str, int]:
    device = t.device
    if device.type == "cuda":
        return VRAM, int(device.index or 0)
    if device.type != "cpu":
        raise LayoutError(f"KV tensors on {device.type} are not supported (cpu or cuda)")
    return DRAM, 0


def describe(
    kv_caches: Mapping[str, Any],
    tp_size: int,
    model_id: str,
    dims: str | None = None,
    groups: Mapping[str, int] | None = None,
) -> KvDescription:
    """Regions of this rank's KV tensors (one per layer), what to register, and the model shape.
    ``dims`` names the axes when the tensors are not in vLLM's default order; ``groups`` maps a
    layer to its KV-cache group (default 0)."""
    if not kv_caches:
        raise ValueError("no KV caches to register")
    regions: list[Region] = []
    first: tuple[TensorPattern, Any] | None = None
    memory: set[tuple[str, int]] = set()
    for name, t in kv_caches.items():
        try:
            pat = tensor_pattern(tuple(t.shape), tuple(t.stride()), t.element_size(), dims or default_dims(t.shape))
        except LayoutError as exc:
            raise ValueError(f"layer {name}: {exc}") from exc
        if first is None:
            first = (pat, t.dtype)
        elif (pat, t.dtype) != first:
            raise ValueError(f"layer {name}: all layers must share one block shape and dtype")
        mem_type, device_id = _memory(t)
        memory.add((mem_type, device_id))
        group = (groups or {}).get(name, 0)
        regions.append(
            Region(
                t.data_ptr(), pat.num_blocks, pat.block_stride, group, mem_type, device_id, pat.pieces, pat.head_stride
            )
        )
    assert first is not None
    if len(memory) > 1:
        raise ValueError(f"KV tensors of one rank span several devices: {sorted(memory)}")
    pat, dtype = first
    rank = RankRegions(tuple(regions), pat.head_bytes * pat.num_heads, pat.num_heads, pat.kind)
    shape = ModelShape(
        model=model_id,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=len(regions),
        total_kv_heads=pat.num_heads * tp_size,
        head_bytes=pat.head_bytes,
        tokens_per_block=pat.tokens_per_block,
        layout=pat.kind,
        rank_heads=0 if pat.kind in HEAD_SLICEABLE else pat.num_heads,
    )
    return KvDescription(rank, register_spans(rank), shape)


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

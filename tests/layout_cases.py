"""KV tensors in every layout vLLM hands to a connector, built as torch CPU views with the real
strides, plus a pattern to fill and check them through their logical axes (test support).

Every case builds one rank's caches for all layers; ``logical`` turns one layer's tensor into a
``[blocks, 2 or 1, heads, tokens, content]`` view whatever its physical order, so the pattern is
written and verified by meaning (layer, block, global head, K/V, token, element), never by offset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LAYERS = 2
TOKENS = 4  # tokens per block
CONTENT = 8  # elements of content per token (head size; the latent for MLA)
DTYPE = torch.int16  # 2-byte elements: offsets in elements and bytes differ

# case -> (builder(blocks, heads) -> {layer: tensor}, logical axis names of each tensor)
Builder = Callable[[int, int], dict[str, torch.Tensor]]


_DEVICE = ["cpu"]  # where ``build`` allocates (set per call)


def _empty(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=DTYPE, device=_DEVICE[0])


def _layers(buf: torch.Tensor, view: Callable[[torch.Tensor], torch.Tensor], axis: int = 0) -> dict[str, torch.Tensor]:
    return {f"layer.{i}": view(buf.select(axis, i)) for i in range(LAYERS)}


CASES: dict[str, tuple[Builder, str]] = {
    # CPU backend / vLLM LBHNC: [blocks, heads, block_size, 2*head], one buffer for all layers.
    "cpu": (lambda b, h: _layers(_empty(LAYERS, b, h, TOKENS, 2 * CONTENT), lambda t: t), "BHNC"),
    # FlashAttention NHD: [2, blocks, block_size, heads, head].
    "kv_split_nhd": (
        lambda b, h: _layers(_empty(LAYERS, 2, b, TOKENS, h, CONTENT), lambda t: t),
        "KBNHC",
    ),
    # The same logical tensor with HND strides (memory [2, blocks, heads, block_size, head]).
    "kv_split_hnd": (
        lambda b, h: _layers(_empty(LAYERS, 2, b, h, TOKENS, CONTENT), lambda t: t.permute(0, 1, 3, 2, 4)),
        "KBNHC",
    ),
    # FlashInfer blocks-first: [blocks, 2, block_size, heads, head], NHD and HND.
    "blocks_first_nhd": (
        lambda b, h: _layers(_empty(LAYERS, b, 2, TOKENS, h, CONTENT), lambda t: t),
        "BKNHC",
    ),
    "blocks_first_hnd": (
        lambda b, h: _layers(_empty(LAYERS, b, 2, h, TOKENS, CONTENT), lambda t: t.permute(0, 1, 3, 2, 4)),
        "BKNHC",
    ),
    # MLA: [blocks, block_size, latent], no head axis (``h`` is ignored: the latent is replicated).
    "mla": (lambda b, h: _layers(_empty(LAYERS, b, TOKENS, CONTENT), lambda t: t), "BNC"),
    # vLLM 4-D views of other KVCacheLayouts: LBNHC (token-major), LHBNC (heads outside blocks),
    # and the cross-layer BLHNC, where one block holds every layer.
    "token_major": (
        lambda b, h: _layers(_empty(LAYERS, b, TOKENS, h, 2 * CONTENT), lambda t: t.permute(0, 2, 1, 3)),
        "BHNC",
    ),
    "head_outer": (
        lambda b, h: _layers(_empty(LAYERS, h, b, TOKENS, 2 * CONTENT), lambda t: t.permute(1, 0, 2, 3)),
        "BHNC",
    ),
    "cross_layer": (
        lambda b, h: _layers(_empty(b, LAYERS, h, TOKENS, 2 * CONTENT), lambda t: t, axis=1),
        "BHNC",
    ),
    # The other cross-layer orders: BHLNC (a head of every layer, then the next head) and BLNHC.
    "cross_layer_bhlnc": (
        lambda b, h: _layers(_empty(b, h, LAYERS, TOKENS, 2 * CONTENT), lambda t: t, axis=2),
        "BHNC",
    ),
    "cross_layer_blnhc": (
        lambda b, h: _layers(_empty(b, LAYERS, TOKENS, h, 2 * CONTENT), lambda t: t.permute(0, 2, 1, 3), axis=1),
        "BHNC",
    ),
}

# Cases whose head slices are one range per block (per K/V half): heterogeneous TP works.
HEAD_SLICEABLE = ("cpu", "kv_split_hnd", "blocks_first_hnd", "head_outer", "cross_layer", "cross_layer_bhlnc")


def build(case: str, blocks: int, heads: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One rank's caches, zeroed, on ``device`` ("cpu" or "cuda:N")."""
    _DEVICE[0] = device
    try:
        return CASES[case][0](blocks, heads)
    finally:
        _DEVICE[0] = "cpu"


def logical(case: str, t: torch.Tensor) -> torch.Tensor:
    """``[blocks, K/V, heads, tokens, content]`` view of one layer's tensor (K/V, heads: size 1
    where the layout has no such axis)."""
    dims = CASES[case][1]
    for axis in "KH":
        if axis not in dims:
            t, dims = t.unsqueeze(-1), dims + axis
    return t.permute(*[dims.index(a) for a in "BKHNC"])


def pattern(layer: int, blocks: Any, global_heads: Any, kv: int, content: int) -> torch.Tensor:
    """Values of ``[len(blocks), kv, len(heads), TOKENS, content]`` for those blocks and heads."""
    b = torch.as_tensor(blocks, dtype=torch.int64)[:, None, None, None, None]
    h = torch.as_tensor(global_heads, dtype=torch.int64)[None, None, :, None, None]
    k = torch.arange(kv)[None, :, None, None, None]
    n = torch.arange(TOKENS)[None, None, None, :, None]
    c = torch.arange(content)[None, None, None, None, :]
    v = layer * 7919 + b * 613 + h * 97 + k * 31 + n * 11 + c + 1
    return (v % 30011).to(DTYPE)


def heads_of(case: str, rank: int, heads: int) -> list[int]:
    """Global heads held by a rank with ``heads`` heads (MLA: the one replicated latent)."""
    return [0] if case == "mla" else list(range(rank * heads, (rank + 1) * heads))


def fill(case: str, caches: dict[str, torch.Tensor], rank: int, heads: int) -> None:
    for layer, t in enumerate(caches.values()):
        view = logical(case, t)
        view.copy_(pattern(layer, range(view.shape[0]), heads_of(case, rank, heads), view.shape[1], view.shape[4]))


def mismatches(
    case: str, caches: dict[str, torch.Tensor], rank: int, heads: int, dst_ids: list[int], src_ids: list[int]
) -> list[tuple[int, int, int, int]]:
    """(rank, layer, destination block, global head) of every head of every block that differs
    from the source block's pattern."""
    bad: list[tuple[int, int, int, int]] = []
    gh = heads_of(case, rank, heads)
    for layer, t in enumerate(caches.values()):
        view = logical(case, t)
        got = view[torch.as_tensor(dst_ids, device=view.device)].cpu()
        want = pattern(layer, src_ids, gh, view.shape[1], view.shape[4])
        wrong = (got != want).flatten(3).any(dim=3).any(dim=1)  # [blocks, heads]
        for i, j in wrong.nonzero().tolist():
            bad.append((rank, layer, dst_ids[i], gh[j]))
    return bad

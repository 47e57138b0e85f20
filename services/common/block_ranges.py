"""Byte ranges of a head slice inside one KV block, and how two sides' ranges pair up (pure).

A block's layout is described by where head 0's bytes lie (``pieces``: (offset, length) relative
to the block's address) and ``head_stride``: head h's pieces are head 0's shifted by
``h * head_stride``. Examples, with e the element size, N tokens per block, H heads on the rank,
D the head size and S the K/V-half stride of a K/V-split tensor:

- CPU ``[blocks, H, N, 2D]``: one piece ``(0, N*2D*e)``, head stride ``N*2D*e``;
- K/V-split HND ``[2, blocks, H, N, D]``: ``(0, N*D*e), (S, N*D*e)``, head stride ``N*D*e``;
- K/V-split NHD ``[2, blocks, N, H, D]``: ``2N`` pieces of ``D*e``, head stride ``D*e``;
- MLA ``[blocks, N, latent]``: one piece, one head.

A slice's ranges are the pieces of its heads, sorted by address, with touching ranges merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class RangeError(ValueError):
    """Two block patterns cannot be paired (different content); the message says why."""


@dataclass(frozen=True)
class BlockPattern:
    pieces: tuple[tuple[int, int], ...]  # head 0, sorted by offset
    head_stride: int
    num_heads: int

    @property
    def head_bytes(self) -> int:
        return sum(n for _, n in self.pieces)


def merge_touching(offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorts ranges by offset and merges each into the previous one where they touch."""
    order = np.argsort(offsets, kind="stable")
    off, n = offsets[order], lengths[order]
    if len(off) < 2:
        return off, n
    breaks = np.flatnonzero(off[:-1] + n[:-1] != off[1:]) + 1
    starts = np.concatenate(([0], breaks))
    return off[starts], np.add.reduceat(n, starts)


def slice_ranges(pattern: BlockPattern, first_head: int, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of heads ``first_head .. first_head + num_heads - 1`` inside one block."""
    if first_head < 0 or num_heads <= 0 or first_head + num_heads > pattern.num_heads:
        raise RangeError(f"heads {first_head}..{first_head + num_heads - 1} outside 0..{pattern.num_heads - 1}")
    base = np.array([o for o, _ in pattern.pieces], dtype=np.uint64)
    lens = np.array([n for _, n in pattern.pieces], dtype=np.uint64)
    heads = np.arange(first_head, first_head + num_heads, dtype=np.uint64) * np.uint64(pattern.head_stride)
    offsets = (heads[:, None] + base[None, :]).ravel()
    return merge_touching(offsets, np.tile(lens, num_heads))


def pair_ranges(
    src: tuple[np.ndarray, np.ndarray], dst: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts both sides' ranges at the union of their boundaries, so the k-th byte of the source
    slice (in memory order) goes to the k-th byte of the destination slice. Returns parallel
    arrays (source offsets, destination offsets, lengths)."""
    s_off, s_len = src
    d_off, d_len = dst
    s_end, d_end = np.cumsum(s_len), np.cumsum(d_len)
    total = int(s_end[-1]) if len(s_end) else 0
    if total != (int(d_end[-1]) if len(d_end) else 0):
        raise RangeError(
            f"slice sizes differ: {total} source vs {int(d_end[-1]) if len(d_end) else 0} destination bytes"
        )
    cuts = np.union1d(s_end, d_end)
    starts = np.concatenate((np.zeros(1, dtype=np.uint64), cuts[:-1])).astype(np.uint64)
    si = np.searchsorted(s_end, starts, side="right")
    di = np.searchsorted(d_end, starts, side="right")
    s_begin = s_end[si] - s_len[si]
    d_begin = d_end[di] - d_len[di]
    return s_off[si] + (starts - s_begin), d_off[di] + (starts - d_begin), (cuts - starts).astype(np.uint64)


def merge_descriptors(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merges each descriptor into the previous one where it continues it on both sides."""
    if len(src) < 2:
        return src, dst, lengths
    cont = (src[:-1] + lengths[:-1] == src[1:]) & (dst[:-1] + lengths[:-1] == dst[1:])
    starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
    return src[starts], dst[starts], np.add.reduceat(lengths, starts)

"""Tensor-parallel head mapping between a prefill engine and a decode engine (pure).

Each TP rank of an engine holds a contiguous range of the model's KV heads. A prefill rank writes
every overlap of its range with a decode rank's range into that decode rank.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """The two engines' TP sizes cannot be mapped onto each other."""


@dataclass(frozen=True)
class HeadSlice:
    """Heads that one prefill rank writes into one decode rank, in local head indices."""

    prefill_rank: int
    decode_rank: int
    src_head: int  # first head within the prefill rank's block
    dst_head: int  # first head within the decode rank's block
    num_heads: int


def heads_per_rank(total_heads: int, tp_size: int) -> int:
    if tp_size <= 0 or total_heads <= 0:
        raise TopologyError(f"invalid topology: total_heads={total_heads} tp_size={tp_size}")
    if total_heads % tp_size:
        raise TopologyError(f"{total_heads} KV heads cannot be split over TP {tp_size} (replicated heads)")
    return total_heads // tp_size


def head_slices(total_heads: int, prefill_tp: int, decode_tp: int) -> list[HeadSlice]:
    """Every (prefill rank, decode rank) overlap, ordered by prefill rank then decode rank."""
    hp = heads_per_rank(total_heads, prefill_tp)
    hd = heads_per_rank(total_heads, decode_tp)
    slices: list[HeadSlice] = []
    for p in range(prefill_tp):
        p_lo, p_hi = p * hp, (p + 1) * hp
        for d in range(decode_tp):
            d_lo, d_hi = d * hd, (d + 1) * hd
            lo, hi = max(p_lo, d_lo), min(p_hi, d_hi)
            if lo < hi:
                slices.append(HeadSlice(p, d, lo - p_lo, lo - d_lo, hi - lo))
    return slices


def slices_from_prefill_rank(total_heads: int, prefill_tp: int, decode_tp: int, rank: int) -> list[HeadSlice]:
    return [s for s in head_slices(total_heads, prefill_tp, decode_tp) if s.prefill_rank == rank]


def prefill_ranks_into(total_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> list[int]:
    """Prefill ranks whose completions a decode rank waits for."""
    return [s.prefill_rank for s in head_slices(total_heads, prefill_tp, decode_tp) if s.decode_rank == decode_rank]

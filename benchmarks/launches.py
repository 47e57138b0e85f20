"""Pools launches of ``make bench-decode-speed``: two launches of one engine differ by more than
most of what one launch measures (docs/bench_phases.md), so a ratio is read over many.

``python -m benchmarks.launches bench-results/ds-*.json``: launches are grouped by their serving
arguments (``--serving-arg``) and client core (``--client-core``), the arm; per group and ratio,
the launches' medians, their geometric mean with a 90 % bootstrap interval over launches, and in
how many launches it was above 1.0. Prints markdown; ``--out`` also writes the pooled numbers as
JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import paired


def arm(res: dict[str, Any]) -> str:
    """A launch's arm: its serving arguments and client core, or ``defaults``."""
    cfg = res.get("config", {})
    extra = [str(a) for a in cfg.get("serving_arg") or []]
    if cfg.get("client_core") is not None:
        extra.append(f"--client-core={cfg['client_core']}")
    return " ".join(extra) or "defaults"


def pool(launches: Sequence[dict[str, Any]], seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per arm and ratio: the launches' values, their geometric mean and its 90 % interval, and the
    count above 1.0. A ratio a launch lacks or read as NaN is left out of that launch's values."""
    rng = np.random.default_rng(seed)
    groups: dict[str, list[dict[str, Any]]] = {}
    for res in launches:
        groups.setdefault(arm(res), []).append(res)
    out: dict[str, dict[str, Any]] = {}
    for name, group in groups.items():
        keys = sorted({k for res in group for k in res.get("ratios", {})})
        ratios: dict[str, Any] = {}
        for k in keys:
            x = [float(res["ratios"][k]) for res in group if k in res.get("ratios", {})]
            x = [v for v in x if math.isfinite(v) and v > 0]
            if not x:
                continue
            ratios[k] = {
                "launches": len(x),
                "values": x,
                "geomean": paired.geomean(x),
                "geomean_ci90": paired.bootstrap_ci90(x, paired.geomean, rng),
                "above_1": sum(v > 1.0 for v in x),
            }
        out[name] = {
            "launches": len(group),
            "load_before": [float(res.get("load_before", math.nan)) for res in group],
            "ratios": ratios,
        }
    return out


def markdown(pooled: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for name, g in pooled.items():
        loads = [v for v in g["load_before"] if math.isfinite(v)]
        load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "?"
        lines += [
            f"**{name}**: {g['launches']} launches, load average before {load}.",
            "",
            "| ratio | launches | geometric mean | 90 % interval | above 1.0 in |",
            "|---|---:|---:|---|---:|",
        ]
        for k, r in g["ratios"].items():
            lo, hi = r["geomean_ci90"]
            lines.append(
                f"| {k} | {r['launches']} | {r['geomean']:.3f} | {lo:.3f}-{hi:.3f} | {r['above_1']} of {r['launches']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench-decode-speed JSON results, one per launch")
    ap.add_argument("--out", type=Path, default=None, help="also write the pooled numbers here (JSON)")
    args = ap.parse_args(argv)
    pooled = pool([json.loads(p.read_text()) for p in args.results])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(pooled, indent=1))
    sys.stdout.write(markdown(pooled))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

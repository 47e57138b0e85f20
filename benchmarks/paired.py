"""What the paired benchmarks (``make bench-phases``, ``make bench-connector-cost``) share: their
start (the model, a harness, seeded prompts) and their report (JSON, markdown, printed)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving import Harness, _relative, parse_args


def setup(args: argparse.Namespace, extra: Sequence[str], count: int) -> tuple[Harness, list[list[int]]]:
    """A paired benchmark's start: the model (made when missing), a harness for its engines with
    ``extra`` serving arguments, and ``count`` seeded random prompts of ``args.prompt_len`` tokens."""
    if not (args.model_dir / "config.json").exists():
        from scripts.cluster.vllm import make_model

        make_model(args.model_dir)
    sargs = parse_args(
        [
            "--model-dir",
            str(args.model_dir),
            "--log-dir",
            str(args.log_dir),
            "--prompt-lens",
            str(args.prompt_len),
            "--max-tokens",
            str(args.output_len),
            *extra,
        ]
    )
    h = Harness(sargs)
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(10, h.model.vocab - 10, size=args.prompt_len)] for _ in range(count)]
    return h, prompts


def tpot(token_times: Sequence[float]) -> float:
    """Time per output token of one streamed request: first to last token over the gaps between."""
    n = len(token_times)
    return (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else float("nan")


def geomean(x: Sequence[float] | np.ndarray) -> float:
    """The geometric mean: the average of ratios (a ratio and its inverse average to 1)."""
    return float(np.exp(np.mean(np.log(np.asarray(x, dtype=float)))))


def bootstrap_ci90(
    x: Sequence[float] | np.ndarray, stat: Callable[[np.ndarray], float], rng: np.random.Generator, n: int = 4000
) -> list[float]:
    """A 90 % percentile-bootstrap interval of ``stat`` over ``x`` (resampled ``n`` times)."""
    a = np.asarray(x, dtype=float)
    samples = [stat(rng.choice(a, len(a))) for _ in range(n)]
    return [float(np.percentile(samples, 5)), float(np.percentile(samples, 95))]


def write_report(
    args: argparse.Namespace,
    res: dict[str, Any],
    markdown: Callable[[dict[str, Any]], str],
    load_before: float,
    started: float,
) -> None:
    """A paired benchmark's ending: adds its configuration, host, load averages and duration to
    ``res``, writes it as JSON to ``args.out`` and its markdown beside it, and prints the markdown."""
    res.update(
        config={k: (_relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        host=f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        load_before=load_before,
        load_after=os.getloadavg()[0],
        total_seconds=time.monotonic() - started,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    args.out.with_suffix(".md").write_text(md)
    sys.stdout.write(md + f"\nresults: {args.out}; {res['total_seconds']:.0f} s\n")

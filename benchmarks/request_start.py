"""What vLLM itself takes to start a request whose prompt KV is already in its cache.

After the hand-off, a decode engine starts a request whose prompt KV was pushed: it computes one
position and samples. The nearest thing a plain vLLM does is a prefix-cache hit: the same prompt a
second time, of which only the last token is computed. This measures, on one plain instance with
prefix caching (pinned to one core, as P/D's decode engine is), per prompt length:

* the full prompt's TTFT (a fresh prompt) and the decode step after it (tokens 2..4);
* the same prompt again: its TTFT (only the last position computed) and the gap to its second token.

Each prompt has ``length + 1`` tokens: vLLM caches whole blocks and always computes at least the
last token, so a hit covers the largest multiple of the block size below the prompt's length; with
``length`` a multiple of the block size (128 tokens on CPU by default) it covers ``length`` tokens
and exactly one position is computed, as on P/D's decode engine.

Compare the hit's TTFT with P/D's "D release -> first token" and the hand-off paths' gap before
their second token (`make bench`): what is left of those once vLLM's own cost of starting a cached
request is taken out is ours. Usage: ``python -m benchmarks.request_start [--core 1] [--prompt-lens
1024,3072] [--requests 20]``; prints one line per length and writes JSON (default
bench-results/request_start.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving_proxies import Client
from kvpush.services.common.vllm_server import VllmServer
from scripts.cluster.vllm import omp_bind

ROOT = Path(__file__).resolve().parents[1]


def _ms(values: list[float], q: float = 50) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1e3


async def measure(
    url: str, lengths: list[int], requests: int, vocab: int, seed: int, clock: Callable[[], float] = time.monotonic
) -> list[dict[str, Any]]:
    """Per length: ``requests`` fresh prompts, each sent twice (``clock``: the client's clock)."""
    client = Client(120)
    rng = np.random.default_rng(seed)
    out = []
    try:
        for _ in range(3):  # warm-up
            prompt = [int(t) for t in rng.integers(10, vocab - 10, size=min(lengths) + 1)]
            await client.token_times(url, prompt, 4, None, uuid.uuid4().hex, clock)
        for length in lengths:
            full, step, hit, hit_gap = [], [], [], []
            for _ in range(requests):
                prompt = [int(t) for t in rng.integers(10, vocab - 10, size=length + 1)]
                t0 = clock()
                times = await client.token_times(url, prompt, 4, None, uuid.uuid4().hex, clock)
                full.append(times[0] - t0)
                step.append((times[-1] - times[1]) / (len(times) - 2))
                t0 = clock()
                times = await client.token_times(url, prompt, 4, None, uuid.uuid4().hex, clock)
                hit.append(times[0] - t0)
                hit_gap.append(times[1] - times[0])
            row = {
                "prompt_len": length,  # cached by the hit; the prompt has one token more
                "requests": requests,
                "full_ttft_p50_ms": _ms(full),
                "decode_step_p50_ms": _ms(step),
                "hit_ttft_p25_ms": _ms(hit, 25),
                "hit_ttft_p50_ms": _ms(hit),
                "hit_ttft_p75_ms": _ms(hit, 75),
                "hit_second_token_gap_p50_ms": _ms(hit_gap),
                "loadavg_1m": os.getloadavg()[0],
            }
            out.append(row)
            sys.stdout.write(
                f"L={length}: full prompt TTFT p50 {row['full_ttft_p50_ms']:.1f} ms, decode step "
                f"{row['decode_step_p50_ms']:.2f} ms; prefix hit (last position only) TTFT p50 "
                f"{row['hit_ttft_p50_ms']:.2f} ms (p25 {row['hit_ttft_p25_ms']:.2f}, p75 {row['hit_ttft_p75_ms']:.2f}), "
                f"its second token {row['hit_second_token_gap_p50_ms']:.2f} ms later\n"
            )
            sys.stdout.flush()
    finally:
        await client.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument("--core", type=int, default=1, help="the core the instance is pinned to (P/D's decode core)")
    ap.add_argument("--prompt-lens", default="1024,3072")
    ap.add_argument("--requests", type=int, default=20, help="prompts per length (each sent twice)")
    ap.add_argument("--executor", choices=("uni", "mp"), default="uni")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "request_start.json")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.prompt_lens.split(",") if x]
    vocab = int(json.loads((args.model_dir / "config.json").read_text())["vocab_size"])
    server = VllmServer(
        args.model_dir,
        max_model_len=max(lengths) + 128,
        kv_cache_memory_bytes=64 << 20,
        env={"PYTHONPATH": str(ROOT), **omp_bind(args.core)},
        extra_args=["--enable-prefix-caching"],
        log_path=args.out.with_suffix(".log"),
        executor=args.executor,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with server:
        server.wait_ready(400)
        server.pin_to_cpu(args.core)
        load_before = os.getloadavg()[0]
        rows = asyncio.run(measure(server.base_url, lengths, args.requests, vocab, args.seed))
    report = {"executor": args.executor, "core": args.core, "loadavg_1m_before": load_before, "results": rows}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    sys.stdout.write(f"median over {args.requests} prompts per length; JSON: {args.out}\n")


if __name__ == "__main__":
    main()

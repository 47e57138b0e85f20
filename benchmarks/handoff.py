"""Light-load TTFT/TPOT of the 1P1D push path against one plain instance, side by side.

Sequential requests (one at a time), fresh prompts, prefix caching on both (prompts never repeat).
For each prompt: the single instance streams it; then the same prompt goes through kvpush, the
client calling the scheduler's ``Assign`` and sending both legs at once (what a frontend does),
and once more through the scheduler's ``Generate``. Reports medians and the differences.

Run: ``python -m benchmarks.handoff [--n 30 --prompt 1024]`` (``make bench-handoff``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from benchmarks.serving_model import Sample
from benchmarks.serving_proxies import Client
from kvpush.v1 import kvpush_pb2 as pb
from scripts.cluster import REPO
from scripts.cluster.pd import PDCluster, pd_cluster
from scripts.cluster.vllm import make_model


async def _single(client: Client, url: str, prompt: list[int], n: int) -> tuple[float, float]:
    s = Sample(ok=False, sent=time.monotonic())
    await client.stream(url, prompt, n, None, uuid.uuid4().hex, s)
    return s.ttft, s.tpot


async def _pd(c: PDCluster, client: Client, prompt: list[int], n: int) -> tuple[float, float]:
    """What a frontend does: Assign, then both legs at once; TTFT counts from the Assign call."""
    s = Sample(ok=False, sent=time.monotonic())
    a = c.stub.Assign(pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=n), timeout=10)
    rid = uuid.uuid4().hex
    prefill = asyncio.create_task(
        client.once(a.prefill.http_endpoint, prompt, 1, MessageToDict(a.prefill_kv_transfer_params), rid)
    )
    await client.stream(a.decode.http_endpoint, prompt, n, MessageToDict(a.decode_kv_transfer_params), rid, s)
    await prefill
    return s.ttft, s.tpot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny-llama")
    ap.add_argument("--log-dir", type=Path, default=REPO / "runs" / "handoff")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "handoff.json")
    args = ap.parse_args(argv)
    make_model(args.model_dir)

    async def run(c: PDCluster) -> dict[str, list[tuple[float, float]]]:
        assert c.baseline is not None
        res: dict[str, list[tuple[float, float]]] = {"single": [], "kvpush": [], "kvpush_generate": []}
        client = Client(request_timeout_s=120)
        try:
            for i in range(args.n + 2):
                prompt = [(7919 * i + 31 * j) % 1000 + 3 for j in range(args.prompt)]
                single = await _single(client, c.baseline.base_url, prompt, args.max_tokens)
                pd = await _pd(c, client, [t + 1 for t in prompt], args.max_tokens)
                g = await asyncio.to_thread(c.generate_timed, [t + 2 for t in prompt], args.max_tokens)
                if i >= 2:  # warm-up
                    res["single"].append(single)
                    res["kvpush"].append(pd)
                    res["kvpush_generate"].append((g.ttft_s, g.tpot_s))
        finally:
            await client.close()
        return res

    with pd_cluster(args.model_dir, args.log_dir, max_model_len=max(1024, 2 * (args.prompt + args.max_tokens))) as c:
        res = asyncio.run(run(c))
    summary = {
        k: {
            "ttft_ms_p50": statistics.median(t for t, _ in v) * 1e3,
            "tpot_ms_p50": statistics.median(p for _, p in v) * 1e3,
        }
        for k, v in res.items()
    }
    base = summary["single"]
    out = sys.stdout
    out.write(f"\n{args.n} sequential requests, {args.prompt}-token prompts, {args.max_tokens} new tokens\n\n")
    out.write("| setup | TTFT p50 ms | TTFT − single ms | TPOT p50 ms | TPOT / single |\n|---|---:|---:|---:|---:|\n")
    for k, v in summary.items():
        out.write(
            f"| {k} | {v['ttft_ms_p50']:.1f} | {v['ttft_ms_p50'] - base['ttft_ms_p50']:+.1f} | "
            f"{v['tpot_ms_p50']:.2f} | {v['tpot_ms_p50'] / base['tpot_ms_p50']:.2f} |\n"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "raw": res}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
from pathlib import Path
from typing import Any

import aiohttp
from google.protobuf.json_format import MessageToDict

from kvpush.v1 import kvpush_pb2 as pb
from scripts.pd_cluster import REPO, PDCluster, make_model, pd_cluster
from services.common.vllm_server import model_name


async def _stream(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], n: int, params: Any
) -> tuple[float, float]:
    """(ttft, tpot) of one streamed completion."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            got = len(chunk["choices"][0].get("token_ids") or [])
            if got:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += got
    return first - start, (last - first) / max(1, tokens - 1)


async def _pd(
    c: PDCluster, session: aiohttp.ClientSession, models: dict[str, str], prompt: list[int], n: int
) -> tuple[float, float]:
    start = time.perf_counter()
    a = c.stub.Assign(pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=n), timeout=10)
    p_params = MessageToDict(a.prefill_kv_transfer_params)
    d_params = MessageToDict(a.decode_kv_transfer_params)
    assign_s = time.perf_counter() - start
    prefill = asyncio.create_task(
        session.post(
            f"{a.prefill.http_endpoint}/v1/completions",
            json={
                "model": models["p"],
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": p_params,
            },
        )
    )
    ttft, tpot = await _stream(session, a.decode.http_endpoint, models["d"], prompt, n, d_params)
    (await prefill).release()
    return ttft + assign_s, tpot


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
        models = {
            "p": model_name(c.prefill.base_url),
            "d": model_name(c.decode.base_url),
            "b": model_name(c.baseline.base_url),
        }
        res: dict[str, list[tuple[float, float]]] = {"single": [], "kvpush": [], "kvpush_generate": []}
        async with aiohttp.ClientSession() as session:
            for i in range(args.n + 2):
                prompt = [(7919 * i + 31 * j) % 1000 + 3 for j in range(args.prompt)]
                single = await _stream(session, c.baseline.base_url, models["b"], prompt, args.max_tokens, None)
                pd = await _pd(c, session, models, [t + 1 for t in prompt], args.max_tokens)
                g = await asyncio.to_thread(c.generate_timed, [t + 2 for t in prompt], args.max_tokens)
                if i >= 2:  # warm-up
                    res["single"].append(single)
                    res["kvpush"].append(pd)
                    res["kvpush_generate"].append((g.ttft_s, g.tpot_s))
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

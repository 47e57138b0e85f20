"""The decode engine's own speed, against vLLM with and without a KV connector (``make
bench-decode-speed``).

The kvpush pair as ``make bench-phases`` starts it (P on the first core, D on the last), then on
D's core a plain vLLM (no connector) and a reference vLLM holding a KV connector that does nothing
(benchmarks/null_connector.py: vLLM's connector plumbing without ours). Each round first sends
``--pd`` P/D requests through the pair (``Assign``, both legs, ``Release``), ``--generate``
``Generate`` calls, ``--pd-handoff`` P/D requests with the first-token hand-off (``Generate``'s
legs, its first token the prefill leg's answer, decode's tokens read straight from decode: without
``Generate``'s relay), ``--pd-waiting`` P/D requests with a plain request decoding while each waits
for its prefill leg and ``--pd-busy`` whose KV lands while one decodes (``--pd 1 --generate 1
--pd-waiting 1 --pd-busy 1`` is ``make bench-phases``' P/D traffic per prompt),
then the round's prompt as a plain streamed request to each of the three
engines, in rotating order, each after ``--quiet-s`` of nothing (vLLM's CPU worker busy-waits for a
while after each step, which would slow whichever engine runs next on the shared core). Per plain
request: its TPOT, and each engine thread's CPU and wake-ups (voluntary context switches, by
thread name: the connector names its own threads, services/common/thread_names.py).

Every P/D request and ``Generate`` call comes after the same pause, and the round's first of each
is measured too: the P/D request's decode leg (its first token is decode's own) and the
``Generate`` call's tokens as its caller reads them (its first token is prefill's, so "from the
second token" leaves the hand-off's gap out), each against the round's plain requests for the
same prompt: on the plain vLLM and the do-nothing connector (``both``) and on the decode engine.

Ratios are per prompt (the same prompt on each engine, seconds apart), their median per launch;
``python -m benchmarks.launches`` pools several launches' medians.
Two launches of one engine differ by more than most of what this measures (docs/bench_phases.md),
so compare settings over several launches, alternating. Without the connector's step trace
(``trace_steps``): its per-step line was what cost the traced decode engine 7-11 %.

Writes JSON (default bench-results/decode_speed.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import paired, serving, serving_proxies
from benchmarks.process_cpu import tree_cpu_by_thread_s, tree_wakes_by_thread

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("plain", "null", "decode")  # a plain vLLM, the do-nothing connector, kvpush's decode engine
NULL_KV = {
    "kv_connector": "NullConnector",
    "kv_connector_module_path": "benchmarks.null_connector",
    "kv_role": "kv_consumer",
}
ITL_METRIC = "vllm:inter_token_latency_seconds"
# The measured P/D traffic: Assign path, Assign path with the first-token hand-off, Generate.
MEASURED_PD = ("pd", "pd_handoff", "generate")
_ENGINE_THREAD = "VLLM::EngineCor/main"  # the engine core process's own thread: the engine loop


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=20, help="rounds measured (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=16, help="tokens of each plain streamed request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pd", type=int, default=0, help="P/D requests (Assign path) through the pair per round")
    ap.add_argument("--generate", type=int, default=0, help="Generate calls (first-token hand-off) per round")
    ap.add_argument(
        "--pd-handoff",
        type=int,
        default=0,
        help="P/D requests (Assign path) per round with the first-token hand-off: Generate without its relay",
    )
    ap.add_argument(
        "--pd-waiting",
        type=int,
        default=0,
        help="P/D requests per round with a plain request decoding while each waits",
    )
    ap.add_argument(
        "--pd-busy", type=int, default=0, help="P/D requests per round whose KV lands while a plain request decodes"
    )
    ap.add_argument("--quiet-s", type=float, default=1.2, help="pause before each plain request")
    ap.add_argument(
        "--client-core",
        type=int,
        default=None,
        help="pin this process (the client of every request) to this core once the engines are up "
        "(default: not pinned, the OS places it)",
    )
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "bench-decode-speed")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "decode_speed.json")
    ap.add_argument("--serving-arg", action="append", default=[], help="passed to the serving harness, repeatable")
    args = ap.parse_args(argv)
    if (
        min(args.pd, args.generate, args.pd_handoff, args.pd_waiting, args.pd_busy, args.warmup) < 0
        or args.requests < 1
    ):
        ap.error("--pd, --generate, --pd-handoff, --pd-waiting, --pd-busy and --warmup must be >= 0, --requests >= 1")
    return args


def _since(now: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """What each thread group added since ``before`` (groups that added nothing left out)."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0) > 0}


def _speed(times: list[float], n: int) -> dict[str, Any]:
    """One streamed request's TPOT, per request and from its second token, the gap before each token
    after the first (ms) and ``span``: its first, second and last token's ``time.monotonic()``, to
    line it up with a system trace (NaN and none when it did not bring its ``n`` tokens)."""
    if len(times) != n:
        return {"tpot": math.nan, "tpot2": math.nan, "gaps_ms": [], "span": []}
    gaps = [round((b - a) * 1e3, 4) for a, b in zip(times, times[1:], strict=False)]
    span = [times[0], times[min(1, n - 1)], times[-1]]
    return {"tpot": paired.tpot(times), "tpot2": paired.tpot(times[1:]), "gaps_ms": gaps, "span": span}


def itl_totals(metrics_text: str) -> tuple[float, float]:
    """vLLM's inter-token latency histogram (its sum in seconds, its count) from a ``/metrics``
    page: the gaps between a request's tokens as its engine core stamped them, before its API
    server and whatever relays them."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != ITL_METRIC:
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


def engine_itl(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The mean inter-token latency (s) of what an engine decoded between two ``itl_totals``."""
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count > 0 else math.nan


def gap_profile(rows: list[dict[str, Any]], what: str) -> list[float]:
    """The median gap (ms) before each token of ``what``'s requests over ``rows``: where in a
    request a difference in TPOT sits (one slow gap, or every gap a little)."""
    gaps = [r[what]["gaps_ms"] for r in rows if what in r and r[what].get("gaps_ms")]
    if not gaps:
        return []
    width = min(len(g) for g in gaps)
    return [float(np.median([g[i] for g in gaps])) for i in range(width)]


async def measure(
    pair: Any, engines: dict[str, Any], args: argparse.Namespace, prompts: list[list[int]]
) -> list[dict[str, Any]]:
    from google.protobuf.json_format import MessageToDict

    from kvpush.v1 import kvpush_pb2 as pb
    from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

    c = serving_proxies.Client(120)
    n = args.output_len
    rows: list[dict[str, Any]] = []

    async def itl_now(url: str) -> tuple[float, float]:
        async with c.session.get(f"{url}/metrics") as resp:
            resp.raise_for_status()
            return itl_totals(await resp.text())

    try:
        async with pair.scheduler.security().aio_channel(pair.scheduler.address) as ch:
            stub = pb_grpc.SchedulerStub(ch)

            def plain_decode(prompt: list[int]) -> asyncio.Task[list[float]]:
                return asyncio.create_task(c.token_times(pair.decode.base_url, prompt, n, None, uuid.uuid4().hex))

            async def pd_request(prompt: list[int], kind: str = "") -> list[float]:
                """``Assign`` and both legs; the decode leg's token times. ``waiting``: a plain
                request decodes on the decode engine while the transfer waits for its prefill leg;
                ``busy``: one runs while the KV lands (the two bench-phases sends besides the plain
                P/D request); ``handoff``: with the first-token hand-off, the first token being the
                prefill leg's answer (what ``Generate`` does, without relaying decode's tokens)."""
                plain = plain_decode(prompt) if kind == "busy" else None
                handoff = kind == "handoff"
                ask = pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=n, first_token_from_prefill=handoff)
                a = await stub.Assign(ask, timeout=30)
                if handoff and not a.first_token_from_prefill:
                    raise RuntimeError("the first-token hand-off was not granted")
                params = MessageToDict(a.decode_kv_transfer_params)
                d_n = n - 1 if handoff else n
                d_leg = asyncio.create_task(c.token_times(pair.decode.base_url, prompt, d_n, params, uuid.uuid4().hex))
                if kind == "waiting":
                    await plain_decode(prompt)
                await c.once(
                    pair.prefill.base_url, prompt, 1, MessageToDict(a.prefill_kv_transfer_params), uuid.uuid4().hex
                )
                answered = time.monotonic()
                times = await d_leg
                if handoff:
                    times = sorted([answered, *times])
                if plain is not None:
                    await plain
                await serving_proxies.release_assignment(stub, a, pb.OUTCOME_OK)
                return times

            async def generate(prompt: list[int]) -> list[float]:
                """The time each token reached this caller (a message's tokens share its time)."""
                req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
                times: list[float] = []
                async for msg in stub.Generate(req, timeout=120):
                    times.extend([time.monotonic()] * len(msg.token_ids))
                return times

            for i, prompt in enumerate(prompts):
                row: dict[str, Any] = {"warmup": i < args.warmup}
                traffic = [("pd", "")] * args.pd + [("generate", "")] * args.generate
                traffic += [("pd", "handoff")] * args.pd_handoff
                traffic += [("pd", "waiting")] * args.pd_waiting + [("pd", "busy")] * args.pd_busy
                for what, kind in traffic:
                    await asyncio.sleep(args.quiet_s)
                    measured = "pd_handoff" if kind == "handoff" else what if not kind else ""
                    if measured in row:
                        measured = ""  # the round's first of each is measured
                    itl0 = await itl_now(pair.decode.base_url) if measured else (0.0, 0.0)
                    ts = await (generate(prompt) if what == "generate" else pd_request(prompt, kind))
                    if measured:
                        itl = engine_itl(itl0, await itl_now(pair.decode.base_url))
                        row[measured] = {**_speed(ts, n), "itl": itl}
                k = i % len(ENGINES)
                for name in ENGINES[k:] + ENGINES[:k]:  # none always first after the pause
                    await asyncio.sleep(args.quiet_s)
                    pid, url = engines[name].pid, engines[name].base_url
                    itl0 = await itl_now(url)
                    cpu0, wakes0 = tree_cpu_by_thread_s(pid), tree_wakes_by_thread(pid)
                    ts = await c.token_times(url, prompt, n, None, uuid.uuid4().hex)
                    row[name] = {
                        **_speed(ts, n),
                        "cpu_by_thread": _since(tree_cpu_by_thread_s(pid), cpu0),
                        "wakes_by_thread": _since(tree_wakes_by_thread(pid), wakes0),
                    }
                    row[name]["itl"] = engine_itl(itl0, await itl_now(url))
                rows.append(row)
    finally:
        await c.close()
    return rows


def analyse(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-prompt ratios and their medians; each engine's TPOT, engine-thread CPU and per-thread
    CPU (ms) and wake-ups, p50 over the measured rounds (a thread absent from a round: 0 there)."""
    rows = [r for r in rows if not r["warmup"]]
    if not rows:
        raise ValueError("no measured rounds")

    def per_prompt(num: str, den: tuple[str, ...], key: str) -> list[float]:
        def value(r: dict[str, Any], e: str) -> float:
            if key == "engine_cpu":
                return float(r[e]["cpu_by_thread"].get(_ENGINE_THREAD, math.nan))
            return float(r[e].get(key, math.nan))  # "itl": none in results from before it

        return [
            value(r, num) / paired.geomean([value(r, d) for d in den])
            for r in rows
            if num in r and all(d in r for d in den)
        ]

    ratios: dict[str, float] = {}
    for key in ("tpot", "engine_cpu", "itl"):
        for label, num, den in (
            ("decode/plain", "decode", ("plain",)),
            ("null/plain", "null", ("plain",)),
            ("decode/null", "decode", ("null",)),
            ("decode/both", "decode", ("plain", "null")),
        ):
            x = per_prompt(num, den, key)
            if key != "itl" or not np.all(np.isnan(x)):  # "itl": none in results from before it
                ratios[f"{key} {label}"] = float(np.nanmedian(x))
    # The measured P/D requests and Generate call of each round, against its plain requests, and
    # against each other (all P/D on the decode engine): Generate / pd is the relay and the
    # hand-off, pd_handoff / pd the hand-off alone, Generate / pd_handoff the relay alone.
    plain_dens = (("both", ("plain", "null")), ("decode", ("decode",)))
    for what, dens in (
        ("pd", plain_dens),
        ("pd_handoff", (*plain_dens, ("pd", ("pd",)))),
        ("generate", (*plain_dens, ("pd", ("pd",)), ("pd_handoff", ("pd_handoff",)))),
    ):
        for key in ("tpot", "tpot2", "itl"):
            for label, den in dens:
                x = per_prompt(what, den, key)
                if x and not np.all(np.isnan(x)):
                    ratios[f"{key} {what}/{label}"] = float(np.nanmedian(x))
    engines: dict[str, dict[str, Any]] = {}
    for e in ENGINES:
        threads = sorted(
            {t for r in rows for t in r[e]["cpu_by_thread"]} | {t for r in rows for t in r[e]["wakes_by_thread"]}
        )
        engines[e] = {
            "tpot_ms": _p50_ms(rows, e, "tpot"),
            "itl_ms": _p50_ms(rows, e, "itl"),
            "cpu_ms_by_thread": {
                t: float(np.median([r[e]["cpu_by_thread"].get(t, 0.0) for r in rows])) * 1e3 for t in threads
            },
            "wakes_by_thread": {
                t: float(np.median([r[e]["wakes_by_thread"].get(t, 0) for r in rows])) for t in threads
            },
        }
    for what in MEASURED_PD:
        if any(what in r for r in rows):
            engines[what] = {f"{key}_ms": _p50_ms(rows, what, key) for key in ("tpot", "tpot2", "itl")}
    gaps = {what: gap_profile(rows, what) for what in (*ENGINES, *MEASURED_PD)}
    return {"n": len(rows), "ratios": ratios, "engines": engines, "gaps_ms": {k: v for k, v in gaps.items() if v}}


def _p50_ms(rows: list[dict[str, Any]], what: str, key: str) -> float:
    """The median of ``what``'s ``key`` over the rounds that have it, in ms (NaN: none has it)."""
    x = [float(r[what].get(key, math.nan)) for r in rows if what in r]
    x = [v for v in x if not math.isnan(v)]
    return float(np.median(x)) * 1e3 if x else math.nan


def markdown(res: dict[str, Any], floor_ms: float = 0.05) -> str:
    cfg, r, e = res["config"], res["ratios"], res["engines"]
    lines = [
        f"Prompt {cfg['prompt_len']} tokens, {res['n']} rounds, {cfg['output_len']} output tokens, per round "
        f"{cfg['pd']} P/D (`Assign`), {cfg['generate']} `Generate`, {cfg.get('pd_waiting', 0)} waiting and "
        f"{cfg.get('pd_busy', 0)} busy P/D requests; load average "
        f"{res['load_before']:.2f} before, {res['load_after']:.2f} after; {res['host']}.",
        "",
        "| plain requests, median of per-prompt ratios | TPOT | engine thread CPU |",
        "|---|---:|---:|",
        *[
            f"| {label} | {r[f'tpot {label}']:.3f} | {r[f'engine_cpu {label}']:.3f} |"
            for label in ("decode/plain", "null/plain", "decode/null", "decode/both")
        ],
        "",
        "(plain: a plain vLLM; null: a vLLM with a do-nothing KV connector; decode: kvpush's decode "
        "engine; both: the geometric mean of plain and null.) TPOT p50 ms: "
        + ", ".join(f"{x} {e[x]['tpot_ms']:.2f}" for x in ENGINES)
        + "; vLLM's inter-token latency p50 ms: "
        + ", ".join(f"{x} {e[x].get('itl_ms', math.nan):.2f}" for x in ENGINES)
        + ".",
        "",
        *_pd_lines(r, e),
        "| per plain request by thread, p50 | " + " | ".join(f"{x} CPU ms | {x} wakes" for x in ENGINES) + " |",
        "|---|" + "---:|" * (2 * len(ENGINES)),
    ]
    threads = sorted({t for x in ENGINES for t in e[x]["cpu_ms_by_thread"]})
    table = []
    for t in threads:
        cpu = [e[x]["cpu_ms_by_thread"].get(t, 0.0) for x in ENGINES]
        if max(cpu) < floor_ms:
            continue
        cells = " | ".join(
            f"{c:.2f} | {e[x]['wakes_by_thread'].get(t, 0.0):.0f}" for c, x in zip(cpu, ENGINES, strict=True)
        )
        table.append((max(cpu), f"| {t} | {cells} |"))
    lines += [row for _, row in sorted(table, key=lambda x: -x[0])]
    return "\n".join(lines + _gap_lines(res.get("gaps_ms", {}))) + "\n"


def _gap_lines(gaps: dict[str, list[float]]) -> list[str]:
    """The median gap before each token, per kind of request (none for results without gaps)."""
    if not gaps:
        return []
    width = max(len(g) for g in gaps.values())
    return [
        "",
        "| median gap (ms) before token | " + " | ".join(str(i + 2) for i in range(width)) + " |",
        "|---|" + "---:|" * width,
        *[f"| {what} | " + " | ".join(f"{x:.2f}" for x in g) + " |" for what, g in gaps.items()],
    ]


# Each measured P/D request's speeds: at its caller per request and from its 2nd token, and at the
# engine (vLLM's inter-token latency, decode's own steps without the relay).
_PD_KEYS = (("tpot", "per request"), ("tpot2", "from the 2nd token"), ("itl", "engine's inter-token latency"))


def _pd_lines(r: dict[str, float], e: dict[str, Any]) -> list[str]:
    """The measured P/D request's and ``Generate`` call's rows (none when the rounds had neither)."""
    rows = []
    for what, label in (
        ("pd", "P/D request (`Assign` path), decode leg"),
        ("pd_handoff", "P/D request (`Assign` path) with the hand-off, prefill's token then decode's"),
        ("generate", "`Generate`, at its caller"),
    ):
        if what not in e:
            continue
        for key, which in _PD_KEYS:
            if math.isnan(e[what].get(f"{key}_ms", math.nan)):
                continue
            rows.append(
                f"| {label}, {which} | {e[what][f'{key}_ms']:.2f} | {r.get(f'{key} {what}/both', math.nan):.3f} |"
                f" {r.get(f'{key} {what}/decode', math.nan):.3f} |"
            )
    if not rows:
        return []
    head = [
        "| measured P/D traffic, median of per-prompt ratios | TPOT p50 ms | / both | / decode engine's plain |",
        "|---|---:|---:|---:|",
    ]
    tail = [
        f"{a} against the round's {b}, same prompt and engine: {r[f'{key} {ratio}']:.3f} {which}."
        for ratio, a, b in (
            ("generate/pd", "`Generate`", "P/D request (`Assign` path)"),
            ("pd_handoff/pd", "The hand-off P/D request", "P/D request (`Assign` path)"),
            ("generate/pd_handoff", "`Generate`", "hand-off P/D request (its relay alone)"),
        )
        for key, which in _PD_KEYS
        if f"{key} {ratio}" in r
    ]
    return [*head, *rows, "", *tail, *([""] if tail else [])]


@contextlib.contextmanager
def _engines(h: serving.Harness) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The kvpush pair, then the plain vLLM and the do-nothing connector on D's core."""
    with h.pair("ours") as pair:
        refs = [h.server("plain-instance", h.d_core, None, {}), h.server("null-connector", h.d_core, NULL_KV, {})]
        try:
            h.start([(srv, h.d_core) for srv in refs])
            yield pair, {"plain": refs[0], "null": refs[1], "decode": pair.decode}
        finally:
            for srv in refs:
                srv.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    h, prompts = paired.setup(args, list(args.serving_arg), args.warmup + args.requests)
    load_before = os.getloadavg()[0]
    t_start = time.monotonic()
    with _engines(h) as (pair, engines):
        if args.client_core is not None:
            os.sched_setaffinity(0, {args.client_core})
        rows = asyncio.run(measure(pair, engines, args, prompts))
    res = analyse(rows)
    res["rows"] = rows  # per prompt, for pooling or a closer look later
    paired.write_report(args, res, markdown, load_before, t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

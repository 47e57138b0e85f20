"""Per-phase accounting of a P/D request, paired with plain requests on the same engines.

``make bench-phases``. One kvpush 1P1D pair (P on core 0, D on core 1, as ``make bench``) with the
connector's step trace on (``trace_steps``). For each prompt, one after another (light load):

1. a plain request (no kvpush params) to the prefill engine, ``max_tokens=1``: the baseline;
2. ``Assign``, then both legs at once (prefill ``max_tokens=1``, decode streamed);
3. ``Generate`` (the first-token hand-off): its first token is the TTFT a client sees;
4. a plain streamed request to the decode engine: the TPOT baseline;
5. the same while a P/D transfer waits on the decode engine (``Assign``, the decode leg, the plain
   request, then the prefill leg): what a waiting transfer costs the requests decoding next to it;
   then a P/D request (``Assign`` path) sent just after a plain request to the decode engine, so its
   KV lands while decode runs that request's steps: its push phases with decode busy;
6. the plain prefill request again (the baseline is the mean of 1 and 6);
7. with ``--plain-instance-core C``: the same plain streamed request on a plain vLLM (no connector)
   pinned to core C and on the decode engine, in alternating order, each after ``--quiet-s`` of
   nothing (vLLM's CPU worker busy-waits for a second after each step, which would slow whichever
   engine runs next on a shared core): the decode engine against one plain instance, in one run.
   ``Generate`` joins that rotation, so its TTFT and TPOT (per request, the hand-off gap included)
   are paired with one plain vLLM's on the same prompt, seconds apart: issue #10's light-load
   ratios free of launch-to-launch variance. Use D's core (1) to compare engines on the same core
   (the P/D TPOT is decoded there too); the pause also follows this step. With ``--plain-twin`` a
   second plain vLLM, identical and started beside the first, joins the rotation: how far apart
   two launches of the very same engine are in this run, the yardstick for every ratio above
   (0.81-1.27x between two plain vLLMs on one core of the 2-core VM, measured: docs/bench_phases.md).

The same prompt on the same engine, minutes apart at most: the differences are what the P/D path
adds, free of the launch-to-launch variance that separates two launches of one plain instance
(10-15 % of TPOT on a 2-core VM, measured). The prefill leg is split with the engine's own log
lines (``request_scheduled``, ``forward_done``, ``request_finished``), the writer's
``write_finished`` and decode's ``transfer_released``; all processes share one clock.

Writes JSON (default bench-results/phases.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import paired, serving, serving_proxies
from benchmarks.paired import tpot
from benchmarks.process_cpu import tree_cpu_by_thread_s
from benchmarks.process_cpu import tree_cpu_s as _tree_cpu_s

ROOT = Path(__file__).resolve().parent.parent
_RID = re.compile(r"[0-9a-f]{32}")
_PHASES = ("sent_to_scheduled", "forward", "forward_to_finished", "finished_to_answer", "answer")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=30, help="prompts measured (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=32, help="decode tokens of the streamed requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "bench-phases")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "phases.json")
    ap.add_argument("--serving-arg", action="append", default=[], help="passed to the serving harness, repeatable")
    ap.add_argument(
        "--plain-instance-core", type=int, default=None, help="also compare with a plain vLLM pinned to this core"
    )
    ap.add_argument(
        "--plain-twin",
        action="store_true",
        help="with --plain-instance-core: a second, identical plain vLLM on that core joins the rotation",
    )
    ap.add_argument(
        "--plain-first",
        action="store_true",
        help="with --plain-instance-core: start the plain vLLM(s) before the pair instead of after it",
    )
    ap.add_argument("--quiet-s", type=float, default=1.2, help="pause before each plain-instance comparison request")
    args = ap.parse_args(argv)
    if (args.plain_twin or args.plain_first) and args.plain_instance_core is None:
        ap.error("--plain-twin and --plain-first need --plain-instance-core")
    return args


class Trace:
    """Timestamps from the engines' logs, keyed by the 32-hex request id the client chose."""

    def __init__(self, p_log: Path, d_log: Path) -> None:
        def by_rid(path: Path, event: str) -> dict[str, float]:
            out: dict[str, float] = {}
            for row in serving.parse_events(path, 0, event):
                m = _RID.search(row.get("request_id", ""))
                if m:
                    out.setdefault(m.group(0), serving._ts(row))
            return out

        def by_tid(path: Path, event: str) -> dict[str, dict[str, str]]:
            return {row["transfer_id"]: row for row in serving.parse_events(path, 0, event) if "transfer_id" in row}

        self.scheduled = by_rid(p_log, "request_scheduled")
        self.scheduled_at = sorted(serving._ts(r) for r in serving.parse_events(p_log, 0, "request_scheduled"))
        self.finished_at = sorted(serving._ts(r) for r in serving.parse_events(p_log, 0, "request_finished"))
        self.finished = by_rid(p_log, "request_finished")
        self.forwards = sorted(serving._ts(r) for r in serving.parse_events(p_log, 0, "forward_done"))
        self.writes = by_tid(p_log, "write_finished")
        self.released = {tid: serving._ts(r) for tid, r in by_tid(d_log, "transfer_released").items()}
        self.d_scheduled = by_rid(d_log, "request_scheduled")
        self.d_forwards = sorted(serving._ts(r) for r in serving.parse_events(d_log, 0, "forward_done"))
        self.d_scheduled_at = sorted(serving._ts(r) for r in serving.parse_events(d_log, 0, "request_scheduled"))
        self.appended_at = sorted(serving._ts(r) for r in serving.parse_events(d_log, 0, "first_token_appended"))
        # (WRITE start, transfer id) of every push, for the ``Generate`` transfers whose ids the
        # scheduler chose: requests run one at a time, so the first push started after a request
        # was scheduled is its own (with ``push_after_output=false`` it starts before the request
        # finished).
        self.write_starts = sorted(
            (serving._ts(row) - float(row.get("write_ms", "nan")) / 1e3, tid) for tid, row in self.writes.items()
        )

    def forward_end(self, scheduled: float, forwards: list[float] | None = None) -> float:
        """The first forward (prefill's, or of ``forwards``) that ended after ``scheduled``
        (requests run one at a time here)."""
        forwards = self.forwards if forwards is None else forwards
        i = bisect.bisect_right(forwards, scheduled)
        return forwards[i] if i < len(forwards) else float("nan")

    def handoff_gap(self, sent: float, second_token: float) -> dict[str, float]:
        """A ``Generate`` request's path from prefill's end to its second token at the client."""
        nan = float("nan")
        s = self.first_after(self.scheduled_at, sent)
        f = self.first_after(self.finished_at, s)
        i = bisect.bisect_left(self.write_starts, (s, ""))
        if i == len(self.write_starts):
            return {}
        w_start, tid = self.write_starts[i]
        w_end = serving._ts(self.writes[tid])
        released = self.released.get(tid, nan)
        d_sched = self.first_after(self.d_scheduled_at, released)
        d_fwd = self.forward_end(d_sched, self.d_forwards)
        return {
            "finished_to_token_appended": self.first_after(self.appended_at, s) - f,
            "finished_to_write": w_start - f,
            "write": w_end - w_start,
            "write_to_release": released - w_end,
            "release_to_scheduled": d_sched - released,
            "decode_forward": d_fwd - d_sched,
            "forward_to_second_token": second_token - d_fwd,
        }

    def first_after(self, times: list[float], t: float) -> float:
        i = bisect.bisect_right(times, t)
        return times[i] if i < len(times) else float("nan")

    def prefill_split(self, rid: str | None, sent: float, answered: float) -> dict[str, float]:
        """The prefill request ``rid``'s phases; None: the first request scheduled after ``sent``
        (a ``Generate`` leg, whose id the scheduler chose; requests run one at a time here)."""
        if rid is None:
            s = self.first_after(self.scheduled_at, sent)
            f = self.first_after(self.finished_at, s)
        else:
            s, f = self.scheduled.get(rid, float("nan")), self.finished.get(rid, float("nan"))
        fwd = self.forward_end(s)
        return {
            "sent_to_scheduled": s - sent,
            "forward": fwd - s,
            "forward_to_finished": f - fwd,
            "finished_to_answer": answered - f,
            "answer": answered - sent,
        }


async def _stream(c: serving_proxies.Client, url: str, prompt: list[int], n: int, params: Any, rid: str) -> list[float]:
    """Arrival times (time.time: comparable with the engines' log timestamps) of each streamed token."""
    out = await c.token_times(url, prompt, n, params, rid, clock=time.time)
    if len(out) != n:
        raise RuntimeError(f"{url}: {len(out)} tokens, expected {n}")
    return out


async def measure(
    pair: Any, args: argparse.Namespace, prompts: list[list[int]], plain: Any = None, twin: Any = None
) -> list[dict[str, Any]]:
    from google.protobuf.json_format import MessageToDict

    from kvpush.v1 import kvpush_pb2 as pb
    from kvpush.v1 import kvpush_pb2_grpc as pb_grpc

    c = serving_proxies.Client(120)
    rows: list[dict[str, Any]] = []
    n = args.output_len
    p_url, d_url = pair.prefill.base_url, pair.decode.base_url
    try:
        async with pair.scheduler.security().aio_channel(pair.scheduler.address) as ch:
            stub = pb_grpc.SchedulerStub(ch)

            async def plain_prefill(prompt: list[int]) -> tuple[str, float, float]:
                rid = uuid.uuid4().hex
                t0 = time.time()
                await c.once(p_url, prompt, 1, None, rid)
                return rid, t0, time.time()

            async def assign(prompt: list[int]) -> Any:
                return await stub.Assign(pb.AssignRequest(prompt_tokens=len(prompt), max_tokens=n), timeout=30)

            def decode_leg(prompt: list[int], a: Any, rid: str | None = None) -> asyncio.Task[list[float]]:
                params = MessageToDict(a.decode_kv_transfer_params)
                return asyncio.create_task(_stream(c, d_url, prompt, n, params, rid or uuid.uuid4().hex))

            async def prefill_leg(prompt: list[int], a: Any, rid: str) -> None:
                await c.once(p_url, prompt, 1, MessageToDict(a.prefill_kv_transfer_params), rid)

            async def plain_decode_next_to_a_waiting_transfer(prompt: list[int]) -> list[float]:
                a = await assign(prompt)
                waiting = decode_leg(prompt, a)
                plain = await _stream(c, d_url, prompt, n, None, uuid.uuid4().hex)
                await prefill_leg(prompt, a, uuid.uuid4().hex)
                await waiting
                await serving_proxies.release_assignment(stub, a, pb.OUTCOME_OK)
                return plain

            async def handoff_into_a_running_decode(prompt: list[int]) -> tuple[str, list[float]]:
                """A P/D request whose KV lands while the decode engine runs a plain request's steps."""
                plain = asyncio.create_task(_stream(c, d_url, prompt, n, None, uuid.uuid4().hex))
                a = await assign(prompt)
                decode = decode_leg(prompt, a)
                await prefill_leg(prompt, a, uuid.uuid4().hex)
                d_tokens = await decode
                await plain
                await serving_proxies.release_assignment(stub, a, pb.OUTCOME_OK)
                return a.transfer_id, d_tokens

            async def generate(prompt: list[int]) -> tuple[float, list[float]]:
                """``Generate`` (the hand-off): when it was called, and each token's arrival."""
                g0 = time.time()
                g_tokens: list[float] = []
                req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
                async for msg in stub.Generate(req, timeout=120):
                    g_tokens.extend([time.time()] * len(msg.token_ids))
                return g0, g_tokens

            async def streamed(url: str, prompt: list[int]) -> tuple[float, list[float]]:
                """A plain streamed request: when it was sent, and each token's arrival."""
                t0 = time.time()
                return t0, await _stream(c, url, prompt, n, None, uuid.uuid4().hex)

            pids = {
                "prefill": pair.prefill.pid,
                "decode": pair.decode.pid,
                "scheduler": pair.scheduler.proc.pid,
                "plain": None if plain is None else plain.pid,
                **({} if twin is None else {"twin": twin.pid}),
            }

            def cpu_by_process() -> dict[str, float]:
                """CPU seconds so far of each process tree of the run, and of this client."""
                return {"client": time.process_time(), **{k: _tree_cpu_s(pid) for k, pid in pids.items()}}

            for i, prompt in enumerate(prompts):
                row: dict[str, Any] = {"warmup": i < args.warmup}
                row["plain_a"] = await plain_prefill(prompt)
                t0 = time.time()
                a = await assign(prompt)
                t1 = time.time()
                p_rid, d_rid = uuid.uuid4().hex, uuid.uuid4().hex
                decode = decode_leg(prompt, a, d_rid)
                await prefill_leg(prompt, a, p_rid)
                t2 = time.time()
                d_tokens = await decode
                await serving_proxies.release_assignment(stub, a, pb.OUTCOME_OK)
                row.update(
                    tid=a.transfer_id, sent=t0, assigned=t1, p_rid=p_rid, d_rid=d_rid, p_answer=t2, d_tokens=d_tokens
                )
                g0, g_tokens = await generate(prompt)
                row.update(g_sent=g0, g_tokens=g_tokens)
                row["plain_d"] = await _stream(c, d_url, prompt, n, None, uuid.uuid4().hex)
                row["plain_d_pending"] = await plain_decode_next_to_a_waiting_transfer(prompt)
                row["busy_tid"], row["busy_d_tokens"] = await handoff_into_a_running_decode(prompt)
                row["plain_b"] = await plain_prefill(prompt)
                if plain is not None:
                    # The three in a rotating order, so none is always first after the pause; each
                    # counts the CPU every process used meanwhile, the plain ones their engine's too.
                    order: list[tuple[str, Callable[[], Awaitable[tuple[float, list[float]]]], str]] = [
                        ("plain_instance", functools.partial(streamed, plain.base_url, prompt), "plain"),
                        ("plain_d_quiet", functools.partial(streamed, d_url, prompt), "decode"),
                        ("generate_quiet", functools.partial(generate, prompt), ""),
                    ]
                    if twin is not None:
                        order.insert(1, ("plain_twin", functools.partial(streamed, twin.base_url, prompt), "twin"))
                    k = i % len(order)
                    for key, call, engine in order[k:] + order[:k]:
                        await asyncio.sleep(args.quiet_s)  # let the last engine's worker stop spinning
                        threads0 = tree_cpu_by_thread_s(pids[engine]) if engine else {}
                        cpu0 = cpu_by_process()
                        row[f"{key}_sent"], row[key] = await call()
                        used = {proc: cpu_s - cpu0[proc] for proc, cpu_s in cpu_by_process().items()}
                        if engine:
                            threads1 = tree_cpu_by_thread_s(pids[engine])
                            row[f"{key}_cpu_by_thread"] = {
                                name: s - threads0.get(name, 0.0) for name, s in threads1.items()
                            }
                        row[f"{key}_cpu_by_process"] = used
                        row[f"{key}_cpu_s"] = used[engine] if engine else float("nan")
                    await asyncio.sleep(args.quiet_s)  # nor the next prompt's requests
                rows.append(row)
    finally:
        await c.close()
    return rows


def analyse(rows: list[dict[str, Any]], trace: Trace) -> dict[str, Any]:
    """Per-row values in ms, then p50 per series and p50 of the paired differences."""
    series: dict[str, list[float]] = {}

    def put(key: str, value: float) -> None:
        series.setdefault(key, []).append(value * 1e3)

    for r in rows:
        if r["warmup"]:
            continue
        plain = [trace.prefill_split(rid, t0, t1) for rid, t0, t1 in (r["plain_a"], r["plain_b"])]
        base = {k: float(np.nanmean([p[k] for p in plain])) for k in plain[0]}
        leg = trace.prefill_split(r["p_rid"], r["assigned"], r["p_answer"])
        for k in base:
            put(f"plain.{k}", base[k])
            put(f"pd.{k}", leg[k])
        put("pd.assign", r["assigned"] - r["sent"])
        put("pd.assign_and_answer", r["p_answer"] - r["sent"])
        fwd = trace.forward_end(trace.scheduled.get(r["p_rid"], float("nan")))
        w = trace.writes.get(r["tid"], {})
        w_ms = float(w.get("write_ms", "nan")) / 1e3
        w_end = serving._ts(w) if w else float("nan")
        put("pd.forward_to_write", w_end - w_ms - fwd)
        put("pd.write", w_ms)
        put("pd.write_to_release", trace.released.get(r["tid"], float("nan")) - w_end)
        released = trace.released.get(r["tid"], float("nan"))
        put("pd.release_to_first_token", r["d_tokens"][0] - released)
        d_sched = trace.d_scheduled.get(r.get("d_rid", ""), float("nan"))
        d_fwd = trace.forward_end(d_sched, trace.d_forwards)
        put("pd.release_to_scheduled", d_sched - released)
        put("pd.decode_forward", d_fwd - d_sched)
        put("pd.forward_to_first_token", r["d_tokens"][0] - d_fwd)
        put("generate.first_to_second_token", r["g_tokens"][1] - r["g_tokens"][0])
        for k, v in trace.handoff_gap(r["g_sent"], r["g_tokens"][1]).items():
            put(f"generate_gap.{k}", v)
        put("plain.first_to_second_token_decode", r["plain_d"][1] - r["plain_d"][0])
        put("pd.ttft_decode", r["d_tokens"][0] - r["sent"])
        put("generate.ttft", r["g_tokens"][0] - r["g_sent"])
        for k, v in trace.prefill_split(None, r["g_sent"], r["g_tokens"][0]).items():
            put(f"generate.{k}", v)
        put("pd.tpot", tpot(r["d_tokens"]))
        put("generate.tpot", tpot(r["g_tokens"]))
        put("plain.tpot_decode", tpot(r["plain_d"]))
        put("plain.tpot_decode_transfer_waiting", tpot(r["plain_d_pending"]))
        if "busy_tid" in r:
            bw = trace.writes.get(r["busy_tid"], {})
            b_rel = trace.released.get(r["busy_tid"], float("nan"))
            put("busy.write_to_release", b_rel - (serving._ts(bw) if bw else float("nan")))
            put("busy.release_to_first_token", r["busy_d_tokens"][0] - b_rel)
        if "plain_instance" in r:
            put("plain.tpot_decode_quiet", tpot(r["plain_d_quiet"]))
            put("plain.cpu_instance_quiet", r["plain_instance_cpu_s"])
            put("plain.cpu_decode_quiet", r["plain_d_quiet_cpu_s"])
            for proc, cpu_s in r.get("plain_d_quiet_cpu_by_process", {}).items():
                put(f"plain.cpu_decode_quiet.{proc}", cpu_s)
            runs = [("plain_instance", "plain.{}_instance_quiet"), ("generate_quiet", "generate.{}_quiet")]
            if "plain_twin" in r:
                runs.append(("plain_twin", "plain.{}_twin_quiet"))
                put("plain.cpu_twin_quiet", r["plain_twin_cpu_s"])
            for key, name in runs:
                ts = r[key]
                put(name.format("tpot"), tpot(ts))
                put(name.format("tpot2"), tpot(ts[1:]))
                put(name.format("ttft"), ts[0] - r[f"{key}_sent"])
                put(name.format("gap"), ts[1] - ts[0])
                for proc, cpu_s in r.get(f"{key}_cpu_by_process", {}).items():
                    put(f"{name.format('cpu')}.{proc}", cpu_s)
            for key, engine in _THREAD_CPU_ENGINES:
                for thread, cpu_s in r.get(f"{key}_cpu_by_thread", {}).items():
                    put(f"threads.{engine}.{thread}", cpu_s)
    # A thread group that used nothing in some request is not in that request's row: its CPU
    # there was 0, so the series are padded before their medians are taken.
    for engine in {k.split(".")[1] for k in series if k.startswith("threads.")}:
        prefix = f"threads.{engine}."
        n = max(len(v) for k, v in series.items() if k.startswith(prefix))
        for k, v in series.items():
            if k.startswith(prefix):
                v.extend([0.0] * (n - len(v)))
    p50 = {k: float(np.nanmedian(v)) for k, v in series.items()}

    def paired(a: str, b: str) -> float:
        return float(np.nanmedian(np.array(series[a]) - np.array(series[b])))

    def ratio(a: str, b: str) -> float:
        return float(np.nanmedian(np.array(series[a]) / np.array(series[b])))

    diffs = {
        "generate_ttft_minus_plain_answer": paired("generate.ttft", "plain.answer"),
        "assign_path_answer_minus_plain_answer": paired("pd.assign_and_answer", "plain.answer"),
        **{f"leg_minus_plain.{k}": paired(f"pd.{k}", f"plain.{k}") for k in _PHASES},
        **{f"generate_minus_plain.{k}": paired(f"generate.{k}", f"plain.{k}") for k in _PHASES},
        "tpot_ratio_pd_to_plain_decode": ratio("pd.tpot", "plain.tpot_decode"),
        "tpot_ratio_generate_to_plain_decode": ratio("generate.tpot", "plain.tpot_decode"),
        "tpot_ratio_transfer_waiting_to_plain_decode": ratio("plain.tpot_decode_transfer_waiting", "plain.tpot_decode"),
    }
    if "plain.tpot_instance_quiet" in series:
        diffs["tpot_ratio_decode_engine_to_plain_instance"] = ratio(
            "plain.tpot_decode_quiet", "plain.tpot_instance_quiet"
        )
        diffs["cpu_ratio_decode_engine_to_plain_instance"] = ratio("plain.cpu_decode_quiet", "plain.cpu_instance_quiet")
        diffs["tpot_ratio_generate_to_plain_instance"] = ratio("generate.tpot_quiet", "plain.tpot_instance_quiet")
        diffs["tpot2_ratio_generate_to_plain_instance"] = ratio("generate.tpot2_quiet", "plain.tpot2_instance_quiet")
        diffs["gap_generate_minus_plain_instance"] = paired("generate.gap_quiet", "plain.gap_instance_quiet")
        diffs["ttft_generate_minus_plain_instance"] = paired("generate.ttft_quiet", "plain.ttft_instance_quiet")
    if "plain.tpot_twin_quiet" in series:
        # Two launches of one plain vLLM, and each P/D ratio against both (their mean per prompt).
        for kind in ("tpot", "tpot2"):
            twin, plain = np.array(series[f"plain.{kind}_twin_quiet"]), np.array(series[f"plain.{kind}_instance_quiet"])
            both = (twin + plain) / 2
            diffs[f"{kind}_ratio_twin_to_plain_instance"] = float(np.nanmedian(twin / plain))
            diffs[f"{kind}_ratio_generate_to_plain_pair"] = float(
                np.nanmedian(np.array(series[f"generate.{kind}_quiet"]) / both)
            )
            if kind == "tpot":
                diffs["tpot_ratio_decode_engine_to_plain_pair"] = float(
                    np.nanmedian(np.array(series["plain.tpot_decode_quiet"]) / both)
                )
        diffs["cpu_ratio_twin_to_plain_instance"] = ratio("plain.cpu_twin_quiet", "plain.cpu_instance_quiet")
    return {"n": len(series.get("pd.answer", [])), "p50_ms": p50, "paired": diffs, "series_ms": series}


_GAP_PHASES = {
    "finished_to_token_appended": "of the gap: prefill's request finished → its token appended on decode",
    "finished_to_write": "of the gap: request finished → the push's WRITE starts (negative: before it)",
    "write": "of the gap: → WRITE done",
    "write_to_release": "of the gap: → decode releases",
    "release_to_scheduled": "of the gap: → decode schedules it",
    "decode_forward": "of the gap: → decode's forward done",
    "forward_to_second_token": "of the gap: → second token at the client",
}


def markdown(res: dict[str, Any]) -> str:
    p, d = res["p50_ms"], res["paired"]
    lines = [
        f"Prompt {res['config']['prompt_len']} tokens, {res['n']} prompts, {res['config']['output_len']} output "
        f"tokens; load average {res['load_before']:.2f} before, {res['load_after']:.2f} after; {res['host']}.",
        "",
        "| prefill leg phase | plain p50 ms | `Assign` leg p50 ms | paired diff | `Generate` leg p50 ms "
        "| paired diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {
        "sent_to_scheduled": "HTTP send → engine schedules it",
        "forward": "→ forward done",
        "forward_to_finished": "→ request finished (sampled, output built)",
        "finished_to_answer": "→ answer at the client (`Generate`: its first token)",
        "answer": "send → answer",
    }
    for k, label in names.items():
        lines.append(
            f"| {label} | {p[f'plain.{k}']:.1f} | {p[f'pd.{k}']:.1f} | {d[f'leg_minus_plain.{k}']:+.1f} | "
            f"{p[f'generate.{k}']:.1f} | {d[f'generate_minus_plain.{k}']:+.1f} |"
        )
    lines += [
        "",
        "`Assign` leg: without the hand-off (its push starts at the forward's end); `Generate` leg: with it "
        "(its push waits for the step's output). Sent: after `Assign` returned, or when `Generate` was called.",
    ]
    lines += [
        "",
        "| TTFT path | p50 ms | paired minus plain answer, p50 ms |",
        "|---|---:|---:|",
        f"| `Generate` (first token from prefill) | {p['generate.ttft']:.1f} | "
        f"{d['generate_ttft_minus_plain_answer']:+.1f} |",
        f"| `Assign` + prefill leg's answer (this leg without the hand-off) | {p['pd.assign_and_answer']:.1f} | "
        f"{d['assign_path_answer_minus_plain_answer']:+.1f} |",
        f"| of it, `Assign` | {p['pd.assign']:.1f} | |",
        f"| `Assign` path, decode's first token (no hand-off) | {p['pd.ttft_decode']:.1f} | |",
        "",
        "| push phase (Assign path) | p50 ms |",
        "|---|---:|",
        f"| forward done → WRITE posted | {p['pd.forward_to_write']:.2f} |",
        f"| WRITE (plan, post, complete) | {p['pd.write']:.2f} |",
        f"| WRITE done → decode releases | {p['pd.write_to_release']:.2f} |",
        f"| release → decode's first token | {p['pd.release_to_first_token']:.1f} |",
        f"| of it: release → decode schedules it | {p['pd.release_to_scheduled']:.2f} |",
        f"| of it: → decode's forward done | {p['pd.decode_forward']:.2f} |",
        f"| of it: → first token at the client | {p['pd.forward_to_first_token']:.2f} |",
        f"| `Generate`: first → second token (plain decode's: "
        f"{p['plain.first_to_second_token_decode']:.2f}) | {p['generate.first_to_second_token']:.2f} |",
        *[
            f"| `Generate`: {label} | {p.get(f'generate_gap.{k}', float('nan')):.2f} |"
            for k, label in _GAP_PHASES.items()
        ],
        f"| decode running a plain request meanwhile: WRITE done → decode releases | "
        f"{p.get('busy.write_to_release', float('nan')):.2f} |",
        f"| decode running a plain request meanwhile: release → decode's first token | "
        f"{p.get('busy.release_to_first_token', float('nan')):.1f} |",
        "",
        "| decode TPOT | p50 ms | paired ratio to plain on the same decode engine |",
        "|---|---:|---:|",
        f"| plain request on the decode engine | {p['plain.tpot_decode']:.2f} | 1 |",
        f"| P/D (`Assign` path) | {p['pd.tpot']:.2f} | {d['tpot_ratio_pd_to_plain_decode']:.3f} |",
        f"| P/D (`Generate`) | {p['generate.tpot']:.2f} | {d['tpot_ratio_generate_to_plain_decode']:.3f} |",
        f"| plain request while a P/D transfer waits on the decode engine | "
        f"{p['plain.tpot_decode_transfer_waiting']:.2f} | {d['tpot_ratio_transfer_waiting_to_plain_decode']:.3f} |",
    ]
    if "tpot_ratio_decode_engine_to_plain_instance" in d:
        lines += [
            "",
            "| decode engine against one plain vLLM (same prompts, alternating, after a quiet pause) | p50 ms |"
            " paired ratio |",
            "|---|---:|---:|",
            f"| plain vLLM (no connector), core {res['config']['plain_instance_core']} | "
            f"{p['plain.tpot_instance_quiet']:.2f} | 1 |",
            f"| the kvpush decode engine, plain request | {p['plain.tpot_decode_quiet']:.2f} | "
            f"{d['tpot_ratio_decode_engine_to_plain_instance']:.3f} |",
            f"| CPU time of the engine's processes per request (all threads): plain vLLM | "
            f"{p['plain.cpu_instance_quiet']:.1f} | 1 |",
            f"| the same, the kvpush decode engine (its agents' threads included) | "
            f"{p['plain.cpu_decode_quiet']:.1f} | {d['cpu_ratio_decode_engine_to_plain_instance']:.3f} |",
            "",
            "| `Generate` (P/D, hand-off) against the same plain vLLM, same rotation | plain vLLM p50 ms | "
            "`Generate` p50 ms | paired |",
            "|---|---:|---:|---:|",
            f"| TTFT (prefill on core {res['config']['plain_instance_core']} against P's core) | "
            f"{p['plain.ttft_instance_quiet']:.1f} | {p['generate.ttft_quiet']:.1f} | "
            f"{d['ttft_generate_minus_plain_instance']:+.1f} ms |",
            f"| TPOT per request (the hand-off gap included) | {p['plain.tpot_instance_quiet']:.2f} | "
            f"{p['generate.tpot_quiet']:.2f} | {d['tpot_ratio_generate_to_plain_instance']:.3f}× |",
            f"| TPOT from the second token | {p['plain.tpot2_instance_quiet']:.2f} | "
            f"{p['generate.tpot2_quiet']:.2f} | {d['tpot2_ratio_generate_to_plain_instance']:.3f}× |",
            f"| first → second token | {p['plain.gap_instance_quiet']:.2f} | {p['generate.gap_quiet']:.2f} | "
            f"{d['gap_generate_minus_plain_instance']:+.2f} ms |",
        ]
        if "tpot_ratio_twin_to_plain_instance" in d:
            lines += [
                "",
                "| two launches of one plain vLLM (the twin: same engine, same core, same rotation) | p50 ms |"
                " paired ratio to the first |",
                "|---|---:|---:|",
                f"| TPOT per request, the twin | {p['plain.tpot_twin_quiet']:.2f} | "
                f"{d['tpot_ratio_twin_to_plain_instance']:.3f} |",
                f"| TPOT from the second token, the twin | {p['plain.tpot2_twin_quiet']:.2f} | "
                f"{d['tpot2_ratio_twin_to_plain_instance']:.3f} |",
                f"| CPU of the twin's processes per request | {p['plain.cpu_twin_quiet']:.1f} | "
                f"{d['cpu_ratio_twin_to_plain_instance']:.3f} |",
                f"| the kvpush decode engine's plain request, against both plain vLLMs' mean | | "
                f"{d['tpot_ratio_decode_engine_to_plain_pair']:.3f} |",
                f"| `Generate` TPOT per request, against both plain vLLMs' mean | | "
                f"{d['tpot_ratio_generate_to_plain_pair']:.3f} |",
                f"| `Generate` TPOT from the second token, against both plain vLLMs' mean | | "
                f"{d['tpot2_ratio_generate_to_plain_pair']:.3f} |",
            ]
        procs = ("client", "scheduler", "prefill", "decode", "plain")
        cpu = {
            which: [p.get(f"{name}.{proc}", float("nan")) for proc in procs]
            for which, name in (
                ("plain vLLM", "plain.cpu_instance_quiet"),
                ("decode engine, plain request", "plain.cpu_decode_quiet"),
                ("`Generate`", "generate.cpu_quiet"),
            )
        }
        lines += [
            "",
            "| CPU per request, p50 ms | " + " | ".join(procs) + " |",
            "|---|" + "---:|" * len(procs),
            *[f"| {which} | " + " | ".join(f"{v:.1f}" for v in vals) + " |" for which, vals in cpu.items()],
        ]
        lines += _thread_cpu_table(p)
    return "\n".join(lines) + "\n"


# Plain requests whose engine's threads are counted one by one: (row key, engine name in series).
_THREAD_CPU_ENGINES = (("plain_instance", "plain"), ("plain_d_quiet", "decode"), ("plain_twin", "twin"))


def _thread_cpu_table(p: dict[str, float], floor_ms: float = 0.05) -> list[str]:
    """The engines' CPU per plain request by thread (process name/thread name, p50 ms): where
    the decode engine's extra CPU goes, next to the plain vLLM's (and the twin's)."""
    engines = [e for _, e in _THREAD_CPU_ENGINES if any(k.startswith(f"threads.{e}.") for k in p)]
    if not engines:
        return []
    threads = sorted({k.split(".", 2)[2] for k in p if k.startswith("threads.")})
    rows = [
        (t, [p.get(f"threads.{e}.{t}", 0.0) for e in engines])
        for t in threads
        if max(p.get(f"threads.{e}.{t}", 0.0) for e in engines) >= floor_ms
    ]
    rows.sort(key=lambda r: -max(r[1]))
    return [
        "",
        "| CPU per plain request by thread, p50 ms | " + " | ".join(engines) + " |",
        "|---|" + "---:|" * len(engines),
        *[f"| {t} | " + " | ".join(f"{v:.2f}" for v in vals) + " |" for t, vals in rows],
    ]


@contextlib.contextmanager
def _plain_instances(h: serving.Harness, core: int | None, twin: bool) -> Iterator[tuple[Any, Any]]:
    """A plain vLLM (no connector) pinned to ``core`` and with ``twin`` a second one beside it, started
    side by side; None where there is none."""
    if core is None:
        yield None, None
        return
    servers = [h.server("plain-instance", core, None, {})]
    if twin:
        servers.append(h.server("plain-twin", core, None, {}))
    try:
        h.start([(srv, core) for srv in servers])
        yield servers[0], (servers[1] if twin else None)
    finally:
        for srv in servers:
            srv.stop()


@contextlib.contextmanager
def _engines(h: serving.Harness, args: argparse.Namespace) -> Iterator[tuple[Any, Any, Any]]:
    """The kvpush pair, then the plain vLLMs; with ``--plain-first`` the other way round (start
    order is one of the things that differ between engines launched for one run)."""
    with contextlib.ExitStack() as stack:
        plains = _plain_instances(h, args.plain_instance_core, args.plain_twin)
        if args.plain_first:
            plain, twin = stack.enter_context(plains)
        pair = stack.enter_context(h.pair("ours"))
        if not args.plain_first:
            plain, twin = stack.enter_context(plains)
        yield pair, plain, twin


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    extra = ["--connector-extra", "trace_steps=true", *args.serving_arg]
    h, prompts = paired.setup(args, extra, args.warmup + args.requests)
    load_before = os.getloadavg()[0]
    t_start = time.monotonic()
    with _engines(h, args) as (pair, plain, twin):
        rows = asyncio.run(measure(pair, args, prompts, plain, twin))
        trace = Trace(pair.prefill.log_path, pair.decode.log_path)
    res = analyse(rows, trace)
    paired.write_report(args, res, markdown, load_before, t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

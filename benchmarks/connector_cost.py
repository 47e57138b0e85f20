"""What the kvpush connector costs a decode engine per step, measured inside one launch.

``make bench-connector-cost``. One kvpush 1P1D pair (P on core 0, D on core 1, as ``make bench``);
the decode engine's process loads ``benchmarks/connector_bypass.py``, which switches the
connector's per-step work off and on (its hooks, its threads) between requests. For each prompt
the modes run in a rotating order, each a plain streamed request to the decode engine after
``--quiet-s`` of nothing, so every request of one mode is paired with one of ``full`` (the
connector as shipped) on the same prompt, seconds apart, in the same process.

Why inside one launch: two launches of the very same plain vLLM decode up to 20 % apart on the
2-core VM, and the VM's own speed swings by 2x within seconds (a fixed CPU loop: p5 11.9 ms, p95
26 ms), so engines launched separately cannot resolve a few percent. A paired ratio per prompt
with a bootstrap interval over 50-100 prompts can (about +-4 % at 90 %).

Per request: TPOT from the second token (the client's clock), the engine thread's CPU, and the
CPU and voluntary wake-ups of every other thread of the engine's process (``/proc``). Writes JSON
(default bench-results/connector_cost.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import paired, serving, serving_proxies
from benchmarks.connector_bypass import MODES
from benchmarks.phases import _stream

ROOT = Path(__file__).resolve().parent.parent
PROBE_PATH = ROOT / "benchmarks" / "engine_probe"
METRICS = ("tpot2_ms", "engine_cpu_ms", "others_cpu_ms", "others_wakeups")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument("--rounds", type=int, default=60, help="prompts measured (each once per mode)")
    ap.add_argument("--warmup", type=int, default=2, help="prompts run first and not counted")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--modes", default="full,bypassed", help=f"comma-separated, first is the base; of {', '.join(MODES)}"
    )
    ap.add_argument("--quiet-s", type=float, default=0.5, help="nothing runs for this long before each request")
    ap.add_argument("--client-core", type=int, default=0, help="this process's core once the pair is up (P's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-dir", type=Path, default=ROOT / "bench-results" / "connector_cost")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "connector_cost.json")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or len(modes) < 2 or len(set(modes)) != len(modes):
        ap.error(f"--modes: two or more distinct of {', '.join(MODES)}")
    args.mode_list = modes
    return args


def thread_stats(pid: int) -> dict[int, tuple[str, int, int]]:
    """Every thread of ``pid``: (name, CPU ns, voluntary context switches)."""
    out: dict[int, tuple[str, int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            cpu_ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        vol = next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
        out[int(task.name)] = (name, cpu_ns, vol)
    return out


def request_stats(
    pid: int, before: dict[int, tuple[str, int, int]], after: dict[int, tuple[str, int, int]]
) -> dict[str, float]:
    """The engine thread's CPU, and the other threads' CPU and wake-ups, between two snapshots."""
    engine = others = wakeups = 0
    for tid, (_, cpu, vol) in after.items():
        if tid not in before:
            continue
        d_cpu, d_vol = cpu - before[tid][1], vol - before[tid][2]
        if tid == pid:
            engine += d_cpu
        else:
            others += d_cpu
            wakeups += d_vol
    return {"engine_cpu_ms": engine / 1e6, "others_cpu_ms": others / 1e6, "others_wakeups": float(wakeups)}


def analyse(rows: dict[str, list[dict[str, float]]], seed: int = 0) -> dict[str, Any]:
    """Medians per mode, and each mode paired with the first per prompt: the median and geometric
    mean of the ratios, each with a 90 % bootstrap interval."""
    modes = list(rows)
    base = modes[0]
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"base": base, "requests": len(rows[base]), "p50": {}, "paired": {}}
    for mode in modes:
        out["p50"][mode] = {k: float(np.median([r[k] for r in rows[mode]])) for k in METRICS}
    for mode in modes[1:]:
        ratios: dict[str, Any] = {}
        for k in METRICS:
            x = np.array([a[k] / b[k] for a, b in zip(rows[mode], rows[base], strict=True) if a[k] > 0 and b[k] > 0])
            if len(x) == 0:
                continue
            ratios[k] = {
                "median": float(np.median(x)),
                "median_ci90": paired.bootstrap_ci90(x, np.median, rng),
                "geomean": paired.geomean(x),
                "geomean_ci90": paired.bootstrap_ci90(x, paired.geomean, rng),
                "n": len(x),
            }
        out["paired"][mode] = ratios
    return out


def markdown(res: dict[str, Any]) -> str:
    base = res["base"]
    lines = [
        f"Decode engine, plain requests, {res['requests']} prompts per mode (load before {res['load_before']:.2f}):",
        "",
        "| mode | TPOT from the 2nd token p50 | engine thread CPU / request | other threads CPU / request |"
        " other threads' wake-ups / request |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, p in res["p50"].items():
        lines.append(
            f"| {mode} | {p['tpot2_ms']:.3f} ms | {p['engine_cpu_ms']:.1f} ms | {p['others_cpu_ms']:.2f} ms |"
            f" {p['others_wakeups']:.0f} |"
        )
    lines += ["", f"Paired per prompt against `{base}` (90 % bootstrap intervals):", ""]
    lines.append("| mode | metric | median ratio | interval | geometric mean | interval |")
    lines.append("|---|---|---:|---|---:|---|")
    for mode, by_metric in res["paired"].items():
        for k, v in by_metric.items():
            lo, hi = v["median_ci90"]
            glo, ghi = v["geomean_ci90"]
            lines.append(
                f"| {mode} | {k} | {v['median']:.3f} | {lo:.3f}–{hi:.3f} | {v['geomean']:.3f} | {glo:.3f}–{ghi:.3f} |"
            )
    return "\n".join(lines) + "\n"


def _engine_pid(server_pid: int) -> int:
    import psutil

    cores = [p.pid for p in psutil.Process(server_pid).children(recursive=True) if "EngineCor" in p.name()]
    if len(cores) != 1:
        raise RuntimeError(f"expected one engine core process under {server_pid}, found {cores}")
    return cores[0]


async def _set_mode(engine_pid: int, control: Path, mode: str, timeout_s: float = 10.0) -> None:
    ack = control / "ack"
    ack.unlink(missing_ok=True)
    (control / "mode").write_text(mode)
    os.kill(engine_pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while not ack.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the decode engine did not apply mode {mode!r} within {timeout_s:g}s (probe not loaded?)"
            )
        await asyncio.sleep(0.01)
    answer = ack.read_text()
    if answer != mode:
        raise RuntimeError(f"the decode engine's probe answered {answer!r} for mode {mode!r}")


async def measure(
    h: serving.Harness, args: argparse.Namespace, control: Path, prompts: list[list[int]]
) -> dict[str, list[dict[str, float]]]:
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in args.mode_list}
    with h.pair("ours") as pair:
        engine = _engine_pid(pair.decode.pid)
        if args.client_core is not None:
            os.sched_setaffinity(0, {args.client_core})
        client = serving_proxies.Client(120)
        try:
            for i, prompt in enumerate(prompts):
                k = i % len(args.mode_list)
                for mode in args.mode_list[k:] + args.mode_list[:k]:
                    await _set_mode(engine, control, mode)
                    await asyncio.sleep(args.quiet_s)
                    before = thread_stats(engine)
                    ts = await _stream(client, pair.decode.base_url, prompt, args.output_len, None, uuid.uuid4().hex)
                    after = thread_stats(engine)
                    if i >= args.warmup:
                        row = request_stats(engine, before, after)
                        row["tpot2_ms"] = (ts[-1] - ts[1]) / (len(ts) - 2) * 1e3
                        rows[mode].append(row)
            await _set_mode(engine, control, "full")
        finally:
            await client.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    control = args.log_dir / "probe-control"
    probe = ["--decode-env", f"KVPUSH_ENGINE_PROBE={control}", "--decode-env", f"PYTHONPATH={PROBE_PATH}"]
    h, prompts = paired.setup(args, probe, args.warmup + args.rounds)
    load_before = os.getloadavg()[0]
    t_start = time.monotonic()
    rows = asyncio.run(measure(h, args, control, prompts))
    res = analyse(rows)
    res["rows"] = rows
    paired.write_report(args, res, markdown, load_before, t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

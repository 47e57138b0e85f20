"""The serving benchmark's report: derived ratios, goals, the markdown table and the plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.serving_model import SETUPS, ModelInfo, PointResult
from benchmarks.serving_slo import SLO_ATTAINMENT

GOAL_TTFT_VS_PUSH = 0.7
GOAL_TTFT_VS_PULL = 0.4
GOAL_TPOT_VS_PUSH = 1.0
GOAL_HANDOFF_VS_NIXL = 1.2
OURS = ("ours", "ours_ft", "ours_grpc")  # our three paths, one P/D pair


def _by_point(results: dict[str, list[PointResult]]) -> dict[str, dict[tuple[int, int, float], PointResult]]:
    """Each setup's results by (prompt length, output length, rate)."""
    return {name: {(r.prompt_len, r.max_tokens, r.rate): r for r in rs} for name, rs in results.items()}


def derive(results: dict[str, list[PointResult]], raw: dict[int, dict[str, float]], model: ModelInfo) -> list[dict]:
    """Per point: hand-off overhead of each P/D setup and the ratios of ours to upstream."""
    by = _by_point(results)
    pre_by = {(r.prompt_len, r.rate): r for r in results.get("prefill_only", [])}
    rows = []
    for (length, out, rate), single in by.get("single", {}).items():
        pre = pre_by.get((length, rate))
        kv = model.kv_bytes(length)
        row: dict[str, Any] = {
            "prompt_len": length,
            "max_tokens": out,
            "rate": rate,
            "kv_bytes": kv,
            "raw_nixl_ms": raw.get(kv, {}).get("p50_ms", math.nan),
            "prefill_only_ttft_p50_ms": pre.ttft_p50_ms if pre else math.nan,
            "single_tpot_p50_ms": single.tpot_p50_ms,
        }
        for name in ("pull", "push", *OURS):
            r = by.get(name, {}).get((length, out, rate))
            if r is None:
                continue
            handoff = r.ttft_p50_ms - row["prefill_only_ttft_p50_ms"] - single.tpot_p50_ms
            row[f"handoff_{name}_ms"] = handoff
            row[f"sustained_{name}"] = r.sustained
        for ours in OURS:
            o = by.get(ours, {}).get((length, out, rate))
            for up in ("push", "pull"):
                u = by.get(up, {}).get((length, out, rate))
                if o and u:
                    row[f"ttft_{ours}/{up}"] = o.ttft_p50_ms / u.ttft_p50_ms
                    row[f"tpot_{ours}/{up}"] = o.tpot_p50_ms / u.tpot_p50_ms
            if f"handoff_{ours}_ms" in row:
                row[f"handoff_{ours}/nixl"] = row[f"handoff_{ours}_ms"] / row["raw_nixl_ms"]
        rows.append(row)
    return rows


def paired(results: dict[str, list[PointResult]]) -> list[dict]:
    """Per point where ``single_paired`` ran (one plain vLLM in our setups' arrival stream): each of
    our setups' TTFT p50 minus its, and TPOT p50 and TPOT-from-the-2nd-token p50 over its. The same
    moments of the machine, so these carry none of the drift between launches."""
    by = _by_point(results)
    rows = []
    for key, plain in sorted(by.get("single_paired", {}).items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        row: dict[str, Any] = {
            "prompt_len": key[0],
            "max_tokens": key[1],
            "rate": key[2],
            "plain_ttft_p50_ms": plain.ttft_p50_ms,
            "plain_tpot_p50_ms": plain.tpot_p50_ms,
        }
        for name in OURS:
            r = by.get(name, {}).get(key)
            if r is None:
                continue
            row[f"ttft_{name}-plain_ms"] = r.ttft_p50_ms - plain.ttft_p50_ms
            row[f"tpot_{name}/plain"] = r.tpot_p50_ms / plain.tpot_p50_ms
            row[f"tpot2_{name}/plain"] = r.tpot_rest_p50_ms / plain.tpot_rest_p50_ms
            if name == "ours_ft" and not math.isnan(r.ttft_answer_p50_ms):
                row["ttft_ours_ft_answer-plain_ms"] = r.ttft_answer_p50_ms - plain.ttft_p50_ms
        rows.append(row)
    return rows


def goals(results: dict[str, list[PointResult]], derived: list[dict]) -> list[dict]:
    """Per prompt length and output length, at the highest rate that ours, push and pull all sustained."""
    by = _by_point(results)
    out = []
    for length, mt in sorted({(d["prompt_len"], d["max_tokens"]) for d in derived}):
        rows = [d for d in derived if (d["prompt_len"], d["max_tokens"]) == (length, mt)]
        ok = [
            d
            for d in rows
            if all(
                by.get(n, {}).get((length, mt, d["rate"])) is not None and by[n][(length, mt, d["rate"])].sustained
                for n in ("ours", "push", "pull")
            )
        ]
        if not ok:
            out.append(
                {
                    "prompt_len": length,
                    "max_tokens": mt,
                    "rate": None,
                    "note": "no rate sustained by ours, push and pull",
                }
            )
            continue
        d = max(ok, key=lambda x: x["rate"])
        light = min(rows, key=lambda x: x["rate"])
        g = {
            "prompt_len": length,
            "max_tokens": mt,
            "rate": d["rate"],
            "ttft_ours/push": d.get("ttft_ours/push"),
            "ttft_ours/pull": d.get("ttft_ours/pull"),
            "tpot_ours/push": d.get("tpot_ours/push"),
            "handoff_ours/nixl_light": light.get("handoff_ours/nixl"),
            "light_rate": light["rate"],
        }
        g["pass_ttft_push"] = (g["ttft_ours/push"] or math.inf) <= GOAL_TTFT_VS_PUSH
        g["pass_ttft_pull"] = (g["ttft_ours/pull"] or math.inf) <= GOAL_TTFT_VS_PULL
        g["pass_tpot_push"] = (g["tpot_ours/push"] or math.inf) <= GOAL_TPOT_VS_PUSH
        g["pass_handoff"] = (g["handoff_ours/nixl_light"] or math.inf) <= GOAL_HANDOFF_VS_NIXL
        out.append(g)
    return out


def _f(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    return f"{x:.{nd}f}"


def _rate_cell(g: dict[str, Any] | None) -> str:
    """A goodput-summary cell: the highest rate at >= target attainment and the goodput there."""
    if not g:
        return "–"
    if g.get("max_rate") is None:
        lowest = min(g.get("rates") or [math.nan])
        return f"< {lowest:g} (best {_f(g.get('best_goodput_rps'), 2)})"
    return f"{g['max_rate']:g} ({_f(g.get('goodput_rps_at_max_rate'), 2)})"


def _slo_line(res: dict[str, Any]) -> str:
    slo = res.get("slo") or {}
    per = slo.get("per_prompt_len") or {}
    known = {k: v for k, v in per.items() if v}
    if not known:
        return (
            "SLOs unknown (no `single` run for the unloaded base and no `--slo-ttft-ms`/`--slo-tpot-ms`): no goodput."
        )
    parts = ", ".join(f"L={k}: TTFT ≤ {v['ttft_ms']:.0f} ms, TPOT ≤ {v['tpot_ms']:.1f} ms" for k, v in known.items())
    return f"SLOs ({slo.get('source', '')}): {parts}."


def markdown(res: dict[str, Any]) -> str:
    results: dict[str, list[dict]] = res["results"]
    cfg = res["config"]
    outs = cfg.get("output_lens") or [cfg["max_tokens"]]
    target = res.get("slo", {}).get("attainment_target", SLO_ATTAINMENT)
    lines = [
        f"Model `{cfg['model_dir']}` ({cfg['model']['layers']} layers, {cfg['model']['kv_heads']} KV heads × "
        f"{cfg['model']['head_dim']}), {' and '.join(str(o) for o in outs)} output tokens, P on core "
        f"{cfg['prefill_core']}, D on core {cfg['decode_core']}, single instance on core {cfg['prefill_core']}, "
        f"two_plain on both; vLLM executor `{cfg.get('vllm_executor', 'mp')}`; {res['host']}."
        + (
            " Our setups interleaved: one arrival stream per point at its rate, each arrival through one of "
            "them, each with the point's request count (throughput and goodput scaled to the whole rate)."
            if cfg.get("interleave")
            else ""
        ),
        "",
        _slo_line(res),
        "",
        "### Latency and throughput per setup",
        "",
        "| prompt | out | rate /s | n | setup | ok | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
        "1st → 2nd token p50 ms | TPOT from 2nd p50 ms | req/s | SLO met | goodput req/s | hand-off p50 ms | "
        "load1 / foreign vLLMs | CPU cal. P / D ms |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    shown = tuple(n for n in SETUPS if results.get(n))  # goodput columns: the setups that ran
    dmap = {(d["prompt_len"], d["max_tokens"], d["rate"]): d for d in res["derived"]}
    keys = sorted(
        {(r["max_tokens"], r["prompt_len"], r["rate"]) for n, rs in results.items() if n != "prefill_only" for r in rs}
    )
    first_out = min((k[0] for k in keys), default=None)
    by = {
        name: {(x["prompt_len"], x["max_tokens"], x["rate"]): x for x in rs}
        for name, rs in results.items()
        if name != "prefill_only"
    }
    pre = {(x["prompt_len"], x["rate"]): x for x in results.get("prefill_only", [])}
    for out, length, rate in keys:
        for name in ("single", "prefill_only", *SETUPS[1:]):
            if name == "prefill_only":
                # One max_tokens=1 reference per prompt length and rate, shown with the first output length.
                r = pre.get((length, rate)) if out == first_out else None
            else:
                r = by.get(name, {}).get((length, out, rate))
            if r is None:
                continue
            handoff = dmap.get((length, out, rate), {}).get(f"handoff_{name}_ms")
            sus = "" if r["sustained"] else " †"
            met = "–" if r.get("slo_attainment") is None else f"{r['slo_attainment'] * 100:.0f} %"
            setup = f"{name} ({r['on_decode']} prefilled on D)" if r.get("on_decode") else name
            lines.append(
                f"| {length} | {r.get('max_tokens')} | {rate:g} | {r['requests']} | {setup} | {r['ok']} | "
                f"{_f(r['ttft_p50_ms'])} | {_f(r['ttft_p99_ms'])} | {_f(r['tpot_p50_ms'], 2)} | "
                f"{_f(r['tpot_p99_ms'], 2)} | {_f(r.get('gap2_p50_ms'), 2)} | {_f(r.get('tpot_rest_p50_ms'), 2)} | "
                f"{_f(r['throughput_rps'], 2)}{sus} | {met} | "
                f"{_f(r.get('goodput_rps'), 2)} | {_f(handoff)} | {_f(r.get('load1'))} / {r.get('foreign_vllm', 0)} | "
                f"{' / '.join(_f(c) for c in r.get('cpu_cal_ms') or []) or '–'} |"
            )
    lines += [
        "",
        "† not sustained (throughput < 0.9 × offered rate, or failures). SLO met: requests with TTFT and "
        "their own mean TPOT both within the SLOs, of all requests (failures miss); goodput = those per second.",
        "",
        f"### Goodput: highest rate with ≥ {target * 100:.0f} % SLO attainment (goodput there, req/s)",
        "",
        _slo_line(res),
        "",
        "| prompt | out | SLO TTFT ms | SLO TPOT ms | " + " | ".join(shown) + " |",
        "|---:|---:|---:|---:|" + "---|" * len(shown),
    ]
    for g in res.get("goodput", []):
        cells = " | ".join(_rate_cell(g["setups"].get(n)) for n in shown)
        lines.append(
            f"| {g['prompt_len']} | {g['max_tokens']} | {_f(g.get('slo_ttft_ms'), 0)} | {_f(g.get('slo_tpot_ms'), 1)} "
            f"| {cells} |"
        )
    lines += [
        "",
        f"Each rate up to the one shown kept ≥ {target * 100:.0f} % of requests within both SLOs; "
        "`< r (best g)`: the lowest rate r already missed (g: the best goodput measured); –: not run.",
        "",
    ]
    if res.get("goodput_by_tpot_slo"):
        lines += [
            "#### The same, across TPOT targets (TTFT target as above)",
            "",
            "| prompt | out | TPOT target | SLO TPOT ms | " + " | ".join(shown) + " |",
            "|---:|---:|---:|---:|" + "---|" * len(shown),
        ]
        for g in res["goodput_by_tpot_slo"]:
            cells = " | ".join(_rate_cell(g["setups"].get(n)) for n in shown)
            lines.append(
                f"| {g['prompt_len']} | {g['max_tokens']} | {g['tpot_factor']:g} × unloaded | "
                f"{_f(g['slo_tpot_ms'], 1)} | {cells} |"
            )
        lines.append("")
    if res.get("paired"):
        lines += [
            "### Paired against one plain vLLM in the same arrival stream (`single_paired`)",
            "",
            "| prompt | out | rate /s | plain TTFT p50 ms | TTFT − plain: ours / ours_ft / ours_grpc ms | "
            "ours_ft by the prefill leg's answer − plain ms | TPOT / plain | TPOT from 2nd / plain |",
            "|---:|---:|---:|---:|---|---:|---|---|",
        ]
        for d in res["paired"]:
            lines.append(
                f"| {d['prompt_len']} | {d['max_tokens']} | {d['rate']:g} | {_f(d['plain_ttft_p50_ms'])} | "
                + " / ".join(
                    f"{d[k]:+.1f}" if d.get(k) is not None else "–" for k in (f"ttft_{n}-plain_ms" for n in OURS)
                )
                + " | "
                + (f"{d['ttft_ours_ft_answer-plain_ms']:+.1f}" if "ttft_ours_ft_answer-plain_ms" in d else "–")
                + " | "
                + " / ".join(_f(d.get(f"tpot_{n}/plain"), 3) for n in OURS)
                + " | "
                + " / ".join(_f(d.get(f"tpot2_{n}/plain"), 3) for n in OURS)
                + " |"
            )
        lines += [
            "",
            "`single_paired` runs on its own core, started with our pair; its requests are arrivals of the same "
            "Poisson stream as ours (each setup an equal share), so the differences carry no launch-to-launch drift.",
            "",
        ]
    lines += [
        "### Ratios (p50), hand-off and raw NIXL",
        "",
        "| prompt | out | rate /s | KV bytes/req | raw NIXL WRITE ms | TTFT ours/push | TTFT ours/pull | "
        "TPOT ours/push | TPOT ours/pull | hand-off ours ms | hand-off ours/NIXL | TTFT grpc/push | "
        "our write_ms p50 | our released waited_ms p50 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ours = {(r["prompt_len"], r["max_tokens"], r["rate"]): r for r in results.get("ours", [])}
    for d in sorted(res["derived"], key=lambda x: (x["max_tokens"], x["prompt_len"], x["rate"])):
        ph = ours.get((d["prompt_len"], d["max_tokens"], d["rate"]), {}).get("phases", {})
        lines.append(
            f"| {d['prompt_len']} | {d.get('max_tokens')} | {d['rate']:g} | {d['kv_bytes']} | "
            f"{_f(d['raw_nixl_ms'], 3)} | {_f(d.get('ttft_ours/push'), 2)} | {_f(d.get('ttft_ours/pull'), 2)} | "
            f"{_f(d.get('tpot_ours/push'), 2)} | {_f(d.get('tpot_ours/pull'), 2)} | {_f(d.get('handoff_ours_ms'))} | "
            f"{_f(d.get('handoff_ours/nixl'), 0)} | {_f(d.get('ttft_ours_grpc/push'), 2)} | "
            f"{_f(ph.get('write_ms_p50'), 3)} | {_f(ph.get('released_waited_ms_p50'), 1)} |"
        )
    lines += [
        "",
        "### Where our TTFT goes (p50 per phase, joined per request on the transfer id; ms)",
        "",
        "| prompt | out | rate /s | setup | TTFT | sent → WRITE start | WRITE (write_ms) | WRITE start → D release | "
        "D release → first token |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in OURS:
        for r in results.get(name, []):
            ph = r.get("phases") or {}
            lines.append(
                f"| {r['prompt_len']} | {r.get('max_tokens')} | {r['rate']:g} | {name} | {_f(r['ttft_p50_ms'])} | "
                f"{_f(ph.get('to_write_start_ms_p50'))} | {_f(ph.get('write_ms_p50'), 2)} | "
                f"{_f(ph.get('write_start_to_release_ms_p50'), 2)} | {_f(ph.get('release_to_first_ms_p50'), 1)} |"
            )
    lines += [
        "",
        "### Goals (at the highest rate that ours, push and pull all sustained; hand-off at the lightest rate)",
        "",
        f"| prompt | out | rate /s | TTFT ours/push (≤ {GOAL_TTFT_VS_PUSH}) | TTFT ours/pull (≤ {GOAL_TTFT_VS_PULL}) | "
        f"TPOT ours/push (≤ {GOAL_TPOT_VS_PUSH}) | hand-off/NIXL at light load (≤ {GOAL_HANDOFF_VS_NIXL}) |",
        "|---:|---:|---:|---|---|---|---|",
    ]
    for g in res["goals"]:
        if g.get("rate") is None:
            lines.append(f"| {g['prompt_len']} | {g.get('max_tokens')} | – | {g['note']} | | | |")
            continue
        lines.append(
            f"| {g['prompt_len']} | {g.get('max_tokens')} | {g['rate']:g} | {_f(g['ttft_ours/push'], 2)} "
            f"{_f(g['pass_ttft_push'])} | {_f(g['ttft_ours/pull'], 2)} {_f(g['pass_ttft_pull'])} | "
            f"{_f(g['tpot_ours/push'], 2)} {_f(g['pass_tpot_push'])} | {_f(g['handoff_ours/nixl_light'], 0)} "
            f"{_f(g['pass_handoff'])} |"
        )
    lines += [
        "",
        "Hand-off = TTFT p50 − prefill-only TTFT p50 (single instance, max_tokens=1, same prompts and arrivals) − "
        "single-instance TPOT p50. Raw NIXL = median single-descriptor NIXL WRITE of the KV bytes (UCX, loopback).",
    ]
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out_dir: Path, stem: str = "serving") -> list[str]:
    """``<stem>_ttft.png``, ``<stem>_tpot.png`` (p50 and p99 vs rate) and ``<stem>_goodput.png``
    (goodput and SLO attainment vs rate); one column per prompt length and output length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, list[dict]] = res["results"]
    cols = sorted(
        {(r["prompt_len"], r["max_tokens"]) for n, rs in results.items() if n != "prefill_only" for r in rs},
        key=lambda k: (k[1], k[0]),
    )
    if not cols:
        return []

    def series(name: str, length: int, out: int) -> list[dict[str, Any]]:
        rs = (r for r in results.get(name, []) if (r["prompt_len"], r["max_tokens"]) == (length, out))
        return sorted(rs, key=lambda r: r["rate"])

    def series_all(length: int, out: int) -> list[dict[str, Any]]:
        return [r for name in SETUPS for r in series(name, length, out)]

    def num(x: Any) -> float:
        return math.nan if x is None else float(x)

    written = []
    for metric, title in (("ttft", "TTFT"), ("tpot", "TPOT")):
        fig, axes = plt.subplots(1, len(cols), figsize=(5 * len(cols), 4), squeeze=False)
        for ax, (length, out) in zip(axes[0], cols, strict=True):
            for name in SETUPS:
                rs = series(name, length, out)
                if not rs:
                    continue
                x = [r["rate"] for r in rs]
                (line,) = ax.plot(x, [num(r[f"{metric}_p50_ms"]) for r in rs], marker="o", label=f"{name} p50")
                ax.plot(x, [num(r[f"{metric}_p99_ms"]) for r in rs], ls="--", color=line.get_color(), alpha=0.6)
            ax.set_title(f"{title}, prompt {length}, {out} out (dashed: p99)", fontsize=9)
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel(f"{title} (ms)")
            if metric == "ttft":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stem}_{metric}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    target = res.get("slo", {}).get("attainment_target", SLO_ATTAINMENT)
    fig, axes = plt.subplots(2, len(cols), figsize=(5 * len(cols), 7), squeeze=False)
    for j, (length, out) in enumerate(cols):
        top, bottom = axes[0][j], axes[1][j]
        for name in SETUPS:
            rs = series(name, length, out)
            if not rs or rs[0].get("slo_attainment") is None:
                continue
            x = [r["rate"] for r in rs]
            (line,) = top.plot(x, [num(r.get("goodput_rps")) for r in rs], marker="o", label=name)
            bottom.plot(x, [num(r.get("slo_attainment")) * 100 for r in rs], marker="o", color=line.get_color())
        top_rate = max(r["rate"] for r in series_all(length, out))
        top.plot([0, top_rate], [0, top_rate], ls=":", color="grey", lw=1)
        top.set_title(f"goodput, prompt {length}, {out} out (dotted: = offered)", fontsize=9)
        top.set_ylabel("goodput (req/s)")
        bottom.axhline(target * 100, ls=":", color="grey", lw=1)
        bottom.set_title(f"SLO attainment (dotted: {target * 100:.0f} %)", fontsize=9)
        bottom.set_ylabel("requests within both SLOs (%)")
        bottom.set_ylim(-5, 105)
        for ax in (top, bottom):
            ax.set_xlabel("offered rate (req/s)")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"{stem}_goodput.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(str(path))
    return written

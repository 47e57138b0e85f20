"""Pure helpers of the serving benchmark (no servers): goodput and SLO attainment, the rate summary,
the round-robin proxy of ``two_plain``, the sweep over output lengths, and the report."""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks import serving as sv
from benchmarks import serving_model as sv_model
from benchmarks import serving_proxies as sv_proxies
from benchmarks import serving_report as sv_report
from benchmarks import serving_slo as sv_slo
from benchmarks.serving_model import Point, PointResult, Sample
from benchmarks.serving_proxies import RoundRobin
from benchmarks.serving_slo import Slo

SLO = Slo(ttft_ms=500.0, tpot_ms=20.0)


# ----- one request against the SLOs ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ttft", "tpot", "met"),
    [
        (100.0, 10.0, True),
        (500.0, 20.0, True),  # the targets themselves are met (<=)
        (500.1, 10.0, False),  # TTFT over
        (100.0, 20.1, False),  # TPOT over
        (600.0, 30.0, False),
        (math.nan, math.nan, False),  # failed request
        (None, None, False),  # failed request, as read back from JSON
        (100.0, math.nan, True),  # one-token output: TTFT alone
        (100.0, None, True),
    ],
)
def test_meets_slo_needs_both_targets(ttft: float | None, tpot: float | None, met: bool) -> None:
    assert sv_slo.meets_slo(ttft, tpot, SLO) is met


def test_goodput_counts_failures_as_missed_and_divides_by_duration() -> None:
    ttft = [100.0, 200.0, 900.0, math.nan, 450.0]
    tpot = [10.0, 25.0, 10.0, math.nan, 19.0]
    met, fraction, rps = sv_slo.goodput(ttft, tpot, 2.0, SLO)
    assert met == 2  # requests 0 and 4; 1 misses TPOT, 2 misses TTFT, 3 failed
    assert fraction == pytest.approx(2 / 5)
    assert rps == pytest.approx(1.0)


def test_goodput_edge_cases() -> None:
    assert sv_slo.goodput([math.nan, math.nan], [math.nan, math.nan], math.nan, SLO) == (0, 0.0, 0.0)
    met, fraction, rps = sv_slo.goodput([], [], 1.0, SLO)
    assert met == 0 and math.isnan(fraction) and rps == 0.0
    with pytest.raises(ValueError):
        sv_slo.goodput([1.0], [], 1.0, SLO)


# ----- the rate summary ----------------------------------------------------------------------------


def test_max_rate_meeting_stops_at_the_first_rate_that_misses() -> None:
    assert sv_slo.max_rate_meeting([(1.0, 1.0), (2.0, 0.95), (4.0, 0.9), (8.0, 0.5)]) == 4.0
    # A pass above a failing rate is noise, not capacity; input order does not matter.
    assert sv_slo.max_rate_meeting([(8.0, 1.0), (2.0, 1.0), (4.0, 0.89)]) == 2.0
    assert sv_slo.max_rate_meeting([(1.0, 0.5), (2.0, 1.0)]) is None
    assert sv_slo.max_rate_meeting([(1.0, 1.0), (2.0, math.nan), (4.0, 1.0)]) == 1.0
    assert sv_slo.max_rate_meeting([]) is None
    assert sv_slo.max_rate_meeting([(1.0, 0.8), (2.0, 0.7)], target=0.75) == 1.0


def test_slos_from_the_unloaded_base_or_fixed_flags() -> None:
    base = {512: {"ttft_ms": 100.0, "tpot_ms": 10.0}, 1024: {"ttft_ms": 200.0, "tpot_ms": 12.0}}
    slos = sv_slo.slos_for([512, 1024, 2048], base, scale=3.0)
    assert slos[512] == Slo(300.0, 30.0)
    assert slos[1024] == Slo(600.0, 36.0)
    assert slos[2048] is None  # no base and no flag: unknown
    mixed = sv_slo.slos_for([1024, 2048], base, scale=3.0, tpot_ms=50.0)
    assert mixed[1024] == Slo(600.0, 50.0)
    assert mixed[2048] is None  # TTFT still has no base
    fixed = sv_slo.slos_for([2048], {}, scale=3.0, ttft_ms=800.0, tpot_ms=40.0)
    assert fixed[2048] == Slo(800.0, 40.0)


def _result(setup: str, pt: Point, ttft_s: list[float], tpot_s: float = 0.01) -> PointResult:
    """A point whose requests are sent 1/rate apart; NaN TTFT: that request failed."""
    samples = []
    for i, t in enumerate(ttft_s):
        s = Sample(ok=not math.isnan(t), sent=i / pt.rate)
        if s.ok:
            s.ttft, s.tpot, s.done = t, tpot_s, i / pt.rate + t + tpot_s * (pt.max_tokens - 1)
        samples.append(s)
    return sv_model.summarize(setup, pt, samples)


def test_summarize_keeps_per_request_times_in_ms() -> None:
    r = _result("single", Point(1024, 2.0, 3, 16), [0.1, math.nan, 0.3], tpot_s=0.02)
    assert r.max_tokens == 16 and r.ok == 2
    assert r.req_ttft_ms[0] == pytest.approx(100.0) and r.req_ttft_ms[2] == pytest.approx(300.0)
    assert math.isnan(r.req_ttft_ms[1]) and math.isnan(r.req_tpot_ms[1])
    assert r.req_tpot_ms[0] == pytest.approx(20.0)


def test_record_splits_the_first_gap_from_the_rest() -> None:
    s = Sample(ok=False, sent=1.0)
    sv_proxies.record(s, 1.1, 1.5, 5, 5, second=1.2)  # tokens at 1.1, 1.2, then three more up to 1.5
    assert s.ok and s.ttft == pytest.approx(0.1) and s.tpot == pytest.approx(0.1)
    assert s.gap2 == pytest.approx(0.1) and s.tpot_rest == pytest.approx(0.1)
    one = Sample(ok=False, sent=0.0)
    sv_proxies.record(one, 0.1, 0.1, 1, 1)
    assert math.isnan(one.gap2) and math.isnan(one.tpot_rest) and math.isnan(one.tpot)
    with pytest.raises(RuntimeError):
        sv_proxies.record(Sample(ok=False, sent=0.0), 0.1, 0.2, 2, 3)


def _sweep() -> dict[str, list[PointResult]]:
    """single meets the SLO at 1/s only; two_plain at 1 and 2/s, and by chance again at 8/s."""
    fast, slow = [0.1] * 10, [0.1] * 5 + [2.0] * 5
    plan = {
        "single": {1.0: fast, 2.0: slow, 4.0: slow, 8.0: fast},
        "two_plain": {1.0: fast, 2.0: fast, 4.0: slow, 8.0: fast},
    }
    out: dict[str, list[PointResult]] = {
        name: [_result(name, Point(1024, rate, 10, 16), t) for rate, t in rates.items()] for name, rates in plan.items()
    }
    out["prefill_only"] = [_result("prefill_only", Point(1024, 1.0, 10, 1), fast)]
    return out


def test_apply_slo_and_goodput_summary() -> None:
    results = _sweep()
    sv_slo.apply_slo(results, {1024: SLO})
    one = results["two_plain"][0]
    assert (one.slo_ttft_ms, one.slo_tpot_ms) == (500.0, 20.0)
    assert one.slo_met == 10 and one.slo_attainment == 1.0
    assert one.goodput_rps == pytest.approx(one.throughput_rps)  # every ok request met the SLOs
    assert results["single"][1].slo_attainment == pytest.approx(0.5)
    assert math.isnan(results["prefill_only"][0].slo_attainment)  # the reference is not judged
    [row] = sv_slo.goodput_summary(results)
    assert (row["prompt_len"], row["max_tokens"]) == (1024, 16)
    assert row["setups"]["single"]["max_rate"] == 1.0
    assert row["setups"]["two_plain"]["max_rate"] == 2.0
    assert row["setups"]["two_plain"]["goodput_rps_at_max_rate"] == pytest.approx(results["two_plain"][1].goodput_rps)
    assert row["setups"]["two_plain"]["best_goodput_rps"] == max(r.goodput_rps for r in results["two_plain"])
    assert "pull" not in row["setups"]


def test_goodput_summary_without_slo_lists_no_setups() -> None:
    results = _sweep()
    sv_slo.apply_slo(results, {1024: None})
    [row] = sv_slo.goodput_summary(results)
    assert row["setups"] == {} and "slo_ttft_ms" not in row


# ----- the round-robin proxy -------------------------------------------------------------------------


def test_round_robin_cycles_through_every_backend() -> None:
    rr = RoundRobin(2)
    assert [rr.pick() for _ in range(5)] == [0, 1, 0, 1, 0]
    rr3 = RoundRobin(3)
    assert [rr3.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    one = RoundRobin(1)
    assert {one.pick() for _ in range(3)} == {0}
    with pytest.raises(ValueError):
        RoundRobin(0)


class _FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    async def stream(self, url: str, prompt: list[int], max_tokens: int, params: Any, rid: str, s: Sample) -> None:
        self.calls.append((url, prompt[0], max_tokens))
        assert params is None  # plain instances: no kv_transfer_params
        s.ok = True


def test_round_robin_proxy_alternates_in_request_order() -> None:
    client = _FakeClient()
    proxy = sv_proxies.round_robin_proxy(client, ["http://a", "http://b"])  # type: ignore[arg-type]

    async def go() -> None:
        for i in range(5):
            await proxy([i], 16, Sample(ok=False, sent=0.0))

    asyncio.run(go())
    assert client.calls == [
        ("http://a", 0, 16),
        ("http://b", 1, 16),
        ("http://a", 2, 16),
        ("http://b", 3, 16),
        ("http://a", 4, 16),
    ]


class _FakePD:
    """A client for the P/D proxies: records P's non-streaming legs and D's streaming leg."""

    def __init__(self) -> None:
        self.once_calls: list[tuple[str, int, dict[str, Any] | None]] = []
        self.stream_calls: list[tuple[str, int, dict[str, Any] | None]] = []

    async def once(self, url: str, prompt: list[int], max_tokens: int, params: Any, rid: str) -> dict[str, Any]:
        self.once_calls.append((url, max_tokens, params))
        return {"kv_transfer_params": {"from": "p"}}

    async def stream(self, url: str, prompt: list[int], max_tokens: int, params: Any, rid: str, s: Sample) -> None:
        self.stream_calls.append((url, max_tokens, params))
        s.ok = True


@pytest.mark.parametrize("kind", ["pull", "push"])
def test_pd_proxies_send_one_prefill_token_and_stream_the_requested_length(kind: str) -> None:
    c = _FakePD()
    if kind == "pull":
        proxy = sv_proxies.pull_proxy(c, "http://p", "http://d")  # type: ignore[arg-type]
    else:
        proxy = sv_proxies.push_proxy(c, "http://p", "http://d", "engine-p", "127.0.0.1", 5600, 1)  # type: ignore[arg-type]
    s = Sample(ok=False, sent=0.0)
    asyncio.run(proxy([1, 2, 3], 128, s))
    assert s.ok
    [(p_url, p_tokens, p_params)] = c.once_calls
    [(d_url, d_tokens, d_params)] = c.stream_calls
    assert (p_url, p_tokens, d_url, d_tokens) == ("http://p", 1, "http://d", 128)
    assert p_params is not None and p_params["do_remote_decode"] is True
    if kind == "pull":
        assert d_params == {"from": "p"}  # P's returned params, after P finished
    else:
        assert d_params is not None and d_params["remote_engine_id"] == "engine-p"


def test_ours_and_grpc_proxies_pass_the_output_length() -> None:
    from google.protobuf.struct_pb2 import Struct

    from kvpush.v1 import kvpush_pb2 as pb

    class Stub:
        def __init__(self) -> None:
            self.assigned: list[int] = []
            self.released: list[int] = []
            self.generated: list[int] = []

        async def Assign(self, req: Any, timeout: float) -> Any:  # the gRPC method names
            self.assigned.append(req.max_tokens)
            params = Struct()
            params.update({"k": "v"})
            return pb.Assignment(
                transfer_id="t1",
                epoch=3,
                prefill=pb.InstanceInfo(http_endpoint="http://p"),
                decode=pb.InstanceInfo(http_endpoint="http://d"),
                prefill_kv_transfer_params=params,
                decode_kv_transfer_params=params,
            )

        async def Release(self, req: Any, timeout: float) -> Any:
            self.released.append(req.outcome)
            return pb.ReleaseResponse()

        async def _gen(self, n: int) -> Any:
            for i in range(n):
                yield pb.GenerateResponse(transfer_id="t2", token_ids=[i])

        def Generate(self, req: Any, timeout: float) -> Any:
            self.generated.append(req.max_tokens)
            return self._gen(req.max_tokens)

    c, stub = _FakePD(), Stub()
    s = Sample(ok=False, sent=0.0)
    asyncio.run(sv_proxies.ours_proxy(c, stub)([1, 2], 128, s))  # type: ignore[arg-type]
    assert stub.assigned == [128] and stub.released == [pb.OUTCOME_OK] and s.transfer_id == "t1"
    assert [x[:2] for x in c.once_calls] == [("http://p", 1)]
    assert [x[:2] for x in c.stream_calls] == [("http://d", 128)]
    g = Sample(ok=False, sent=0.0)
    asyncio.run(sv_proxies.grpc_proxy(stub)([1, 2], 16, g))
    assert stub.generated == [16] and g.ok and g.tokens == 16 and g.transfer_id == "t2"
    assert g.gap2 >= 0 and not math.isnan(g.tpot_rest)


@pytest.mark.parametrize("which", ["ours", "ours_ft"])
def test_our_proxies_send_an_assignment_prefilled_on_decode_to_decode_alone(which: str) -> None:
    """Local prefill: both Assign paths allow it; an answer with ``prefill_on_decode`` is one plain
    streamed request to decode (no kv_transfer_params, the whole output), no prefill leg, no wait
    for a first token, released OK, and counted per request and per point."""
    from kvpush.v1 import kvpush_pb2 as pb

    class Stub:
        def __init__(self) -> None:
            self.allowed: list[bool] = []
            self.released: list[int] = []

        async def Assign(self, req: Any, timeout: float) -> Any:
            self.allowed.append(req.allow_prefill_on_decode)
            return pb.Assignment(
                transfer_id="t1", epoch=3, decode=pb.InstanceInfo(http_endpoint="http://d"), prefill_on_decode=True
            )

        async def Release(self, req: Any, timeout: float) -> Any:
            self.released.append(req.outcome)
            return pb.ReleaseResponse()

        async def AwaitFirstToken(self, req: Any, timeout: float) -> Any:
            raise AssertionError("no first token to wait for")

    c, stub = _FakePD(), Stub()
    proxy = sv_proxies.ours_proxy if which == "ours" else sv_proxies.ours_ft_proxy
    s = Sample(ok=False, sent=0.0)
    asyncio.run(proxy(c, stub)([1, 2], 16, s))  # type: ignore[arg-type]
    assert stub.allowed == [True] and stub.released == [pb.OUTCOME_OK]
    assert not c.once_calls and c.stream_calls == [("http://d", 16, None)]
    assert s.ok and s.on_decode
    r = sv_model.summarize(which, Point(3072, 5.0, 2, 16), [s, Sample(ok=False, sent=0.0)])
    assert r.on_decode == 1 and r.req_on_decode == [True, False]


def test_ours_ft_proxy_puts_prefills_token_first_and_times_the_gap_to_decodes() -> None:
    """The first token is the scheduler's AwaitFirstToken answer (asked with the assignment's id
    and epoch); the prefill leg's answer, with the same token, is timed beside it; a token that
    differs fails the request."""
    from google.protobuf.struct_pb2 import Struct

    from kvpush.v1 import kvpush_pb2 as pb

    class Client:
        def __init__(self) -> None:
            self.decode_max_tokens: list[int] = []

        async def once(self, url: str, prompt: list[int], max_tokens: int, params: Any, rid: str) -> Any:
            assert max_tokens == 1
            await asyncio.sleep(0.01)  # the leg's answer comes after the scheduler's
            return {"choices": [{"token_ids": [7]}]}

        async def token_times(self, url: str, prompt: list[int], max_tokens: int, params: Any, rid: str) -> Any:
            self.decode_max_tokens.append(max_tokens)
            await asyncio.sleep(0.02)  # decode's first token comes after prefill's answer
            return [1e12 + i for i in range(max_tokens)]  # far later, 1 s apart

    class Stub:
        async def Assign(self, req: Any, timeout: float) -> Any:
            assert req.first_token_from_prefill
            return pb.Assignment(
                transfer_id="t",
                epoch=5,
                first_token_from_prefill=True,
                prefill=pb.InstanceInfo(http_endpoint="http://p"),
                decode=pb.InstanceInfo(http_endpoint="http://d"),
                prefill_kv_transfer_params=Struct(),
                decode_kv_transfer_params=Struct(),
            )

        async def AwaitFirstToken(self, req: Any, timeout: float) -> Any:
            assert (req.transfer_id, req.epoch) == ("t", 5)
            return pb.AwaitFirstTokenResponse(token_id=self.token, prefill_engine_id="p0")

        async def Release(self, req: Any, timeout: float) -> Any:
            self.released.append(req.outcome)
            return pb.ReleaseResponse()

        def __init__(self, token: int) -> None:
            self.token = token
            self.released: list[int] = []

    c = Client()
    s = Sample(ok=False, sent=time.monotonic())
    stub = Stub(7)
    asyncio.run(sv_proxies.ours_ft_proxy(c, stub)([1, 2], 4, s))  # type: ignore[arg-type]
    assert c.decode_max_tokens == [3] and s.ok and s.tokens == 4
    assert s.gap2 > 1e6  # prefill's token (now) to decode's first (far later)
    assert s.tpot_rest == pytest.approx(1.0)  # decode's own tokens, 1 s apart
    assert 0 <= s.ttft < s.ttft_answer  # the scheduler's answer came first here
    assert stub.released == [pb.OUTCOME_OK]
    other = Stub(8)  # the scheduler and the prefill leg disagree: the request fails, released as such
    bad = Sample(ok=False, sent=time.monotonic())
    with pytest.raises(RuntimeError, match="AwaitFirstToken gave 8"):
        asyncio.run(sv_proxies.ours_ft_proxy(c, other)([1, 2], 4, bad))  # type: ignore[arg-type]
    assert not bad.ok and other.released == [pb.OUTCOME_FAILED]


# ----- the sweep and the flags ------------------------------------------------------------------------


def test_every_point_runs_once_per_output_length_with_the_same_prompts() -> None:
    args = sv.parse_args(["--quick"])
    assert args.output_lens == [16, 128]
    assert "two_plain" in args.setups
    assert args.max_model_len >= max(args.prompt_lens) + 128
    pts = sv.points(args)
    assert [(p.max_tokens, p.rate) for p in pts] == [(16, 4.0), (16, 16.0), (128, 4.0), (128, 16.0)]
    assert len({p.key for p in pts}) == len(pts)
    assert sv.prompts_for(pts[0], 1000, 0) == sv.prompts_for(pts[2], 1000, 0)
    assert sv.arrivals_for(pts[0], 0) == sv.arrivals_for(pts[2], 0)
    pre = sv.prefill_only_points(pts)
    assert [(p.rate, p.max_tokens) for p in pre] == [(4.0, 1), (16.0, 1)]


def test_flags() -> None:
    args = sv.parse_args(["--max-tokens", "32", "--setups", "single,two_plain", "--slo-ttft-ms", "400"])
    assert args.output_lens == [32] and args.max_tokens == 32
    assert args.setups == ["single", "two_plain"]
    assert args.slo_ttft_ms == 400.0 and args.slo_tpot_ms == 0.0 and args.slo_scale == 3.0
    assert sv.parse_args(["--output-lens", "128,16,16"]).output_lens == [16, 128]
    with pytest.raises(SystemExit):
        sv.parse_args(["--setups", "single,three_plain"])
    with pytest.raises(SystemExit):
        sv.parse_args(["--output-lens", "0"])


# ----- the report ----------------------------------------------------------------------------------------


def _res(results: dict[str, list[PointResult]], slo: Slo | None) -> dict[str, Any]:
    model = sv_model.ModelInfo(layers=2, kv_heads=4, head_dim=32, dtype_bytes=2, vocab=1000, max_positions=4096)
    derived = sv_report.derive(results, {}, model)
    res = {
        "host": "test",
        "config": {"model_dir": "m", "model": asdict(model), "output_lens": [16], "prefill_core": 0, "decode_core": 1},
        "results": {k: [asdict(r) for r in v] for k, v in results.items()},
        "derived": derived,
        "slo": {"source": "test", "attainment_target": 0.9, "per_prompt_len": {"1024": asdict(slo) if slo else None}},
        "goodput": sv_slo.goodput_summary(results),
        "goodput_by_tpot_slo": sv_slo.tpot_slo_sweep(
            results, {1024: slo}, {1024: {"tpot_ms": 10.0}}, factors=(1.25, 3.0)
        ),
        "goals": sv_report.goals(results, derived),
    }
    out: dict[str, Any] = sv._jsonable(res)
    return out


def test_markdown_shows_two_plain_and_goodput(tmp_path: Path) -> None:
    results = _sweep()
    sv_slo.apply_slo(results, {1024: SLO})
    results["two_plain"][1].cpu_cal_ms = [11.5, 17.25]
    md = sv_report.markdown(_res(results, SLO))
    assert "| 1024 | 16 | 2 | 10 | two_plain | 10 |" in md
    assert next(line for line in md.splitlines() if "| 1024 | 16 | 2 | 10 | two_plain |" in line).endswith(
        "| 11.5 / 17.2 |"
    )
    assert md.count("| prefill_only |") == 1  # the max_tokens=1 reference, once per prompt length and rate
    assert "| 1024 | 1 | 1 | 10 | prefill_only | 10 |" in md
    assert "### Goodput" in md and "TTFT ≤ 500 ms, TPOT ≤ 20.0 ms" in md
    row = next(line for line in md.splitlines() if line.startswith("| 1024 | 16 | 500 | 20.0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4:6] == [
        f"1 ({results['single'][0].goodput_rps:.2f})",
        f"2 ({results['two_plain'][1].goodput_rps:.2f})",
    ]
    assert len(cells) == 6  # the setups that ran, no column for pull, push, ours... not run
    assert "across TPOT targets" in md
    tight = next(line for line in md.splitlines() if line.startswith("| 1024 | 16 | 1.25 × unloaded | 12.5 |"))
    assert [c.strip() for c in tight.strip("|").split("|")][4] == "1 (" + f"{results['single'][0].goodput_rps:.2f})"
    written = sv_report.plots(_res(results, SLO), tmp_path, "t")
    assert sorted(Path(p).name for p in written) == ["t_goodput.png", "t_tpot.png", "t_ttft.png"]
    assert all(Path(p).stat().st_size > 0 for p in written)


def test_markdown_without_slo_says_so() -> None:
    results = _sweep()
    sv_slo.apply_slo(results, {1024: None})
    md = sv_report.markdown(_res(results, None))
    assert "SLOs unknown" in md
    assert "| 1024 | 16 | 2 | 10 | two_plain | 10 |" in md


def test_tpot_slo_sweep_says_where_each_setup_meets_which_target() -> None:
    """TPOT 20 ms per request for single, 12 ms for two_plain: at 1.25 x a 10 ms unloaded TPOT only
    two_plain meets it; at 3 x both do, up to the rates their TTFTs allow. The points keep their
    own SLO fields."""
    results = _sweep()
    for name, tpot in (("single", 20.0), ("two_plain", 12.0)):
        for r in results[name]:
            r.req_tpot_ms = [tpot] * len(r.req_tpot_ms)
    sv_slo.apply_slo(results, {1024: SLO})
    before = [(r.slo_tpot_ms, r.slo_met) for r in results["single"]]
    rows = sv_slo.tpot_slo_sweep(results, {1024: SLO}, {1024: {"tpot_ms": 10.0}}, factors=(1.25, 3.0))
    assert [(r["tpot_factor"], r["slo_tpot_ms"]) for r in rows] == [(1.25, 12.5), (3.0, 30.0)]
    tight, loose = rows
    assert tight["slo_ttft_ms"] == SLO.ttft_ms
    assert tight["setups"]["single"]["max_rate"] is None
    assert tight["setups"]["single"]["rates"] == [1.0, 2.0, 4.0, 8.0]
    assert tight["setups"]["two_plain"]["max_rate"] == 2.0
    assert loose["setups"]["single"]["max_rate"] == 1.0
    assert loose["setups"]["two_plain"]["max_rate"] == 2.0
    assert [(r.slo_tpot_ms, r.slo_met) for r in results["single"]] == before
    assert sv_slo.tpot_slo_sweep(results, {1024: None}, {1024: {"tpot_ms": 10.0}}) == []


# ----- interleaved setups ------------------------------------------------------------------------------


def test_interleaving_covers_every_setup_once_per_run_of_k_arrivals() -> None:
    which = sv.interleaving(30, 3, seed=0)
    assert len(which) == 30
    for i in range(0, 30, 3):
        assert sorted(which[i : i + 3]) == [0, 1, 2]
    assert which == sv.interleaving(30, 3, seed=0)  # seeded: the same in every run
    assert which != sv.interleaving(30, 3, seed=1)
    assert len({tuple(which[i : i + 3]) for i in range(0, 30, 3)}) > 1  # not one fixed order
    assert sorted(sv.interleaving(4, 3, seed=0)[3:]) in ([0], [1], [2])  # a partial last run


def test_summarize_with_a_share_scales_throughput_and_goodput() -> None:
    pt = Point(1024, 3.0, 2, 16)
    samples = []
    for i in range(2):
        s = Sample(ok=True, sent=float(i))
        s.ttft, s.tpot, s.done = 0.1, 0.01, float(i) + 1.0
        samples.append(s)
    whole, third = sv_model.summarize("ours", pt, samples), sv_model.summarize("ours", pt, samples, share=1 / 3)
    assert whole.duration_s == pytest.approx(2.0) and whole.throughput_rps == pytest.approx(1.0)
    assert third.throughput_rps == pytest.approx(3.0) and third.share == pytest.approx(1 / 3)
    results = {"ours": [third]}
    sv_slo.apply_slo(results, {1024: SLO})
    assert third.slo_met == 2 and third.goodput_rps == pytest.approx(3.0)
    [row] = sv_slo.tpot_slo_sweep(results, {1024: SLO}, {1024: {"tpot_ms": 10.0}}, factors=(3.0,))
    assert row["setups"]["ours"]["goodput_rps_at_max_rate"] == pytest.approx(3.0)


class _FakeHarness:
    def __init__(self, tmp_path: Path) -> None:
        self.args = sv.parse_args(["--seed", "0", "--settle-s", "0"])
        self.model = sv_model.ModelInfo(
            layers=2, kv_heads=4, head_dim=32, dtype_bytes=2, vocab=1000, max_positions=4096
        )
        self.notes: list[str] = []
        self.cores_before = sorted(os.sched_getaffinity(0))
        self.p_core, self.d_core = self.cores_before[0], self.cores_before[-1]

    def note(self, msg: str) -> None:
        self.notes.append(msg)


def test_measure_interleaved_sends_each_setup_its_own_requests_in_one_stream(tmp_path: Path) -> None:
    seen: dict[str, list[tuple[int, float]]] = {"a": [], "b": [], "c": []}

    def fake(name: str) -> sv_proxies.Proxy:
        async def run(prompt: list[int], max_tokens: int, s: Sample) -> None:
            seen[name].append((prompt[0], s.sent))
            s.ok, s.ttft, s.tpot, s.done = True, 0.01, 0.001, s.sent + 0.02

        return run

    logs = (tmp_path / "p.log", tmp_path / "d.log")
    for p in logs:
        p.write_text("")
    h = _FakeHarness(tmp_path)
    pt = Point(64, 500.0, 4, 16)
    res = asyncio.run(
        sv.measure_interleaved([(n, fake(n)) for n in ("a", "b", "c")], [pt], h, logs)  # type: ignore[arg-type]
    )
    assert sorted(res) == ["a", "b", "c"]
    for name in "abc":
        [r] = res[name]
        assert r.requests == 4 and r.ok == 4 and r.share == pytest.approx(1 / 3) and r.rate == 500.0
        assert len(seen[name]) == 4
        # The VM's speed on P's and D's core right after the point, the same for every setup of it.
        assert len(r.cpu_cal_ms) == 2 and all(ms > 0 for ms in r.cpu_cal_ms) and r.cpu_cal_ms == res["a"][0].cpu_cal_ms
    assert os.sched_getaffinity(0) == set(h.cores_before)  # the calibration gave the process its CPUs back
    # One arrival stream: the setups' requests alternate in time, and every prompt was sent once.
    firsts = sorted((t, n) for n, calls in seen.items() for _, t in calls)
    assert {n for _, n in firsts[:3]} == {"a", "b", "c"}
    prompts = [p for calls in seen.values() for p, _ in calls]
    assert len(prompts) == 12
    assert sorted(prompts) == sorted(p[0] for p in sv.prompts_for(Point(64, 500.0, 12, 16), 1000, 0))
    assert len(h.notes) == 3


def test_interleave_flag() -> None:
    assert sv.parse_args(["--interleave"]).interleave is True
    assert sv.parse_args([]).interleave is False
    assert sv.parse_args([]).paired_single_core is None
    assert sv.parse_args(["--setups", "ours", "--paired-single-core", "1"]).paired_single_core == 1
    with pytest.raises(SystemExit):
        sv.parse_args(["--setups", "single,two_plain", "--paired-single-core", "1"])  # nothing to pair with


def test_paired_rows_compare_our_setups_with_the_plain_vllm_of_the_same_stream() -> None:
    """TTFT as a difference, TPOT (per request and from the 2nd token) as a ratio, per point where
    single_paired ran; a setup that did not run at that point has no entry."""
    lo, hi = Point(1024, 0.5, 10, 16), Point(1024, 1.5, 10, 16)
    results = {
        "single_paired": [_result("single_paired", pt, [0.030] * 10, tpot_s=0.004) for pt in (lo, hi)],
        "ours_ft": [_result("ours_ft", pt, [0.0335] * 10, tpot_s=0.0042) for pt in (lo, hi)],
        "ours_grpc": [_result("ours_grpc", lo, [0.0290] * 10, tpot_s=0.005)],
        "single": [_result("single", lo, [0.010] * 10, tpot_s=0.001)],  # another launch: not a reference here
    }
    results["single_paired"][0].tpot_rest_p50_ms, results["ours_grpc"][0].tpot_rest_p50_ms = 4.0, 5.0
    results["ours_ft"][0].ttft_answer_p50_ms = 37.0  # the prefill leg's answer, same requests
    rows = sv_report.paired(results)
    assert [(r["rate"], r["max_tokens"]) for r in rows] == [(0.5, 16), (1.5, 16)]
    low = rows[0]
    assert low["plain_ttft_p50_ms"] == pytest.approx(30.0)
    assert low["ttft_ours_ft-plain_ms"] == pytest.approx(3.5)
    assert low["ttft_ours_grpc-plain_ms"] == pytest.approx(-1.0)
    assert low["tpot_ours_ft/plain"] == pytest.approx(1.05)
    assert low["ttft_ours_ft_answer-plain_ms"] == pytest.approx(7.0)
    assert "ttft_ours_ft_answer-plain_ms" not in rows[1]  # not measured there
    assert low["tpot2_ours_grpc/plain"] == pytest.approx(1.25)
    assert "ttft_ours-plain_ms" not in low  # ours did not run
    assert "ttft_ours_grpc-plain_ms" not in rows[1]
    res = _res(results, None)
    res["paired"] = sv._jsonable(rows)
    md = sv_report.markdown(res)
    line = next(x for x in md.splitlines() if x.startswith("| 1024 | 16 | 0.5 | 30.0 |"))
    assert "– / +3.5 / -1.0 | +7.0 |" in line and "– / 1.050 / 1.250" in line and line.endswith("| – / – / 1.250 |")
    assert "### Paired against one plain vLLM" in md
    assert "### Paired against" not in sv_report.markdown(_res(_sweep(), None))  # no single_paired: no section


def test_a_paired_benchmark_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json
    import time

    args = argparse.Namespace(out=tmp_path / "r.json", log_dir=tmp_path / "logs", rounds=3)
    res: dict[str, Any] = {"p50": 1.5}
    from benchmarks.paired import write_report

    write_report(args, res, lambda r: f"p50 {r['p50']} load {r['load_before']}", 0.25, time.monotonic())
    written = json.loads(args.out.read_text())
    assert written["p50"] == 1.5 and written["load_before"] == 0.25 and written["total_seconds"] >= 0
    assert written["config"]["rounds"] == 3 and written["config"]["log_dir"] == "logs"  # outside the repo: its name
    assert args.out.with_suffix(".md").read_text() == "p50 1.5 load 0.25"
    assert "p50 1.5 load 0.25" in capsys.readouterr().out

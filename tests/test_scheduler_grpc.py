"""The Scheduler service over real gRPC on 127.0.0.1 (in-process grpc.aio server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from scheduler_support import WAIT_S, FakeInstance, info, next_event, run, scheduler, wait_for

from kvpush.services.common import transfer_params
from kvpush.services.scheduler.main import config_from_args, parse_args
from kvpush.v1 import kvpush_pb2 as pb

EV = pb.InstanceEventKind


def test_register_watch_and_lease_expiry() -> None:
    async def body() -> None:
        async with scheduler(interval_s=0.05, misses=2) as (server, stub, _):
            watch = stub.Watch(pb.WatchRequest())
            # Watch is live once it answers; a registration before that could be missed.
            await wait_for(lambda: len(server.servicer._subscribers) == 1)
            d = await FakeInstance(stub, info("d0")).start()
            p = await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.engine_id) == (EV.INSTANCE_EVENT_KIND_REGISTERED, "d0")
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.engine_id) == (EV.INSTANCE_EVENT_KIND_REGISTERED, "p0")
            resp = await stub.Assign(pb.AssignRequest(prompt_tokens=32), timeout=WAIT_S)
            # Prefill stops reporting (hung, stream still open): its lease runs out.
            p.reporting.clear()
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.engine_id) == (EV.INSTANCE_EVENT_KIND_DEAD, "p0")
            assert "lease expired" in ev.reason
            # Its open assignment stays open: the decode engine holds the reservation and reroutes
            # the transfer (or fails the request) itself.
            listing = await stub.ListInstances(pb.ListInstancesRequest(), timeout=WAIT_S)
            assert [(s.instance.engine_id, s.open_assignments, s.alive) for s in listing.instances] == [("d0", 1, True)]
            assert "lease expired" in server.registry.open[resp.transfer_id].prefill_lost
            # The decode kept reporting all along, and stays.
            assert d.acks >= 1
            expiries = server.metrics.registry.get_sample_value(
                "kvpush_scheduler_lease_expiries_total", {"role": "prefill", "cause": "lease"}
            )
            assert expiries == 1.0
            # Reports from the dead instance are refused: it must register again.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                call = stub.ReportLoad(iter([p.report()]))
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            watch.cancel()
            await d.close()

    run(body())


def test_stream_end_and_reregistration() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            watch = stub.Watch(pb.WatchRequest())
            await wait_for(lambda: len(server.servicer._subscribers) == 1)
            a = await FakeInstance(stub, info("a")).start()
            b = await FakeInstance(stub, info("b")).start()
            for _ in range(2):
                assert (await next_event(watch)).kind == EV.INSTANCE_EVENT_KIND_REGISTERED
            await a.close()
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.engine_id) == (EV.INSTANCE_EVENT_KIND_DRAINING, "a")
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.engine_id) == (EV.INSTANCE_EVENT_KIND_DEREGISTERED, "a")
            b.cancel()
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.engine_id, ev.reason) == (
                EV.INSTANCE_EVENT_KIND_DEAD,
                "b",
                "load stream lost",
            )
            # Restart with a new incarnation replaces the old one, which is reported dead first.
            c1 = await FakeInstance(stub, info("c", incarnation="one")).start()
            assert (await next_event(watch)).instance.incarnation == "one"
            c2 = await FakeInstance(stub, info("c", incarnation="two")).start()
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.incarnation) == (EV.INSTANCE_EVENT_KIND_DEAD, "one")
            assert "replaced" in ev.reason
            ev = await next_event(watch)
            assert (ev.kind, ev.instance.incarnation) == (EV.INSTANCE_EVENT_KIND_REGISTERED, "two")
            # The old incarnation's stream is refused on its next report.
            await asyncio.wait_for(c1._task, WAIT_S)  # type: ignore[arg-type]
            assert await c1._call.code() == grpc.StatusCode.FAILED_PRECONDITION
            # include_current replays the live instances.
            w2 = stub.Watch(pb.WatchRequest(include_current=True))
            ev = await next_event(w2)
            assert (ev.kind, ev.instance.incarnation) == (EV.INSTANCE_EVENT_KIND_REGISTERED, "two")
            w2.cancel()
            watch.cancel()
            await c2.close()

    run(body())


def test_assign_skewed_load_and_params() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0, settle_s=10.0) as (server, stub, _):
            insts = [
                await FakeInstance(stub, info("p0", pb.ROLE_PREFILL, tp=2)).start(),
                await FakeInstance(stub, info("d-a"), free_blocks=950).start(),
                await FakeInstance(stub, info("d-b"), free_blocks=900).start(),
                await FakeInstance(stub, info("d-hot"), free_blocks=100).start(),
            ]
            await wait_for(lambda: all(i.acks >= 1 for i in insts))
            chosen: Counter[str] = Counter()
            for _ in range(100):
                a = await stub.Assign(pb.AssignRequest(prompt_tokens=40, max_tokens=8), timeout=WAIT_S)
                chosen[a.decode.engine_id] += 1
            assert chosen["d-hot"] == 0 and chosen["d-a"] > 0 and chosen["d-b"] > 0
            # The scheduler's own unreported assignments (3 blocks each) count against the decodes.
            free = {i.engine_id: i.projected_free for i in server.registry.snapshot() if i.engine_id != "p0"}
            assert free["d-a"] + free["d-b"] == 950 + 900 - 3 * 100 and free["d-hot"] == 100
            # Both legs' params follow the shared contract.
            assert a.prefill.engine_id == "p0" and a.epoch > 0 and len(a.transfer_id) == 32
            dleg = transfer_params.parse(MessageToDict(a.decode_kv_transfer_params))
            pleg = transfer_params.parse(MessageToDict(a.prefill_kv_transfer_params))
            assert dleg == transfer_params.DecodeLeg(
                transfer_id=a.transfer_id,
                epoch=a.epoch,
                prefill_engine_id="p0",
                prefill_incarnation="inc1",
                prefill_tp_size=2,
                prefill_agent_endpoints=["127.0.0.1:7000", "127.0.0.1:7001"],
                decode_engine_id=a.decode.engine_id,
            )
            assert pleg == transfer_params.PrefillLeg(
                transfer_id=a.transfer_id, decode_engine_id=a.decode.engine_id, prefill_engine_id="p0", epoch=a.epoch
            )
            sample = server.metrics.registry.get_sample_value
            assert sample("kvpush_scheduler_decisions_total", {"role": "prefill", "engine_id": "p0"}) == 100
            assert sample("kvpush_scheduler_assign_seconds_count") == 100
            # A caller-chosen transfer id keeps it; re-assigning it bumps the epoch.
            t1 = await stub.Assign(pb.AssignRequest(prompt_tokens=1, transfer_id="mine"), timeout=WAIT_S)
            t2 = await stub.Assign(pb.AssignRequest(prompt_tokens=1, transfer_id="mine"), timeout=WAIT_S)
            assert t1.transfer_id == "mine" and t2.epoch > t1.epoch
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Release(pb.ReleaseRequest(transfer_id="mine", epoch=t1.epoch, outcome=pb.OUTCOME_OK))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await stub.Release(pb.ReleaseRequest(transfer_id="mine", epoch=t2.epoch, outcome=pb.OUTCOME_OK))
            for i in insts:
                await i.close()

    run(body())


def test_admission_rejects_and_queues_within_deadline() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0, settle_s=10.0) as (server, stub, _):
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            await FakeInstance(stub, info("d0", blocks=10)).start()
            first = await stub.Assign(pb.AssignRequest(prompt_tokens=16 * 7), timeout=WAIT_S)  # 8 blocks
            # No deadline: refused at once, with the reason.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Assign(pb.AssignRequest(prompt_tokens=16 * 7))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "no decode instance can hold 8 KV blocks" in e.value.details()
            # Larger than any decode: refused at once even with a deadline.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Assign(pb.AssignRequest(prompt_tokens=16 * 20), timeout=WAIT_S)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "largest" in e.value.details()
            # With a deadline it queues until capacity frees up.
            queued = asyncio.ensure_future(stub.Assign(pb.AssignRequest(prompt_tokens=16 * 7), timeout=WAIT_S))
            await wait_for(lambda: server.servicer._queued == 1)
            assert not queued.done()
            await stub.Release(
                pb.ReleaseRequest(transfer_id=first.transfer_id, epoch=first.epoch, outcome=pb.OUTCOME_OK)
            )
            second = await queued
            assert second.decode.engine_id == "d0"
            # Queued until the deadline: RESOURCE_EXHAUSTED with the reason, before DEADLINE_EXCEEDED.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Assign(pb.AssignRequest(prompt_tokens=16 * 7), timeout=0.2)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queued until the deadline" in e.value.details()
            sample = server.metrics.registry.get_sample_value
            assert sample("kvpush_scheduler_rejections_total", {"reason": "no_capacity"}) == 2
            assert sample("kvpush_scheduler_rejections_total", {"reason": "too_large"}) == 1

    run(body())


def test_many_concurrent_assign_clients() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            await FakeInstance(stub, info("p1", pb.ROLE_PREFILL)).start()
            for n in range(4):
                await FakeInstance(stub, info(f"d{n}", blocks=100_000)).start()
            channels = [grpc.aio.insecure_channel(server.address) for _ in range(4)]
            stubs = [type(stub)(c) for c in channels]

            async def client(k: int) -> list[pb.Assignment]:
                out = []
                for _ in range(10):
                    a = await stubs[k % 4].Assign(pb.AssignRequest(prompt_tokens=100), timeout=WAIT_S)
                    out.append(a)
                return out

            results = [a for batch in await asyncio.gather(*(client(k) for k in range(40))) for a in batch]
            assert len({a.transfer_id for a in results}) == 400
            assert len({a.epoch for a in results}) == 400
            assert len(server.registry.open) == 400
            per_decode = Counter(a.decode.engine_id for a in results)
            assert set(per_decode) == {"d0", "d1", "d2", "d3"} and min(per_decode.values()) > 50
            await asyncio.gather(
                *(
                    stubs[0].Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK))
                    for a in results
                )
            )
            assert not server.registry.open
            for c in channels:
                await c.close()

    run(body())


def test_malformed_requests() -> None:
    async def body() -> None:
        async with scheduler(interval_s=1.0) as (server, stub, _):

            async def code_of(coro: object) -> grpc.StatusCode:
                try:
                    await coro  # type: ignore[misc]
                except grpc.aio.AioRpcError as e:
                    return e.code()
                raise AssertionError("expected an error")

            bad = info("x")
            bad.role = pb.ROLE_UNSPECIFIED
            inv = grpc.StatusCode.INVALID_ARGUMENT
            assert await code_of(stub.Register(pb.RegisterRequest(instance=bad))) == inv
            assert await code_of(stub.Register(pb.RegisterRequest())) == inv
            bad = info("x", tp=2)
            del bad.agent_endpoints[1]
            assert await code_of(stub.Register(pb.RegisterRequest(instance=bad))) == inv
            assert await code_of(stub.Assign(pb.AssignRequest(prompt_tokens=0))) == inv
            assert await code_of(stub.Assign(pb.AssignRequest(prompt_tokens=1 << 30))) == inv
            assert await code_of(stub.Release(pb.ReleaseRequest(transfer_id="", epoch=1, outcome=1))) == inv
            await FakeInstance(stub, info("p0", pb.ROLE_PREFILL)).start()
            await FakeInstance(stub, info("d0")).start()
            a = await stub.Assign(pb.AssignRequest(prompt_tokens=5), timeout=WAIT_S)
            assert await code_of(stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch))) == inv
            assert (
                await code_of(stub.Release(pb.ReleaseRequest(transfer_id="nope", epoch=1, outcome=pb.OUTCOME_OK)))
                == grpc.StatusCode.NOT_FOUND
            )
            assert (
                await code_of(
                    stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch - 1, outcome=pb.OUTCOME_OK))
                )
                == grpc.StatusCode.FAILED_PRECONDITION
            )
            # Registering an existing engine under the other role.
            assert (
                await code_of(stub.Register(pb.RegisterRequest(instance=info("d0", pb.ROLE_PREFILL, "new"))))
                == grpc.StatusCode.FAILED_PRECONDITION
            )
            # One load stream speaks for one instance only.
            reports = [
                pb.LoadReport(engine_id="d0", incarnation="inc1", free_blocks=5),
                pb.LoadReport(engine_id="p0", incarnation="inc1", free_blocks=5),
            ]
            call = stub.ReportLoad(iter(reports))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == inv
            # Generate validation happens before any assignment.
            for req in (
                pb.GenerateRequest(max_tokens=4),
                pb.GenerateRequest(prompt_token_ids=[1], max_tokens=0),
                pb.GenerateRequest(prompt_token_ids=[1], max_tokens=1, temperature=-1),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(req):
                        pass
                assert e.value.code() == inv
            # The server is still fine.
            assert (await stub.ListInstances(pb.ListInstancesRequest())).instances

    run(body())


def test_health_and_reflection() -> None:
    async def body() -> None:
        async with scheduler() as (server, _stub, channel):
            health = health_pb2_grpc.HealthStub(channel)
            resp = await health.Check(health_pb2.HealthCheckRequest(service="kvpush.v1.Scheduler"), timeout=WAIT_S)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name async for r in call for s in r.list_services_response.service]
            assert "kvpush.v1.Scheduler" in names and "grpc.health.v1.Health" in names

    run(body())


def test_flags_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPUSH_SCHEDULER_LEASE_INTERVAL_MS", "250")
    monkeypatch.setenv("KVPUSH_SCHEDULER_DECODE_POLICY", "least")
    args = parse_args(["--lease-misses", "5", "--insecure"])
    cfg = config_from_args(args)
    assert cfg.lease.interval_s == 0.25 and cfg.lease.misses == 5 and cfg.decode_policy == "least"
    with pytest.raises(SystemExit):
        parse_args(["--lease-misses", "0"])


def test_main_process_sigterm(tmp_path: Path) -> None:
    """The console entry point: READY=1 to $NOTIFY_SOCKET, metrics served, clean exit on SIGTERM."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(WAIT_S * 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    env = {
        **os.environ,
        "KVPUSH_SCHEDULER_LISTEN": "127.0.0.1:0",
        "KVPUSH_SCHEDULER_INSECURE": "1",
        "KVPUSH_SCHEDULER_METRICS_PORT": str(metrics_port),
        "KVPUSH_SCHEDULER_METRICS_ADDR": "127.0.0.1",
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpush.services.scheduler.main"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stderr is not None
        ready = notify.recv(4096).decode()  # blocks until the server says it is ready
        assert ready.startswith("READY=1") and "serving on 127.0.0.1:" in ready
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT_S) as resp:
            assert b"kvpush_scheduler_instances" in resp.read()
        proc.send_signal(signal.SIGTERM)
        assert notify.recv(4096).decode() == "STOPPING=1"
        rest = proc.stderr.read()
        assert proc.wait(timeout=WAIT_S * 2) == 0
        events = [json.loads(line)["event"] for line in rest.splitlines() if line.startswith("{")]
        # Plaintext only as asked for (KVPUSH_SCHEDULER_INSECURE), and said so first.
        assert events[:2] == ["plaintext_grpc", "scheduler_started"] and "scheduler_ready" in events
        assert events[-2:] == ["scheduler_stopping", "scheduler_stopped"]
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()

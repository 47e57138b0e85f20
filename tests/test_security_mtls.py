"""Mutual TLS on every gRPC hop, and what a certificate's identity may do.

Real gRPC with real certificates (``dev_certs``): the scheduler in process, a prefill agent and a
decode engine (ranks + agent) as separate processes with real NIXL (``start_cluster(tls_dir=...)``).
Each attack is made by a peer holding a valid certificate of the cluster CA unless said otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.connector.registration import Registration
from kvpush.services.common import limits
from kvpush.services.common.security import (
    DECODE_RANK_POLICY,
    PREFILL_AGENT_POLICY,
    SCHEDULER_POLICY,
    PeerIdentity,
    Security,
    SecurityError,
    TlsFiles,
    claim_problem,
    decide,
    parse_spiffe_id,
)
from kvpush.services.scheduler.main import parse_args, security_from_args
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from scripts.make_certs import make_certs
from tests.scheduler_support import WAIT_S, FakeInstance, info, run, scheduler, wait_for
from tests.scheduler_support import status_code as _code
from tests.transfer_nodes import Cluster, shape, start_cluster

DENIED = grpc.StatusCode.PERMISSION_DENIED
TOKENS = 40


def sec(certs: Path, name: str) -> Security:
    return Security.mtls(TlsFiles.in_dir(certs, name))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA's PKI with the same names: valid-looking certificates the cluster must refuse."""
    return make_certs(tmp_path_factory.mktemp("other-ca"), engines=["decode-0", "prefill-0", "decode-mtls"])


def _no_client_cert(certs: Path) -> grpc.ChannelCredentials:
    """Verifies the server like a real client, but presents no certificate."""
    return grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())


def _foreign(certs: Path, other_ca: Path, name: str) -> grpc.ChannelCredentials:
    """Trusts the cluster CA (so the server is accepted) but presents a certificate of another CA."""
    files = TlsFiles.in_dir(other_ca, name)
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=Path(files.key_file).read_bytes(),
        certificate_chain=Path(files.cert_file).read_bytes(),
    )


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _refused_handshakes(certs: Path, other_ca: Path, address: str) -> None:
    """A valid certificate is served; no certificate, another CA's, or plaintext are not."""
    with sec(certs, "frontend").sync_channel(address) as ch:
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
    for creds in (_no_client_cert(certs), _foreign(certs, other_ca, "decode-0")):
        with grpc.secure_channel(address, creds) as ch, pytest.raises(grpc.RpcError) as err:
            _health(ch)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        _health(ch)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


GARBAGE = [
    b"\x00" * 64,
    os.urandom(4096),
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(512),  # an h2c preface on a TLS port
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(300),  # a truncated ClientHello
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
]


def _spray(address: str) -> None:
    """Raw bytes that are no TLS handshake, each on its own connection, some left half open."""
    host, port = address.rsplit(":", 1)
    held = []
    for blob in GARBAGE:
        s = socket.create_connection((host, int(port)), timeout=5)
        with contextlib.suppress(OSError):  # the server may already have closed it
            s.sendall(blob)
        held.append(s)
    time.sleep(0.2)
    for s in held:
        s.close()


# ----- pure parts ---------------------------------------------------------------------------------


def test_policies_and_decisions() -> None:
    """Every method of every service has a rule; the rule table says who may call what."""
    assert len(SCHEDULER_POLICY) == 12 and len(PREFILL_AGENT_POLICY) == 1 and len(DECODE_RANK_POLICY) == 3
    register = SCHEDULER_POLICY["/kvpush.v1.Scheduler/Register"]
    assign = SCHEDULER_POLICY["/kvpush.v1.Scheduler/Assign"]
    assign_stream = SCHEDULER_POLICY["/kvpush.v1.Scheduler/AssignStream"]
    leg_failure = SCHEDULER_POLICY["/kvpush.v1.Scheduler/ReportLegFailure"]
    complete = DECODE_RANK_POLICY["/kvpush.v1.DecodeRank/Complete"]
    expect = DECODE_RANK_POLICY["/kvpush.v1.DecodeRank/Expect"]
    d0, p0, fe = PeerIdentity("decode", "d0"), PeerIdentity("prefill", "p0"), PeerIdentity("frontend", "ops")
    assert decide(register, d0, "") is None and decide(register, p0, "") is None
    assert decide(register, fe, "")[0] is DENIED  # type: ignore[index]
    assert decide(assign, fe, "") is None and decide(assign, d0, "")[0] is DENIED  # type: ignore[index]
    # The batched frontend API is the frontend's alone, like Assign and Release.
    assert decide(assign_stream, fe, "") is None
    assert decide(assign_stream, d0, "")[0] is DENIED and decide(assign_stream, p0, "")[0] is DENIED  # type: ignore[index]
    # First tokens come from prefill engines only (each in its own name: the handler checks that).
    first_tokens = SCHEDULER_POLICY["/kvpush.v1.Scheduler/ReportFirstTokens"]
    assert decide(first_tokens, p0, "") is None
    assert decide(first_tokens, d0, "")[0] is DENIED and decide(first_tokens, fe, "")[0] is DENIED  # type: ignore[index]
    # A transfer's first token is the frontend's (the request's output), not an engine's to read.
    await_token = SCHEDULER_POLICY["/kvpush.v1.Scheduler/AwaitFirstToken"]
    assert decide(await_token, fe, "") is None
    assert decide(await_token, d0, "")[0] is DENIED and decide(await_token, p0, "")[0] is DENIED  # type: ignore[index]
    # Only a frontend reports an undelivered leg: an engine could otherwise fail others' transfers.
    assert decide(leg_failure, fe, "") is None
    assert decide(leg_failure, d0, "")[0] is DENIED and decide(leg_failure, p0, "")[0] is DENIED  # type: ignore[index]
    assert decide(complete, p0, "d0") is None and decide(complete, d0, "d0")[0] is DENIED  # type: ignore[index]
    assert decide(expect, d0, "d0") is None and decide(expect, d0, "d1")[0] is DENIED  # type: ignore[index]
    assert decide(expect, None, "d0")[0] is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[index]
    assert decide(None, fe, "")[0] is DENIED  # type: ignore[index]
    assert claim_problem(None, "anyone") is None  # plaintext: no identity, nothing to bind
    assert claim_problem(d0, "d0", "decode") is None
    assert claim_problem(d0, "d1") and claim_problem(d0, "d0", "prefill")


def test_spiffe_ids() -> None:
    assert parse_spiffe_id("spiffe://kvpush/decode/decode-0") == PeerIdentity("decode", "decode-0")
    for bad in (
        "spiffe://other/decode/decode-0",
        "spiffe://kvpush/admin/x",
        "spiffe://kvpush/decode/a/b",
        "spiffe://kvpush/decode/",
        "https://kvpush/decode/d",
    ):
        assert parse_spiffe_id(bad) is None, bad


def test_make_certs_is_idempotent_and_keys_are_private(tmp_path: Path) -> None:
    out = make_certs(tmp_path / "c", engines=["prefill-0", "decode/d7"], hosts=["10.0.0.5", "node.example"])
    ca = (out / "ca.pem").read_bytes()
    leaf = (out / "d7.pem").read_bytes()
    make_certs(out, engines=["prefill-0", "decode/d7"], hosts=["10.0.0.5", "node.example"])
    assert (out / "ca.pem").read_bytes() == ca and (out / "d7.pem").read_bytes() == leaf
    make_certs(out, engines=["decode/d7"], hosts=["10.0.0.6"])  # a new host: reissued, same CA
    assert (out / "ca.pem").read_bytes() == ca and (out / "d7.pem").read_bytes() != leaf
    for key in out.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    cert = x509.load_pem_x509_certificate((out / "d7.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://kvpush/decode/d7"]
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.6"}
    assert sec(out, "d7").identity == PeerIdentity("decode", "d7")
    assert sec(out, "scheduler").identity == PeerIdentity("scheduler", "scheduler")
    make_certs(out, engines=["decode/d7"], force=True)
    assert (out / "ca.pem").read_bytes() != ca
    with pytest.raises(ValueError):
        make_certs(out, engines=["worker-1"])


def test_bad_files_fail_at_start_up(dev_certs: Path, tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="cannot read"):
        Security.mtls(TlsFiles.in_dir(dev_certs, "nobody"))
    mixed = TlsFiles(str(dev_certs / "ca.pem"), str(dev_certs / "decode-0.pem"), str(dev_certs / "decode-1.key"))
    with pytest.raises(SecurityError, match="does not belong"):
        Security.mtls(mixed)
    (tmp_path / "empty.pem").write_text("")
    with pytest.raises(SecurityError, match="no PEM"):
        Security.mtls(TlsFiles(str(tmp_path / "empty.pem"), mixed.cert_file, str(dev_certs / "decode-0.key")))


def _kv(role: str, engine_id: str, **extra: Any) -> Any:
    return SimpleNamespace(kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra)


def test_connector_requires_tls_or_explicit_insecure(dev_certs: Path) -> None:
    with pytest.raises(ConfigError, match="mutual TLS"):
        ConnectorConfig.from_vllm(_kv("kv_consumer", "decode-0"))
    with pytest.raises(ConfigError, match="tls_key_file"):
        ConnectorConfig.from_vllm(_kv("kv_consumer", "decode-0", tls_ca_file="ca", tls_cert_file="c", insecure=True))
    files = TlsFiles.in_dir(dev_certs, "decode-0")
    tls = {"tls_ca_file": files.ca_file, "tls_cert_file": files.cert_file, "tls_key_file": files.key_file}
    assert ConnectorConfig.from_vllm(_kv("kv_consumer", "decode-0", **tls)).security("t").secure
    # A certificate must name this very engine and role.
    for role, engine in (("kv_consumer", "decode-1"), ("kv_producer", "decode-0")):
        with pytest.raises(ConfigError, match="spiffe://kvpush/decode/decode-0"):
            ConnectorConfig.from_vllm(_kv(role, engine, **tls)).security("t")
    assert not ConnectorConfig.from_vllm(_kv("kv_consumer", "decode-0", insecure=True)).security("t").secure


def test_scheduler_cli_requires_tls_or_explicit_insecure(dev_certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TLS_CA", "TLS_CERT", "TLS_KEY", "INSECURE"):
        monkeypatch.delenv(f"KVPUSH_SCHEDULER_{var}", raising=False)
    with pytest.raises(SystemExit, match="--tls-ca"):
        security_from_args(parse_args([]))
    with pytest.raises(SystemExit, match="--tls-key"):
        security_from_args(parse_args(["--insecure", "--tls-ca", "x", "--tls-cert", "y"]))
    assert not security_from_args(parse_args(["--insecure"])).secure
    files = TlsFiles.in_dir(dev_certs, "scheduler")
    monkeypatch.setenv("KVPUSH_SCHEDULER_TLS_CA", files.ca_file)
    monkeypatch.setenv("KVPUSH_SCHEDULER_TLS_CERT", files.cert_file)
    monkeypatch.setenv("KVPUSH_SCHEDULER_TLS_KEY", files.key_file)
    assert security_from_args(parse_args([])).identity == PeerIdentity("scheduler", "scheduler")
    with pytest.raises(SystemExit, match="cannot read"):
        security_from_args(parse_args(["--tls-key", str(dev_certs / "missing.key")]))


# ----- the scheduler ------------------------------------------------------------------------------


def test_scheduler_port_refuses_unauthenticated_peers_and_survives_garbage(dev_certs: Path, other_ca: Path) -> None:
    async def body() -> None:
        async with scheduler(security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")) as (
            server,
            stub,
            _,
        ):
            await asyncio.to_thread(_refused_handshakes, dev_certs, other_ca, server.address)
            await asyncio.to_thread(_spray, server.address)
            assert (await stub.ListInstances(pb.ListInstancesRequest(), timeout=WAIT_S)).instances == []

    run(body())


def test_engines_register_and_report_only_as_themselves(dev_certs: Path) -> None:
    async def body() -> None:
        async with scheduler(
            interval_s=0.1, security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")
        ) as (server, frontend, _):
            d0 = sec(dev_certs, "decode-0").aio_channel(server.address)
            d1 = sec(dev_certs, "decode-1").aio_channel(server.address)
            try:
                as_d0, as_d1 = pb_grpc.SchedulerStub(d0), pb_grpc.SchedulerStub(d1)
                victim = await FakeInstance(as_d1, info("decode-1")).start()
                await wait_for(lambda: victim.acks > 2)

                def reg(stub: pb_grpc.SchedulerStub, inst: pb.InstanceInfo) -> Any:
                    return stub.Register(pb.RegisterRequest(instance=inst), timeout=WAIT_S)

                assert await _code(reg(as_d0, info("decode-1", incarnation="evil"))) is DENIED
                assert await _code(reg(as_d0, info("decode-0", role=pb.ROLE_PREFILL))) is DENIED
                assert await _code(reg(as_d0, info("decode-0"))) is grpc.StatusCode.OK

                async def reports() -> Any:
                    yield pb.LoadReport(engine_id="decode-1", incarnation="inc1", draining=True)

                assert await _code(_drain(as_d0.ReportLoad(reports(), timeout=WAIT_S))) is DENIED
                # decode-1 is untouched: alive, same incarnation, still reporting.
                acks = victim.acks
                await wait_for(lambda: victim.acks > acks + 2)
                live = {
                    s.instance.engine_id: s
                    for s in (await frontend.ListInstances(pb.ListInstancesRequest(), timeout=WAIT_S)).instances
                }
                assert live["decode-1"].alive and live["decode-1"].instance.incarnation == "inc1"
                await victim.close()
            finally:
                await d0.close()
                await d1.close()

    run(body())


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def test_roles_bound_to_methods_on_the_scheduler(dev_certs: Path) -> None:
    """A frontend cannot register; an engine cannot use the frontend API."""

    async def body() -> None:
        async with scheduler(security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")) as (
            server,
            frontend,
            _,
        ):
            reg = pb.RegisterRequest(instance=info("frontend"))
            assert await _code(frontend.Register(reg, timeout=WAIT_S)) is DENIED
            assert await _code(_drain(frontend.ReportLoad(iter([pb.LoadReport(engine_id="x")])))) is DENIED
            for name in ("decode-0", "prefill-0", "scheduler"):
                ch = sec(dev_certs, name).aio_channel(server.address)
                try:
                    stub = pb_grpc.SchedulerStub(ch)
                    assign = stub.Assign(pb.AssignRequest(prompt_tokens=8, max_tokens=1), timeout=WAIT_S)
                    assert await _code(assign) is DENIED, name
                    assert await _code(stub.Release(pb.ReleaseRequest(transfer_id="t"), timeout=WAIT_S)) is DENIED
                    batch = pb.AssignStreamRequest(assigns=[pb.AssignRequest(prompt_tokens=8)])
                    assert await _code(_drain(stub.AssignStream(iter([batch]), timeout=WAIT_S))) is DENIED, name
                    failure = pb.LegFailure(transfer_id="t", prefill_engine_id="p")
                    assert await _code(stub.ReportLegFailure(failure, timeout=WAIT_S)) is DENIED
                    assert await _code(stub.ListInstances(pb.ListInstancesRequest(), timeout=WAIT_S)) is DENIED
                    assert await _code(_drain(stub.Watch(pb.WatchRequest(), timeout=WAIT_S))) is DENIED
                    gen = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], max_tokens=1), timeout=WAIT_S)
                    assert await _code(_drain(gen)) is DENIED
                    # Health stays open to every authenticated peer.
                    check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
                    assert (await check).status == health_pb2.HealthCheckResponse.SERVING
                finally:
                    await ch.close()
            # The frontend API works for a frontend.
            assert await _code(frontend.ListInstances(pb.ListInstancesRequest(), timeout=WAIT_S)) is grpc.StatusCode.OK
            answers = [
                r async for r in frontend.AssignStream(iter([pb.AssignStreamRequest(batch_id=3)]), timeout=WAIT_S)
            ]
            assert [a.batch_id for a in answers] == [3]

    run(body())


def test_only_the_assignments_decode_engine_reroutes_it(dev_certs: Path) -> None:
    """Reroute moves a transfer's prefill leg and makes the scheduler send a prompt to a prefill:
    only the assignment's own decode engine, in its own name, may ask; a frontend, a prefill or
    another decode engine is refused, and so are out-of-bounds prompts. Nothing moves."""

    async def body() -> None:
        async with scheduler(
            interval_s=0.5, security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")
        ) as (server, frontend, _):
            chans = {n: sec(dev_certs, n).aio_channel(server.address) for n in ("decode-0", "decode-1", "prefill-0")}
            try:
                stubs = {n: pb_grpc.SchedulerStub(c) for n, c in chans.items()}
                insts = [
                    await FakeInstance(stubs["decode-0"], info("decode-0")).start(),
                    await FakeInstance(stubs["decode-1"], info("decode-1", blocks=1)).start(),
                    await FakeInstance(stubs["prefill-0"], info("prefill-0", pb.ROLE_PREFILL)).start(),
                ]
                a = await frontend.Assign(pb.AssignRequest(prompt_tokens=32, max_tokens=1), timeout=WAIT_S)
                assert a.decode.engine_id == "decode-0"  # decode-1 has no room

                def ask(stub: pb_grpc.SchedulerStub, decode: str, prompt: list[int] | None = None) -> Any:
                    req = pb.RerouteRequest(
                        transfer_id=a.transfer_id,
                        decode_engine_id=decode,
                        failed_prefill_engine_id="prefill-0",
                        prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
                    )
                    return stub.Reroute(req, timeout=WAIT_S)

                assert await _code(ask(frontend, "decode-0")) is DENIED  # role
                assert await _code(ask(stubs["prefill-0"], "decode-0")) is DENIED  # role
                assert await _code(ask(stubs["decode-1"], "decode-0")) is DENIED  # not its own name
                not_its = await _code(ask(stubs["decode-1"], "decode-1"))  # not its assignment
                assert not_its is grpc.StatusCode.FAILED_PRECONDITION
                too_long = [1] * (limits.MAX_PROMPT_TOKENS + 1)  # above the message bound, too
                assert await _code(ask(stubs["decode-0"], "decode-0", too_long)) is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert await _code(ask(stubs["decode-0"], "decode-0", [])) is grpc.StatusCode.INVALID_ARGUMENT
                rec = server.registry.open[a.transfer_id]
                assert rec.epoch == a.epoch and rec.prefill.engine_id == "prefill-0"  # nothing moved
                # The owner is answered: no other prefill here, so the request is left to decode.
                assert await _code(ask(stubs["decode-0"], "decode-0")) is grpc.StatusCode.RESOURCE_EXHAUSTED
                for inst in insts:
                    await inst.close()
            finally:
                for c in chans.values():
                    await c.close()

    run(body())


def test_connector_registers_over_mtls(dev_certs: Path) -> None:
    """The connector's registration thread, configured as an operator would (certificate files)."""
    files = TlsFiles.in_dir(dev_certs, "decode-1")

    async def body() -> None:
        async with scheduler(security=sec(dev_certs, "scheduler"), client=sec(dev_certs, "frontend")) as (
            server,
            frontend,
            _,
        ):
            cfg = ConnectorConfig.from_vllm(
                _kv(
                    "kv_consumer",
                    "decode-1",
                    scheduler_address=server.address,
                    load_report_ms=20,
                    tls_ca_file=files.ca_file,
                    tls_cert_file=files.cert_file,
                    tls_key_file=files.key_file,
                )
            )
            reg = Registration(cfg, info("decode-1"), lambda: pb.LoadReport(free_blocks=10)).start()
            try:
                assert await asyncio.to_thread(reg.registered.wait, WAIT_S)
                live = (await frontend.ListInstances(pb.ListInstancesRequest(), timeout=WAIT_S)).instances
                assert [(s.instance.engine_id, s.alive) for s in live] == [("decode-1", True)]
            finally:
                await asyncio.to_thread(reg.stop)

    run(body())


# ----- prefill agent and decode ranks -------------------------------------------------------------


@pytest.fixture(scope="module")
def cm(dev_certs: Path) -> Iterator[Cluster]:
    """Prefill ``prefill-mtls`` TP1 -> decode ``decode-mtls`` TP1, both with mTLS."""
    c = start_cluster(1, 1, tag="-mtls", tls_dir=str(dev_certs))
    yield c
    c.stop()


def _transfer_ok(c: Cluster, tid: str, dst: int, src: int) -> None:
    c.decode.call("reserve", tid, c.leg(tid), [[dst]], TOKENS, 0)
    c.done_all(tid, [src], TOKENS)
    res = c.decode.call("wait", [tid], 30.0, timeout=40)
    assert res["ranks"][tid] == ("ok", ""), res
    assert c.decode.call("verify", [([dst], [src])]) == []


def _rank_endpoint(c: Cluster) -> str:
    return pb.RankLayout.FromString(c.decode.info["layouts"][0]).completion_endpoint


def test_transfers_run_over_mtls(cm: Cluster) -> None:
    """Reservation stream, Expect, WRITE, Complete: the whole path with certificates."""
    _transfer_ok(cm, "mtls-1", 3, 7)


def test_agent_and_rank_ports_refuse_unauthenticated_peers_and_survive_garbage(
    cm: Cluster, dev_certs: Path, other_ca: Path
) -> None:
    for address in (cm.prefill[0].info["endpoint"], _rank_endpoint(cm)):
        _refused_handshakes(dev_certs, other_ca, address)
        _spray(address)
        with sec(dev_certs, "frontend").sync_channel(address) as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
    _transfer_ok(cm, "after-garbage", 4, 8)


def _complete_code(creds: Security, endpoint: str, prefill_engine: str, tid: str = "none") -> grpc.StatusCode:
    msg = pb.Completion(
        transfer_id=tid,
        epoch=1,
        decode_rank=0,
        status=pb.TRANSFER_STATUS_FAILED,
        prefill=pb.EngineIdentity(engine_id=prefill_engine, role=pb.ROLE_PREFILL),
    )
    with creds.sync_channel(endpoint) as ch:
        try:
            pb_grpc.DecodeRankStub(ch).Complete(msg, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_only_prefill_identities_complete_in_their_own_name(cm: Cluster, dev_certs: Path) -> None:
    ep = _rank_endpoint(cm)
    assert _complete_code(sec(dev_certs, "decode-mtls"), ep, "prefill-mtls") is DENIED  # decode's own cert
    assert _complete_code(sec(dev_certs, "decode-0"), ep, "prefill-mtls") is DENIED
    assert _complete_code(sec(dev_certs, "frontend"), ep, "prefill-mtls") is DENIED
    assert _complete_code(sec(dev_certs, "prefill-0"), ep, "prefill-mtls") is DENIED  # another prefill's name
    # The right prefill passes authorization (and the barrier then does not know the transfer).
    assert _complete_code(sec(dev_certs, "prefill-mtls"), ep, "prefill-mtls") is grpc.StatusCode.NOT_FOUND
    # A forged FAILED completion from another prefill does not fail a live transfer.
    tid = "forged"
    epoch = cm.decode.call("reserve", tid, cm.leg(tid), [[5]], TOKENS, 0)
    assert cm.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
    assert _complete_code(sec(dev_certs, "prefill-0"), ep, "prefill-mtls", tid) is DENIED
    cm.done_all(tid, [9], TOKENS)
    assert cm.decode.call("wait", [tid], 30.0, timeout=40)["ranks"][tid] == ("ok", "")


def test_only_the_same_engines_decode_agent_expects_and_settles(cm: Cluster, dev_certs: Path) -> None:
    ep = _rank_endpoint(cm)
    expect = pb.ExpectRequest(
        expectations=[
            pb.Expectation(
                transfer_id="x-exp", epoch=1, request_id="r", prefill_ranks=[0], prefill_engine_id="prefill-mtls"
            )
        ]
    )
    settle = pb.Settlement(transfer_id="x-exp", epoch=1, status=pb.TRANSFER_STATUS_CANCELLED, reason="t")
    for name in ("decode-0", "prefill-mtls", "frontend"):
        with sec(dev_certs, name).sync_channel(ep) as ch:
            stub = pb_grpc.DecodeRankStub(ch)
            for call, msg in ((stub.Expect, expect), (stub.Settle, settle)):
                with pytest.raises(grpc.RpcError) as err:
                    call(msg, timeout=10)
                assert err.value.code() is DENIED, (name, msg)
    with sec(dev_certs, "decode-mtls").sync_channel(ep) as ch:
        stub = pb_grpc.DecodeRankStub(ch)
        assert stub.Expect(expect, timeout=10).results[0].code == 0
        stub.Settle(settle, timeout=10)


def _hello(engine_id: str, c: Cluster) -> pb.DecodeMessage:
    msg = pb.DecodeMessage()
    msg.hello.decode.CopyFrom(
        pb.EngineIdentity(
            engine_id=engine_id,
            incarnation="i1",
            role=pb.ROLE_DECODE,
            tp_size=1,
            compatibility_hash=shape().compatibility_hash(),
        )
    )
    msg.hello.decode_ranks.append(pb.RankLayout.FromString(c.decode.info["layouts"][0]))
    return msg


def _reservations_code(creds: Security, endpoint: str, first: pb.DecodeMessage) -> grpc.StatusCode:
    with creds.sync_channel(endpoint) as ch:
        call = pb_grpc.PrefillAgentStub(ch).Reservations(iter([first]), timeout=10)
        try:
            for _ in call:
                call.cancel()  # accepted (HelloAck): leave at once
                return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_reservation_streams_only_in_the_peers_own_name(cm: Cluster, dev_certs: Path) -> None:
    ep = cm.prefill[0].info["endpoint"]
    # Another decode engine, or a non-decode identity, cannot speak for decode-mtls.
    assert _reservations_code(sec(dev_certs, "decode-0"), ep, _hello("decode-mtls", cm)) is DENIED
    assert _reservations_code(sec(dev_certs, "prefill-0"), ep, _hello("prefill-0", cm)) is DENIED
    assert _reservations_code(sec(dev_certs, "frontend"), ep, _hello("decode-mtls", cm)) is DENIED
    # In its own name the Hello gets past the identity check to the usual ones (here: the layout hash).
    own = _hello("decode-0", cm)
    own.hello.decode.compatibility_hash = "another-model"
    assert _reservations_code(sec(dev_certs, "decode-0"), ep, own) is grpc.StatusCode.FAILED_PRECONDITION
    # The real decode engine keeps being served.
    _transfer_ok(cm, "after-hellos", 6, 10)

"""The kvpush scheduler as a local subprocess: legs signed with a fresh Ed25519 pair (or MACed per
engine with the development master) and mutual TLS with development certificates
(``scripts/make_certs.py``) unless turned off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc

from kvpush.services.common.leg_macs import MASTER_FILE
from kvpush.services.common.leg_signing import write_keypair
from kvpush.services.common.security import Security, TlsFiles
from kvpush.services.common.vllm_server import free_port
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from scripts.cluster import REPO
from scripts.make_certs import make_certs

LegAuthMode = Literal["sign", "mac", "none"]


@dataclass
class SchedulerProcess:
    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    # The pair whose private half signs every leg (--leg-signing-key); None: an --insecure scheduler.
    leg_signing_key: Path | None = None
    leg_public_key: Path | None = None
    # The master from which each engine's leg MAC key is derived (--leg-mac-key); None: not MACed.
    leg_mac_key: Path | None = None
    # mTLS: the `make certs` directory (scheduler, frontend and engine certificates); None: plaintext.
    cert_dir: Path | None = None
    argv: list[str] = field(default_factory=list)  # how it was started, for restart()

    def connector_extra(self, role: str = "", engine_id: str = "") -> dict[str, Any]:
        """The kv_connector_extra_config keys that make a connector verify this scheduler's legs
        and, given its role and engine id, speak mTLS with a certificate of its own (issued here)."""
        extra: dict[str, Any] = {}
        if self.leg_public_key is not None:
            extra["leg_public_key_file"] = str(self.leg_public_key)
        elif self.leg_mac_key is None:
            extra["insecure"] = True
        # MACed legs: the connector's key comes with its registration (over mTLS), nothing to set.
        if self.cert_dir is None or not engine_id:
            extra["insecure"] = True
            return extra
        make_certs(self.cert_dir, engines=[f"{role}/{engine_id}"])
        files = TlsFiles.in_dir(self.cert_dir, engine_id)
        return {**extra, "tls_ca_file": files.ca_file, "tls_cert_file": files.cert_file, "tls_key_file": files.key_file}

    def security(self, name: str = "frontend") -> Security:
        """Client credentials for talking to this scheduler (a frontend certificate by default)."""
        if self.cert_dir is None:
            return Security.insecure(f"client of {self.address}")
        return Security.mtls(TlsFiles.in_dir(self.cert_dir, name))

    def wait_registered(self, prefills: int = 1, decodes: int = 1, timeout_s: float = 120.0) -> list[pb.InstanceStatus]:
        """Polls ``ListInstances`` until at least ``prefills`` prefill and ``decodes`` decode
        instances are alive; returns the live ones."""
        deadline = time.monotonic() + timeout_s
        with self.security().sync_channel(self.address) as ch:
            stub = pb_grpc.SchedulerStub(ch)
            while True:
                live = [s for s in stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances if s.alive]
                roles = [s.instance.role for s in live]
                if roles.count(pb.ROLE_PREFILL) >= prefills and roles.count(pb.ROLE_DECODE) >= decodes:
                    return live
                if time.monotonic() > deadline:
                    raise TimeoutError(f"instances did not register within {timeout_s} s: {live}")
                time.sleep(0.2)

    def restart(self) -> None:
        """SIGKILLs the scheduler and starts it again on the same address, keys and certificates;
        returns once it accepts connections. Its in-memory state (registry, assignments) is lost."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = _spawn(self.argv, self.log_path)
        _wait_accepting(self)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_scheduler(
    log_dir: Path,
    lease_interval_ms: int = 500,
    legs: LegAuthMode = "sign",
    cert_dir: Path | None = None,
    tls: bool = True,
    extra_args: Sequence[str] = (),
) -> SchedulerProcess:
    """``legs``: ``sign``: a fresh Ed25519 pair under ``log_dir/leg-keys`` signs every leg
    (connectors get the public key through ``connector_extra()``); ``mac``: every leg MACed with its
    engine's key, derived from ``cert_dir``'s ``leg-mac.key`` (needs ``tls``); ``none``: an
    ``--insecure`` scheduler, unsigned legs. ``tls``: mutual TLS with the certificates in
    ``cert_dir`` (made or completed here; default ``log_dir/certs``); False: plaintext gRPC
    (``--insecure``). ``extra_args``: more scheduler flags (e.g. ``--local-prefill-wait-ms 150``)."""
    cert_dir = make_certs(cert_dir or log_dir / "certs") if tls else None
    port = free_port()
    address = f"127.0.0.1:{port}"
    log_path = log_dir / "scheduler.log"
    key = pub = master = None
    if legs == "sign":
        key, pub = write_keypair(log_dir / "leg-keys", overwrite=True)
    elif legs == "mac":
        if cert_dir is None:
            raise ValueError("MACed legs need mutual TLS: each engine's key travels in its registration")
        master = cert_dir / MASTER_FILE
    argv = [
        sys.executable,
        "-m",
        "kvpush.services.scheduler.main",
        "--listen",
        address,
        "--lease-interval-ms",
        str(lease_interval_ms),
        "--metrics-port",
        "0",
        *(["--leg-signing-key", str(key)] if key is not None else []),
        *(["--leg-mac-key", str(master)] if master is not None else []),
        *(_tls_flags(TlsFiles.in_dir(cert_dir, "scheduler")) if cert_dir is not None else []),
        *(["--insecure"] if legs == "none" or cert_dir is None else []),
        *extra_args,
    ]
    sched = SchedulerProcess(address, _spawn(argv, log_path), log_path, key, pub, master, cert_dir, argv)
    _wait_accepting(sched)
    return sched


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO
        )


def _wait_accepting(sched: SchedulerProcess, timeout_s: float = 60.0) -> None:
    ch = sched.security().sync_channel(sched.address)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout_s)
    finally:
        ch.close()


def _tls_flags(files: TlsFiles) -> list[str]:
    return ["--tls-ca", files.ca_file, "--tls-cert", files.cert_file, "--tls-key", files.key_file]

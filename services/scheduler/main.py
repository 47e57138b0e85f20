"""``kvpush-scheduler``: flags (with KVPUSH_SCHEDULER_* env defaults), logs, metrics, signals."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
from collections.abc import Sequence
from typing import Any

import sdnotify

from kvpush.services.common import logs
from kvpush.services.common.leg_macs import LegMacer
from kvpush.services.common.leg_signing import LegSigner
from kvpush.services.common.security import Security, SecurityError, TlsFiles
from kvpush.services.scheduler.convert import LegSealer
from kvpush.services.scheduler.local_prefill import LocalPrefillConfig
from kvpush.services.scheduler.policy import DECODE_POLICIES
from kvpush.services.scheduler.registry import LeaseConfig
from kvpush.services.scheduler.server import SchedulerConfig, SchedulerServer
from kvpush.services.scheduler.servicer import ServicerConfig

ENV_PREFIX = "KVPUSH_SCHEDULER_"


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def _flag(p: argparse.ArgumentParser, flag: str, default: str, **kw: Any) -> None:
    """``--some-flag`` defaulting to ``$KVPUSH_SCHEDULER_SOME_FLAG`` or ``default``; argparse applies
    ``type`` (and its error message) to string defaults as to the command line."""
    p.add_argument(flag, default=_env(flag.removeprefix("--").upper().replace("-", "_"), default), **kw)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvpush-scheduler",
        description="kvpush scheduler: instance registry, load leases, assignment and the frontend API. "
        f"Every flag defaults to the environment variable {ENV_PREFIX}<FLAG> (upper case, _ for -).",
    )
    _flag(p, "--listen", "0.0.0.0:50051", help="gRPC address host:port")
    _flag(p, "--metrics-port", "9400", type=int, help="Prometheus port; 0: off")
    _flag(p, "--metrics-addr", "0.0.0.0")
    _flag(p, "--lease-interval-ms", "500", type=int, help="instances report load at least this often")
    _flag(p, "--lease-misses", "3", type=int, help="missed intervals before an instance is declared dead")
    _flag(
        p,
        "--settle-ms",
        "500",
        type=int,
        help="an assignment counts against its decode until a report this much later reflects it",
    )
    _flag(p, "--decode-policy", "p2c", choices=sorted(DECODE_POLICIES))
    _flag(p, "--max-queue-s", "10", type=float, help="longest an Assign with a deadline waits for decode capacity")
    _flag(p, "--max-queued", "1024", type=int)
    _flag(
        p,
        "--max-reroutes",
        "2",
        type=int,
        help="prefill engines one transfer may be tried on (Reroute), the first included",
    )
    _flag(
        p,
        "--decode-stall-s",
        "5",
        type=float,
        help="Generate: after a streaming decode's assignment is lost (lease), end the call only if "
        "decode streams nothing for this long (0: end it at once)",
    )
    _flag(
        p,
        "--local-prefill-max-tokens",
        "0",
        type=int,
        help="local prefill: a prompt of at most this many tokens prefills on its decode instance, for "
        "Generate and frontends that allow it (0: off)",
    )
    _flag(
        p,
        "--local-prefill-wait-ms",
        "0",
        type=float,
        help="local prefill: a prompt whose prefill would wait longer than this behind its prefill instance's "
        "queue prefills on its decode instance instead, when that decode is not prefilling another; the queue is "
        "estimated from the prefill engines' reports of finished prefills (0: off)",
    )
    _flag(
        p,
        "--local-prefill-ttft-ms",
        "0",
        type=float,
        help="local prefill: a prompt whose first token would come later than this from its prefill instance "
        "(the queue's wait plus its own prefill at that instance's learned speed), and in time from its decode, "
        "prefills on its decode instance instead, when that decode is not prefilling another (0: off)",
    )
    _flag(
        p,
        "--local-prefill-max-decoding",
        "-1",
        type=int,
        help="local prefill: the wait and TTFT rules move a prompt only to a decode instance decoding at most this "
        "many requests (each is stalled for the prompt's prefill; -1: any)",
    )
    _flag(p, "--model", "", help="served model name for Generate; empty: the first entry of GET /v1/models")
    _flag(
        p,
        "--readiness-probe",
        "1",
        type=int,
        choices=(0, 1),
        help="1: an instance is assignable only once its OpenAI server answers GET /health (default)",
    )
    _flag(
        p, "--assignment-ttl-s", "600", type=float, help="an Assign with no Release this long after is closed as failed"
    )
    _flag(p, "--http-read-timeout-s", "600", type=float)
    _flag(p, "--grace-s", "30", type=float, help="on SIGTERM/SIGINT, how long in-flight Generate calls may finish")
    _flag(
        p,
        "--leg-signing-key",
        "",
        metavar="FILE",
        help="Ed25519 private key (PEM) that signs every kv_transfer_params leg; connectors verify with the "
        "public key (python -m kvpush.services.common.leg_signing keygen DIR). Required unless --leg-mac-key "
        "or --insecure",
    )
    _flag(
        p,
        "--leg-mac-key",
        "",
        metavar="FILE",
        help="instead of --leg-signing-key: master secret (hex) from which each engine's leg key is derived; "
        "every leg carries an HMAC under the key of the engine it is for, handed to that engine when it "
        "registers over mutual TLS (python -m kvpush.services.common.leg_macs keygen DIR). Needs --tls-*",
    )
    _flag(
        p,
        "--leg-ttl-s",
        "60",
        type=float,
        help="a signed leg is refused this long after it was minted (plus the connectors' clock skew allowance)",
    )
    _flag(p, "--tls-ca", "", metavar="FILE", help="PEM CA that signs every peer's certificate")
    _flag(
        p,
        "--tls-cert",
        "",
        metavar="FILE",
        help="the scheduler's PEM certificate (URI SAN spiffe://kvpush/scheduler/scheduler); `make certs` makes a dev set",
    )
    _flag(p, "--tls-key", "", metavar="FILE", help="its PEM private key")
    p.add_argument(
        "--insecure",
        action="store_true",
        default=_env("INSECURE", "0").lower() in ("1", "true", "yes"),
        help="development only: without --tls-* serve plaintext gRPC (no client authentication, logged), "
        "and without --leg-signing-key send legs unsigned",
    )
    _flag(p, "--log-level", "INFO")
    _flag(p, "--log-json", "1", type=int, choices=(0, 1), help="1: JSON lines (default), 0: key=value")
    args = p.parse_args(argv)
    for name in ("lease_interval_ms", "lease_misses", "max_queued"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.leg_ttl_s > 0:
        p.error("--leg-ttl-s must be > 0")
    return args


def leg_signer_from_args(args: argparse.Namespace) -> LegSealer | None:
    """The signer of ``--leg-signing-key`` or the MACer of ``--leg-mac-key``; None only with
    ``--insecure``. Exits with a message when neither is given (or both), a key cannot be loaded, or
    MACed legs are asked for without mutual TLS (the engines' keys travel in their registrations): a
    scheduler must not mint unsigned legs, or hand out keys in the clear, by accident."""
    if args.leg_signing_key and args.leg_mac_key:
        raise SystemExit("kvpush-scheduler: --leg-signing-key and --leg-mac-key exclude each other: pick one")
    if args.leg_mac_key:
        if not (args.tls_ca and args.tls_cert and args.tls_key):
            raise SystemExit(
                "kvpush-scheduler: --leg-mac-key needs mutual TLS (--tls-ca, --tls-cert, --tls-key): each engine's "
                "leg key is sent in its registration, only to a peer whose certificate names it"
            )
        try:
            return LegMacer.from_file(args.leg_mac_key, ttl_s=args.leg_ttl_s)
        except ValueError as exc:
            raise SystemExit(f"kvpush-scheduler: {exc}") from exc
    if args.leg_signing_key:
        try:
            return LegSigner.from_file(args.leg_signing_key, ttl_s=args.leg_ttl_s)
        except ValueError as exc:
            raise SystemExit(f"kvpush-scheduler: {exc}") from exc
    if not args.insecure:
        raise SystemExit(
            f"kvpush-scheduler: refusing to start without --leg-signing-key ({ENV_PREFIX}LEG_SIGNING_KEY): "
            "connectors verify every kv_transfer_params leg with its public key. Make a pair with "
            "`python -m kvpush.services.common.leg_signing keygen DIR`, or pass --insecure for unsigned legs"
        )
    return None


def security_from_args(args: argparse.Namespace) -> Security:
    """mTLS from ``--tls-ca/--tls-cert/--tls-key``; plaintext only with ``--insecure`` and none of them.
    Exits with a message otherwise, or when a file cannot be read."""
    files = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    given = [flag for flag, path in files.items() if path]
    if not given and args.insecure:
        return Security.insecure("scheduler")
    if len(given) != len(files):
        missing = ", ".join(
            f"{flag} ({ENV_PREFIX}{flag[2:].replace('-', '_').upper()})" for flag in files if not files[flag]
        )
        raise SystemExit(
            f"kvpush-scheduler: refusing to start without mutual TLS: missing {missing}. "
            "`make certs` makes a development set; --insecure serves plaintext gRPC"
        )
    try:
        return Security.mtls(TlsFiles(args.tls_ca, args.tls_cert, args.tls_key), component="scheduler")
    except SecurityError as exc:
        raise SystemExit(f"kvpush-scheduler: {exc}") from exc


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    local_prefill = LocalPrefillConfig(
        max_tokens=args.local_prefill_max_tokens,
        wait_ms=args.local_prefill_wait_ms,
        ttft_ms=args.local_prefill_ttft_ms,
        max_decoding=args.local_prefill_max_decoding,
    )
    try:
        local_prefill.validate()
    except ValueError as exc:
        raise SystemExit(f"kvpush-scheduler: {exc}") from exc
    return SchedulerConfig(
        listen=args.listen,
        lease=LeaseConfig(
            interval_s=args.lease_interval_ms / 1000.0,
            misses=args.lease_misses,
            settle_s=args.settle_ms / 1000.0,
            assignment_ttl_s=args.assignment_ttl_s,
        ),
        decode_policy=args.decode_policy,
        local_prefill=local_prefill,
        servicer=ServicerConfig(
            max_queue_s=args.max_queue_s,
            max_queued=args.max_queued,
            max_reroutes=args.max_reroutes,
            decode_stall_s=args.decode_stall_s,
        ),
        model=args.model,
        http_read_timeout_s=args.http_read_timeout_s,
        leg_signer=leg_signer_from_args(args),
        security=security_from_args(args),
        readiness_probe=bool(args.readiness_probe),
    )


async def serve(args: argparse.Namespace) -> None:
    log = logs.get_logger("scheduler")
    server = SchedulerServer(config_from_args(args))
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if not stop_requested.is_set():
            log.info("signal_received", signal=sig.name)
            stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.start()
    # Everything allocated so far lives for the whole process: keep it out of the collector's full
    # passes, whose pauses would land in Assign's tail latency.
    gc.freeze()
    server.metrics.gc_pauses.install()
    if args.metrics_port:
        server.metrics.serve(args.metrics_port, args.metrics_addr)
        log.info("metrics_started", port=args.metrics_port)
    notifier = sdnotify.SystemdNotifier()
    notifier.notify(f"READY=1\nSTATUS=serving on {server.address}")
    log.info("scheduler_ready", address=server.address)
    await stop_requested.wait()
    notifier.notify("STOPPING=1")
    await server.stop(args.grace_s)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logs.configure(json=bool(args.log_json), level=args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

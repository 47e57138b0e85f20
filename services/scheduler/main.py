"""``kvpush-scheduler``: flags (with KVPUSH_SCHEDULER_* env defaults), logs, metrics, signals."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
from collections.abc import Sequence

import sdnotify

from services.common import logs
from services.scheduler.policy import DECODE_POLICIES
from services.scheduler.registry import LeaseConfig
from services.scheduler.server import SchedulerConfig, SchedulerServer
from services.scheduler.servicer import ServicerConfig

ENV_PREFIX = "KVPUSH_SCHEDULER_"


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvpush-scheduler",
        description="kvpush scheduler: instance registry, load leases, assignment and the frontend API. "
        f"Every flag defaults to the environment variable {ENV_PREFIX}<FLAG> (upper case, _ for -).",
    )
    p.add_argument("--listen", default=_env("LISTEN", "0.0.0.0:50051"), help="gRPC address host:port")
    p.add_argument(
        "--metrics-port", type=int, default=int(_env("METRICS_PORT", "9400")), help="Prometheus port; 0: off"
    )
    p.add_argument("--metrics-addr", default=_env("METRICS_ADDR", "0.0.0.0"))
    p.add_argument(
        "--lease-interval-ms",
        type=int,
        default=int(_env("LEASE_INTERVAL_MS", "500")),
        help="instances report load at least this often",
    )
    p.add_argument(
        "--lease-misses",
        type=int,
        default=int(_env("LEASE_MISSES", "3")),
        help="missed intervals before an instance is declared dead",
    )
    p.add_argument(
        "--settle-ms",
        type=int,
        default=int(_env("SETTLE_MS", "500")),
        help="an assignment counts against its decode until a report this much later reflects it",
    )
    p.add_argument("--decode-policy", choices=sorted(DECODE_POLICIES), default=_env("DECODE_POLICY", "p2c"))
    p.add_argument(
        "--max-queue-s",
        type=float,
        default=float(_env("MAX_QUEUE_S", "10")),
        help="longest an Assign with a deadline waits for decode capacity",
    )
    p.add_argument("--max-queued", type=int, default=int(_env("MAX_QUEUED", "1024")))
    p.add_argument(
        "--model",
        default=_env("MODEL", ""),
        help="served model name for Generate; empty: the first entry of GET /v1/models",
    )
    p.add_argument(
        "--readiness-probe",
        type=int,
        choices=(0, 1),
        default=int(_env("READINESS_PROBE", "1")),
        help="1: an instance is assignable only once its OpenAI server answers GET /health (default)",
    )
    p.add_argument(
        "--assignment-ttl-s",
        type=float,
        default=float(_env("ASSIGNMENT_TTL_S", "600")),
        help="an Assign with no Release this long after is closed as failed",
    )
    p.add_argument("--http-read-timeout-s", type=float, default=float(_env("HTTP_READ_TIMEOUT_S", "600")))
    p.add_argument(
        "--grace-s",
        type=float,
        default=float(_env("GRACE_S", "30")),
        help="on SIGTERM/SIGINT, how long in-flight Generate calls may finish",
    )
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    p.add_argument(
        "--log-json",
        type=int,
        choices=(0, 1),
        default=int(_env("LOG_JSON", "1")),
        help="1: JSON lines (default), 0: key=value",
    )
    args = p.parse_args(argv)
    for name in ("lease_interval_ms", "lease_misses", "max_queued"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        listen=args.listen,
        lease=LeaseConfig(
            interval_s=args.lease_interval_ms / 1000.0,
            misses=args.lease_misses,
            settle_s=args.settle_ms / 1000.0,
            assignment_ttl_s=args.assignment_ttl_s,
        ),
        decode_policy=args.decode_policy,
        servicer=ServicerConfig(max_queue_s=args.max_queue_s, max_queued=args.max_queued),
        model=args.model,
        http_read_timeout_s=args.http_read_timeout_s,
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

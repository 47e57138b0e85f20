"""gRPC plumbing shared by every service: health checking, reflection, mTLS-aware servers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpush.services.common.limits import MAX_MESSAGE_BYTES  # a larger message: RESOURCE_EXHAUSTED
from kvpush.services.common.security import Rule, Security
from kvpush.v1 import kvpush_pb2

# Keep channels alive across idle periods and notice dead peers within seconds.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def add_health_and_reflection(server: grpc.Server | grpc.aio.Server, service_names: list[str]) -> health.HealthServicer:
    """Registers grpc.health.v1 and server reflection for kvpush services given by short name
    (``"Scheduler"``); each starts SERVING, as does the server as a whole (``""``)."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    full_names = [service_name(n) for n in service_names]
    for name in [*full_names, ""]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*full_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


def service_name(short: str) -> str:
    """Fully qualified name of a kvpush service, e.g. ``kvpush.v1.Scheduler``."""
    return kvpush_pb2.DESCRIPTOR.services_by_name[short].full_name


async def start_aio_server(
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    servicer: Any,
    name: str,
    host: str,
    port: int,
    security: Security,
    policy: Mapping[str, Rule],
    own_name: str = "",
) -> tuple[grpc.aio.Server, int]:
    """Starts a grpc.aio server for one kvpush service (with health and reflection) on the
    running loop; returns it and the bound port (``port`` 0 picks a free one). With mTLS, every
    call is checked against ``policy`` before its handler runs (``own_name``: this engine's id,
    for methods only the same engine may call)."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=security.interceptors(policy, own_name))
    add_servicer(servicer, server)
    add_health_and_reflection(server, [name])
    bound = security.add_port(server, f"{host}:{port}")
    await server.start()
    return server, bound

"""Outcome codes of the pure state machines (prefill matching table, decode barrier).

Pure modules return these instead of gRPC status codes; the gRPC edges (the push writer, the
decode rank) map them with ``grpc.StatusCode[code.name]``. Each value is the numeric gRPC status
of the same name, which is also what ``ReservationRejected.code`` and ``ExpectResult.code`` carry.
"""

from __future__ import annotations

import enum


class RefusalCode(enum.Enum):
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10

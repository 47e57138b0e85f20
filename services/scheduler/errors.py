"""Errors of the pure scheduler logic; the servicer maps each to one gRPC status code."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class. ``reason`` is a short machine-readable label (used in metrics)."""

    reason = "error"


class InvalidArgument(SchedulerError):
    reason = "invalid_argument"


class NotFound(SchedulerError):
    reason = "not_found"


class FailedPrecondition(SchedulerError):
    reason = "failed_precondition"


class NoCapacity(SchedulerError):
    """Admission refused; ``reason`` says why (no_decode, no_prefill, no_capacity, queue_full...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

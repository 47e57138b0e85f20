"""Completion notices: a prefill rank's OK completion as a NIXL notification (pure codec).

The ``Completion`` RPC leaves a busy prefill core late: the agent's loop thread must wake, take
the GIL and the core behind the engine's output, and gRPC must send it (measured 1-5 ms after the
request ended, docs/bench_phases.md). A NIXL notification leaves from the thread that knows: the
writer thread the moment its WRITE completed, the engine thread the moment it sampled the first
token; one C call each, no thread to wake. Decode's poller drains it with the NIXL progress it
runs anyway.

Anyone who can reach a decode rank's UCX port can send it notifications, so a notice counts only
when its MAC verifies: HMAC-SHA256 under the ``completion_key`` of the transfer's current epoch,
32 random bytes the decode agent mints per (transfer, epoch) and sends only to that epoch's
prefill engine (its reservation, over its mutually authenticated stream) and to its own ranks
(their expectation). A valid MAC therefore proves the transfer's prefill engine, for this epoch,
reported this rank's WRITE into this decode rank done, as an OK ``Completion`` from it does; a
replay only repeats what was already recorded, and a notice never reports a failure (the RPC
does, and still follows every notice).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from kvpush.services.common import limits
from kvpush.v1 import kvpush_pb2 as pb

PREFIX = b"kvpush-notice-v1:"
KEY_BYTES = 32
MAX_NOTICE_BYTES = 512  # a notice is an id, four integers and a MAC: anything larger is refused
_DOMAIN = b"kvpush.completion-notice.v1\n"
_NO_TOKEN = 1 << 32  # outside uint32: a MAC with a token never equals one without


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, n: pb.CompletionNotice) -> bytes:
    token = n.first_token if n.HasField("first_token") else _NO_TOKEN
    tid = n.transfer_id.encode()
    body = (
        _DOMAIN
        + struct.pack("!I", len(tid))
        + tid
        + struct.pack("!QIIQ", n.epoch, n.prefill_rank, n.decode_rank, token)
    )
    return hmac.new(key, body, hashlib.sha256).digest()


def encode(
    key: bytes, transfer_id: str, epoch: int, prefill_rank: int, decode_rank: int, first_token: int | None = None
) -> bytes:
    n = pb.CompletionNotice(transfer_id=transfer_id, epoch=epoch, prefill_rank=prefill_rank, decode_rank=decode_rank)
    if first_token is not None:
        n.first_token = first_token
    n.mac = _mac(key, n)
    return PREFIX + n.SerializeToString()


def decode(raw: bytes) -> pb.CompletionNotice | str:
    """The notice in ``raw``, or why it is not one (bounded before it is parsed)."""
    if len(raw) > MAX_NOTICE_BYTES:
        return f"notice of {len(raw)} bytes (at most {MAX_NOTICE_BYTES})"
    if not raw.startswith(PREFIX):
        return "not a completion notice"
    n = pb.CompletionNotice()
    try:
        n.ParseFromString(raw[len(PREFIX) :])
    except Exception:  # protobuf's DecodeError, or worse on garbage
        return "malformed notice"
    if not n.transfer_id or len(n.transfer_id) > limits.MAX_ID_CHARS:
        return "notice without a transfer id, or one too long"
    if n.epoch == 0 or len(n.mac) != hashlib.sha256().digest_size:
        return "notice without an epoch or a MAC"
    return n


def verify(key: bytes, n: pb.CompletionNotice) -> bool:
    return len(key) == KEY_BYTES and hmac.compare_digest(_mac(key, n), n.mac)


def valid_key(key: bytes) -> bool:
    """A key as reservations and expectations carry it: none (no notices), or KEY_BYTES."""
    return len(key) in (0, KEY_BYTES)

"""Prefill rank: completion notices, the NIXL-notification head start of its OK completions.

services/common/completion_notice.py has the format and why a notice can be trusted. Here is who
sends one, and when:

- the writer thread, the moment a transfer's WRITE into a decode rank completed OK (``written``),
  with the first token when the engine has posted it by then;
- the engine thread, right after it posted a hand-off transfer's first token, for the transfers
  whose notice already went without it (``token_posted``, the token board's listener). It never
  waits: while the writer thread is inside NIXL it skips, and the token goes with the Completion
  RPC (and the scheduler's relay) instead.

The writer's notices go first, so the engine thread only ever sends on a connection they (and the
WRITE before them) already opened. Whether a token is then owed is decided under one lock, with
the board read again inside it: a token posted while the writer sent is sent by the writer, one
posted after that by the engine thread, and neither thread sends it twice. Transfers waiting for their token are kept for the newest
``capacity``; an older one goes without a notice for its token, nothing worse.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from kvpush.services.common import completion_notice
from kvpush.services.common.logs import get_logger
from kvpush.services.common.nixl_engine import NixlEngine, NixlError
from kvpush.services.prefill_agent import metrics

log = get_logger("prefill.notices")

_CAPACITY = 4096


class TokenBoard(Protocol):
    """The first tokens this prefill engine sampled (connector/completion_tokens.py)."""

    def get(self, transfer_id: str) -> int | None: ...

    def pending(self, transfer_id: str) -> bool: ...


@dataclass(frozen=True)
class NoticeTarget:
    decode_rank: int
    nixl_peer: str  # the decode rank's NIXL agent, as this rank's engine knows it


@dataclass(frozen=True)
class _Owed:
    epoch: int
    key: bytes
    targets: tuple[NoticeTarget, ...]


class CompletionNotices:
    def __init__(self, engine: NixlEngine, rank: int, board: TokenBoard | None, capacity: int = _CAPACITY) -> None:
        self.engine = engine
        self.rank = rank
        self.board = board
        self.capacity = capacity
        self._lock = threading.Lock()
        self._owed: OrderedDict[str, _Owed] = OrderedDict()  # transfer id -> notices owed a token

    def written(self, transfer_id: str, epoch: int, key: bytes, targets: list[NoticeTarget]) -> set[int]:
        """The writer thread: this rank's WRITEs of ``transfer_id`` into ``targets`` completed OK.
        Its notices go first; a token still to come is then owed, under the lock the engine
        thread takes after it posts (so a token posted meanwhile is sent here, once). Returns
        the decode ranks a notice went to."""
        if not key or not targets:
            return set()
        token = self.board.get(transfer_id) if self.board is not None else None
        sent = {t.decode_rank for t in targets if self._send("writer", transfer_id, epoch, key, t, token, True)}
        if token is not None or self.board is None:
            return sent
        with self._lock:
            token = self.board.get(transfer_id)
            if token is None:
                if self.board.pending(transfer_id):
                    self._owed[transfer_id] = _Owed(epoch, key, tuple(targets))
                    while len(self._owed) > self.capacity:
                        self._owed.popitem(last=False)
                return sent
        for t in targets:  # posted while the notices above went
            self._send("writer", transfer_id, epoch, key, t, token, blocking=True)
        return sent

    def token_posted(self, transfer_id: str, token: int) -> None:
        """The engine thread, after it posted ``token``: never blocks, never raises."""
        with self._lock:
            owed = self._owed.pop(transfer_id, None)
        if owed is None:
            return
        for t in owed.targets:
            self._send("engine", transfer_id, owed.epoch, owed.key, t, token, blocking=False)

    def owed_count(self) -> int:
        with self._lock:
            return len(self._owed)

    def _send(
        self, sender: str, transfer_id: str, epoch: int, key: bytes, t: NoticeTarget, token: int | None, blocking: bool
    ) -> bool:
        msg = completion_notice.encode(key, transfer_id, epoch, self.rank, t.decode_rank, token)
        try:
            sent = self.engine.send_notif(t.nixl_peer, msg, blocking=blocking)
        except NixlError as exc:  # the peer is gone: the Completion RPC reports what it can
            metrics.COMPLETION_NOTICES.labels(sender=sender, result="failed").inc()
            log.info("completion_notice_failed", transfer_id=transfer_id, epoch=epoch, error=str(exc))
            return False
        metrics.COMPLETION_NOTICES.labels(sender=sender, result="sent" if sent else "busy").inc()
        if not sent:
            log.debug("completion_notice_skipped", transfer_id=transfer_id, epoch=epoch, reason="NIXL busy")
        return sent

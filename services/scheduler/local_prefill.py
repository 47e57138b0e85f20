"""Local prefill (conditional disaggregation): when a request's prefill runs on its decode instance
instead of on a prefill instance, and the estimate of a prefill instance's queue those rules read.

Disaggregation pays off when a prefill would stall decodes; it costs a hand-off and, when the
prefill instances are behind, their queue. The rules (all off by default, and only for frontends
that allow it, ``AssignRequest.allow_prefill_on_decode``; ``Generate`` always does):

* ``max_tokens``: a prompt of at most this many tokens prefills on its decode (a short prefill
  stalls decode less than the hand-off costs the request);
* ``wait_ms``: a prompt whose prefill would wait longer than this behind the chosen prefill
  instance's queue prefills on its decode, when the decode is not prefilling another such request
  (prefill saturated: the decode's core takes some of the overflow instead of the queue growing;
  one at a time, because each stalls the decodes it runs beside);
* ``ttft_ms``: the same, for a prompt whose first token would come later than this from the
  chosen prefill instance (its queue's wait plus its own prefill at the instance's learned speed)
  but in time from its decode (its own prefill alone): a TTFT target that follows the engines'
  speed, where ``wait_ms`` is a fixed share of it;
* ``max_decoding`` (with ``wait_ms`` or ``ttft_ms``): those two move a prompt only to a decode
  instance that, by the scheduler's books, decodes at most this many requests (its open
  assignments whose prefill finished, or that it prefills itself): a prompt prefilled there stalls
  every one of them for its prefill, which can cost each its TPOT target (-1: any number);
* with ``max_tokens``, ``wait_ms`` or ``ttft_ms`` on, a request that finds no ready prefill
  instance is prefilled by its decode.

Pure state, time passed in, no I/O: the registry drives it from the scheduler's event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPrefillConfig:
    max_tokens: int = 0  # prompts up to this many tokens prefill on their decode (0: none)
    wait_ms: float = 0.0  # prefill on decode when the prefill queue is longer than this (0: never)
    ttft_ms: float = 0.0  # prefill on decode when prefill's first token would come later than this (0: never)
    max_decoding: int = -1  # the queue rules pick only a decode decoding at most this many requests (-1: any)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 or self.queue_rules

    @property
    def queue_rules(self) -> bool:
        """A rule that reads the prefill queue estimate is on."""
        return self.wait_ms > 0 or self.ttft_ms > 0

    def validate(self) -> None:
        inf = float("inf")
        if self.max_tokens < 0 or not 0 <= self.wait_ms < inf or not 0 <= self.ttft_ms < inf:
            raise ValueError("local prefill max_tokens, wait_ms and ttft_ms must be >= 0 and finite")
        if self.max_decoding < -1:
            raise ValueError("local prefill max_decoding must be >= -1")

    def overflows(self, wait_s: float, own_s: float) -> bool:
        """Whether a prompt whose prefill would wait ``wait_s`` behind the prefill queue and then
        take ``own_s`` is better prefilled on its decode (``wait_ms``; ``ttft_ms``: too late there
        and in time on decode)."""
        if self.wait_ms > 0 and wait_s * 1000.0 > self.wait_ms:
            return True
        return self.ttft_ms > 0 and (wait_s + own_s) * 1000.0 > self.ttft_ms > own_s * 1000.0


class PrefillBacklog:
    """One prefill instance's queue as the scheduler sees it: the prompts assigned to it whose
    prefill was not seen to finish, in assignment order, its speed in seconds per prompt token,
    learned from the prefill engine's reports of finished prefills (a hand-off transfer's first
    token, the moment prefill sampled it; a ``PrefillDone`` with its age for any other), and a
    virtual clock: when it would be done with them, serving them one after another at that speed.

    FIFO model: a report for a transfer means every transfer assigned before it finished too (they
    leave without a sample), and the clock restarts from the report. A sample is taken only for the
    head of the queue: its service began when it was assigned or when the previous one was seen to
    finish, whichever was later. Between reports the clock runs down. Until the first sample the
    speed is unknown and so is the wait (``wait_s`` is None)."""

    ALPHA = 0.25  # weight of a new sample in the speed's moving average

    def __init__(self) -> None:
        self._queue: OrderedDict[str, tuple[int, float]] = OrderedDict()  # transfer id -> (tokens, assigned at)
        self._last_finish = float("-inf")
        self._free_at = float("-inf")  # the virtual clock (with a known speed)
        self.s_per_token: float | None = None
        self.samples = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._queue

    def add(self, transfer_id: str, tokens: int, now: float) -> None:
        if transfer_id in self._queue:
            self.drop(transfer_id)
        self._queue[transfer_id] = (tokens, now)
        if self.s_per_token is not None:
            self._free_at = max(self._free_at, now) + tokens * self.s_per_token

    def drop(self, transfer_id: str) -> None:
        """The transfer left without a report (released, closed, moved to another prefill): the
        clock loses its work (O(1): a Release comes for every request)."""
        entry = self._queue.pop(transfer_id, None)
        if entry is not None and self.s_per_token is not None:
            self._free_at -= entry[0] * self.s_per_token

    def finished(self, transfer_id: str, now: float) -> bool:
        """Prefill sampled the transfer's first token at ``now``. False when it is not queued here."""
        if transfer_id not in self._queue:
            return False
        head = True
        while self._queue:
            tid, (tokens, assigned_at) = self._queue.popitem(last=False)
            if tid != transfer_id:
                head = False
                continue
            if head and tokens > 0:
                served = now - max(assigned_at, self._last_finish)
                if served > 0:
                    sample = served / tokens
                    spt = self.s_per_token
                    self.s_per_token = sample if spt is None else spt + self.ALPHA * (sample - spt)
                    self.samples += 1
            break
        self._last_finish = max(self._last_finish, now)
        self._rewind()
        return True

    def _rewind(self) -> None:
        """The virtual clock again from the last report, over what is still queued."""
        spt = self.s_per_token
        if spt is None:
            return
        free_at = self._last_finish
        for tokens, assigned_at in self._queue.values():
            free_at = max(free_at, assigned_at) + tokens * spt
        self._free_at = free_at

    def wait_s(self, now: float) -> float | None:
        """How long a prefill assigned now would wait for the queue ahead of it (None: speed unknown)."""
        if self.s_per_token is None:
            return None
        return max(0.0, self._free_at - now)


class LocalQueue:
    """The prefills a decode instance took on itself, as a virtual clock: when it would be done with
    them, at the speed of the prefill instance whose queue sent them there (it takes the next one
    only once this clock ran out)."""

    def __init__(self) -> None:
        self.free_at = float("-inf")

    def add(self, tokens: int, s_per_token: float, now: float) -> None:
        self.free_at = max(self.free_at, now) + tokens * s_per_token

    def wait_s(self, now: float) -> float:
        return max(0.0, self.free_at - now)

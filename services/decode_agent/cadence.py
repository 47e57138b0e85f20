"""How long the decode rank's NIXL poller naps between progress calls.

The poller runs inside the decode engine's process. Over UCX's default (peer failure) mode a
prefill WRITE completes only once this side progresses, so while a transfer is expected the nap
bounds the WRITE's completion latency. But every wake-up takes the GIL and the core from the
engine's forward loop: measured on a 2-core machine, waking every 100 µs while one P/D request
waited made the plain requests decoding next to it 17-24 % slower per token. So the poller naps:

- ``expecting_s`` (100 µs) while a transfer is expected and the engine is not running forwards:
  the core is free, and the WRITE's completion is on the path of a request that is alone;
- ``busy_s`` (5 ms) while a transfer is expected and the engine runs forwards. The engine thread
  then progresses NIXL itself at the end of every step (``DecodeRank.step_ended``: about a
  microsecond, no wake-up), which is where a released transfer is picked up anyway; the poller
  only covers long steps;
- ``idle_s`` (20 ms) otherwise, so a late WRITE (for a transfer decode already settled) still
  completes instead of waiting for the writer's timeout. A WRITE that overtakes its expectation
  does not wait for it: the expectation wakes the poller at once.

What a wake-up costs is the wake-up, not the progress call: on the 2-core VM, one
``get_new_notifs`` took 1.3 µs while a thread that naps and progresses used 14 % of a core at
100 µs naps, 5.4 % at 1 ms and 2.2 % at 5 ms (timer wake-ups under virtualisation; the idle
nap was 5 ms before, 2.6 % of an idle decode engine's core). Measured
as the TPOT of plain requests decoding while a transfer waits, against the same with nothing
waiting: 1.17-1.24x with 100 µs naps, 1.04-1.14x with 1 ms naps, 1.01x with 5 ms naps.

The engine thread reports its steps (``forward_started``, ``step_ended``); the poller thread reads
the result (``nap``). Plain attribute stores and loads: no lock on the engine's path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class PollCadence:
    expecting_s: float = 100e-6
    busy_s: float = 5e-3
    idle_s: float = 20e-3
    # A gap this short between two forward steps (scheduling, output processing) is still busy.
    busy_hold_s: float = 0.02
    _in_forward: bool = field(default=False, repr=False)
    _last_forward_end: float = field(default=-math.inf, repr=False)

    def forward_started(self) -> None:
        """The engine bound a step that runs a forward (it scheduled tokens)."""
        self._in_forward = True

    def step_ended(self, now: float) -> None:
        """The engine finished a step (forward or not)."""
        if self._in_forward:
            self._in_forward = False
            self._last_forward_end = now

    def engine_busy(self, now: float) -> bool:
        return self._in_forward or now - self._last_forward_end < self.busy_hold_s

    def nap(self, expecting: bool, now: float) -> float:
        if not expecting:
            return self.idle_s
        return self.busy_s if self.engine_busy(now) else self.expecting_s

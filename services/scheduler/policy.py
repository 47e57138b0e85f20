"""Instance choice policies. Candidates arrive pre-filtered (alive, not draining, and for decode,
able to hold the demand); a policy only ranks them."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from services.scheduler.model import Demand, Instance


class DecodePolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance], demand: Demand) -> Instance | None: ...


class PrefillPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance], demand: Demand) -> Instance | None: ...


def _projected(inst: Instance, demand: Demand) -> float:
    return inst.pressure(demand.blocks_on(inst.spec.tokens_per_block))


class PowerOfTwoChoices:
    """Samples two distinct candidates and takes the one with the lower projected pressure.

    Random sampling keeps concurrent schedulers (or bursts between load reports) from herding onto
    the single least-loaded instance, while never choosing the most loaded one of a pair.
    """

    name = "p2c"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Instance], demand: Demand) -> Instance | None:
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        ca, cb = candidates[a], candidates[b]
        return ca if _projected(ca, demand) <= _projected(cb, demand) else cb


class LeastPressure:
    """Takes the candidate with the lowest projected pressure; random among exact ties."""

    name = "least"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Instance], demand: Demand) -> Instance | None:
        if not candidates:
            return None
        scores = [_projected(c, demand) for c in candidates]
        best = min(scores)
        return self._rng.choice([c for c, s in zip(candidates, scores, strict=True) if s == best])


class LeastBusy:
    """Prefill policy: least queued/running work (see ``Instance.busyness``); random among ties."""

    name = "least-busy"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Instance], demand: Demand) -> Instance | None:
        if not candidates:
            return None
        scores = [c.busyness() for c in candidates]
        best = min(scores)
        return self._rng.choice([c for c, s in zip(candidates, scores, strict=True) if s == best])


DECODE_POLICIES: dict[str, Callable[[], DecodePolicy]] = {
    PowerOfTwoChoices.name: PowerOfTwoChoices,
    LeastPressure.name: LeastPressure,
}


def decode_policy(name: str) -> DecodePolicy:
    try:
        return DECODE_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown decode policy {name!r}; known: {sorted(DECODE_POLICIES)}") from None

"""Instance choice policies. Candidates arrive pre-filtered (alive, not draining, and for decode,
able to hold the demand); a policy only ranks them."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpush.services.scheduler.model import Demand, Instance


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
        n = len(candidates)
        a = int(self._rng.random() * n)
        b = int(self._rng.random() * (n - 1))
        ca, cb = candidates[a], candidates[b if b < a else b + 1]  # two distinct, uniformly
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


class PrefixAffinity:
    """Sends requests with the same ``prefix_hint`` to the same decode (rendezvous hashing), so its
    prefix cache hits and fewer blocks need pushing, as long as that decode's projected pressure is
    within ``slack`` of the least loaded candidate; the next in hash order otherwise. Requests
    without a hint use power of two choices."""

    name = "affinity"

    def __init__(self, slack: float = 0.15, rng: random.Random | None = None) -> None:
        self.slack = slack
        self._fallback = PowerOfTwoChoices(rng)

    def choose(self, candidates: Sequence[Instance], demand: Demand) -> Instance | None:
        if not candidates or not demand.prefix_hint:
            return self._fallback.choose(candidates, demand)
        scores = {c.engine_id: _projected(c, demand) for c in candidates}
        bound = min(scores.values()) + self.slack
        ranked = sorted(candidates, key=lambda c: _rendezvous(demand.prefix_hint, c.engine_id), reverse=True)
        return next(c for c in ranked if scores[c.engine_id] <= bound)


def _rendezvous(key: str, engine_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{engine_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


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
        ties = [c for c, s in zip(candidates, scores, strict=True) if s == best]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)


DECODE_POLICIES: dict[str, Callable[[], DecodePolicy]] = {
    PowerOfTwoChoices.name: PowerOfTwoChoices,
    LeastPressure.name: LeastPressure,
    PrefixAffinity.name: PrefixAffinity,
}


def decode_policy(name: str) -> DecodePolicy:
    try:
        return DECODE_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown decode policy {name!r}; known: {sorted(DECODE_POLICIES)}") from None

"""Pytest fixtures that start real vLLM servers on the tiny seeded Llama (for ``@pytest.mark.vllm`` tests).

Wire them into the suite with one line in ``tests/conftest.py``::

    pytest_plugins = ["vllm_fixtures"]

Fixtures (all session-scoped, so one pair of engines serves every vllm test in the session):

* ``tiny_model_dir``: a model directory made by ``scripts/make_tiny_model.py`` (``scripts.cluster.vllm.make_model``:
  in a subprocess, so the test process never imports torch).
* ``vllm_servers``: a ``VllmServerPool``; ``pool.start(n, **kwargs)`` starts n servers concurrently, each
  on its own core, and waits until all are healthy (``scripts.cluster.vllm.start_side_by_side``). Everything
  it started is stopped at session end.
* ``plain_vllm_pair``: two plain (connector-less) servers started concurrently on different cores.
* ``plain_vllm_server``: the first of the pair: the single-instance baseline.

Servers are started concurrently because one start-up costs ~70 s of CPU-bound imports on a 2-core machine;
two in sequence would not fit a 90 s test budget, two side by side do.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.services.common.vllm_server import VllmServer, VllmServerError

READY_TIMEOUT_S = 240.0  # unless $KVPUSH_VLLM_READY_TIMEOUT says otherwise


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (run `make install`)")


class VllmServerPool:
    """Starts servers concurrently and owns them until ``close()``."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.servers: list[VllmServer] = []
        self._next_core = 0

    def start(self, n: int = 1, pin: bool = True, **kwargs: Any) -> list[VllmServer]:
        """Start ``n`` servers side by side and wait until all are healthy.

        Each server gets the next core: as its OpenMP binding at start-up and, if ``pin``, as the affinity
        of its whole process tree once it is ready. ``kwargs`` go to ``VllmServer``; ``env`` is merged.
        """
        # Imported here: this plugin loads for every test, also where only ``tests/`` is on sys.path.
        from scripts.cluster.vllm import cores, omp_bind, ready_timeout_s, start_side_by_side

        on = cores()
        batch: list[tuple[VllmServer, int | None]] = []
        for _ in range(n):
            core = on[self._next_core % len(on)]
            self._next_core += 1
            args = dict(kwargs)
            env = {**omp_bind(core), **args.pop("env", {})}
            model_dir = args.pop("model_dir", self.model_dir)
            log_path = self.log_dir / f"vllm-{len(self.servers)}-core{core}.log"
            srv = VllmServer(model_dir, env=env, log_path=log_path, ready_timeout=None, **args)
            self.servers.append(srv)
            batch.append((srv, core))
        return start_side_by_side(batch, ready_timeout_s(READY_TIMEOUT_S), pin=pin)

    def close(self) -> None:
        errors: list[str] = []
        for srv in reversed(self.servers):
            try:
                srv.stop()
            except (OSError, VllmServerError) as exc:
                errors.append(f"{srv.base_url}: {exc}")
        self.servers.clear()
        if errors:
            raise VllmServerError("; ".join(errors))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require_vllm()
    from scripts.cluster.vllm import make_model

    return make_model(tmp_path_factory.mktemp("tiny-llama"), timeout_s=120.0, quiet=True)


@pytest.fixture(scope="session")
def vllm_servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServerPool]:
    pool = VllmServerPool(tiny_model_dir, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def plain_vllm_pair(vllm_servers: VllmServerPool) -> tuple[VllmServer, VllmServer]:
    a, b = vllm_servers.start(2)
    return a, b


@pytest.fixture(scope="session")
def plain_vllm_server(plain_vllm_pair: tuple[VllmServer, VllmServer]) -> VllmServer:
    return plain_vllm_pair[0]

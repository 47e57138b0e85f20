"""Turns the kvpush connector's per-step work off and on inside a running decode engine (benchmark
only, ``make bench-connector-cost``).

Loaded into the decode engine's process by ``benchmarks/engine_probe/sitecustomize.py`` when
``KVPUSH_ENGINE_PROBE`` names a control directory. It keeps every ``KvPushConnector`` the process
builds and, on ``SIGUSR1``, applies the mode written in ``<dir>/mode``:

- ``full``: the connector as shipped;
- ``hooks``: every hook vLLM calls per step or per request answers at once, as a connector that
  does nothing would (valid only while the engine serves plain requests: no P/D transfer may be
  in flight, which the benchmark guarantees);
- ``threads``: the connector's own threads stay asleep (the decode rank's NIXL poller naps 2 s
  instead of 20 ms while nothing is expected, the registration stream sends no periodic load
  report);
- ``bypassed``: both.

It answers in ``<dir>/ack`` (the mode, or the error). Switching inside one process compares the
connector with and without its per-step work on the same launch, between requests seconds apart,
free of the launch-to-launch spread that separates two launches of one plain vLLM (up to 20 % on a
2-core VM; docs/bench_phases.md).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import signal
import sys
import threading
import types
from pathlib import Path
from typing import Any

MODES = ("full", "hooks", "threads", "bypassed")
PER_STEP_HOOKS = (
    "bind_connector_metadata",
    "wait_for_save",
    "get_transfer_results",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_meta",
    "update_connector_output",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "request_finished",
    "request_finished_all_groups",
)
QUIET_NAP_S = 2.0
CONNECTORS: list[Any] = []
_state = {"mode": "full"}


class QuietableEvent(threading.Event):
    """The registration stream's wake-up: in the quiet modes a periodic report waits 30 s (a load
    change still sets it and sends one at once)."""

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(30.0 if _state["mode"] in ("threads", "bypassed") else timeout)


def _results() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults()


def _bypass_hooks(conn: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    if conn.worker is not None:
        conn.bind_connector_metadata = lambda m: KVConnectorBase_V1.bind_connector_metadata(conn, m)
        conn.wait_for_save = lambda: None
        conn.get_transfer_results = lambda ids: _results()
        conn.get_finished = lambda ids: (None, None)
        conn.get_block_ids_with_load_errors = set
    if conn.scheduler is not None:
        empty = KVConnectorMetadata()
        conn.build_connector_meta = lambda out: empty
        conn.update_connector_output = lambda out: None
        conn.get_num_new_matched_tokens = lambda req, n: (0, False)
        conn.update_state_after_alloc = lambda req, blocks, n: None
        conn.request_finished = lambda req, blocks: (False, None)
        conn.request_finished_all_groups = lambda req, blocks: (False, None)


def apply_mode(mode: str, connectors: list[Any] | None = None) -> None:
    """Applies ``mode`` to ``connectors`` (default: every one this process built). Raises when a
    connector lacks what a mode switches (renamed internals must break the benchmark, not make it
    measure nothing)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    conns = CONNECTORS if connectors is None else connectors
    if not conns:
        raise RuntimeError("no KvPushConnector in this process")
    _state["mode"] = mode
    quiet = mode in ("threads", "bypassed")
    for conn in conns:
        for name in PER_STEP_HOOKS:
            conn.__dict__.pop(name, None)  # back to the class's methods
        if mode in ("hooks", "bypassed"):
            _bypass_hooks(conn)
        rank = getattr(conn.worker, "rank", None) if conn.worker is not None else None
        if rank is not None:
            rank.cadence.idle_s = QUIET_NAP_S if quiet else rank.config.idle_poll_s
        registration = getattr(conn.scheduler, "registration", None) if conn.scheduler is not None else None
        if registration is not None:
            if not isinstance(registration._wake, QuietableEvent):
                registration._wake = QuietableEvent()
            if not quiet:
                registration._wake.set()  # out of a long wait now


def _on_signal(control: Path) -> None:
    try:
        mode = (control / "mode").read_text().strip()
        apply_mode(mode)
        answer = mode
    except Exception as exc:  # reported to the benchmark, which stops
        answer = f"error: {type(exc).__name__}: {exc}"
    tmp = control / "ack.tmp"
    tmp.write_text(answer)
    os.replace(tmp, control / "ack")


def _keep(cls: type) -> None:
    init = cls.__init__

    def keeping(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        CONNECTORS.append(self)

    cls.__init__ = keeping  # type: ignore[misc]


class _ConnectorModuleFinder(importlib.abc.MetaPathFinder):
    """Wraps ``KvPushConnector.__init__`` as its module loads."""

    target = "kvpush.connector.push_connector"

    def __init__(self) -> None:
        self._busy = False

    def find_spec(
        self, name: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != self.target or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            _keep(module.KvPushConnector)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(control: Path) -> None:
    """In the engine process, before vLLM loads: keeps the connectors and listens for SIGUSR1.
    Outside the main thread (no signal handler possible) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    control.mkdir(parents=True, exist_ok=True)
    sys.meta_path.insert(0, _ConnectorModuleFinder())
    signal.signal(signal.SIGUSR1, lambda signum, frame: _on_signal(control))

"""Benchmark only (``make bench-connector-cost``): on this directory's PYTHONPATH entry, a process
whose environment names a control directory in ``KVPUSH_ENGINE_PROBE`` loads
``benchmarks.connector_bypass``; every other process is left alone. Then the next
``sitecustomize`` on the path runs as if this one were not there (the serving harness's affinity
shim, say)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("KVPUSH_ENGINE_PROBE"):
    from benchmarks.connector_bypass import install

    install(Path(os.environ["KVPUSH_ENGINE_PROBE"]))


def _next_sitecustomize() -> None:
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "sitecustomize.py"
        if candidate.parent != here and candidate.is_file():
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_next_sitecustomize()

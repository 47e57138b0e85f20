"""CPU time of a process tree, to the nanosecond, for benchmarks that count it per request."""

from __future__ import annotations

import contextlib
from pathlib import Path


def tree_cpu_s(pid: int | None) -> float:
    """CPU time (s) of every thread of ``pid`` and its descendants so far (Linux ``schedstat``, in
    ns: per-request amounts are tens of ms, below ``cpu_times``' clock ticks): an engine's API
    server, engine core, and the threads the connector runs in them."""
    if pid is None:
        return float("nan")
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total_ns = 0
    for proc in procs:
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError, IndexError):  # ended meanwhile
                total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e9


def tree_cpu_by_thread_s(pid: int | None) -> dict[str, float]:
    """The same, by thread: CPU seconds so far per ``process name/thread name`` (the kernel's
    names; a process's first thread is ``main``), threads of one name summed. The connector names
    its own threads (services/common/thread_names.py), so they are told from vLLM's."""
    if pid is None:
        return {}
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    by_name: dict[str, float] = {}
    for proc in procs:
        with contextlib.suppress(OSError):
            proc_name = Path(f"/proc/{proc.pid}/comm").read_text().strip()
            for task in Path(f"/proc/{proc.pid}/task").glob("*"):
                with contextlib.suppress(OSError, ValueError, IndexError):  # ended meanwhile
                    name = "main" if task.name == str(proc.pid) else (task / "comm").read_text().strip()
                    key = f"{proc_name}/{name}"
                    by_name[key] = by_name.get(key, 0.0) + int((task / "schedstat").read_text().split()[0]) / 1e9
    return by_name

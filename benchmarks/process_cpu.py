"""CPU time of a process tree, to the nanosecond, for benchmarks that count it per request."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path


def _tree_tasks(pid: int) -> Iterator[tuple[int, Path]]:
    """(process id, /proc task directory) of every thread of ``pid`` and its descendants; nothing
    when ``pid`` is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(OSError):  # ended meanwhile
            yield from ((proc.pid, task) for task in Path(f"/proc/{proc.pid}/task").glob("*"))


def _run_ns(task: Path) -> int:
    return int((task / "schedstat").read_text().split()[0])


def tree_cpu_s(pid: int | None) -> float:
    """CPU time (s) of every thread of ``pid`` and its descendants so far (Linux ``schedstat``, in
    ns: per-request amounts are tens of ms, below ``cpu_times``' clock ticks): an engine's API
    server, engine core, and the threads the connector runs in them."""
    if pid is None:
        return float("nan")
    total_ns = 0
    for _, task in _tree_tasks(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):  # ended meanwhile
            total_ns += _run_ns(task)
    return total_ns / 1e9


def tree_cpu_by_thread_s(pid: int | None) -> dict[str, float]:
    """The same, by thread: CPU seconds so far per ``process name/thread name`` (the kernel's
    names; a process's first thread is ``main``), threads of one name summed. The connector names
    its own threads (services/common/thread_names.py), so they are told from vLLM's."""
    return {k: ns / 1e9 for k, ns in _by_thread(pid, _run_ns).items()}


def tree_wakes_by_thread(pid: int | None) -> dict[str, int]:
    """Voluntary context switches so far (how often a thread blocked, hence was woken), keyed as
    ``tree_cpu_by_thread_s``: a thread that naps on a timer shows its cadence here."""
    return _by_thread(pid, _voluntary_switches)


def _voluntary_switches(task: Path) -> int:
    for line in (task / "status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def _by_thread(pid: int | None, read: Callable[[Path], int]) -> dict[str, int]:
    """``read(task)`` of every thread of ``pid``'s tree, summed per ``process name/thread name``."""
    by_name: dict[str, int] = {}
    if pid is None:
        return by_name
    proc_names: dict[int, str] = {}
    for proc_pid, task in _tree_tasks(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):  # ended meanwhile
            if proc_pid not in proc_names:
                proc_names[proc_pid] = Path(f"/proc/{proc_pid}/comm").read_text().strip()
            proc_name = proc_names[proc_pid]
            name = "main" if task.name == str(proc_pid) else (task / "comm").read_text().strip()
            key = f"{proc_name}/{name}"
            by_name[key] = by_name.get(key, 0) + read(task)
    return by_name

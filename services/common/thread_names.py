"""The kernel's name for the calling thread (``/proc/<pid>/task/<tid>/comm``: what ``top -H``,
``ps -L`` and per-thread CPU accounting show).

Python 3.11 does not pass ``threading.Thread(name=...)`` to the OS, so every thread the connector
starts inside vLLM's engine process would otherwise carry the engine's name (``VLLM::EngineCor``)
and could not be told from vLLM's own threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_PR_SET_NAME = 15
MAX_LEN = 15  # the kernel keeps 16 bytes, the NUL included


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def name_native_thread(name: str) -> bool:
    """Names the calling thread ``name`` (cut to 15 bytes) for the OS; False where it cannot
    (not Linux, no libc). Only the name changes: nothing depends on it."""
    libc = _libc()
    if libc is None:
        return False
    raw = name.encode("ascii", "replace")[:MAX_LEN]
    return int(libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)) == 0

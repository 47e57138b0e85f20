"""deploy/systemd: `make install-systemd` into a temporary DESTDIR, then `systemd-analyze verify`.

systemd-analyze checks that every Exec* binary exists, so the units are installed with
PREFIX=<tmp>/opt/kvpush (the recipe substitutes /opt/kvpush) and stub executables are put there.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ["kvpush-scheduler.service", "kvpush-prefill.service", "kvpush-decode.service"]
ENVS = ["scheduler.env", "prefill.env", "decode.env"]


def _install(dest: Path, prefix: str) -> None:
    subprocess.run(
        ["make", "-s", "install-systemd", f"DESTDIR={dest}", f"PREFIX={prefix}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def _exec_start(unit: str) -> str:
    text = (ROOT / "deploy/systemd" / unit).read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    return line[len("ExecStart=") :]


def test_install_layout(tmp_path: Path) -> None:
    _install(tmp_path, "/opt/kvpush")
    for unit in UNITS:
        installed = tmp_path / "etc/systemd/system" / unit
        assert installed.read_text() == (ROOT / "deploy/systemd" / unit).read_text()
        assert installed.stat().st_mode & 0o777 == 0o644
    for env in ENVS:
        assert (tmp_path / "etc/kvpush" / env).stat().st_mode & 0o777 == 0o640


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze missing (apt-get install -y systemd)"
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    prefix = tmp_path / "opt/kvpush"
    _install(tmp_path, str(prefix))
    bindir = prefix / ".venv/bin"
    bindir.mkdir(parents=True)
    for name in ("python", "kvpush-scheduler"):
        stub = bindir / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    units = [str(tmp_path / "etc/systemd/system" / u) for u in UNITS]
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "kvpush" not in proc.stderr, proc.stderr  # no warnings about our units either


@pytest.mark.parametrize(
    ("unit", "env", "role"),
    [
        ("kvpush-prefill.service", "prefill.env", "kv_producer"),
        ("kvpush-decode.service", "decode.env", "kv_consumer"),
    ],
)
def test_vllm_units_kv_transfer_config(unit: str, env: str, role: str) -> None:
    """With the documented env file, ${VAR} substitution yields the connector contract."""
    values = _env_file(ROOT / "deploy/systemd/env" / env)
    line = _exec_start(unit)
    used = set(re.findall(r"\$\{(\w+)\}", line)) | set(re.findall(r"\$(\w+)", line))
    assert used <= set(values), f"{unit} uses variables {used - set(values)} missing in {env}"
    expanded = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], line)
    (raw,) = re.findall(r"'([^']*)'", expanded)
    config = json.loads(raw)
    assert config["kv_connector"] == "KvPushConnector"
    assert config["kv_connector_module_path"] == "kvpush.connector.push_connector"
    assert config["kv_role"] == role and config["engine_id"] == values["KVPUSH_ENGINE_ID"]
    extra = config["kv_connector_extra_config"]
    assert extra["scheduler_address"] == values["KVPUSH_SCHEDULER_ADDRESS"]
    assert extra["agent_host"] == values["KVPUSH_AGENT_HOST"]
    assert extra["agent_base_port"] == int(values["KVPUSH_AGENT_BASE_PORT"])
    assert extra["http_endpoint"].endswith(":" + values["KVPUSH_VLLM_PORT"])
    # The connector accepts exactly this config (it refuses unknown extra keys).
    from kvpush.connector.config import ConnectorConfig

    cfg = ConnectorConfig.from_vllm(SimpleNamespace(**config))
    assert cfg.role == ("prefill" if role == "kv_producer" else "decode")
    # mTLS from files, never plaintext; secrets are files too, none is on the command line (ps).
    assert cfg.tls_ca_file and cfg.tls_cert_file and cfg.tls_key_file and not cfg.insecure
    assert cfg.tls_cert_file.endswith(f"/{values['KVPUSH_ENGINE_ID']}.pem")
    assert "auth_token" not in extra and "TOKEN}" not in line.replace("TOKEN_FILE}", "")
    assert (
        cfg.advertised(cfg.port_for(1))
        == f"{values['KVPUSH_ADVERTISE_HOST']}:{int(values['KVPUSH_AGENT_BASE_PORT']) + 1}"
    )
    assert line.startswith("/opt/kvpush/.venv/bin/python -m vllm.entrypoints.openai.api_server ")
    # Both roles tap vLLM's sampler for the first-token hand-off (connector/vllm_worker.py).
    assert "--worker-cls kvpush.connector.vllm_worker.KvPushWorker " in line


def test_wait_http(tmp_path: Path) -> None:
    """The vLLM units' ExecStartPost readiness wait."""
    import http.server
    import threading

    from kvpush.services.common import wait_http

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert wait_http.wait(f"{base}/health", timeout_s=5, interval_s=0.05)
        assert not wait_http.wait(f"{base}/starting", timeout_s=0.2, interval_s=0.05)
    finally:
        server.shutdown()
        server.server_close()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpush.services.common.wait_http",
            "--timeout",
            "0.2",
            "--interval",
            "0.05",
            "http://127.0.0.1:9/health",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1 and "did not answer 200" in proc.stderr


def test_scheduler_env_matches_flags() -> None:
    """Every variable in scheduler.env is one the scheduler reads."""
    from kvpush.services.scheduler.main import ENV_PREFIX, parse_args

    flags = {a.replace("-", "_") for a in vars(parse_args([]))}
    for key in _env_file(ROOT / "deploy/systemd/env/scheduler.env"):
        assert key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() in flags, key

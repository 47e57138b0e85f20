"""Shared pytest set-up: real-vLLM fixtures (``tiny_model_dir``, server pools) and a development PKI
(``dev_certs``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["vllm_fixtures"]

# Engine ids with a certificate in ``dev_certs`` (besides ``scheduler`` and ``frontend``): the usual
# 2P2D names, and the engines of ``start_cluster(tag="-mtls")``.
DEV_CERT_ENGINES = ("prefill-0", "prefill-1", "decode-0", "decode-1", "prefill-mtls", "decode-mtls")


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory made by ``make certs``: ``ca.pem`` and ``<name>.pem``/``<name>.key`` for
    ``scheduler``, ``frontend`` and each of ``DEV_CERT_ENGINES``. A test's Security for engine X:
    ``Security.mtls(TlsFiles.in_dir(dev_certs, X))``; more engines: ``make_certs(dev_certs, [...])``
    (the CA is kept)."""
    from scripts.make_certs import make_certs

    return make_certs(tmp_path_factory.mktemp("certs"), engines=DEV_CERT_ENGINES)

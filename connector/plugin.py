"""``vllm.general_plugins`` entry point: makes ``KvPushConnector`` known by name to vLLM's factory."""

from __future__ import annotations

CONNECTOR_NAME = "KvPushConnector"
MODULE_PATH = "kvpush.connector.push_connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)

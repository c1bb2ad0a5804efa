"""vLLM loads zkv from here: ``kv_connector_module_path="zkv.integrations.vllm_connector"``,
``kv_connector="ZkvConnector"``. The implementation lives in :mod:`zkv.integrations.vllm`."""

from zkv.integrations.vllm.connector import ZkvConnector, ZkvConnectorMetadata

__all__ = ["ZkvConnector", "ZkvConnectorMetadata"]

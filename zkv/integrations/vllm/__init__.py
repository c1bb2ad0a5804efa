"""zkv inside vLLM: a v1 KV connector (``zkv.integrations.vllm_connector.ZkvConnector``).

::

    config.py      kv_connector_extra_config -> ZkvVllmConfig (refuses bad keys/values)
    layout.py      vLLM's per-layer KV tensors -> zkv (K, V) views + CacheLayout
    identity.py    the model's identity in the L3 namespace (path or hub commit, ...)
    request_hashes.py  a vLLM request's tokens, chain root and placeholder items
    pd.py          P/D over the store: the producer's answer, the consumer's wait
    scheduler.py   the scheduler half (EngineCore process): CacheManager + Dispatcher
    worker.py      the worker half (each model worker): Sidecar over vLLM's KV tensors
    metrics.py     prometheus_client counters in the zkv: namespace
    events.py      the connector's event names (connector.*)
    connector.py   ZkvConnector, the KVConnectorBase_V1 that vLLM loads
    check.py       ``zkv-check-vllm-config``: the config checked before vLLM starts
"""

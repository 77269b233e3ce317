"""pdserve's vLLM integration: the only package that imports vLLM.

``pdserve.vllm.connector.PdserveConnector`` is the KV connector vLLM loads by
``kv_connector_module_path``; ``pdserve.vllm.params`` (no vLLM import) holds its configuration,
the ``kv_transfer_params`` schema and the pure planning/lease logic, so they can be unit-tested
without vLLM.
"""

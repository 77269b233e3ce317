"""pdserve's vLLM integration: the only package that imports vLLM.

``pdserve.vllm.connector.PdserveConnector`` is the KV connector vLLM loads by ``kv_connector_module_path``;
it delegates to ``scheduler`` (scheduler process) or ``worker`` (worker process). ``params`` (configuration,
the ``kv_transfer_params`` schema, block planning), ``messages``, ``release``, ``pool`` and ``scheduler``
import neither vLLM nor torch, so they are unit-tested without vLLM.
"""

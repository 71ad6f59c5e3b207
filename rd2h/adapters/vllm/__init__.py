"""rd2h as a vLLM KV connector.

Use with ``--kv-transfer-config '{"kv_connector": "SfaRemoteD2HConnector",
"kv_connector_module_path": "rd2h.adapters.vllm.connector", ...}'``. This package
is the only place in rd2h that imports vLLM; import ``rd2h.adapters.vllm.connector``
only where vLLM is installed.
"""

"""The entry layer: what vLLM instantiates by name (``kv_connector_module_path:
rd2h.entry.connector``). It translates vLLM's objects (``translate.py``) and drives the
app's connector roles, which the composition root builds (``rd2h.bootstrap.roles``). The
one place outside the app that reaches into it; nothing imports this layer."""

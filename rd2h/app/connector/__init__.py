"""rd2h as a vLLM KV connector: the four roles (Decode/Prefill x scheduler/worker)
as plain application services. ``rd2h.entry.translate`` turns vLLM's objects into the
plain values these take, ``rd2h.bootstrap.roles`` builds them; nothing here imports
vLLM."""

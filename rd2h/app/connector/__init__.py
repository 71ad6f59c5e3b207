"""rd2h as a vLLM KV connector: the four roles (Decode/Prefill x scheduler/worker)
as plain application services. ``rd2h.adapters.vllm`` turns vLLM's objects into
the plain values these take; nothing here imports vLLM."""

"""Ascend-side adapters (duck-typed over vllm-ascend objects; nothing imported here)."""

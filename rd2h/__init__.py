"""rd2h: pull-model KV-cache transfer from Prefill to Decode (remote device-to-host)."""

__version__ = "0.1.0"

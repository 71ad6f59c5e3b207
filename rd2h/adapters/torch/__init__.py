"""torch adapters: device events, the Decode TP group exchange and cache-tensor geometry."""

"""torch adapters: device events and the Decode TP group exchange."""

"""Pure rules of rd2h: no I/O, no threads, no clocks, no logging (stdlib + numpy only)."""

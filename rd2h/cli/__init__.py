"""The ``rd2h`` command line (demo, probe, proxy): it uses the library like any user
would; nothing in the library imports it."""

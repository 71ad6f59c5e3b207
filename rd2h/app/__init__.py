"""Use cases, settings, the composition root and the command line."""

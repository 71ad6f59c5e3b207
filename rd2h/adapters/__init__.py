"""Adapters: the only place that imports outside libraries. One folder per outside thing."""

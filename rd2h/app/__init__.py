"""The application: the drivers that move bytes and time for the domain's sessions
(``prefill``, ``decode``, their loop and device events), the vLLM connector's four roles
(``connector``), settings, secrets and telemetry. The composition root that wires them
to adapters is ``rd2h.bootstrap``; the command line is ``rd2h.cli``."""

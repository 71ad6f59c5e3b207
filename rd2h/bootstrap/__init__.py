"""The composition root, above the layers it wires: ``bootstrap(settings, **overrides)``
builds rd2h's objects from settings (adapters chosen by the settings, fakes passed as
keyword overrides); ``roles`` builds the vLLM connector's roles from it; ``gateways``
gives the command line, the demo and the probe the few adapters they start directly.
The connector entry, the CLI, the demo and the probe use it; ``rd2h.app`` (the drivers
and roles) and ``rd2h.adapters`` never import each other."""

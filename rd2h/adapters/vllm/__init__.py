"""vLLM's side of rd2h: cache layouts and destinations from vLLM's tensors
(``caches.py``), the stats payload and Prometheus series (``stats.py``, ``prom.py``) and
the sibling-connector host (``multi.py``). The connector vLLM instantiates is the entry
layer's ``rd2h.entry.connector``. Import these only where vLLM is installed.
"""

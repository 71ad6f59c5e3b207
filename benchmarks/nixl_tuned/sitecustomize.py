"""Benchmark-only shims for ``serving_vs_peers.py``'s ``nixl-tuned`` target: vLLM's
NixlConnector with its two CPU handicaps on a small CPU host switched off, the best it
can do here. Never part of rd2h; active only in processes started with
``RD2H_BENCH_NIXL_TUNED=1`` and this folder first on ``PYTHONPATH``.

1. The NIXL worker's one ``os.sched_setaffinity`` call on CPU (it pins the model
   thread to the last core of each NUMA node, "reserving" the rest for transfers) is
   suppressed: the engine keeps every core, as the plain engine and rd2h do.
2. NIXL's agent is built with ``enable_prog_thread=False``: no UCX progress thread
   spinning beside the model; UCX progresses when the connector polls its transfers.

Each shim logs one line to stderr when it first acts, so an engine log shows that the
tuned target really ran tuned.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_AFFINITY_CALLER = os.path.join("nixl", "base_worker.py")


def _say(what: str) -> None:
    print(f"[nixl-tuned shim pid {os.getpid()}] {what}", file=sys.stderr, flush=True)


def _keep_affinity() -> None:
    real = os.sched_setaffinity

    def sched_setaffinity(pid: int, cpus: object) -> None:
        if sys._getframe(1).f_code.co_filename.endswith(_AFFINITY_CALLER):
            _say(f"suppressed the NIXL worker's sched_setaffinity({pid}, {cpus})")
            return None
        return real(pid, cpus)

    os.sched_setaffinity = sched_setaffinity


def _no_progress_thread(module: object) -> None:
    """``module`` is ``nixl._api`` (the wheel's __init__ puts the CUDA build's there)."""
    config = module.nixl_agent_config  # type: ignore[attr-defined]
    real_init = config.__init__

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        kwargs["enable_prog_thread"] = False
        real_init(self, *args, **kwargs)
        _say("nixl_agent_config(enable_prog_thread=False)")

    config.__init__ = __init__


class _AfterNixl(importlib.abc.MetaPathFinder):
    """Runs the real ``nixl`` package import, then patches ``nixl._api``."""

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name != "nixl":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # type: ignore[arg-type]
        if spec is None or spec.loader is None:
            return spec
        real_loader = spec.loader

        def exec_module(module: object) -> None:
            real_loader.exec_module(module)  # type: ignore[union-attr]
            api = sys.modules.get("nixl._api")
            if api is not None and hasattr(api, "nixl_agent_config"):
                _no_progress_thread(api)

        spec.loader = type("_PatchedLoader", (), {
            "create_module": lambda self, s: real_loader.create_module(s),
            "exec_module": lambda self, m: exec_module(m),
        })()
        return spec


if os.environ.get("RD2H_BENCH_NIXL_TUNED") == "1":
    _keep_affinity()
    sys.meta_path.insert(0, _AfterNixl())

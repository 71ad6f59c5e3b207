"""``rd2h demo``: the multi-process Prefill -> Decode pull demo (a harness around the
library: it uses ``rd2h.app`` like any user would; nothing in the library imports it).

The public names load on first use, so ``rd2h --help`` does not import the ranks."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "DemoConfig": "rd2h.demo.config",
    "SENTINEL": "rd2h.demo.config",
    "internal_id": "rd2h.demo.config",
    "layer_name": "rd2h.demo.config",
    "main_pool_bytes": "rd2h.demo.config",
    "main_pool_mismatches": "rd2h.demo.config",
    "verify_main_pool": "rd2h.demo.config",
    "DemoResult": "rd2h.demo.report",
    "summary_text": "rd2h.demo.report",
    "to_json": "rd2h.demo.report",
    "run_demo": "rd2h.demo.run",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rd2h.demo' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)

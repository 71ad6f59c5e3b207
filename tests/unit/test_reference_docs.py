"""The reference pages under ``docs/reference/`` are generated from the code
(``scripts/gen_reference.py``); this fails when a committed page is stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


GEN = _generator()
PAGES = GEN.render()


@pytest.mark.parametrize("name", sorted(PAGES))
def test_reference_page_is_current(name: str) -> None:
    committed = (ROOT / "docs" / "reference" / name).read_text()
    assert committed == PAGES[name], (
        f"docs/reference/{name} is stale: run .venv/bin/python scripts/gen_reference.py")


def test_every_option_metric_and_command_is_documented() -> None:
    from rd2h.app.settings import Deadlines, Limits, Rd2hOptions
    from rd2h.cli.main import build_parser

    config, metrics, cli = PAGES["configuration.md"], PAGES["metrics.md"], PAGES["cli.md"]
    for name in Rd2hOptions.model_fields:
        if name not in ("deadlines", "limits"):
            assert f"| `{name}` |" in config, name
    for prefix, model in (("deadlines.", Deadlines), ("limits.", Limits)):
        for name in model.model_fields:
            assert f"| `{prefix}{name}` |" in config, name
    for series in ("vllm:rd2h_bytes_pulled_total", "vllm:rd2h_requests_failed_by_cause_total",
                   "rd2h_proxy_ejections_total", "rd2h_proxy_affinity_total",
                   "rd2h_proxy_decode_first_byte_seconds_bucket"):
        assert f"`{series}" in metrics, series
    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices)
    for command in sub.choices:
        assert f"## `rd2h {command}`" in cli, command

"""The model sweep in CI (issue #59): one architecture per distinct KV-group shape of the
committed sweep (``benchmarks/results/model_sweep.json``), run again by the sweep's own
code (``model_sweep.sweep_one``: a tiny checkpoint, a plain reference engine computing
the P/D split, Prefill and Decode with rd2h over cma behind ``rd2h proxy``, prompts of 1
token to past two blocks and four at once), each expected to get its committed verdict.
A shape is the set of group kinds rd2h names at start (``full``, ``sliding``, ``mla``,
``state``, ...); a refused family is run too, so that its refusal stays named.

The whole sweep (every architecture, about 40 minutes) is ``benchmarks/model_sweep.py``;
its matrix is ``docs/reference/models.md``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks"
RESULTS = json.loads((BENCH / "results" / "model_sweep.json").read_text())["architectures"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# One architecture per shape (``test_every_shape_has_one`` keeps this complete), and the
# refusals worth keeping named.
CI_ARCHS = (
    "GraniteMoeSharedForCausalLM",  # full attention (MoE with a shared expert)
    "GraniteSWAForCausalLM",  # full and sliding-window groups
    "MistralForCausalLM",  # sliding only
    "Lfm2MoeForCausalLM",  # short-convolution state beside attention
    "Llama4ForCausalLM",  # refused: chunked local attention
)


def _modules():
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        import model_sweep
        import serving_support
    finally:
        sys.path[:] = saved
    return model_sweep, serving_support


SWEEP, SP = _modules()


def shape(groups: str) -> tuple[str, ...]:
    """The kinds of groups (a sliding window's width aside): ``('full', 'sliding')``."""
    return tuple(sorted({re.sub(r"w\d+$", "", g.split("/")[0])
                         for g in groups.split(",") if g}))


def test_every_shape_has_one() -> None:
    """Each distinct shape among the architectures the sweep found right has one
    architecture here."""
    right = {shape(r["groups"]) for r in RESULTS.values() if r["verdict"] == "EQUAL+PULLED"}
    here = {shape(RESULTS[a]["groups"]) for a in CI_ARCHS}
    assert right <= here, f"shapes without an architecture in CI_ARCHS: {right - here}"


@pytest.fixture(scope="module")
def guardian():
    g = SP.Guardian()
    yield g
    g.release()


@pytest.mark.parametrize("arch", CI_ARCHS)
def test_architecture_gets_its_committed_verdict(arch, guardian, tmp_path_factory) -> None:
    committed = RESULTS[arch]
    got = SWEEP.sweep_one(arch, committed["model_type"], tmp_path_factory.mktemp("sweep"),
                          guardian)
    assert got["verdict"] == committed["verdict"], got
    assert shape(got["groups"]) == shape(committed["groups"]), (got, committed)
    if got["verdict"] == "EQUAL+PULLED":
        assert got["bytes_pulled"] == committed["bytes_pulled"], (got, committed)
    else:
        assert got["reason"].split(":")[:2] == committed["reason"].split(":")[:2], got

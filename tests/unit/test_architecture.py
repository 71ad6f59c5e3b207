"""The shape of the package, checked: no import cycle between modules, no file over 400
lines, and the sans-IO sessions import nothing but the standard library, numpy and the
domain. (The layer contracts themselves are import-linter's, run by ``.ci/run``.)"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2] / "rd2h"
SESSIONS = ("rd2h.domain.prefill_session", "rd2h.domain.decode_session")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # Imports under TYPE_CHECKING count: a cycle there is still a cycle of the design.
    return grimp.build_graph("rd2h", include_external_packages=True,
                             exclude_type_checking_imports=False)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    modules = sorted(m for m in graph.modules if m.startswith("rd2h"))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in graph.find_modules_directly_imported_by(m):
            if not n.startswith("rd2h"):
                continue
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_no_module_import_cycle(graph: grimp.ImportGraph) -> None:
    assert _cycles(graph) == []


def test_the_cycle_check_can_fail() -> None:
    g = grimp.ImportGraph()
    for m in ("rd2h.a", "rd2h.b"):
        g.add_module(m)
    g.add_import(importer="rd2h.a", imported="rd2h.b")
    g.add_import(importer="rd2h.b", imported="rd2h.a")
    assert _cycles(g) == [["rd2h.a", "rd2h.b"]]


def test_no_file_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


@pytest.mark.parametrize("session", SESSIONS)
def test_sessions_import_only_stdlib_numpy_and_the_domain(graph: grimp.ImportGraph,
                                                          session: str) -> None:
    allowed_roots = set(sys.stdlib_module_names) | {"numpy"}
    for imported in graph.find_modules_directly_imported_by(session):
        if imported.startswith("rd2h."):
            assert imported.startswith("rd2h.domain."), (session, imported)
        else:
            assert imported.split(".")[0] in allowed_roots, (session, imported)
    for banned in ("threading", "socket", "time", "selectors", "asyncio"):
        assert banned not in graph.find_modules_directly_imported_by(session), banned

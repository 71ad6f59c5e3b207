"""The shape of the package, checked: no import cycle between modules; the domain in
rooms named by concern; no two modules of the library's rooms share a name; the sessions
are one class each, with no mixins; a loose size alarm (modules are cut by concern, not
by a line count); and the sans-IO sessions import nothing but the standard library,
numpy and the domain. (The layer contracts themselves are import-linter's, run by
``.ci/run``.)"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2] / "rd2h"
SESSIONS = ("rd2h.domain.prefill.prefill_session", "rd2h.domain.decode.decode_session")


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


DOMAIN_ROOMS = {"wire", "decode", "prefill", "planning"}
SIZE_ALARM = 800  # lines: past this a module is probably two concerns


def test_the_domain_is_in_rooms_by_concern() -> None:
    """Every domain module sits in a room (its errors are shared by all of them)."""
    domain = ROOT / "domain"
    loose = {p.name for p in domain.glob("*.py")} - {"__init__.py", "errors.py"}
    assert loose == set()
    assert {p.name for p in domain.iterdir() if p.is_dir() and p.name != "__pycache__"} \
        == DOMAIN_ROOMS


# The domain's rooms in layers: a room imports only the rooms after it (errors are
# everyone's). The wire is the bottom; planning reads the wire; each side's sessions
# read both.
DOMAIN_LAYERS = (("decode", "prefill"), ("planning",), ("wire",))


def test_the_domains_rooms_import_only_downwards(graph: grimp.ImportGraph) -> None:
    """No loop between rooms: a room imports no room beside or above it."""
    below: dict[str, set[str]] = {}
    for i, rooms in enumerate(DOMAIN_LAYERS):
        lower = {r for layer in DOMAIN_LAYERS[i + 1:] for r in layer}
        for room in rooms:
            below[room] = lower
    assert set(below) == DOMAIN_ROOMS
    wrong = []
    for module in sorted(graph.find_children("rd2h.domain")):
        room = module.split(".")[2]
        if room not in below:
            continue
        for sub in [*sorted(graph.find_descendants(module)), module]:
            for imported in graph.find_modules_directly_imported_by(sub):
                parts = imported.split(".")
                if (imported.startswith("rd2h.domain.") and len(parts) > 2
                        and parts[2] in DOMAIN_ROOMS and parts[2] != room
                        and parts[2] not in below[room]):
                    wrong.append((sub, imported))
    assert wrong == [], wrong


def _library_modules() -> list[Path]:
    """The library's own rooms: the domain, the app, the proxy, the entry point."""
    return [p for room in ("domain", "app", "proxy", "entry") for p in (ROOT / room).rglob("*.py")
            if p.name != "__init__.py"]


def test_no_two_library_modules_share_a_name() -> None:
    seen: dict[str, list[str]] = {}
    for p in _library_modules():
        seen.setdefault(p.stem, []).append(str(p.relative_to(ROOT.parent)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_no_module_past_the_size_alarm() -> None:
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > SIZE_ALARM}
    assert long == {}


@pytest.mark.parametrize("session", SESSIONS)
def test_each_session_is_one_class_without_mixins(session: str) -> None:
    import importlib
    import inspect

    module = importlib.import_module(session)
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if c.__module__ == session and c.__name__.endswith("Session")]
    assert len(classes) == 1, classes
    assert classes[0].__bases__ == (object,), classes[0].__bases__


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


# The files one announcement walks through (``scripts/walk_files.py``): Decode from the
# READ_READY_BATCH frame to its reply, Prefill from the submitted layer to its answer.
# Before the rooms (59cbca1) the same measure gave 22 and 13.
WALK_LIMITS = {"decode": 19, "prefill": 12}


def test_one_announcement_walks_no_more_files_than_the_layout_allows() -> None:
    import importlib.util

    script = ROOT.parent / "scripts" / "walk_files.py"
    spec = importlib.util.spec_from_file_location("walk_files", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    walks = module.walks()
    for side, limit in WALK_LIMITS.items():
        assert walks[side], f"nothing recorded for {side}: the measure is broken"
        assert len(walks[side]) <= limit, (side, walks[side])
    assert "rd2h/domain/planning/planning.py" in walks["decode"]
    assert "rd2h/domain/prefill/prefill_session.py" in walks["prefill"]

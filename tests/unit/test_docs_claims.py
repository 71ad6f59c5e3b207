"""Claims the docs make about the code, kept true (issue #42: docs that hold).

Each test reads a page as a reader would and compares what it states with the code or
the tests it names: the gate budget and the deadline defaults (docs/operations/deadlines.md),
the topologies CI runs on real engines and the variables that narrow them
(docs/guide/vllm.md), the environment variables any page names, the files the pages
point at, and the compatibility keys of MF_META (docs/security.md). The test modules
under tests/integration/vllm are parsed (ast), not imported: they import the real-engine
harness.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
VLLM_TESTS = ROOT / "tests" / "integration" / "vllm"
# Every page a reader gets: the site, the README, the changelog and the results.
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md",
         ROOT / "benchmarks" / "RESULTS.md"]
# Real-engine modules whose topologies docs/guide/vllm.md lists.
TOPOLOGY_MODULES = ("test_unequal_tp_e2e", "test_head_split_e2e")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _flat(text: str) -> str:
    """The text with every run of white space (line breaks included) one space."""
    return " ".join(text.split())


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``marker`` (header and rule left out)."""
    assert marker in text, f"marker {marker!r} is gone from the page"
    start = text.rfind("\n", 0, text.index(marker)) + 1  # from the marker's own line
    rows: list[list[str]] = []
    for line in text[start:].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table after {marker!r}"
    return rows[2:]


# ----------------------------------------------------------------- (a) deadlines


def test_the_gate_budget_figure_is_the_codes() -> None:
    from rd2h.app.settings import Deadlines
    from rd2h.domain.prefill.prefill_state import GATE_SLACK_S, PrefillTimeouts

    text = _flat(_read(DOCS / "operations" / "deadlines.md"))
    assert "`device_event_s + meta_ack_s + 2 x layer_ack_s`" in text
    found = re.search(r"\((\d+(?:\.\d+)?) \+ (\d+(?:\.\d+)?) \+ 2 x (\d+(?:\.\d+)?) \+ "
                      r"(\d+(?:\.\d+)?) = (\d+(?:\.\d+)?) s at the defaults\)", text)
    assert found, "deadlines.md no longer spells out the gate budget at the defaults"
    event, meta, layer, slack, total = (float(g) for g in found.groups())
    d = Deadlines()
    assert (event, meta, layer) == (d.device_event_s, d.meta_ack_s, d.layer_ack_s)
    assert slack == GATE_SLACK_S
    assert event + meta + 2 * layer + slack == total, "the page's own sum is wrong"
    # What the connector builds from the settings (rd2h.bootstrap.container -> PrefillSender)
    # and the session's own defaults must both give the figure.
    from_settings = PrefillTimeouts(meta_ack_s=d.meta_ack_s, layer_ack_s=d.layer_ack_s,
                                    device_event_s=d.device_event_s,
                                    idle_link_s=d.idle_link_s)
    assert from_settings.gate_budget_s == total
    assert PrefillTimeouts().gate_budget_s == total


def test_the_deadline_table_states_the_settings_defaults() -> None:
    from rd2h.app.settings import Deadlines
    from rd2h.cli.main import build_parser

    rows = _table_after(_read(DOCS / "operations" / "deadlines.md"),
                        "| deadline | default | bounds | on expiry |")
    stated: dict[str, float] = {}
    flags: list[str] = []
    for name_cell, default, *_ in rows:
        name = re.match(r"`(\w+)`", name_cell)
        assert name, name_cell
        stated[name.group(1)] = float(default)
        flags += re.findall(r"`(--[\w-]+)`", name_cell)
    code = {name: field.default for name, field in Deadlines.model_fields.items()}
    assert stated == code
    # The flags the table names are the demo's.
    parser = build_parser()
    sub = next(a for a in parser._actions if getattr(a, "choices", None))
    demo_flags = {s for a in sub.choices["demo"]._actions for s in a.option_strings}
    assert flags and set(flags) <= demo_flags, set(flags) - demo_flags


# ----------------------------------------------------------------- (b) topologies


def _module(name: str) -> ast.Module:
    return ast.parse(_read(VLLM_TESTS / f"{name}.py"))


def _environ_get(node: ast.AST) -> tuple[str, str] | None:
    """``(variable, default)`` of an ``os.environ.get("NAME", "default")`` call."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and ast.unparse(node.func.value) == "os.environ"
            and len(node.args) == 2
            and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                    for a in node.args)):
        return node.args[0].value, node.args[1].value  # type: ignore[union-attr]
    return None


def _fixture_params(tree: ast.Module) -> dict[str, ast.expr]:
    """The ``params`` of every ``@pytest.fixture(params=...)``, by fixture name."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and ast.unparse(deco.func) == "pytest.fixture":
                    for kw in deco.keywords:
                        if kw.arg == "params":
                            out[node.name] = kw.value
    return out


def _unequal_tp_sizes() -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{"PREFILL_TPS": (variable, sizes), "DECODE_TPS": ...}`` as the module reads
    them when no variable is set, checked to be what its fixtures run."""
    tree = _module("test_unequal_tp_e2e")
    sizes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in ("PREFILL_TPS", "DECODE_TPS")):
            calls = [c for c in map(_environ_get, ast.walk(node.value)) if c]
            assert len(calls) == 1, ast.unparse(node)
            variable, default = calls[0]
            sizes[node.targets[0].id] = (variable, tuple(int(x) for x in default.split(",")))
    assert set(sizes) == {"PREFILL_TPS", "DECODE_TPS"}, sizes
    params = {name: ast.unparse(value) for name, value in _fixture_params(tree).items()}
    assert params == {"prefill": "PREFILL_TPS", "cluster": "DECODE_TPS"}, params
    return sizes


def _ci_topologies() -> dict[str, set[tuple[int, int]]]:
    """(Prefill TP, Decode TP) pairs each module runs by default."""
    sizes = _unequal_tp_sizes()
    unequal = {(p, d) for p in sizes["PREFILL_TPS"][1] for d in sizes["DECODE_TPS"][1]
               if p % d == 0 or d % p == 0}
    (head_split,) = _fixture_params(_module("test_head_split_e2e")).values()
    return {"test_unequal_tp_e2e": unequal,
            "test_head_split_e2e": set(ast.literal_eval(head_split))}


def _pairs(text: str) -> set[tuple[int, int]]:
    return {(int(p), int(d)) for p, d in
            re.findall(r"(\d+) -> (?:Decode TP )?(\d+)\b", text)}


def test_the_topology_list_is_what_ci_runs() -> None:
    text = _read(DOCS / "guide" / "vllm.md")
    marker = "**The topologies CI runs on real engines**"
    assert marker in text
    listed: dict[str, set[tuple[int, int]]] = {}
    for line in text[text.index(marker):].split("\n\n", 2)[1].splitlines():
        item = re.match(r"- `(\w+)`[^:]*: (.*)", line)
        assert item, line
        listed[item.group(1)] = _pairs(item.group(2))
    assert listed == _ci_topologies()


def test_the_topology_table_names_only_pairs_its_modules_run() -> None:
    runs = _ci_topologies()
    rows = _table_after(_read(DOCS / "guide" / "vllm.md"),
                        "| Prefill TP | Decode TP | model kind | works | tested |")
    checked = 0
    for *_, tested in rows:
        named = [m for m in TOPOLOGY_MODULES if f"`{m}`" in tested]
        if len(named) == 1:
            pairs = _pairs(tested)
            assert pairs, tested
            assert pairs <= runs[named[0]], (named[0], pairs - runs[named[0]])
            checked += 1
    assert checked >= 4, "the table no longer names the modules' topologies"


# ----------------------------------------------------------------- (c) variables


def test_the_unequal_tp_variables_are_the_ones_the_module_reads() -> None:
    sizes = _unequal_tp_sizes()
    text = _flat(_read(DOCS / "guide" / "vllm.md"))
    found = re.search(r"`(RD2H_\w+)` and `(RD2H_\w+)` \(comma lists, default `([\d,]+)` "
                      r"and `([\d,]+)`\) narrow the set", text)
    assert found, "vllm.md no longer names the variables that narrow the unequal-TP set"
    prefill_var, decode_var, prefill_default, decode_default = found.groups()
    assert (prefill_var, tuple(int(x) for x in prefill_default.split(","))) \
        == sizes["PREFILL_TPS"]
    assert (decode_var, tuple(int(x) for x in decode_default.split(","))) \
        == sizes["DECODE_TPS"]
    # "Prefill engines at TP 1, 2 and 4, each serving Decode engines at TP 1 and TP 2".
    at = re.search(r"Prefill engines at TP ([\d, and]+), each serving Decode engines at "
                   r"TP ([\d, andTP]+) in turn", text)
    assert at, "vllm.md no longer says which TP sizes the module starts"
    assert tuple(int(x) for x in re.findall(r"\d+", at.group(1))) == sizes["PREFILL_TPS"][1]
    assert tuple(int(x) for x in re.findall(r"\d+", at.group(2))) == sizes["DECODE_TPS"][1]


def _sources() -> str:
    files = [p for top in ("rd2h", "tests", "benchmarks") for p in (ROOT / top).rglob("*.py")]
    files += [p for p in (ROOT / "scripts").rglob("*") if p.is_file()]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files
                     if p.resolve() != Path(__file__).resolve())


def test_every_rd2h_variable_a_page_names_is_read_by_the_code() -> None:
    code = _sources()
    missing = []
    for page in PAGES:
        text = _read(page)
        # A name the reader picks (``"auth_secret_env": "RD2H_AUTH_SECRET"``) is an example.
        examples = set(re.findall(r'"\w+_env": "(RD2H_\w+)"', text))
        for name in sorted(set(re.findall(r"\bRD2H_[A-Z0-9_]+\b", text)) - examples):
            if not re.search(rf"\b{name}\b", code):
                missing.append(f"{_rel(page)}: {name}")
    assert not missing, missing


# ----------------------------------------------------------------- (d) links


_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|md|json|toml|yml|yaml|txt|sh))`")


def test_pages_link_only_to_files_in_the_repository() -> None:
    broken = []
    for page in PAGES:
        text = _read(page)
        for target in _LINK.findall(text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):  # a URL, or an anchor on the page
                continue
            where = (page.parent / path).resolve()
            if "shared" in Path(path).parts or not where.exists() \
                    or not where.is_relative_to(ROOT):
                broken.append(f"{_rel(page)}: link {target}")
        # A file named in code style: from the root, the docs, the page, or the tests.
        for path in _PATH.findall(text):
            bases = (ROOT, DOCS, page.parent, ROOT / "tests", VLLM_TESTS)
            if path.startswith(("../", "shared/")) or not any((b / path).exists()
                                                             for b in bases):
                broken.append(f"{_rel(page)}: file {path}")
    assert not broken, broken


def test_no_page_of_the_site_cites_a_spec_section_it_does_not_have() -> None:
    cited = []
    for page in sorted(DOCS.rglob("*.md")):
        for n, line in enumerate(_read(page).splitlines(), 1):
            if re.search(r"\bspec\s*(?:§|\d)|rd2h-spec", line, re.IGNORECASE):
                cited.append(f"{_rel(page)}:{n}: {line.strip()}")
    assert not cited, cited


# ----------------------------------------------------------------- (e) compat keys


def _keys_the_code_states() -> set[str]:
    """Every key rd2h puts in MF_META's compatibility map: ``compat_of``'s parameters
    and every ``with_values(...)`` keyword in the package."""
    from rd2h.domain.wire.compat import compat_of

    keys = set(inspect.signature(compat_of).parameters)
    for path in (ROOT / "rd2h").rglob("*.py"):
        for node in ast.walk(ast.parse(_read(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "with_values"):
                keys |= {kw.arg for kw in node.keywords if kw.arg}
    return keys


def test_the_security_page_lists_every_compatibility_key() -> None:
    from rd2h.domain.wire.compat import KNOWN

    rows = _table_after(_read(DOCS / "security.md"),
                        "**Mismatched builds meet at the handshake.**")
    listed = [re.fullmatch(r"`(\w+)`", row[0]) for row in rows]
    assert all(listed), [row[0] for row in rows]
    documented = {m.group(1) for m in listed if m}
    assert len(documented) == len(rows), "a key is listed twice"
    assert _keys_the_code_states() == set(KNOWN), "the code states a key Decode does not know"
    assert documented == set(KNOWN)


def test_the_install_page_states_the_pinned_versions() -> None:
    """The versions the install page gives are pyproject's pins and set-up's torch."""
    tomllib = pytest.importorskip("tomllib")

    text = _read(DOCS / "guide" / "install.md")
    project = tomllib.loads(_read(ROOT / "pyproject.toml"))["project"]
    for extra in ("mooncake", "memfabric", "proxy", "bench"):
        for requirement in project["optional-dependencies"][extra]:
            assert f"`{requirement}`" in text, (extra, requirement)
    torch = re.search(r'install --quiet "torch==([\d.]+)"', _read(ROOT / "scripts" /
                                                                "setup-venv"))
    assert torch and f"torch=={torch.group(1)}" in text
    (vllm,) = project["optional-dependencies"]["vllm"]
    assert f"`{vllm}`" in text

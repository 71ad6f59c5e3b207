"""Claims the docs make about the code, kept true (issue #42: docs that hold).

Each test reads a page as a reader would and compares what it states with the code or
the tests it names: the gate budget and the deadline defaults (docs/operations/deadlines.md),
the topologies CI runs on real engines and the variables that narrow them
(docs/guide/vllm.md), the environment variables any page names, the files the pages
point at, and the compatibility keys of MF_META (docs/security.md). The test modules
under tests/integration/vllm are parsed (ast), not imported: they import the real-engine
harness.

Issue #60 (docs that hold, kept by tests): every metric name, rd2h flag, stated default,
proxy endpoint and environment variable a page names is checked against the code: the
generated references (docs/reference/, scripts/gen_reference.py), the argparse parsers,
the settings models and the proxy's route table. vLLM's own flags, series and variables
are left to vLLM (an explicit allowlist of its flags; its series are not rd2h-prefixed;
its variables are looked up in its envs.py). Each check has a test that feeds it a wrong
name and expects it reported, so none can pass by reading nothing.
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


def _vllm_variables() -> str | None:
    """The text of the installed vLLM's ``vllm/envs.py`` (every variable vLLM reads),
    found without importing vLLM; None when vLLM is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    envs = Path(next(iter(spec.submodule_search_locations))) / "envs.py"
    return _read(envs) if envs.exists() else None


def _unknown_variables(text: str, code: str, vllm_envs: str | None) -> list[str]:
    """The ``RD2H_*`` variables ``text`` names that ``code`` never mentions, and the
    ``VLLM_*`` ones that neither rd2h's code (its sources, tests, scripts and deploy
    files) nor vLLM's ``envs.py`` does (vLLM's own variables are vLLM's to name)."""
    # A name the reader picks (``"auth_secret_env": "RD2H_AUTH_SECRET"``) is an example.
    examples = set(re.findall(r'"\w+_env": "(RD2H_\w+)"', text))
    unknown = []
    for name in sorted(set(re.findall(r"\bRD2H_[A-Z0-9_]+\b", text)) - examples):
        if not re.search(rf"\b{name}\b", code):
            unknown.append(name)
    for name in sorted(set(re.findall(r"\bVLLM_[A-Z0-9_]+\b", text))):
        if re.search(rf"\b{name}\b", code):
            continue
        if vllm_envs is not None and not re.search(rf"[\"']{name}[\"']", vllm_envs):
            unknown.append(name)
    return unknown


def test_every_variable_a_page_names_is_read_by_the_code() -> None:
    code = _sources() + "\n" + "\n".join(
        _read(p) for p in (ROOT / "deploy").rglob("*") if p.is_file())
    vllm_envs = _vllm_variables()
    missing = [f"{_rel(page)}: {name}" for page in PAGES
               for name in _unknown_variables(_read(page), code, vllm_envs)]
    assert not missing, missing


def test_the_variable_check_reports_a_name_nobody_reads() -> None:
    code = 'os.environ.get("RD2H_TIMELINE_DIR")'
    envs = 'environment_variables = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": lambda: 5}'
    page = ("Set `RD2H_TIMELINE_DIR` or `RD2H_TIMELINE_FOLDER`; vLLM reads "
            "`VLLM_HTTP_TIMEOUT_KEEP_ALIVE` and `VLLM_KEEPALIVE_S`; "
            '"auth_secret_env": "RD2H_MY_SECRET" is an example.')
    assert _unknown_variables(page, code, envs) == ["RD2H_TIMELINE_FOLDER",
                                                    "VLLM_KEEPALIVE_S"]


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


# ----------------------------------------------------------------- (f) metric names
# The generated metrics reference (scripts/gen_reference.py, from the code) is the source:
# every ``vllm:rd2h_*`` and ``rd2h_*`` series a page names must be one it lists. vLLM's
# own series (``vllm:num_requests_waiting``) are not rd2h's and are not checked.

REFERENCE = DOCS / "reference"
# Pages every check reads: the generated references are the truth, not claims.
CLAIM_PAGES = [p for p in PAGES if not p.is_relative_to(REFERENCE)]
# ``rd2h:name`` too: never a name rd2h's series have, so always reported.
_SERIES = re.compile(r"(?<![\w:.])((?:vllm:)?rd2h[_:][a-z0-9_]*[a-z0-9])(?![\w*])")


def _series_of_reference(reference: str) -> set[str]:
    """Every series name a Prometheus scrape can show, from the metrics reference's
    tables: counters with ``_total``, histograms as ``_bucket`` / ``_sum`` / ``_count``
    (and their base name, as pages name a histogram)."""
    names: set[str] = set()
    for cell in re.findall(r"^\| `([^`]+)` \|", reference, re.MULTILINE):
        if cell.endswith("_bucket / _sum / _count"):
            base = cell.split(" ")[0].removesuffix("_bucket")
            names |= {base, base + "_bucket", base + "_sum", base + "_count"}
        else:
            names.add(cell)
    return names


def _unknown_series(text: str, known: set[str]) -> list[str]:
    return sorted({name for name in _SERIES.findall(text) if name not in known})


def test_every_series_a_page_names_is_in_the_metrics_reference() -> None:
    known = _series_of_reference(_read(REFERENCE / "metrics.md"))
    assert "vllm:rd2h_bytes_pulled_total" in known and "rd2h_proxy_requests_total" in known
    wrong = [f"{_rel(page)}: {name}" for page in CLAIM_PAGES
             for name in _unknown_series(_read(page), known)]
    assert not wrong, wrong


def test_the_series_check_reports_a_name_the_code_does_not_have() -> None:
    known = _series_of_reference(_read(REFERENCE / "metrics.md"))
    page = ("Decode's `vllm:rd2h_control_frames_shed_total` and `rd2h:control_frames_shed`, "
            "`vllm:rd2h_announcements_parked`, `rd2h_proxy_ejections_total`, "
            "`rd2h_proxy_decode_first_byte_seconds_bucket`, vLLM's "
            "`vllm:num_requests_waiting`, all `rd2h_proxy_*`, `rd2h_proxy_requests_totl`.")
    assert _unknown_series(page, known) == ["rd2h:control_frames_shed",
                                            "rd2h_proxy_requests_totl",
                                            "vllm:rd2h_announcements_parked"]


def _ejection_causes_listed(text: str) -> set[str]:
    row = re.search(r"\| `instance ejected` \(with `cause`: ([^)]*)\)", text)
    assert row, "troubleshooting.md no longer lists the ejection causes"
    return set(re.findall(r"`(\w+)`", row.group(1)))


def test_troubleshooting_lists_every_ejection_cause() -> None:
    from rd2h.proxy.routing import Failure

    listed = _ejection_causes_listed(_read(DOCS / "operations" / "troubleshooting.md"))
    assert listed == {f.value for f in Failure}
    # And the check sees a cause left out.
    short = "| `instance ejected` (with `cause`: `probe`, `connect`, `error`) | x |"
    assert _ejection_causes_listed(short) != {f.value for f in Failure}


# ----------------------------------------------------------------- (g) command-line flags


def _commands() -> dict[str, set[str]]:
    """Every ``rd2h`` command (``"proxy"``, ``"probe mooncake"``, ``""`` for ``rd2h``
    itself) with its option strings, from the argparse parsers."""
    import argparse

    from rd2h.cli.main import build_parser

    def options(parser: argparse.ArgumentParser) -> set[str]:
        return {s for a in parser._actions for s in a.option_strings}

    def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    root = build_parser()
    out = {"": options(root)}
    for name, sub in subparsers(root).items():
        out[name] = options(sub)
        for inner, parser in subparsers(sub).items():
            out[f"{name} {inner}"] = options(parser)
    return out


def _flag_defaults() -> dict[str, set[object]]:
    """Each rd2h flag's default on every command that has it, and any default its help
    states (``default 64``) where argparse's own is None."""
    import argparse

    from rd2h.cli.main import build_parser

    out: dict[str, set[object]] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
                continue
            for flag in action.option_strings:
                values = out.setdefault(flag, set())
                if isinstance(action.default, (str, int, float)) \
                        and action.default is not argparse.SUPPRESS:
                    values.add(action.default)
                for said in re.findall(r"default:? (-?\d[\d.]*)", action.help or ""):
                    values.add(float(said.rstrip(".")))

    walk(build_parser())
    return out


_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])")


def _invocations(text: str, commands: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(command, rest of its line)`` for each ``rd2h COMMAND ...`` a page runs: in a
    code block (continuation lines joined, comments and what follows a pipe or a
    ``;`` left out) or in an inline code span that begins with it."""
    lines: list[str] = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(re.split(r"(?:^|\s)#|\||;|&&|\s&(?:\s|$)", line)[0])
    prose = _FENCE.sub("", text)
    lines += re.findall(r"`(rd2h [^`]+)`", prose)
    found = []
    for line in lines:
        # rd2h as the program a line runs: first on it, maybe after a prompt, variable
        # assignments or a path (.venv/bin/rd2h); not an argument of another program.
        for m in re.finditer(r"^\s*(?:\$\s+)?(?:\w+=\S*\s+)*(?:exec\s+)?(?:[\w./-]*/)?"
                             r"rd2h((?:\s+[a-z][a-z-]*){0,2})(?=\s|$)(.*)", line):
            words, rest = m.group(1).split(), m.group(2)
            # the longest command the words name: "probe mooncake", "proxy", or rd2h's own
            for n in (2, 1, 0):
                name = " ".join(words[:n])
                if len(words) >= n and name in commands:
                    tail = " ".join(words[n:])
                    found.append((name, f"{tail} {rest}".strip()))
                    break
    return found


def _wrong_invocation_flags(text: str, commands: dict[str, set[str]]) -> list[str]:
    wrong = []
    for command, rest in _invocations(text, commands):
        for flag in _FLAG.findall(rest):
            if flag not in commands[command]:
                wrong.append(f"rd2h {command} {flag}".replace("  ", " "))
    return wrong


def test_every_flag_given_to_an_rd2h_command_is_that_commands() -> None:
    commands = _commands()
    wrong = [f"{_rel(page)}: {claim}" for page in CLAIM_PAGES
             for claim in _wrong_invocation_flags(_read(page), commands)]
    assert not wrong, wrong
    # The pages do run rd2h with flags, so the check has something to read.
    assert len(_invocations(_read(DOCS / "guide" / "across-hosts.md"), commands)) >= 4


def test_the_invocation_check_reports_a_flag_the_command_lacks() -> None:
    commands = _commands()
    page = ("Run `rd2h proxy --dispatch parallel --eject-after-timeouts 3`, then\n\n"
            "```bash\nrd2h probe mooncake --serve --host 10.0.0.2 \\\n  --peer-url x  # --x\n"
            "rd2h demo --requests 2 | grep --count ok\n```\n")
    assert _wrong_invocation_flags(page, commands) == [
        "rd2h probe mooncake --peer-url", "rd2h proxy --eject-after-timeouts"]


# Flags of other programs that pages name: vLLM's engine (``vllm serve`` /
# ``python -m vllm.entrypoints.openai.api_server``), pip and python -m build, kubectl and
# container builds. rd2h does not define them, so they are not checked against its parsers.
VLLM_FLAGS = {
    "--attention-backend", "--compilation-config", "--disable-hybrid-kv-cache-manager",
    "--disable-log-stats", "--disable-uvicorn-access-log", "--dtype", "--enable-sleep-mode",
    "--enforce-eager", "--kv-cache-dtype", "--kv-transfer-config", "--max-num-seqs",
    "--no-enable-prefix-caching", "--num-gpu-blocks-override", "--tensor-parallel-size",
}
TOOL_FLAGS = {
    "--build-arg", "--constraint", "--dry-run", "--from-file", "--hash", "--index-url",
    "--no-deps", "--require-hashes", "--sdist", "--wheel-dir", "--find-links", "--no-index",
}
# Measurement and developer pages name the benchmarks' and profilers' flags at length;
# the flags they give rd2h itself are checked above.
NOT_FLAG_CHECKED = {ROOT / "benchmarks" / "RESULTS.md", DOCS / "development.md"}


def _benchmark_flags() -> set[str]:
    text = "\n".join(_read(p) for p in (ROOT / "benchmarks").glob("*.py"))
    return set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", text))


def _unknown_flags(text: str, known: set[str]) -> list[str]:
    return sorted(set(_FLAG.findall(text)) - known)


def test_every_flag_a_page_names_is_rd2hs_or_a_named_tools() -> None:
    known = set().union(*_commands().values(), VLLM_FLAGS, TOOL_FLAGS, _benchmark_flags())
    wrong = [f"{_rel(page)}: {flag}" for page in CLAIM_PAGES if page not in NOT_FLAG_CHECKED
             for flag in _unknown_flags(_read(page), known)]
    assert not wrong, wrong


def test_the_flag_check_reports_a_flag_nobody_defines() -> None:
    known = set().union(*_commands().values(), VLLM_FLAGS, TOOL_FLAGS)
    page = ("Lower `--decode-timeout`; vLLM's `--enforce-eager`; `--eject-after-probe-timeout` "
            "and `--upstream-socket aiohttp`; pip's `--require-hashes`.")
    assert _unknown_flags(page, known) == ["--eject-after-probe-timeout", "--upstream-socket"]


# ----------------------------------------------------------------- (h) stated defaults

_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_NAME = r"--[a-z][a-z0-9-]*|(?:deadlines\.|limits\.)?[a-z][a-z0-9]*_[a-z0-9_]+"
_NUMBER = r"(-?\d[\d,]*(?:\.\d+)?)(?: ?(s|ms|KiB|MiB|GiB))?"
_NUMBER_UNIT = r"(-?\d[\d,]*(?:\.\d+)?) ?(s|ms|KiB|MiB|GiB)\b"
# `name` (N unit) | `name` (N unit; ... | `name` (N unit by default | `name` N unit,
# `name`, default N | `name`, N unit,
_STATED = [
    re.compile(rf"`({_NAME})` \({_NUMBER}(?:\)|;| by default)"),
    re.compile(rf"`({_NAME})`,? default {_NUMBER}(?=[,;.)]| \(|$)"),
    re.compile(rf"`({_NAME})`,? {_NUMBER_UNIT}(?=[,;.)]| \(|$)"),
]
# `--flag value`, the default | by default, `--flag value` | `--flag value` (the default
_STATED_VALUE = [
    re.compile(r"`(--[a-z][a-z0-9-]*) ([^`\s]+)`(?:,| \(|) the (?:new )?default\b"),
    re.compile(r"\bby default, `(--[a-z][a-z0-9-]*) ([^`\s]+)`"),
    re.compile(r"`[^`]*?(--[a-z][a-z0-9-]*)[^`]*` \(default `([^`]+)`\)"),
]
# `--flag {a,b,c}`: the choices a page lists must be the parser's, all of them.
_CHOICES = re.compile(r"`[^`]*?(--[a-z][a-z0-9-]*) \{([\w,-]+)\}`")


def _config_defaults() -> dict[str, object]:
    """Every ``kv_connector_extra_config`` key's default: ``name``, ``deadlines.name``,
    ``limits.name``; a nested key also under its bare name when no other key has it."""
    from pydantic_core import PydanticUndefined

    from rd2h.app.settings import Deadlines, Limits, Rd2hOptions

    out: dict[str, object] = {}
    bare: dict[str, list[object]] = {}
    for prefix, model in (("", Rd2hOptions), ("deadlines.", Deadlines), ("limits.", Limits)):
        for name, field in model.model_fields.items():
            if field.default is PydanticUndefined:
                continue
            out[prefix + name] = field.default
            bare.setdefault(name, []).append(field.default)
    for name, values in bare.items():
        if len(values) == 1:
            out.setdefault(name, values[0])
    return out


def _value(number: str, unit: str | None, name: str) -> float:
    value = float(number.replace(",", ""))
    if unit in _UNITS:
        return value * _UNITS[unit]
    if unit == "ms" and not name.endswith("_ms"):
        return value / 1000
    if unit == "s" and name.endswith("_ms"):
        return value * 1000
    return value


def _numeric(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _table_defaults(text: str) -> list[tuple[str, str, str | None]]:
    """``(name, number, unit)`` of each row of a table with a ``default`` column whose
    first cell begins with a name in code style (``| `limits.recv_hwm` | 64 | ...``)."""
    out = []
    column = None
    for line in text.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            column = cells.index("default") if "default" in cells else -1
            continue
        if column < 0 or len(cells) <= column or set(cells[0]) <= set("-: "):
            continue
        name = re.match(rf"`({_NAME})`", cells[0])
        value = re.fullmatch(_NUMBER, cells[column])
        if name and value:
            out.append((name.group(1), value.group(1), value.group(2)))
    return out


def _flag_choices() -> dict[str, set[str]]:
    """The choices of each rd2h flag that has them (the same on every command)."""
    import argparse

    from rd2h.cli.main import build_parser

    out: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            elif action.choices is not None:
                for flag in action.option_strings:
                    out[flag] = {str(c) for c in action.choices}

    walk(build_parser())
    return out


def _wrong_defaults(text: str, flags: dict[str, set[object]],
                    keys: dict[str, object],
                    choices: dict[str, set[str]] | None = None) -> list[str]:
    """Each default ``text`` states for an rd2h flag or configuration key that is not
    the code's. Names that are neither (vLLM's flags, request fields) are left alone."""
    flat = _flat(text)
    choices = _flag_choices() if choices is None else choices
    wrong = []
    claims: list[tuple[str, str, str | None]] = []
    for pattern in _STATED:
        claims += pattern.findall(flat)
    claims += _table_defaults(text)
    for name, number, unit in claims:
        if name.startswith("--"):
            code = {v for v in map(_numeric, flags.get(name, ())) if v is not None}
        else:
            one = _numeric(keys.get(name))
            code = set() if one is None else {one}
        if not code:
            continue  # not an rd2h flag or key with a numeric default
        stated = _value(number, unit, name)
        if not any(abs(stated - c) <= 1e-9 * max(1.0, abs(c)) for c in code):
            wrong.append(f"{name}: {number}{' ' + unit if unit else ''}")
    for pattern in _STATED_VALUE:
        for flag, value in pattern.findall(flat):
            code_values = {str(v) for v in flags.get(flag, ())}
            if code_values and value not in code_values:
                wrong.append(f"{flag}: {value}")
    for flag, listed in _CHOICES.findall(flat):
        code_choices = choices.get(flag)
        if code_choices is not None and set(listed.split(",")) != code_choices:
            wrong.append(f"{flag}: {{{listed}}}")
    return wrong


def test_every_default_a_page_states_is_the_codes() -> None:
    flags, keys = _flag_defaults(), _config_defaults()
    wrong = [f"{_rel(page)}: {claim}" for page in CLAIM_PAGES if page not in NOT_FLAG_CHECKED
             for claim in _wrong_defaults(_read(page), flags, keys)]
    assert not wrong, wrong
    # The check reads what the pages state (a table, a flag in prose, a nested key).
    assert len(_table_defaults(_read(DOCS / "security.md"))) >= 8


def test_the_default_check_reports_a_default_the_code_does_not_have() -> None:
    flags, keys = _flag_defaults(), _config_defaults()
    page = ("Probes every `--probe-interval` (2 s) with `--probe-timeout` (3 s); "
            "`--eject-after` 5 s, `--upstream-sockets asyncio`, the default; by default, "
            "`--affinity-chunk 64`; `admission_wait_s`, 5 s; `deadlines.request_s` (60 s); "
            "`limits.max_queued_bytes` (256 MiB; ...); `idle_wait_ms`, default 5; vLLM's "
            "`--max-num-seqs` (256); `heartbeat_timeout_s` (5000 ms); `request_s` 20; "
            "`rd2h proxy --upstream-sockets {asyncio,anyio}`; "
            "`--dispatch {decode-first,parallel}`; "
            "`--decode-policy P` (default `round_robin`); `--client-keepalive` 60 s.\n\n"
            "| limit | default | bounds |\n|---|---|---|\n"
            "| `limits.recv_hwm` | 64 | x |\n| `limits.max_peers` | 2048 | x |\n")
    assert _wrong_defaults(page, flags, keys) == [
        "--probe-timeout: 3 s", "deadlines.request_s: 60 s", "--client-keepalive: 60 s",
        "limits.max_peers: 2048",
        "--upstream-sockets: asyncio", "--decode-policy: round_robin",
        "--upstream-sockets: {asyncio,anyio}"]


# ----------------------------------------------------------------- (i) proxy endpoints


def _proxy_routes() -> set[tuple[str, str]]:
    """``(method, path)`` of every route ``rd2h proxy`` serves, from its app."""
    from fastapi.routing import APIRoute

    from rd2h.proxy.options import ProxyConfig
    from rd2h.proxy.service import create_app

    url = "http://127.0.0.1:9"
    app = create_app(ProxyConfig(prefill=(url,), decode=(url,), public_url=url))
    return {(method, route.path) for route in app.routes if isinstance(route, APIRoute)
            for method in route.methods}


_METHOD_PATH = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/[\w/.-]*\w)")
# Paths named alone in code style that only the proxy (or an engine beside it) serves.
_PATH_SPAN = re.compile(r"`((?:/v1|/admin)/[\w/.-]*\w|/health|/healthcheck|/status|/metrics|"
                        r"/tokenize|/detokenize)[`?\s]")


def _unknown_endpoints(text: str, routes: set[tuple[str, str]]) -> list[str]:
    paths = {path for _, path in routes}
    wrong = {f"{method} {path}" for method, path in _METHOD_PATH.findall(text)
             if (method, path) not in routes}
    wrong |= {path for path in _PATH_SPAN.findall(text) if path not in paths}
    return sorted(wrong)


def test_every_endpoint_a_page_names_is_the_proxys() -> None:
    routes = _proxy_routes()
    assert ("POST", "/tokenize") in routes and ("GET", "/health") in routes
    # The generated cli.md counts here: it is the proxy's --help, written by hand.
    wrong = [f"{_rel(page)}: {claim}" for page in PAGES
             for claim in _unknown_endpoints(_read(page), routes)]
    assert not wrong, wrong


def test_the_endpoint_check_reports_a_route_the_proxy_lacks() -> None:
    routes = _proxy_routes()
    page = ("`POST /v1/completions`, `GET /v1/models`, `GET /tokenize`, `POST /v1/embeddings`, "
            "`/admin/instances/drain?role=R`, `/admin/instance`, `/healthz` and `/metrics`.")
    assert _unknown_endpoints(page, routes) == ["/admin/instance", "GET /tokenize",
                                                "POST /v1/embeddings"]


def _unnamed_routes(help_text: str, routes: set[tuple[str, str]]) -> list[str]:
    """Client-facing routes the proxy's --help does not name: all but the metaserver's
    (the engines' own) and the admin API's (``/admin/...``, 'rd2h proxy-admin')."""
    missing = []
    for method, path in sorted(routes):
        if path.startswith(("/v1/metaserver", "/admin/")):
            continue
        if not re.search(rf"(?<![\w/]){re.escape(path)}(?![\w/])", help_text):
            missing.append(f"{method} {path}")
    return missing


def test_the_proxy_help_names_every_client_endpoint() -> None:
    cli = _read(REFERENCE / "cli.md")
    help_text = cli[cli.index("## `rd2h proxy`"):cli.index("## `rd2h proxy-admin`")]
    routes = _proxy_routes()
    assert not _unnamed_routes(help_text, routes)
    assert _unnamed_routes(help_text.replace("/tokenize", "/tokenise"), routes) == [
        "POST /tokenize"]


def test_the_proxy_page_names_every_endpoint() -> None:
    text = _read(DOCS / "guide" / "proxy.md")
    missing = [path for _, path in sorted(_proxy_routes())
               if not re.search(rf"(?<![\w/]){re.escape(path)}(?![\w/])", text)]
    assert not missing, missing


# ----------------------------------------------------------------- (j) installing rd2h


def _installs_by_name(text: str) -> list[str]:
    """``pip install`` lines of a page that take rd2h by its name from a package index
    (``pip install 'rd2h[mooncake]'``), where rd2h is not published: a file, a folder or
    a ``rd2h @ URL`` requirement is fine."""
    lines = [line for block in _FENCE.findall(text) for line in block.splitlines()]
    prose = _FENCE.sub("", text)
    for span in re.finditer(r"`([^`]+)`", prose):  # inline code, paired left to right
        before = prose[max(0, span.start() - 30):span.start()].lower()
        if "not run" not in before and "never" not in before:  # a warning names it
            lines.append(span.group(1))
    found = []
    for line in lines:
        if "pip install " not in line:
            continue
        args = line.split("pip install ", 1)[1].split("#", 1)[0]
        for word in re.findall(r"[^\s\"']+", args.replace("'", " ").replace('"', " ")):
            if re.fullmatch(r"rd2h(?:\[[\w,-]+\])?(?:[=<>~!]=?[\w.*]+)?", word) \
                    and not re.search(rf"{re.escape(word)}\s*@", args):
                found.append(line.strip())
    return found


def test_no_page_installs_rd2h_by_name() -> None:
    found = [f"{_rel(page)}: {line}" for page in PAGES for line in _installs_by_name(_read(page))]
    assert not found, found
    text = _read(DOCS / "guide" / "install.md")
    assert "Do not run `pip install rd2h`" in text and "--require-hashes" in text
    assert re.search(r'pip install "rd2h\[mooncake\] @ git\+https://\S+@<commit>"', text)


def test_the_install_check_reports_rd2h_by_name() -> None:
    page = ("```bash\npip install 'rd2h[mooncake]'   # engine hosts\n"
            "pip install './rd2h-0.1.0-py3-none-any.whl[proxy]'\n"
            'pip install "rd2h[mooncake] @ git+https://example.org/rd2h@0123abc"\n'
            "pip install -e '.[dev]'\n```\nor `pip install rd2h==0.1.0`; "
            "do not run `pip install rd2h`: pip installs rd2h from the index.")
    assert _installs_by_name(page) == ["pip install 'rd2h[mooncake]'   # engine hosts",
                                       "pip install rd2h==0.1.0"]

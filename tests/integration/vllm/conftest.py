"""Fixtures shared by the real-vLLM test modules.

Engines are expensive on a 2-core machine (tens of seconds each to start), so the
tiny checkpoints and the plain Llama reference engine are made once per test session
and shared; each module starts only the engines its own configuration needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
import stall
from fakes.net import free_port
from servers import MLA_ARGS, Server, running, vllm_server

from rd2h.demo.tiny_model import make_tiny_deepseek, make_tiny_llama


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama every Llama module serves."""
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="session")
def llama_reference(
    llama_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One plain (non-disaggregated) engine on the tiny Llama: the token reference."""
    log = tmp_path_factory.mktemp("llama-ref") / "base.log"
    server = vllm_server("reference engine", llama_model, free_port(), log)
    with running(server):
        yield server


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight DeepSeek-V2 (MLA) checkpoint."""
    return make_tiny_deepseek(tmp_path_factory.mktemp("mla") / "model")


@pytest.fixture(scope="session")
def mla_reference(
    mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One plain engine on the tiny MLA model with ``MLA_ARGS``: the token reference."""
    log = tmp_path_factory.mktemp("mla-ref") / "base.log"
    server = vllm_server("MLA reference engine", mla_model, free_port(), log, args=MLA_ARGS)
    with running(server):
        yield server


@pytest.fixture(scope="module", autouse=True)
def no_secret_leaks() -> Iterator[None]:
    """Every real-engine module: the secrets it configured (``servers.secret_file``)
    appear on no server's command line and in no server's log (engines, proxies, rd2h's
    lines among them). Checked as its servers stop; a leak fails the module here."""
    servers.SECRETS.clear()
    servers.LEAKS.clear()
    yield
    leaks, secrets = list(servers.LEAKS), len(servers.SECRETS)
    servers.SECRETS.clear()
    servers.LEAKS.clear()
    assert not leaks, f"{len(leaks)} leak(s) of the module's {secrets} secret(s): {leaks}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test's report shows what every process did while its requests were
    late (``stall.py``): the summary of each capture taken since its setup began."""
    if call.when == "setup":
        item.stash[_FIRST_CAPTURE] = len(stall.captures)
    outcome = yield
    report = outcome.get_result()
    first = item.stash.get(_FIRST_CAPTURE, len(stall.captures))
    for cap in stall.captures[first:]:
        cap.nodeid = cap.nodeid or item.nodeid
        if report.failed:
            report.sections.append((f"stall capture: {cap.label}, {cap.late_s:.0f} s late "
                                    f"(whole: {cap.path})", cap.summary))


def pytest_terminal_summary(terminalreporter) -> None:
    """Every late request of the session, passed or not, one line each."""
    if stall.captures:
        terminalreporter.section("late real-engine requests (stall captures)")
        for cap in stall.captures:
            terminalreporter.write_line(f"{cap.nodeid or '?'}: {cap.label} unanswered after "
                                        f"{cap.late_s:.0f} s -> {cap.path}")


_FIRST_CAPTURE = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A module whose ``cluster`` fixture is parametrized (``CLUSTER_PARAMS``) and whose
    tests also parametrize it with other arguments (``indirect``) keeps each cluster's
    tests together, so each cluster starts once: pytest's own reordering groups only
    arguments of the fixture's scope. Within a cluster, the module's order."""
    for module in {item.module for item in items
                   if hasattr(getattr(item, "module", None), "CLUSTER_PARAMS")}:
        order = list(module.CLUSTER_PARAMS)
        at = [i for i, item in enumerate(items) if getattr(item, "module", None) is module]
        mine = [items[i] for i in at]
        mine.sort(key=lambda item: (order.index(item.callspec.params["cluster"]),
                                    item.function.__code__.co_firstlineno))
        for i, item in zip(at, mine):
            items[i] = item

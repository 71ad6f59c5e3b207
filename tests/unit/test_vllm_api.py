"""The connector's hooks against vLLM's connector API: the installed vLLM (0.32, tested
end to end) and a snapshot of vLLM 0.33.0's ``KVConnectorBase_V1`` / ``SupportsHMA``
(``tests/data/vllm-0.33.0-connector-api.json``, written by
``scripts/connector-api-snapshot`` from the 0.33.0 wheel): checked at the API level."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1 import base

from rd2h.entry.connector import SfaRemoteD2HConnector

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "vllm-0.33.0-connector-api.json"
CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
# Hooks vLLM 0.33 added, each reviewed for rd2h: sleep mode is refused
# (supports_sleep_mode -> False), so vLLM never calls unregister / restore.
REVIEWED_0_33 = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}


def _func(value: Any) -> Any:
    if isinstance(value, (classmethod, staticmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value


def _shape(func: Any) -> dict[str, Any]:
    params = inspect.signature(func).parameters.values()
    return {
        "params": [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)],
        "kwonly": [p.name for p in params if p.kind is p.KEYWORD_ONLY],
        "varargs": any(p.kind is p.VAR_POSITIONAL for p in params),
        "varkw": any(p.kind is p.VAR_KEYWORD for p in params),
    }


def _overrides() -> dict[str, Any]:
    """Hooks the connector defines itself (not inherited), by name."""
    return {n: _func(v) for n, v in vars(SfaRemoteD2HConnector).items()
            if not n.startswith("__") and callable(_func(v))}


def _compatible(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """vLLM calls a hook as its base class declares it: the same positional names
    (ours may take more only as optional ``**kwargs`` / ``*args``)."""
    if ours["params"] != theirs["params"]:
        return False
    if theirs["varkw"] and not ours["varkw"]:
        return False
    return not theirs["varargs"] or ours["varargs"]


def test_every_hook_matches_the_installed_vllm() -> None:
    checked = 0
    for cname in CLASSES:
        cls = getattr(base, cname)
        for name, func in _overrides().items():
            if name in vars(cls):
                theirs = _shape(_func(vars(cls)[name]))
                assert _compatible(_shape(func), theirs), (cname, name, _shape(func), theirs)
                checked += 1
    assert checked >= 20
    missing = {m for m in base.KVConnectorBase_V1.__abstractmethods__
               if m not in _overrides()}
    assert not missing, missing


def test_every_hook_matches_vllm_0_33_and_its_new_hooks_are_reviewed() -> None:
    snap = json.loads(SNAPSHOT.read_text())
    assert snap["vllm"] == "0.33.0"
    checked = 0
    for cname in CLASSES:
        theirs_all = snap["classes"][cname]
        for name, func in _overrides().items():
            if name in theirs_all:
                assert _compatible(_shape(func), theirs_all[name]), (cname, name)
                checked += 1
        installed = set(vars(getattr(base, cname)))
        new = set(theirs_all) - installed
        assert new <= REVIEWED_0_33, f"{cname} hooks new in 0.33 not reviewed: {new}"
    assert checked >= 20


@pytest.mark.parametrize("config", [None, object()])
def test_sleep_mode_is_refused(config: Any) -> None:
    assert SfaRemoteD2HConnector.supports_sleep_mode(config) is False


def test_the_old_module_path_still_loads_the_connector_with_a_warning() -> None:
    import importlib
    import sys

    sys.modules.pop("rd2h.adapters.vllm.connector", None)
    with pytest.warns(DeprecationWarning, match=r"rd2h\.entry\.connector"):
        old = importlib.import_module("rd2h.adapters.vllm.connector")
    assert old.SfaRemoteD2HConnector is SfaRemoteD2HConnector
    # As vLLM's KVConnectorFactory loads a module path and a class name.
    module = importlib.import_module("rd2h.adapters.vllm.connector")
    assert module.SfaRemoteD2HConnector is SfaRemoteD2HConnector

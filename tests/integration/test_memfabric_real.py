"""Against the real installed ``memfabric_hybrid`` (1.3.0), on a machine without an
Ascend driver.

* The adapter's calls match the real methods' names and parameters (read from the pybind
  signatures), and the recording fake has the real signatures.
* The fake's return codes agree with the real library wherever this machine can observe
  them (before ``initialize``, bad arguments, config stores).
* ``initialize`` failing here becomes rd2h's clear ``TransportLibraryError``;
  ``create_config_store`` on a free loopback port really listens.
* ``rd2h probe memfabric`` exits 1 with one sentence and no traceback; with
  ``--transport cma`` it moves and verifies real bytes between two processes.

The real library is only ever called in subprocesses (it prints its log on stdout and
starts threads), each with a timeout.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fakes.memfabric import FakeMemFabricModule, FakeMemFabricNetwork, FakeTransferEngine

from rd2h.adapters.memfabric import MemFabricConfig, MemFabricTransferEngine, start_config_store

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfabric_hybrid: Linux"),
]

PYTHON = sys.executable
RD2H = str(Path(sys.executable).with_name("rd2h"))
SUBPROCESS_S = 90
ENGINE_METHODS = [
    "initialize", "get_rpc_port", "register_memory", "batch_register_memory",
    "unregister_memory", "batch_transfer_sync_read", "destroy", "unInitialize",
]
MODULE_FUNCTIONS = [
    "create_config_store", "get_last_err_msg", "get_and_clear_last_err_msg",
    "set_extern_logger",
]


def _run_python(code: str, tmp_path: Path, timeout: float = SUBPROCESS_S) -> Any:
    """Run ``code`` in a fresh interpreter; it writes its JSON answer to ``OUT`` (stdout is
    the library's log). Returns the decoded answer."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "answer.json"
    script = f"OUT = {str(out)!r}\n" + textwrap.dedent(code)
    proc = subprocess.run(
        [PYTHON, "-c", script], capture_output=True, text=True, timeout=timeout,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- signatures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The first line of each real method's / function's pybind docstring."""
    code = f"""
    import json, memfabric_hybrid as m
    docs = {{}}
    for name in {ENGINE_METHODS!r}:
        docs["TransferEngine." + name] = getattr(m.TransferEngine, name).__doc__
    for name in {MODULE_FUNCTIONS!r}:
        docs[name] = getattr(m, name).__doc__
    docs["TransDataOpType"] = {{k: int(v) for k, v in m.TransDataOpType.__members__.items()}}
    json.dump(docs, open(OUT, "w"))
    """
    return _run_python(code, tmp_path_factory.mktemp("docs"))


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(<":
            depth += 1
        elif ch in "])>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def pybind_signature(doc: str, name: str) -> inspect.Signature:
    """``name(self: T, a: int, b: str = 'x') -> int`` (pybind's first doc line) as a
    Signature (without ``self``); defaults are placeholders, only their presence counts."""
    first = doc.strip().splitlines()[0]
    match = re.fullmatch(rf"{re.escape(name)}\((.*)\)\s*->\s*.+", first)
    assert match, f"unexpected pybind signature line: {first!r}"
    params = []
    for part in _split_top_level(match.group(1)):
        pname = part.split(":", 1)[0].strip()
        if pname == "self":
            continue
        has_default = " = " in part
        params.append(inspect.Parameter(
            pname, inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=object() if has_default else inspect.Parameter.empty,
        ))
    return inspect.Signature(params)


class _Spy:
    """Wraps an object; records ``(qualified name, args, kwargs)`` of every call made
    through it, wrapping what ``TransferEngine()`` returns too."""

    def __init__(self, target: Any, prefix: str, log: list[tuple[str, tuple, dict]]) -> None:
        self._target, self._prefix, self._log = target, prefix, log

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append((self._prefix + name, args, kwargs))
            result = attr(*args, **kwargs)
            if name == "TransferEngine":
                return _Spy(result, "TransferEngine.", self._log)
            return result

        return call


def _adapter_calls() -> list[tuple[str, tuple, dict]]:
    """Every library call the adapter makes in a full life cycle, as it makes them."""
    log: list[tuple[str, tuple, dict]] = []
    network = FakeMemFabricNetwork()
    store = "tcp://127.0.0.1:7300"
    start_config_store(store, _Spy(network.process(), "", log))  # type: ignore[arg-type]
    peer_lib = network.process()
    peer = MemFabricTransferEngine(MemFabricConfig(store, "Prefill"), library=peer_lib)
    src = np.arange(8192, dtype=np.uint8)
    peer.register_memory(src.ctypes.data, src.nbytes)
    reader = MemFabricTransferEngine(
        MemFabricConfig(store, "Decode", device_id=1), library=_Spy(network.process(), "", log)
    )
    dst = np.zeros(3 * 4096, np.uint8)
    reader.register_memory(dst.ctypes.data, 4096)
    reader.register_regions([dst.ctypes.data + 4096, dst.ctypes.data + 8192], [4096, 4096])
    one = np.ones(1, np.int64)
    reader.batch_read(peer.session_id, dst.ctypes.data * one, src.ctypes.data * one, 64 * one)
    reader.close()
    peer.close()
    return log


def test_the_adapter_calls_real_methods_with_their_parameters(real_docs: dict) -> None:
    calls = _adapter_calls()
    called = {name for name, _, _ in calls}
    assert {"TransferEngine", "TransferEngine.initialize", "TransferEngine.get_rpc_port",
            "TransferEngine.register_memory", "TransferEngine.batch_register_memory",
            "TransferEngine.batch_transfer_sync_read", "TransferEngine.unregister_memory",
            "TransferEngine.destroy", "TransferEngine.unInitialize",
            "create_config_store", "get_and_clear_last_err_msg",
            "set_extern_logger"} <= called
    for name, args, kwargs in calls:
        if name == "TransferEngine":
            assert args == () and kwargs == {}
            continue
        assert name in real_docs, f"the adapter calls {name}, which the real library lacks"
        short = name.rpartition(".")[2]
        signature = pybind_signature(real_docs[name], short)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            pytest.fail(f"{name}{signature} cannot take the adapter's call {args} {kwargs}: {exc}")
    init = next(args for name, args, _ in calls if name == "TransferEngine.initialize")
    assert len(init) == 7  # every parameter given explicitly, in the real order


def test_the_fake_has_the_real_signatures(real_docs: dict) -> None:
    for name in ENGINE_METHODS:
        real = pybind_signature(real_docs[f"TransferEngine.{name}"], name)
        fake = inspect.signature(getattr(FakeTransferEngine, name))
        fake_params = [p for p in fake.parameters.values() if p.name != "self"]
        assert [p.name for p in fake_params] == list(real.parameters), name
        assert [p.default is p.empty for p in fake_params] == [
            p.default is p.empty for p in real.parameters.values()
        ], name
    for name in MODULE_FUNCTIONS:
        real = pybind_signature(real_docs[name], name)
        fake = inspect.signature(getattr(FakeMemFabricModule, name))
        assert [p for p in fake.parameters if p != "self"] == list(real.parameters), name
    from fakes.memfabric import TransDataOpType

    assert {m.name: m.value for m in TransDataOpType} == real_docs["TransDataOpType"]


def test_signature_parser_reads_pybind_lines() -> None:
    sig = pybind_signature(
        "initialize(self: X, a: str, b: typing.Callable[[int, str], None], "
        "c: E = <E.SDMA: 1>, d: str = 'Decode') -> int\n\nmore text", "initialize"
    )
    assert list(sig.parameters) == ["a", "b", "c", "d"]
    sig.bind(1, 2)
    with pytest.raises(TypeError):
        sig.bind(1)
    with pytest.raises(TypeError):
        sig.bind(1, 2, 3, 4, 5)


# --- behaviour: the fake agrees with the real library -------------------------------------

# Calls whose results this machine can observe (no Ascend driver): return code zero or not,
# and the sticky last-error message.
_PARITY = """
import json, socket
lib = {lib}
results = []
def note(label, rc):
    results.append([label, rc == 0, lib.get_and_clear_last_err_msg()])
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); taken = s.getsockname()[1]
note("store bad url", lib.create_config_store("garbage"))
note("store host name", lib.create_config_store("tcp://localhost:5000"))
note("store port 0", lib.create_config_store("tcp://127.0.0.1:0"))
note("store taken port", lib.create_config_store(f"tcp://127.0.0.1:{{taken}}"))
free = socket.socket(); free.bind(("127.0.0.1", 0)); port = free.getsockname()[1]; free.close()
url = f"tcp://127.0.0.1:{{port}}"
note("store ok", lib.create_config_store(url))
note("store again", lib.create_config_store(url))
e = lib.TransferEngine()
results.append(["rpc port before init", e.get_rpc_port(), ""])
note("register before init", e.register_memory(0x10000, 4096))
note("batch register unequal", e.batch_register_memory([0x20000, 0x30000], [4096]))
note("read before init", e.batch_transfer_sync_read("127.0.0.1:5", [0x10000], [0x1], [8]))
note("init bad role", e.initialize(url, "127.0.0.1:0", "Leader", 0))
note("init no driver", e.initialize(url, "127.0.0.1:0", "Decode", 0))
results.append(["rpc port after failed init", e.get_rpc_port(), ""])
for label, call in [("int op type", lambda: e.initialize(url, "127.0.0.1:0", "Decode", 0, 2)),
                    ("float address", lambda: e.register_memory(1.5, 8)),
                    ("str lengths", lambda: e.batch_transfer_sync_read("a", [1], [2], "3"))]:
    try:
        call()
        results.append([label, "no error", ""])
    except TypeError:
        results.append([label, "TypeError", ""])
json.dump(results, open(OUT, "w"))
"""


def _parity_results(lib_expr: str, tmp_path: Path, prelude: str = "") -> list:
    return _run_python(prelude + _PARITY.format(lib=lib_expr), tmp_path)


def test_the_fake_returns_what_the_real_library_returns(tmp_path: Path) -> None:
    real = _parity_results("__import__('memfabric_hybrid')", tmp_path / "real")
    tests_dir = str(Path(__file__).resolve().parents[1])
    prelude = f"""
import socket, sys
sys.path.insert(0, {tests_dir!r})
from fakes.memfabric import FakeMemFabricNetwork
def port_in_use(host, port):
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False
network = FakeMemFabricNetwork()
network.port_in_use = port_in_use
"""
    fake = _parity_results("network.process(driver=False)", tmp_path / "fake", prelude)
    assert [r[0] for r in real] == [r[0] for r in fake]
    for (label, real_rc, real_msg), (_, fake_rc, fake_msg) in zip(real, fake):
        assert real_rc == fake_rc, f"{label}: real {real_rc!r}, fake {fake_rc!r}"
        # Where the real library explains itself in get_last_err_msg, so does the fake.
        assert bool(real_msg) == bool(fake_msg), f"{label}: real {real_msg!r}, fake {fake_msg!r}"
        if "CreateParser" in real_msg or "not initialized" in real_msg:
            assert real_msg == fake_msg, label


# --- behaviour: rd2h over the real library ------------------------------------------------


def test_initialize_failure_and_config_store_over_the_real_library(tmp_path: Path) -> None:
    port, taken = _free_port(), socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    code = f"""
    import json, socket, sys
    from rd2h.adapters.memfabric import MemFabricConfig, MemFabricTransferEngine
    from rd2h.adapters.memfabric import start_config_store
    from rd2h.domain.errors import TransportLibraryError
    answer = {{}}
    url = "tcp://127.0.0.1:{port}"
    start_config_store(url)
    with socket.create_connection(("127.0.0.1", {port}), timeout=5):
        answer["store_listens"] = True
    try:
        start_config_store("tcp://127.0.0.1:{taken.getsockname()[1]}")
    except TransportLibraryError as exc:
        answer["taken"] = [exc.operation, exc.rc, str(exc)]
    try:
        MemFabricTransferEngine(MemFabricConfig(url, "Prefill", device_id=0))
    except TransportLibraryError as exc:
        answer["init"] = [exc.operation, exc.rc, exc.library_message, str(exc)]
    # Nothing was bound by the failure: a different configuration is tried, not refused.
    try:
        MemFabricTransferEngine(MemFabricConfig(url, "Decode", device_id=1))
    except TransportLibraryError as exc:
        answer["second"] = type(exc).__name__
    json.dump(answer, open(OUT, "w"))
    sys.stdout.flush()
    import os; os._exit(0)  # skip the store's slow shutdown
    """
    try:
        answer = _run_python(code, tmp_path)
    finally:
        taken.close()
    assert answer["store_listens"] is True
    op, rc, text = answer["taken"]
    assert op == "create_config_store" and rc != 0 and "address in use" in text
    op, rc, library_message, text = answer["init"]
    assert op == "initialize" and rc == -1
    assert "ascend driver does not support mf" in library_message
    assert text.startswith("MemFabric initialize (role Prefill, device 0, SDMA")
    assert "ascend driver does not support mf" in text and "check that the Ascend driver" in text
    assert answer["second"] == "TransportLibraryError"


def test_importing_rd2h_never_imports_memfabric(tmp_path: Path) -> None:
    code = """
    import json, sys
    sys.modules["memfabric_hybrid"] = None  # as if it were not installed
    import rd2h.adapters.memfabric, rd2h.bootstrap.container, rd2h.cli.main, rd2h.probe.run
    from rd2h.app.settings import Rd2hSettings
    from rd2h.bootstrap.container import bootstrap
    from rd2h.domain.errors import TransferError
    s = Rd2hSettings(role="decode", transport="memfabric", memfabric_store_url="tcp://1.2.3.4:5")
    c = bootstrap(s)
    try:
        c.transport()
        err = None
    except TransferError as exc:
        err = str(exc)
    json.dump({"error": err}, open(OUT, "w"))
    """
    answer = _run_python(code, tmp_path)
    assert answer["error"].startswith("cannot import memfabric_hybrid")


# --- the probe -------------------------------------------------------------------------------


def _probe(*argv: str, timeout: float = SUBPROCESS_S) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [RD2H, "probe", "memfabric", *argv], capture_output=True, text=True,
        timeout=timeout, env=env,
    )


def test_probe_memfabric_fails_here_with_one_sentence(tmp_path: Path) -> None:
    log = tmp_path / "probe.log"
    proc = _probe("--timeout", "60", "--log-file", str(log))
    assert proc.returncode == 1
    assert proc.stdout == ""
    err = proc.stderr
    assert err.count("\n") == 1 and err.endswith(".\n"), err
    assert "Traceback" not in err
    assert err.startswith("rd2h probe memfabric: the Prefill endpoint (device 0) could not "
                          "start its MemFabric engine: MemFabric initialize")
    assert "ascend driver does not support mf" in err
    assert f"(endpoint log: {log})." in err
    # The library's own log went to the log file, not to the terminal.
    assert "hybm" in log.read_text().lower() or "driver" in log.read_text()


def test_probe_cma_moves_and_verifies_real_bytes() -> None:
    proc = _probe("--transport", "cma", "--bytes", "8M", "--block-bytes", "64K",
                  "--iterations", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    res = json.loads(proc.stdout)
    assert res["verified"] is True and res["transport"] == "cma"
    assert res["bytes"] == 8 << 20 and res["descriptors"] == 128 and res["iterations"] == 2
    assert len(res["seconds"]) == 2 and res["best_gbps"] > 0
    assert res["prefill_session"] != res["decode_session"]


def test_probe_deadline_is_one_sentence_too(tmp_path: Path) -> None:
    proc = _probe("--transport", "cma", "--bytes", "4K", "--timeout", "0.001",
                  "--log-file", str(tmp_path / "probe.log"))
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "before the deadline" in proc.stderr


"""The MemFabric adapter's rules, driven by the recording fake of ``memfabric_hybrid``:
one engine per process and configuration, each region registered once, batches checked
before the library is called, the session published only after ``initialize`` worked,
and every failure explained with the library's own words."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import numpy as np
import pydantic
import pytest
from fakes.memfabric import FakeMemFabricModule, FakeMemFabricNetwork, TransDataOpType

from rd2h.adapters.memfabric import (
    MemFabricConfig,
    MemFabricTransferEngine,
    load_library,
    start_config_store,
)
from rd2h.adapters.memfabric.library import error_tap
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.errors import TransferError, TransportBindingError, TransportLibraryError

STORE = "tcp://127.0.0.1:7000"


@pytest.fixture
def network() -> FakeMemFabricNetwork:
    net = FakeMemFabricNetwork()
    start_config_store(STORE, net.process())
    return net


@pytest.fixture
def lib(network: FakeMemFabricNetwork) -> FakeMemFabricModule:
    return network.process()


@pytest.fixture
def engine(lib: FakeMemFabricModule) -> Iterator[MemFabricTransferEngine]:
    e = MemFabricTransferEngine(MemFabricConfig(STORE, "Decode", device_id=1), library=lib)
    yield e
    e.close()


def _engine_calls(lib: FakeMemFabricModule, name: str) -> list:
    return [c for c in lib.calls if c.target != "module" and c.name == name]


def _buffer(size: int) -> np.ndarray:
    return np.zeros(size, np.uint8)


# --- one engine per process ------------------------------------------------------------


def test_identical_configuration_is_the_same_engine(lib: FakeMemFabricModule) -> None:
    config = MemFabricConfig(STORE, "Decode", device_id=1)
    a = MemFabricTransferEngine(config, library=lib)
    b = MemFabricTransferEngine(MemFabricConfig(STORE, "Decode", device_id=1), library=lib)
    assert a.session_id == b.session_id
    assert len(_engine_calls(lib, "initialize")) == 1
    buf = _buffer(4096)
    a.register_memory(buf.ctypes.data, buf.nbytes)
    b.register_memory(buf.ctypes.data, buf.nbytes)  # shared registrations: a no-op
    assert len(_engine_calls(lib, "register_memory")) == 1
    a.close()
    one = np.ones(1, np.int64)
    b.batch_read(b.session_id, buf.ctypes.data * one, buf.ctypes.data * one, 16 * one)
    with pytest.raises(TransferError, match="closed"):
        a.batch_read(b.session_id, buf.ctypes.data * one, buf.ctypes.data * one, 16 * one)
    assert _engine_calls(lib, "destroy") == []  # b still holds the engine
    b.close()
    assert [c.name for c in lib.calls if c.name in ("destroy", "unInitialize")] == [
        "destroy", "unInitialize"
    ]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"role": "Prefill"}, "role"),
        ({"device_id": 2}, "device_id"),
        ({"host": "10.0.0.7"}, "host"),
        ({"transfer_type": "DEVICE_RDMA"}, "transfer_type"),
    ],
)
def test_a_different_configuration_is_refused_without_calling_the_library(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule, change: dict, field: str
) -> None:
    before = len(lib.calls)
    base = {"store_url": STORE, "role": "Decode", "device_id": 1}
    with pytest.raises(TransportBindingError, match=field) as info:
        MemFabricTransferEngine(MemFabricConfig(**{**base, **change}), library=lib)
    assert "role Decode, device 1, host 127.0.0.1" in str(info.value)
    assert lib.calls[before:] == []


def test_the_binding_outlives_close(lib: FakeMemFabricModule) -> None:
    config = MemFabricConfig(STORE, "Prefill", device_id=0)
    first = MemFabricTransferEngine(config, library=lib)
    first.close()
    with pytest.raises(TransportBindingError):
        MemFabricTransferEngine(MemFabricConfig(STORE, "Decode", device_id=0), library=lib)
    again = MemFabricTransferEngine(config, library=lib)  # same config: a fresh engine
    try:
        assert len(_engine_calls(lib, "initialize")) == 2
        assert lib.context is lib.engines[-1]
    finally:
        again.close()


def test_session_is_host_and_rpc_port_read_after_initialize(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule
) -> None:
    names = [c.name for c in lib.calls if c.target == "engine0"]
    assert names[:2] == ["initialize", "get_rpc_port"]
    init = _engine_calls(lib, "initialize")[0]
    assert init.args[:4] == (STORE, "127.0.0.1:0", "Decode", 1)
    assert init.args[4] is TransDataOpType.SDMA
    assert engine.session_id == f"127.0.0.1:{lib.engines[0].port}"


def test_transfer_type_is_passed_as_the_library_enum(lib: FakeMemFabricModule) -> None:
    e = MemFabricTransferEngine(
        MemFabricConfig(STORE, "Prefill", transfer_type="DEVICE_RDMA", nic="tcp://10.0.0.1:7000"),
        library=lib,
    )
    try:
        init = _engine_calls(lib, "initialize")[0]
        assert init.args[4] is TransDataOpType.DEVICE_RDMA
        assert init.args[5:] == ("Decode", "tcp://10.0.0.1:7000")
    finally:
        e.close()


def test_failed_initialize_publishes_nothing_and_explains_why(
    network: FakeMemFabricNetwork,
) -> None:
    lib = network.process(driver=False)
    with pytest.raises(TransportLibraryError) as info:
        MemFabricTransferEngine(MemFabricConfig(STORE, "Prefill"), library=lib)
    err = info.value
    assert err.operation == "initialize" and err.rc == -1
    assert "ascend driver does not support mf" in err.library_message
    assert "ascend driver does not support mf" in str(err)
    assert "role Prefill, device 0" in str(err)
    assert _engine_calls(lib, "get_rpc_port") == []  # no session was read or published
    assert _engine_calls(lib, "destroy")  # the half-made engine is released
    # Nothing was bound: another configuration may still be tried in this process.
    lib.driver = True
    e = MemFabricTransferEngine(MemFabricConfig(STORE, "Decode", device_id=3), library=lib)
    e.close()


def test_unknown_store_is_refused_with_the_library_message(lib: FakeMemFabricModule) -> None:
    expected = r"connect to config store tcp://127\.0\.0\.1:9 failed"
    with pytest.raises(TransportLibraryError, match=expected):
        MemFabricTransferEngine(MemFabricConfig("tcp://127.0.0.1:9", "Decode"), library=lib)


def test_a_missing_rpc_port_fails_and_tears_down(
    lib: FakeMemFabricModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = lib.TransferEngine()
    monkeypatch.setattr(lib, "TransferEngine", lambda: engine)
    monkeypatch.setattr(engine, "get_rpc_port", lambda: 0)
    with pytest.raises(TransferError, match=r"get_rpc_port\(\) returned 0"):
        MemFabricTransferEngine(MemFabricConfig(STORE, "Decode"), library=lib)
    assert engine.destroyed


def test_library_type_errors_become_transfer_errors(
    lib: FakeMemFabricModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = lib.TransferEngine()
    monkeypatch.setattr(lib, "TransferEngine", lambda: engine)

    def bad(*args: object) -> int:
        raise TypeError("initialize(): incompatible function arguments")

    monkeypatch.setattr(engine, "initialize", bad)
    with pytest.raises(TransferError, match="initialize raised TypeError"):
        MemFabricTransferEngine(MemFabricConfig(STORE, "Decode"), library=lib)


def test_config_is_checked_before_the_library() -> None:
    for kwargs, match in [
        ({"role": "prefill"}, "role"),
        ({"role": "Decode", "device_id": -1}, "device_id"),
        ({"role": "Decode", "host": "localhost"}, "IPv4"),
        ({"role": "Decode", "transfer_type": "PIGEON"}, "transfer_type"),
        ({"role": "Decode", "store_server_role": "Both"}, "store_server_role"),
    ]:
        with pytest.raises(ValueError, match=match):
            MemFabricConfig(STORE, **kwargs)
    for url in ["127.0.0.1:7000", "tcp://127.0.0.1", "tcp://host:7000", "tcp://1.2.3.4:0"]:
        with pytest.raises(ValueError, match="store URL"):
            MemFabricConfig(url, "Decode")


# --- registration ------------------------------------------------------------------------


def test_each_region_is_registered_once(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule
) -> None:
    buf = _buffer(8192)
    base = buf.ctypes.data
    engine.register_memory(base, 8192)
    engine.register_memory(base, 8192)
    engine.register_memory(base + 1024, 1024)  # inside: recorded, not registered again
    assert [c.args for c in _engine_calls(lib, "register_memory")] == [(base, 8192)]


@pytest.mark.parametrize("offset, size", [(4096, 8192), (-1024, 2048), (-1024, 16384)])
def test_overlapping_regions_are_refused_before_the_library(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule, offset: int, size: int
) -> None:
    buf = _buffer(32768)
    base = buf.ctypes.data + 8192
    engine.register_memory(base, 8192)
    before = len(lib.calls)
    with pytest.raises(TransferError, match="overlaps the region"):
        engine.register_memory(base + offset, size)
    assert _engine_calls(lib, "register_memory")[1:] == []
    assert all(c.target == "module" for c in lib.calls[before:])


def test_register_regions_uses_one_batch_call(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule
) -> None:
    buf = _buffer(3 * 4096)
    a, b, c = (buf.ctypes.data + i * 4096 for i in range(3))
    engine.register_memory(a, 4096)
    # a again, b twice, c and a sub-range of c: one library call for b and c.
    engine.register_regions([a, b, b, c + 100, c], [4096, 4096, 4096, 50, 4096])
    batch = _engine_calls(lib, "batch_register_memory")
    assert [call.args for call in batch] == [([b, c], [4096, 4096])]
    one = np.ones(1, np.int64)
    engine.batch_read(engine.session_id, (c + 100) * one, a * one, 50 * one)


def test_register_regions_rejects_bad_lists_before_the_library(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule
) -> None:
    buf = _buffer(8192)
    base = buf.ctypes.data
    before = len(lib.calls)
    with pytest.raises(TransferError, match="2 addresses but 1 sizes"):
        engine.register_regions([base, base + 4096], [4096])
    with pytest.raises(TransferError, match="cannot register region"):
        engine.register_regions([base, 0], [4096, 4096])
    with pytest.raises(TransferError, match="in the same call"):
        engine.register_regions([base, base + 2048], [4096, 4096])
    assert lib.calls[before:] == []


def test_registration_failure_carries_the_library_message(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule
) -> None:
    buf = _buffer(4096)
    lib.fail_next("register_memory", rc=-3, message="no memory handle left")
    with pytest.raises(TransportLibraryError, match="returned -3") as info:
        engine.register_memory(buf.ctypes.data, 4096)
    assert info.value.library_message == "no memory handle left"
    # Not recorded: a retry calls the library again and succeeds.
    engine.register_memory(buf.ctypes.data, 4096)
    assert len(_engine_calls(lib, "register_memory")) == 2


def test_a_stale_library_message_is_not_blamed(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule
) -> None:
    lib.error("something unrelated from earlier")  # sticky in get_last_err_msg
    lib.fail_next("register_memory", rc=-5, message="fresh cause", sticky=False)
    buf = _buffer(4096)
    with pytest.raises(TransportLibraryError) as info:
        engine.register_memory(buf.ctypes.data, 4096)
    assert "fresh cause" in str(info.value)
    assert "unrelated" not in str(info.value)


# --- reads ---------------------------------------------------------------------------------


@pytest.fixture
def peer(network: FakeMemFabricNetwork) -> Iterator[tuple[MemFabricTransferEngine, np.ndarray]]:
    src = np.arange(4096, dtype=np.uint8)
    p = MemFabricTransferEngine(MemFabricConfig(STORE, "Prefill"), library=network.process())
    p.register_memory(src.ctypes.data, src.nbytes)
    yield p, src
    p.close()


def test_read_passes_python_int_lists_and_lands_bytes(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule, peer: tuple
) -> None:
    p, src = peer
    dst = _buffer(256)
    engine.register_memory(dst.ctypes.data, dst.nbytes)
    engine.batch_read(
        p.session_id,
        dst.ctypes.data + np.array([0, 128], np.int64),
        src.ctypes.data + np.array([1000, 7], np.uint64),
        np.array([128, 128], np.int32),
    )
    (call,) = _engine_calls(lib, "batch_transfer_sync_read")
    session, local, remote, lengths, _flags = call.args
    assert session == p.session_id
    assert all(type(x) is int for x in local + remote + lengths)
    np.testing.assert_array_equal(dst, np.concatenate([src[1000:1128], src[7:135]]))


@pytest.mark.parametrize(
    "shapes", [(2, 2, 1), (1, 2, 2), (2, 1, 2)], ids=["lengths", "local", "remote"]
)
def test_mismatched_lists_never_reach_the_library(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule, peer: tuple, shapes: tuple
) -> None:
    p, src = peer
    dst = _buffer(64)
    engine.register_memory(dst.ctypes.data, 64)
    with pytest.raises(TransferError, match="shape"):
        engine.batch_read(
            p.session_id,
            dst.ctypes.data + np.arange(shapes[0], dtype=np.int64),
            src.ctypes.data + np.arange(shapes[1], dtype=np.int64),
            np.ones(shapes[2], np.int64),
        )
    assert _engine_calls(lib, "batch_transfer_sync_read") == []


def test_local_range_and_session_are_checked_before_the_library(
    engine: MemFabricTransferEngine, lib: FakeMemFabricModule, peer: tuple
) -> None:
    p, src = peer
    dst = _buffer(64)
    engine.register_memory(dst.ctypes.data, 32)
    one = np.ones(1, np.int64)
    with pytest.raises(TransferError, match="local range"):
        engine.batch_read(p.session_id, dst.ctypes.data * one, src.ctypes.data * one, 64 * one)
    for bad in ["", "127.0.0.1", "host:80", "127.0.0.1:0", "127.0.0.1:x"]:
        with pytest.raises(TransferError, match="session"):
            engine.batch_read(bad, dst.ctypes.data * one, src.ctypes.data * one, 8 * one)
    empty = np.empty(0, np.int64)
    engine.batch_read(p.session_id, empty, empty, empty)
    assert _engine_calls(lib, "batch_transfer_sync_read") == []


def test_read_failure_names_the_peer_and_the_library_reason(
    engine: MemFabricTransferEngine, peer: tuple
) -> None:
    p, src = peer
    dst = _buffer(64)
    engine.register_memory(dst.ctypes.data, 64)
    one = np.ones(1, np.int64)
    with pytest.raises(TransportLibraryError) as info:
        engine.batch_read(p.session_id, dst.ctypes.data * one, (src.ctypes.data + 4090) * one,
                          16 * one)
    msg = str(info.value)
    assert p.session_id in msg and "returned -1" in msg
    assert "peer buffer" in msg and "not registered" in msg  # the library's words
    p.close()
    with pytest.raises(TransportLibraryError, match=f"connect to session {p.session_id} failed"):
        engine.batch_read(p.session_id, dst.ctypes.data * one, src.ctypes.data * one, 16 * one)


# --- plumbing ------------------------------------------------------------------------------


def test_library_log_lines_go_to_python_logging(
    lib: FakeMemFabricModule, caplog: pytest.LogCaptureFixture
) -> None:
    tap = error_tap(lib)
    assert tap is not None and error_tap(lib) is tap  # installed once
    with caplog.at_level(logging.DEBUG, logger="rd2h.memfabric"):
        lib.log(3, "[SMEM x.cpp:1 Fn] something broke")
        lib.log(2, "[HYBM y.cpp:2 Fn] a warning")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "something broke"), (logging.WARNING, "a warning")
    ]
    tap("not-an-int", object())  # type: ignore[arg-type]  # never raises into the library


def test_missing_library_is_a_clear_transfer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", None)
    with pytest.raises(TransferError, match="cannot import memfabric_hybrid"):
        load_library()


def test_config_store_url_is_checked_and_failures_explained(
    network: FakeMemFabricNetwork,
) -> None:
    lib = network.process()
    with pytest.raises(TransferError, match="store URL"):
        start_config_store("tcp://localhost:7001", lib)
    assert lib.calls == []
    network.listening.add(("127.0.0.1", 7002))
    with pytest.raises(TransportLibraryError, match="address in use"):
        start_config_store("tcp://127.0.0.1:7002", lib)


def test_settings_validate_memfabric_fields() -> None:
    ok = Rd2hSettings(role="decode", transport="memfabric", memfabric_store_url=STORE)
    assert ok.memfabric_transfer_type == "SDMA" and ok.memfabric_device == 0
    bad = [
        ({"memfabric_store_url": None}, "memfabric_store_url is required"),
        ({"memfabric_store_url": "http://1.2.3.4:5"}, "store URL"),
        ({"host": "my-host"}, "IPv4"),
        ({"memfabric_transfer_type": "TCP"}, "memfabric_transfer_type"),
        ({"memfabric_device_id": -1}, "memfabric_device_id"),
    ]
    for change, match in bad:
        kwargs = {"role": "decode", "transport": "memfabric", "memfabric_store_url": STORE}
        with pytest.raises(pydantic.ValidationError, match=match):
            Rd2hSettings(**{**kwargs, **change})


def test_container_builds_the_memfabric_engine_from_settings(
    lib: FakeMemFabricModule,
) -> None:
    settings = Rd2hSettings(
        role="prefill", transport="memfabric", memfabric_store_url=STORE,
        memfabric_device_id=5, memfabric_transfer_type="HOST_RDMA", host="127.0.0.1",
    )
    container = bootstrap(settings, memfabric_library=lib)
    engine = container.transport()
    try:
        assert isinstance(engine, MemFabricTransferEngine)
        assert container.transport() is engine
        init = _engine_calls(lib, "initialize")[0]
        assert init.args[2:5] == ("Prefill", 5, TransDataOpType.HOST_RDMA)
        assert engine.session_id.startswith("127.0.0.1:")
    finally:
        engine.close()

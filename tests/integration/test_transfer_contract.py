"""One contract for every TransferEngine adapter: inproc (same process), cma (a real
second process read with process_vm_readv), mooncake (a real second process read over
Mooncake TCP on loopback) and memfabric (the MemFabric adapter over the recording fake of
``memfabric_hybrid``: two fake processes in this one, real bytes moved by address). Plus
unit checks of the shared helpers."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import pytest
from fakes.memfabric import FakeMemFabricNetwork

from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.adapters.regions import RegionTable, validate_batch
from rd2h.domain.errors import TransferError
from rd2h.ports.transfer import TransferEngine

pytestmark = pytest.mark.integration

PEER_SIZE = 16 << 20
PATTERN_SEED = 20240601
WAIT_S = 30.0
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")


def _pattern(size: int) -> np.ndarray:
    return np.random.default_rng(PATTERN_SEED).integers(0, 256, size, dtype=np.uint8)


def _peer_main(conn: Connection, size: int, kind: str) -> None:
    """Child process: expose a patterned buffer over ``kind`` (cma or mooncake), report
    it, wait (bounded) for 'exit'."""
    if kind == "cma":
        from rd2h.adapters.cma import CmaTransferEngine as Engine
    else:
        from rd2h.adapters.mooncake import MooncakeTransferEngine as Engine

    buf = _pattern(size)
    engine = Engine()
    engine.register_memory(buf.ctypes.data, buf.nbytes)
    conn.send((engine.session_id, buf.ctypes.data))
    conn.poll(300.0)
    engine.close()
    conn.close()
    if kind == "mooncake":
        os._exit(0)  # skip the library's engine teardown (about a second)


@dataclass
class Setup:
    """A reader engine and a peer exposing ``peer_buffer`` at ``peer_address``."""

    kind: str
    reader: TransferEngine
    peer_session: str
    peer_address: int
    peer_buffer: np.ndarray
    unknown_session: str
    kill_peer: Callable[[], None]


def _inproc_setup() -> Iterator[Setup]:
    peer = InprocTransferEngine()
    reader = InprocTransferEngine()
    buf = _pattern(PEER_SIZE)
    peer.register_memory(buf.ctypes.data, buf.nbytes)
    try:
        yield Setup(
            "inproc",
            reader,
            peer.session_id,
            buf.ctypes.data,
            buf,
            "inproc:" + "0" * 32,
            peer.close,
        )
    finally:
        reader.close()
        peer.close()


def _cma_setup() -> Iterator[Setup]:
    from rd2h.adapters.cma import CmaTransferEngine

    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child_conn, PEER_SIZE, "cma"), daemon=True)
    proc.start()
    child_conn.close()
    reader = CmaTransferEngine()

    def kill() -> None:
        proc.kill()
        proc.join(WAIT_S)

    try:
        if not parent_conn.poll(WAIT_S):
            raise TimeoutError("cma peer process did not report its buffer in time")
        try:
            session, address = parent_conn.recv()
        except EOFError:
            proc.join(5.0)
            raise RuntimeError(f"cma peer process died early (exit code {proc.exitcode})") from None
        with open("/proc/sys/kernel/pid_max") as f:
            never_a_pid = int(f.read())
        host = session.rpartition(":")[0]
        yield Setup(
            "cma", reader, session, address, _pattern(PEER_SIZE), f"{host}:{never_a_pid}", kill
        )
    finally:
        reader.close()
        with contextlib.suppress(OSError):
            parent_conn.send("exit")
        parent_conn.close()
        proc.join(5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _mooncake_setup() -> Iterator[Setup]:
    from rd2h.adapters.mooncake import MooncakeTransferEngine

    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_peer_main, args=(child_conn, PEER_SIZE, "mooncake"), daemon=True
    )
    proc.start()
    child_conn.close()

    def kill() -> None:
        proc.kill()
        proc.join(WAIT_S)

    reader = None
    try:
        reader = MooncakeTransferEngine()
        if not parent_conn.poll(WAIT_S):
            raise TimeoutError("mooncake peer process did not report its buffer in time")
        try:
            session, address = parent_conn.recv()
        except EOFError:
            proc.join(5.0)
            raise RuntimeError(
                f"mooncake peer process died early (exit code {proc.exitcode})"
            ) from None
        # Port 1 is privileged and never a Mooncake listener: the handshake is refused.
        yield Setup("mooncake", reader, session, address, _pattern(PEER_SIZE), "127.0.0.1:1", kill)
    finally:
        if reader is not None:
            reader.close()
        with contextlib.suppress(OSError):
            parent_conn.send("exit")
        parent_conn.close()
        proc.join(5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _memfabric_setup() -> Iterator[Setup]:
    """Prefill peer and Decode reader as two fake processes sharing one fake network (the
    library's engine is one per process, so one process cannot hold both roles)."""
    from rd2h.adapters.memfabric import (
        MemFabricConfig,
        MemFabricTransferEngine,
        start_config_store,
    )

    network = FakeMemFabricNetwork()
    store = "tcp://127.0.0.1:7100"
    start_config_store(store, network.process())
    peer = MemFabricTransferEngine(
        MemFabricConfig(store, "Prefill", device_id=0), library=network.process()
    )
    reader = MemFabricTransferEngine(
        MemFabricConfig(store, "Decode", device_id=1), library=network.process()
    )
    buf = _pattern(PEER_SIZE)
    peer.register_memory(buf.ctypes.data, buf.nbytes)
    try:
        # Port 1 is never a MemFabric session: the library cannot reach it.
        yield Setup(
            "memfabric", reader, peer.session_id, buf.ctypes.data, buf, "127.0.0.1:1", peer.close
        )
    finally:
        reader.close()
        peer.close()


_SETUPS = {
    "inproc": _inproc_setup,
    "cma": _cma_setup,
    "mooncake": _mooncake_setup,
    "memfabric": _memfabric_setup,
}


@pytest.fixture(
    params=[
        "inproc",
        pytest.param("cma", marks=linux_only),
        pytest.param("mooncake", marks=linux_only),
        "memfabric",
    ]
)
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    yield from _SETUPS[request.param]()


@pytest.fixture(params=["inproc", pytest.param("mooncake", marks=linux_only), "memfabric"])
def confining_setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    """Adapters that refuse remote ranges outside the peer's registration (cma cannot:
    the kernel lets it read any mapped page of the peer)."""
    yield from _SETUPS[request.param]()


@pytest.fixture
def cma_setup() -> Iterator[Setup]:
    yield from _cma_setup()


def _destination(engine: TransferEngine, size: int, register: int | None = None) -> np.ndarray:
    dst = np.zeros(size, np.uint8)
    engine.register_memory(dst.ctypes.data, size if register is None else register)
    return dst


def _random_batch(
    rng: np.random.Generator, n: int, max_len: int, peer_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random (remote offsets, lengths); destinations are packed back to back."""
    lengths = rng.integers(1, max_len + 1, n, dtype=np.int64)
    offsets = rng.integers(0, peer_size - lengths, dtype=np.int64)
    return offsets, lengths


def _expected(pattern: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([pattern[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())])


def _packed_locals(base: int, lengths: np.ndarray) -> np.ndarray:
    return base + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)


# --- the contract -------------------------------------------------------------------


def test_bytes_land_exactly(setup: Setup) -> None:
    rng = np.random.default_rng(1)
    offsets, lengths = _random_batch(rng, 3000, 4096, PEER_SIZE)
    dst = _destination(setup.reader, int(lengths.sum()) + 64)
    setup.reader.batch_read(
        setup.peer_session,
        _packed_locals(dst.ctypes.data, lengths),
        setup.peer_address + offsets,
        lengths,
    )
    total = int(lengths.sum())
    np.testing.assert_array_equal(dst[:total], _expected(setup.peer_buffer, offsets, lengths))
    assert not dst[total:].any()


def test_batch_larger_than_iov_max(setup: Setup) -> None:
    rng = np.random.default_rng(2)
    n = 5000
    offsets = rng.permutation(PEER_SIZE // 256)[:n].astype(np.int64) * 256
    lengths = np.full(n, 200, np.int64)
    dst = _destination(setup.reader, n * 200)
    setup.reader.batch_read(
        setup.peer_session,
        dst.ctypes.data + np.arange(n) * 200,
        setup.peer_address + offsets,
        lengths,
    )
    np.testing.assert_array_equal(dst, _expected(setup.peer_buffer, offsets, lengths))


def test_batch_of_70000_descriptors(setup: Setup) -> None:
    n = 70000
    offsets = np.random.default_rng(5).permutation(PEER_SIZE // 128)[:n].astype(np.int64) * 128
    lengths = np.full(n, 64, np.int64)
    dst = _destination(setup.reader, n * 64)
    setup.reader.batch_read(
        setup.peer_session,
        dst.ctypes.data + np.arange(n) * 64,
        setup.peer_address + offsets,
        lengths,
    )
    np.testing.assert_array_equal(dst, _expected(setup.peer_buffer, offsets, lengths))


def test_remote_range_outside_the_peers_registration_is_refused(
    confining_setup: Setup,
) -> None:
    setup = confining_setup
    dst = _destination(setup.reader, 4096)
    # The peer registered exactly PEER_SIZE bytes: the last range crosses its end.
    local = dst.ctypes.data + np.array([0, 1024], np.int64)
    remote = setup.peer_address + np.array([0, PEER_SIZE - 100], np.int64)
    with pytest.raises(TransferError, match="remote"):
        setup.reader.batch_read(setup.peer_session, local, remote, np.array([512, 200], np.int64))


def test_empty_batch_is_a_no_op(setup: Setup) -> None:
    dst = _destination(setup.reader, 64)
    empty = np.empty(0, np.int64)
    setup.reader.batch_read(setup.peer_session, empty, empty, empty)
    assert not dst.any()


@pytest.mark.parametrize("shapes", [(3, 3, 2), (2, 3, 3), (3, 2, 3)])
def test_mismatched_shapes_are_refused(setup: Setup, shapes: tuple[int, int, int]) -> None:
    dst = _destination(setup.reader, 64)
    local = dst.ctypes.data + np.arange(shapes[0], dtype=np.int64)
    remote = setup.peer_address + np.arange(shapes[1], dtype=np.int64)
    lengths = np.ones(shapes[2], np.int64)
    with pytest.raises(TransferError, match="shape"):
        setup.reader.batch_read(setup.peer_session, local, remote, lengths)
    assert not dst.any()


@pytest.mark.parametrize("bad_length", [0, -4])
def test_non_positive_length_is_refused(setup: Setup, bad_length: int) -> None:
    dst = _destination(setup.reader, 64)
    local = dst.ctypes.data + np.array([0, 16, 32], np.int64)
    remote = setup.peer_address + np.array([0, 16, 32], np.int64)
    lengths = np.array([8, bad_length, 8], np.int64)
    with pytest.raises(TransferError, match="descriptor 1 has non-positive length"):
        setup.reader.batch_read(setup.peer_session, local, remote, lengths)
    assert not dst.any()


def test_local_range_outside_registered_memory_is_refused(setup: Setup) -> None:
    dst = _destination(setup.reader, 8192, register=4096)
    local = dst.ctypes.data + np.array([0, 1024, 4000], np.int64)
    remote = setup.peer_address + np.array([0, 1024, 4000], np.int64)
    lengths = np.array([512, 512, 200], np.int64)  # the last one crosses the end
    with pytest.raises(TransferError, match="descriptor 2: local range"):
        setup.reader.batch_read(setup.peer_session, local, remote, lengths)
    assert not dst.any(), "nothing may be copied when any descriptor is refused"


def test_unknown_session_is_refused(setup: Setup) -> None:
    dst = _destination(setup.reader, 64)
    one = np.ones(1, np.int64)
    with pytest.raises(TransferError):
        setup.reader.batch_read(
            setup.unknown_session, dst.ctypes.data * one, setup.peer_address * one, 16 * one
        )
    assert not dst.any()


def test_unmapped_remote_address_is_refused(setup: Setup) -> None:
    dst = _destination(setup.reader, 64)
    one = np.ones(1, np.int64)
    with pytest.raises(TransferError) as info:
        setup.reader.batch_read(setup.peer_session, dst.ctypes.data * one, 8 * one, 16 * one)
    assert {"cma": "EFAULT"}.get(setup.kind, "remote") in str(info.value)


def test_dead_peer_fails_quickly(setup: Setup) -> None:
    dst = _destination(setup.reader, 4096)
    setup.kill_peer()
    one = np.ones(1, np.int64)
    started = time.monotonic()
    with pytest.raises(TransferError) as info:
        setup.reader.batch_read(
            setup.peer_session, dst.ctypes.data * one, setup.peer_address * one, 4096 * one
        )
    assert time.monotonic() - started < 1.0
    expected = {"cma": "ESRCH", "mooncake": "gone", "memfabric": "gone"}
    assert expected.get(setup.kind, "closed") in str(info.value)


def test_registering_the_same_region_twice_is_fine(setup: Setup) -> None:
    dst = np.zeros(4096, np.uint8)
    setup.reader.register_memory(dst.ctypes.data, dst.nbytes)
    setup.reader.register_memory(dst.ctypes.data, dst.nbytes)
    setup.reader.register_memory(dst.ctypes.data + 1024, 1024)  # overlapping: fine too
    one = np.ones(1, np.int64)
    setup.reader.batch_read(
        setup.peer_session, dst.ctypes.data * one, (setup.peer_address + 100) * one, 4096 * one
    )
    np.testing.assert_array_equal(dst, setup.peer_buffer[100:4196])


@pytest.mark.parametrize("bad", ["float", "2d"])
def test_bad_array_kinds_are_refused(setup: Setup, bad: str) -> None:
    dst = _destination(setup.reader, 64)
    local = np.array([dst.ctypes.data], np.int64)
    remote = np.array([setup.peer_address], np.int64)
    lengths = np.array([8.0]) if bad == "float" else np.array([[8]], np.int64)
    with pytest.raises(TransferError):
        setup.reader.batch_read(setup.peer_session, local, remote, lengths)


def test_closed_reader_is_refused(setup: Setup) -> None:
    dst = _destination(setup.reader, 64)
    setup.reader.close()
    setup.reader.close()  # idempotent
    one = np.ones(1, np.int64)
    with pytest.raises(TransferError, match="closed"):
        setup.reader.batch_read(
            setup.peer_session, dst.ctypes.data * one, setup.peer_address * one, 8 * one
        )


# --- inproc only ----------------------------------------------------------------------


def test_inproc_reads_only_what_the_peer_registered() -> None:
    peer, reader = InprocTransferEngine(), InprocTransferEngine()
    try:
        src = _pattern(8192)
        peer.register_memory(src.ctypes.data, 4096)
        dst = _destination(reader, 8192)
        one = np.ones(1, np.int64)
        with pytest.raises(TransferError, match="remote"):
            reader.batch_read(
                peer.session_id, dst.ctypes.data * one, (src.ctypes.data + 4000) * one, 200 * one
            )
        assert not dst.any()
    finally:
        peer.close()
        reader.close()


def test_inproc_session_ids_are_distinct() -> None:
    a, b = InprocTransferEngine(), InprocTransferEngine()
    try:
        assert a.session_id != b.session_id
        assert a.session_id.startswith("inproc:")
    finally:
        a.close()
        b.close()


# --- cma only -------------------------------------------------------------------------


@linux_only
@pytest.mark.parametrize("parallel_min_bytes", [None, 0])
def test_cma_threads_copy_a_large_batch(cma_setup: Setup, parallel_min_bytes: int | None) -> None:
    from rd2h.adapters.cma import CmaTransferEngine

    setup = cma_setup
    kwargs = {} if parallel_min_bytes is None else {"parallel_min_bytes": parallel_min_bytes}
    engine = CmaTransferEngine(threads=2, **kwargs)
    try:
        rng = np.random.default_rng(3)
        n = 3000
        lengths = rng.integers(1, 8192, n, dtype=np.int64)
        offsets = rng.integers(0, PEER_SIZE - lengths, dtype=np.int64)
        dst = _destination(engine, int(lengths.sum()))
        assert dst.nbytes >= 4 << 20
        engine.batch_read(
            setup.peer_session,
            _packed_locals(dst.ctypes.data, lengths),
            setup.peer_address + offsets,
            lengths,
        )
        np.testing.assert_array_equal(dst, _expected(setup.peer_buffer, offsets, lengths))

        # One bad descriptor in the second half fails the whole batch.
        bad = offsets.copy()
        bad_remote = setup.peer_address + bad
        bad_remote[n - 10] = 8
        with pytest.raises(TransferError, match=f"descriptor {n - 10}"):
            engine.batch_read(
                setup.peer_session, _packed_locals(dst.ctypes.data, lengths), bad_remote, lengths
            )
    finally:
        engine.close()


@linux_only
def test_cma_refuses_other_hosts_and_malformed_sessions() -> None:
    from rd2h.adapters.cma import CmaTransferEngine

    engine = CmaTransferEngine()
    try:
        dst = _destination(engine, 64)
        one = np.ones(1, np.int64)
        args = (dst.ctypes.data * one, dst.ctypes.data * one, 8 * one)
        with pytest.raises(TransferError, match="same host"):
            engine.batch_read("some-other-host.example:1234", *args)
        for bad in ["", "1234", "host:", "host:abc", "host:-3", "host:0"]:
            host = engine.session_id.rpartition(":")[0]
            session = bad.replace("host", host)
            with pytest.raises(TransferError, match="malformed"):
                engine.batch_read(session, *args)
    finally:
        engine.close()


@linux_only
def test_cma_session_id_names_host_and_pid() -> None:
    import os
    import socket

    from rd2h.adapters.cma import CmaTransferEngine

    engine = CmaTransferEngine()
    try:
        assert engine.session_id == f"{socket.gethostname()}:{os.getpid()}"
    finally:
        engine.close()


@linux_only
def test_cma_short_read_into_a_guard_page_names_efault() -> None:
    """A real partial read: the kernel copies up to a PROT_NONE page, then refuses."""
    from rd2h.adapters.cma import CmaTransferEngine

    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 2 * page)
    anchor = ctypes.c_char.from_buffer(area)
    base = ctypes.addressof(anchor)
    area[:page] = bytes(range(256)) * (page // 256)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
    engine = CmaTransferEngine()
    try:
        dst = _destination(engine, 2 * page)
        local = dst.ctypes.data + np.array([0, 256], np.int64)
        remote = base + np.array([0, page - 256], np.int64)
        lengths = np.array([256, 512], np.int64)  # the second crosses into the guard page
        with pytest.raises(TransferError, match="EFAULT") as info:
            engine.batch_read(engine.session_id, local, remote, lengths)
        assert "descriptor 1" in str(info.value)
        assert bytes(dst[:512]) == bytes(range(256)) * 2  # copied up to the fault
    finally:
        engine.close()
        assert libc.mprotect(base + page, page, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        del anchor
        area.close()


# --- unit checks of the helpers ---------------------------------------------------------


def _fake_readv(max_bytes: int, calls: list[int]) -> Callable[[int, int, int, int, int, int], int]:
    """A process_vm_readv stand-in that copies at most ``max_bytes`` per call."""

    def readv(pid: int, local_ptr: int, lcount: int, remote_ptr: int, rcount: int, f: int) -> int:
        assert lcount == rcount <= 1024 and f == 0
        iov_l = np.ctypeslib.as_array((ctypes.c_int64 * (2 * lcount)).from_address(local_ptr))
        iov_r = np.ctypeslib.as_array((ctypes.c_int64 * (2 * rcount)).from_address(remote_ptr))
        budget = max_bytes
        for k in range(lcount):
            n = min(int(iov_l[2 * k + 1]), budget)
            ctypes.memmove(int(iov_l[2 * k]), int(iov_r[2 * k]), n)
            budget -= n
            if budget == 0:
                break
        calls.append(lcount)
        return max_bytes - budget

    return readv


@linux_only
@pytest.mark.parametrize("max_bytes", [1, 7, 1000, 1 << 30])
def test_read_range_resumes_short_reads_at_the_exact_byte(max_bytes: int) -> None:
    from rd2h.adapters.cma.transport import read_range

    rng = np.random.default_rng(4)
    n = 1500 if max_bytes >= 1000 else 40
    lengths = rng.integers(1, 64, n, dtype=np.int64)
    src = _pattern(int(lengths.sum()) * 2)
    offsets = rng.integers(0, src.size - lengths, dtype=np.int64)
    dst = np.zeros(int(lengths.sum()), np.uint8)
    local_iov = np.stack([_packed_locals(dst.ctypes.data, lengths), lengths], axis=1)
    remote_iov = np.stack([src.ctypes.data + offsets, lengths], axis=1)
    calls: list[int] = []
    read_range(_fake_readv(max_bytes, calls), 1, local_iov, remote_iov, 0, n)
    np.testing.assert_array_equal(dst, _expected(src, offsets, lengths))
    assert max(calls) <= 1024
    if max_bytes >= 1 << 30:
        assert calls == [1024, n - 1024]


@linux_only
def test_read_range_reports_zero_progress_and_errno() -> None:
    from rd2h.adapters.cma.transport import read_range

    iov = np.array([[0x1000, 8]], np.int64)
    with pytest.raises(TransferError, match="returned 0"):
        read_range(lambda *a: 0, 1, iov.copy(), iov.copy(), 0, 1)

    def gone(*args: int) -> int:
        ctypes.set_errno(errno.ESRCH)
        return -1

    with pytest.raises(TransferError, match="ESRCH: no such process"):
        read_range(gone, 1, iov.copy(), iov.copy(), 0, 1)


@linux_only
def test_split_by_bytes_is_contiguous_and_balanced() -> None:
    from rd2h.adapters.cma.transport import _split_by_bytes

    lens = np.array([10, 10, 10, 10, 1000, 10], np.int64)
    parts = _split_by_bytes(lens, 3)
    assert parts[0][0] == 0 and parts[-1][1] == lens.size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    assert _split_by_bytes(np.ones(1, np.int64), 4) == [(0, 1)]
    even = _split_by_bytes(np.ones(100, np.int64), 4)
    assert even == [(0, 25), (25, 50), (50, 75), (75, 100)]


def test_region_table_needs_one_region_to_contain_the_range() -> None:
    table = RegionTable()
    assert table.add(1000, 100)
    assert not table.add(1000, 100)
    assert table.add(1100, 100)  # adjacent
    assert table.add(5000, 1000)
    assert table.add(5100, 50)  # nested
    addrs = np.array([1000, 1099, 1150, 1050, 5990, 5100, 999, 6000, 10], np.int64)
    lens = np.array([100, 1, 50, 100, 10, 900, 1, 1, 5], np.int64)
    # 1050+100 spans the two adjacent regions: not inside a single one.
    assert table.outside(addrs, lens).tolist() == [3, 6, 7, 8]
    with pytest.raises(TransferError):
        table.add(0, 10)
    with pytest.raises(TransferError):
        table.add(10, 0)


def test_validate_batch_refuses_overflowing_and_negative_addresses() -> None:
    big = np.iinfo(np.int64).max
    with pytest.raises(TransferError, match="remote"):
        validate_batch(np.array([0]), np.array([big - 4]), np.array([8]))
    with pytest.raises(TransferError, match="local"):
        validate_batch(np.array([-8]), np.array([0]), np.array([8]))
    with pytest.raises(TransferError, match="remote"):
        validate_batch(np.array([0]), np.array([2**64 - 8], np.uint64), np.array([8]))
    local, _, _ = validate_batch(np.array([1], np.int32), np.array([2]), np.array([3]))
    assert local.dtype == np.int64

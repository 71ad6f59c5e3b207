"""The processes of ``rd2h probe``: a config store (MemFabric), a Prefill endpoint that
exposes a patterned buffer, and a Decode endpoint that reads it, verifies every byte and
times the reads.

Each runs in its own spawned process with stdout and stderr sent to the probe's log file
(the MemFabric library prints its log on stdout), and reports to the parent over a pipe:
``("ready", ...)``, ``("result", ...)`` or ``("error", phase, message)``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from rd2h.domain.errors import Rd2hError
from rd2h.ports.transfer import TransferEngine

PAGE = 4096
"""Every page of the pattern starts with its page number (xor the seed), so a read that
lands at the wrong offset cannot match by accident."""

_PERIOD = 251  # a prime: the background pattern never lines up with a power of two


@dataclass(frozen=True)
class EndpointSpec:
    """What both endpoints need to know (picklable: it crosses to spawned processes)."""

    transport: str
    host: str
    store_url: str
    transfer_type: str
    nic: str
    prefill_device: int
    decode_device: int
    size: int
    block: int
    iterations: int
    seed: int
    timeout_s: float
    log_path: str
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""


def pattern(size: int, seed: int) -> np.ndarray:
    """``size`` bytes that depend on ``seed`` and on every byte's offset."""
    base = ((np.arange(_PERIOD, dtype=np.uint32) * 131 + seed) % _PERIOD).astype(np.uint8)
    out = np.resize(base, size)
    stamped = (size - 8) // PAGE + 1 if size >= 8 else 0
    if stamped:
        stamps = np.arange(stamped, dtype="<u8") ^ np.uint64(seed)
        heads = np.lib.stride_tricks.as_strided(
            out, shape=(stamped, 8), strides=(PAGE, 1), writeable=True
        )
        heads[:] = stamps.view(np.uint8).reshape(stamped, 8)
    return out


def descriptors(
    local_base: int, remote_base: int, size: int, block: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read descriptors covering ``size`` bytes in ``block``-byte pieces (the last may be
    shorter), same offset on both sides, in a seeded shuffled order."""
    offsets = np.arange(0, size, block, dtype=np.int64)
    lengths = np.minimum(block, size - offsets)
    order = np.random.default_rng(seed).permutation(offsets.size)
    return local_base + offsets[order], remote_base + offsets[order], lengths[order]


def first_difference(got: np.ndarray, expected: np.ndarray) -> str | None:
    """``None`` when equal, else where and how the first byte differs."""
    bad = np.flatnonzero(got != expected)
    if bad.size == 0:
        return None
    i = int(bad[0])
    return (
        f"{bad.size} of {got.size} bytes differ, the first at offset {i} "
        f"(got {int(got[i])}, expected {int(expected[i])})"
    )


def make_engine(spec: EndpointSpec, role: str) -> TransferEngine:
    """The transfer engine of one endpoint (``role`` is 'prefill' or 'decode'), built by
    the composition root like any rank's."""
    from rd2h.app.settings import Rd2hSettings
    from rd2h.bootstrap.container import build_container

    memfabric = spec.transport == "memfabric"
    settings = Rd2hSettings(
        role=role, transport=spec.transport, host=spec.host,  # type: ignore[arg-type]
        memfabric_store_url=spec.store_url if memfabric else None,
        memfabric_transfer_type=spec.transfer_type,  # type: ignore[arg-type]
        memfabric_nic=spec.nic,
        memfabric_device_id=spec.prefill_device if role == "prefill" else spec.decode_device,
        mooncake_protocol=spec.mooncake_protocol,  # type: ignore[arg-type]
        mooncake_device=spec.mooncake_device,
    )
    return build_container(settings).transport()


def redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (fds 1 and 2), and Python logging (the
    MemFabric library's log lines arrive there), to the end of ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO,
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )


def describe(exc: BaseException) -> str:
    """One line: rd2h's own errors speak for themselves, others get their type."""
    text = str(exc) if isinstance(exc, Rd2hError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _wait_for_exit(conn: Connection, timeout_s: float) -> None:
    """Block until the parent says 'exit' or goes away, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            if conn.poll(min(left, 1.0)):
                conn.recv()
                return
        except (EOFError, OSError):
            return


def store_main(conn: Connection, spec: EndpointSpec) -> None:
    """Process: run a MemFabric config store at ``spec.store_url`` until told to exit."""
    redirect_output(spec.log_path)
    try:
        from rd2h.bootstrap.gateways import start_memfabric_store

        start_memfabric_store(spec.store_url)
    except Exception as exc:
        conn.send(("error", "store", describe(exc)))
        os._exit(1)
    conn.send(("ready",))
    _wait_for_exit(conn, spec.timeout_s)
    os._exit(0)  # the library's store shutdown takes seconds and serves no one now


def prefill_main(conn: Connection, spec: EndpointSpec) -> None:
    """Process: expose a patterned buffer and report (session, address) until told to exit
    (or ``spec.timeout_s`` passed)."""
    redirect_output(spec.log_path)
    phase = "start"
    engine: Any = None
    try:
        engine = make_engine(spec, "prefill")
        phase = "register"
        buf = pattern(spec.size, spec.seed)
        engine.register_memory(buf.ctypes.data, buf.nbytes)
        if spec.transport == "cma":
            from rd2h.bootstrap.gateways import allow_reads_by

            allow_reads_by(os.getppid())  # the Decode endpoint is our sibling
        conn.send(("ready", engine.session_id, buf.ctypes.data))
        _wait_for_exit(conn, spec.timeout_s)
    except Exception as exc:
        conn.send(("error", phase, describe(exc)))
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:
                print(f"closing the Prefill engine: {describe(exc)}", file=sys.stderr)
        conn.close()


def decode_main(conn: Connection, spec: EndpointSpec, session: str, remote: int) -> None:
    """Process: read the Prefill buffer ``1 + iterations`` times, verify every read, report
    the timed ones (the first warms up)."""
    redirect_output(spec.log_path)
    phase = "start"
    engine: Any = None
    try:
        engine = make_engine(spec, "decode")
        phase = "register"
        dst = np.zeros(spec.size, np.uint8)
        engine.register_memory(dst.ctypes.data, dst.nbytes)
        expected = pattern(spec.size, spec.seed)
        local, remote_addrs, lengths = descriptors(
            dst.ctypes.data, remote, spec.size, spec.block, spec.seed
        )
        seconds = []
        for i in range(spec.iterations + 1):
            dst.fill(0)
            phase = "read"
            t0 = time.perf_counter()
            engine.batch_read(session, local, remote_addrs, lengths)
            elapsed = time.perf_counter() - t0
            phase = "verify"
            diff = first_difference(dst, expected)
            if diff is not None:
                raise Rd2hError(f"read {i + 1} of {spec.iterations + 1}: {diff}")
            if i:
                seconds.append(elapsed)
        conn.send(("result", {"seconds": seconds, "descriptors": int(lengths.size),
                              "session": engine.session_id}))
    except Exception as exc:
        conn.send(("error", phase, describe(exc)))
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:
                print(f"closing the Decode engine: {describe(exc)}", file=sys.stderr)
        conn.close()

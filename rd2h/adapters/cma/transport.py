"""Cross-memory-attach transfer engine: same-host reads with Linux ``process_vm_readv``.

The descriptor arrays become the syscall's iovec arrays directly: an (n, 2)
int64 array per side, row ``i`` = ``(address, length)``, which is the memory
layout of ``struct iovec {void *iov_base; size_t iov_len;}`` on 64-bit Linux.
At most ``IOV_MAX`` (1024) iovecs go into one call; short reads continue from
the exact byte where the kernel stopped.

The reader needs ptrace-attach permission over the peer: same uid, and with
Yama ``ptrace_scope=1`` the peer must be a descendant or have allowed it
(``prctl(PR_SET_PTRACER)``). Otherwise reads fail with EPERM.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import itertools
import os
import socket
import struct
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from rd2h.adapters.transport_base import BaseTransferEngine
from rd2h.domain.errors import TransferError

IOV_MAX = 1024
"""Most iovecs Linux accepts per side in one ``process_vm_readv`` call."""

DEFAULT_PARALLEL_MIN_BYTES = 4 << 20
"""Batches smaller than this are read on the calling thread even when ``threads > 1``."""

_IOVEC_BYTES = 16
_sum = np.add.reduce
_PEERS_KEPT = 4096  # sessions whose pid is remembered (then the memo starts again)

# (pid, local_iov, liovcnt, remote_iov, riovcnt, flags) -> bytes read or -1 (errno set).
ReadvFn = Callable[[int, int, int, int, int, int], int]

_ERRNO_HINTS = {
    errno_mod.ESRCH: "no such process (the peer is gone or never existed)",
    errno_mod.EFAULT: "an address is not mapped (remote in the peer, or local here)",
    errno_mod.EPERM: "not permitted to read the peer (needs the same uid and ptrace "
    "permission, see /proc/sys/kernel/yama/ptrace_scope)",
    errno_mod.ENOMEM: "the kernel could not allocate memory for the iovecs",
    errno_mod.EINVAL: "invalid arguments (iovec count or total length)",
    errno_mod.ENOSYS: "process_vm_readv is not available (kernel or seccomp)",
}


def _load_process_vm_readv() -> ReadvFn:
    if not sys.platform.startswith("linux"):
        raise TransferError(
            f"cma transport needs Linux process_vm_readv; this platform is {sys.platform!r}"
        )
    if struct.calcsize("P") != 8:
        raise TransferError("cma transport supports 64-bit Linux only (16-byte struct iovec)")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError) as exc:
        raise TransferError(f"cma transport: libc has no process_vm_readv ({exc})") from exc
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


def _describe_errno(err: int) -> str:
    name = errno_mod.errorcode.get(err, f"errno {err}")
    hint = _ERRNO_HINTS.get(err, os.strerror(err))
    return f"{name}: {hint}"


def read_range(
    readv: ReadvFn, pid: int, local_iov: np.ndarray, remote_iov: np.ndarray, start: int, stop: int
) -> None:
    """Read descriptors ``[start, stop)`` of the (n, 2) int64 iovec arrays from ``pid``.

    Calls ``readv`` with at most ``IOV_MAX`` iovecs at a time. After a short read
    the partly copied iovec is advanced in place on both sides (the arrays are
    scratch copies) and reading resumes from that exact byte. Raises
    ``TransferError`` on -1 or on a call that copies nothing.
    """
    local_ptr = local_iov.ctypes.data
    remote_ptr = remote_iov.ctypes.data
    lens = local_iov[:, 1]
    i = start
    while i < stop:
        count = min(IOV_MAX, stop - i)
        want = int(_sum(lens[i : i + count]))
        offset = i * _IOVEC_BYTES
        got = readv(pid, local_ptr + offset, count, remote_ptr + offset, count, 0)
        if got == want:
            i += count
            continue
        if got < 0 or got == 0 or got > want:
            reason = _describe_errno(ctypes.get_errno()) if got < 0 else f"kernel returned {got}"
            raise TransferError(
                f"process_vm_readv from pid {pid} failed at descriptor {i} "
                f"(remote {int(remote_iov[i, 0]):#x}, local {int(local_iov[i, 0]):#x}, "
                f"{int(lens[i])} bytes): {reason}"
            )
        done = np.cumsum(lens[i : i + count])
        whole = int(np.searchsorted(done, got, side="right"))
        rest = got - (int(done[whole - 1]) if whole else 0)
        i += whole
        if rest:
            local_iov[i, 0] += rest
            local_iov[i, 1] -= rest
            remote_iov[i, 0] += rest
            remote_iov[i, 1] -= rest


def _split_by_bytes(lens: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Cut ``[0, n)`` into at most ``parts`` contiguous, non-empty, byte-balanced ranges."""
    cum = np.cumsum(lens)
    targets = cum[-1] * np.arange(1, parts) // parts
    cuts = np.searchsorted(cum, targets, side="left") + 1
    bounds = np.unique(np.concatenate(([0], np.minimum(cuts, lens.size), [lens.size])))
    return list(itertools.pairwise(bounds.tolist()))


class CmaTransferEngine(BaseTransferEngine):
    """Transfer engine reading other processes on this host via ``process_vm_readv``.

    ``session_id`` is ``"<hostname>:<pid>"``. ``register_memory`` records local
    regions; every descriptor's local range must lie inside one of them. Remote
    addresses are not checked here (the peer's advertised regions are the
    caller's business); the kernel refuses unmapped ones (EFAULT).

    ``threads > 1`` splits a batch of at least ``parallel_min_bytes`` into that
    many contiguous byte-balanced parts read concurrently (ctypes releases the
    GIL during the syscall); any part failing fails the batch. A failure may
    leave a partial copy.
    """

    engine_name = "cma"

    def __init__(
        self, threads: int = 1, parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._readv = _load_process_vm_readv()
        super().__init__()
        self._host = socket.gethostname()
        self._session_id = f"{self._host}:{os.getpid()}"
        self._threads = threads
        self._pids: dict[str, int] = {}
        self._parallel_min_bytes = parallel_min_bytes
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="rd2h-cma") if threads > 1 else None
        )

    @property
    def session_id(self) -> str:
        """``"<hostname>:<pid>"`` of this process."""
        return self._session_id

    def _peer(self, session: str) -> int:
        """The peer's pid: ``session`` must be ``"<this host>:<pid>"`` (a session that
        passed is remembered: every read of a peer names the same one)."""
        pid = self._pids.get(session)
        if pid is not None:
            return pid
        pid = self._parse_peer(session)
        if len(self._pids) >= _PEERS_KEPT:
            self._pids.clear()
        self._pids[session] = pid
        return pid

    def _parse_peer(self, session: str) -> int:
        host, sep, pid_text = session.rpartition(":")
        if not sep or not host or not pid_text.isdigit() or int(pid_text) <= 0:
            raise TransferError(f"malformed cma session {session!r}; expected '<host>:<pid>'")
        if host != self._host:
            raise TransferError(
                f"cma only reads on the same host: session {session!r} is on {host!r}, "
                f"this is {self._host!r}"
            )
        return int(pid_text)

    def _read(self, pid: int, local: np.ndarray, remote: np.ndarray, lens: np.ndarray) -> None:
        n = lens.size
        local_iov = np.empty((n, 2), np.int64)
        local_iov[:, 0] = local
        local_iov[:, 1] = lens
        remote_iov = np.empty((n, 2), np.int64)
        remote_iov[:, 0] = remote
        remote_iov[:, 1] = lens
        pool = self._pool
        if pool is None or n < 2 or int(lens.sum()) < self._parallel_min_bytes:
            read_range(self._readv, pid, local_iov, remote_iov, 0, n)
            return
        parts = _split_by_bytes(lens, self._threads)
        try:
            futures = [
                pool.submit(read_range, self._readv, pid, local_iov, remote_iov, a, b)
                for a, b in parts
            ]
        except RuntimeError as exc:  # the pool was shut down by a concurrent close()
            raise TransferError(f"the engine was closed during batch_read ({exc})") from exc
        wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            first = errors[0]
            if isinstance(first, TransferError) and len(errors) == 1:
                raise first
            raise TransferError(
                f"{len(errors)} of {len(parts)} parts failed; first: {first}"
            ) from first

    def _close(self) -> list[str]:
        """Stop the thread pool (the regions are already forgotten)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return []

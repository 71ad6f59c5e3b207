"""In-process transfer engine: peers live in the same process and reads are memmoves.

It is a real transport, not a mock: bytes are copied by raw address, and every
batch is validated as a whole (vectorised, ``rd2h.adapters.regions``) before the
first byte moves.
"""

from __future__ import annotations

import ctypes
import threading
import uuid
import weakref

import numpy as np

from rd2h.adapters.regions import RegionTable, validate_batch
from rd2h.domain.errors import TransferError

_registry_lock = threading.Lock()
_registry: weakref.WeakValueDictionary[str, InprocTransferEngine] = weakref.WeakValueDictionary()


def _lookup(session: str) -> InprocTransferEngine | None:
    with _registry_lock:
        return _registry.get(session)


class InprocTransferEngine:
    """Transfer engine whose peers are other engines in this process.

    Each engine gets a session id ``inproc:<uuid4 hex>`` in a process-wide
    registry (weak: an engine dropped without ``close`` disappears too).
    ``batch_read`` reads only from the peer's registered regions into this
    engine's registered regions, and validates the whole batch before copying.
    The memory itself belongs to the callers; it must outlive the read.
    """

    def __init__(self) -> None:
        self._session_id = f"inproc:{uuid.uuid4().hex}"
        self._regions = RegionTable()
        self._closed = False
        with _registry_lock:
            _registry[self._session_id] = self

    @property
    def session_id(self) -> str:
        """How peers name this engine in ``batch_read``."""
        return self._session_id

    def register_memory(self, addr: int, size: int) -> None:
        """Expose ``[addr, addr + size)`` to peers and as a read destination."""
        if self._closed:
            raise TransferError(f"inproc engine {self._session_id} is closed")
        self._regions.add(addr, size)

    def batch_read(
        self,
        session: str,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Copy ``lengths[i]`` bytes from ``remote_addrs[i]`` of peer ``session`` to
        ``local_addrs[i]`` here, for all i; nothing is copied unless all are valid."""
        if self._closed:
            raise TransferError(f"inproc engine {self._session_id} is closed")
        local, remote, lens = validate_batch(local_addrs, remote_addrs, lengths)
        peer = _lookup(session)
        if peer is None or peer._closed:
            raise TransferError(f"no inproc engine with session {session!r} (unknown or closed)")
        if lens.size == 0:
            return
        peer._regions.require_inside(remote, lens, f"remote (peer {session})")
        self._regions.require_inside(local, lens, "local")
        memmove = ctypes.memmove
        for dst, src, n in zip(local.tolist(), remote.tolist(), lens.tolist()):
            memmove(dst, src, n)

    def close(self) -> None:
        """Unregister the session and forget the regions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _registry_lock:
            if _registry.get(self._session_id) is self:
                del _registry[self._session_id]
        self._regions.clear()

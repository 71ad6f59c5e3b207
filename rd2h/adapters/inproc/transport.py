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

from rd2h.adapters.transport_base import BaseTransferEngine
from rd2h.domain.errors import TransferError

_registry_lock = threading.Lock()
_registry: weakref.WeakValueDictionary[str, InprocTransferEngine] = weakref.WeakValueDictionary()


def _lookup(session: str) -> InprocTransferEngine | None:
    with _registry_lock:
        return _registry.get(session)


class InprocTransferEngine(BaseTransferEngine):
    """Transfer engine whose peers are other engines in this process.

    Each engine gets a session id ``inproc:<uuid4 hex>`` in a process-wide
    registry (weak: an engine dropped without ``close`` disappears too).
    ``batch_read`` reads only from the peer's registered regions into this
    engine's registered regions, and validates the whole batch before copying.
    The memory itself belongs to the callers; it must outlive the read.
    """

    engine_name = "inproc"

    def __init__(self) -> None:
        super().__init__()
        self._session_id = f"inproc:{uuid.uuid4().hex}"
        with _registry_lock:
            _registry[self._session_id] = self

    @property
    def session_id(self) -> str:
        """How peers name this engine in ``batch_read``."""
        return self._session_id

    def _peer(self, session: str) -> InprocTransferEngine:
        peer = _lookup(session)
        if peer is None or peer.closed:
            raise TransferError("no inproc engine has this session (unknown or closed)")
        return peer

    def _read(
        self, peer: InprocTransferEngine, local: np.ndarray, remote: np.ndarray, lens: np.ndarray
    ) -> None:
        """Memmoves, once every remote range lies inside one of the peer's regions."""
        peer._book.regions.require_inside(remote, lens, "remote")
        memmove = ctypes.memmove
        for dst, src, n in zip(local.tolist(), remote.tolist(), lens.tolist()):
            memmove(dst, src, n)

    def _close(self) -> list[str]:
        """Leave the process-wide registry (the regions are already forgotten)."""
        with _registry_lock:
            if _registry.get(self._session_id) is self:
                del _registry[self._session_id]
        return []

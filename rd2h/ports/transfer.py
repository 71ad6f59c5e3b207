"""Transfer engine port: one-sided batched reads by raw address (spec 1, 5)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TransferEngine(Protocol):
    """A transport that lets this endpoint read peers' registered memory.

    Implementations: ``inproc`` (same process), ``cma`` (same host, Linux
    ``process_vm_readv``), MemFabric (Ascend), Mooncake (TCP/RDMA).
    """

    @property
    def session_id(self) -> str:
        """How peers name this endpoint in ``batch_read`` (published in MF_META)."""
        ...

    def register_memory(self, addr: int, size: int) -> None:
        """Expose ``[addr, addr + size)`` to peers / as a destination. Registering the
        same region again is a no-op; raises ``TransferError`` on failure."""
        ...

    def batch_read(
        self,
        session: str,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Synchronously copy ``lengths[i]`` bytes from ``remote_addrs[i]`` in the peer
        ``session`` to ``local_addrs[i]`` here, for all i. Raises ``TransferError``
        (with a clear message) on any failure, including a short read."""
        ...

    def close(self) -> None:
        """Release registrations and resources. Idempotent."""
        ...

"""The one base of the transfer engines: the port's three methods as template methods.

``BaseTransferEngine`` does, once for every transport, what surrounds moving the bytes:

* ``batch_read``: the closed-engine check, the batch checks (``validate_batch``), the
  peer's session (``_peer``, the transport's hook), the empty batch, every local range
  inside registered memory; then ``_read``.
* ``register_memory``: the region's checks and bookkeeping. Where the library registers
  by base address (``registers_by_base``), it gets only disjoint regions: a region inside
  one already registered is only recorded, one partly overlapping is refused; then
  ``_register`` with the new ones.
* ``close``: idempotent; unregisters every region handed to the library
  (``_unregister``), forgets them all, then ``_close``.

One error convention: every failure of these methods is a ``TransferError`` (a subclass
such as ``TransportLibraryError`` stays itself) whose message starts with the engine and
its session, and for a read the peer's: ``"Mooncake engine 10.0.0.1:15000 reading from
'10.0.0.2:15001': ..."``. The hooks raise ``TransferError`` with the detail only.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np

from rd2h.adapters.regions import RegionTable, as_region, validate_batch
from rd2h.domain.errors import TransferError


class Registrations:
    """What an engine registered: ``regions``, every range a read may write (overlaps
    allowed), and ``library``, base -> size of the disjoint regions handed to a library
    that registers by base address. Handles on one library engine share one (MemFabric).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.regions = RegionTable()
        self.library: dict[int, int] = {}
        self.closed = False

    def new_for_library(self, regions: list[tuple[int, int]], name: str) -> dict[int, int]:
        """The regions of ``regions`` (sorted by base, enclosing ones first) the library
        does not hold yet, neither registered nor inside a region registered or new;
        ``TransferError`` for a region partly overlapping one of those."""
        fresh: dict[int, int] = {}
        for addr, size in regions:
            if _inside(self.library, addr, size) or _inside(fresh, addr, size):
                continue
            _refuse_overlap(self.library, addr, size, "already registered", name)
            _refuse_overlap(fresh, addr, size, "in the same call", name)
            fresh[addr] = size
        return fresh


def _inside(regions: dict[int, int], addr: int, size: int) -> bool:
    end = addr + size
    return any(start <= addr and end <= start + length for start, length in regions.items())


def _refuse_overlap(regions: dict[int, int], addr: int, size: int, what: str, name: str) -> None:
    end = addr + size
    for start, length in regions.items():
        if addr < start + length and start < end:
            raise TransferError(
                f"region [{addr:#x}, +{size}) partly overlaps the region [{start:#x}, "
                f"+{length}) {what}; {name} registers by base address and needs disjoint "
                "registrations: register the enclosing region once"
            )


class BaseTransferEngine(ABC):
    """A ``TransferEngine`` (``rd2h.ports.transfer``) whose transport fills in the hooks.

    Subclasses set ``engine_name`` (how messages name the transport), define
    ``session_id`` and ``_read``, and override the other hooks they need. ``registrations``
    is the engine's own ``Registrations`` unless handles share one.
    """

    engine_name: ClassVar[str]
    registers_by_base: ClassVar[bool] = False
    """The library registers regions by base address: it gets disjoint regions only
    (``_register``) and each is unregistered on close (``_unregister``)."""

    def __init__(self, registrations: Registrations | None = None) -> None:
        self._book = registrations if registrations is not None else Registrations()
        self._closed = False

    @property
    @abstractmethod
    def session_id(self) -> str:
        """How peers name this engine in ``batch_read``."""

    @property
    def closed(self) -> bool:
        """Whether this engine (or the library engine it is a handle on) is closed."""
        return self._closed or self._book.closed

    # --- the port ----------------------------------------------------------------------

    def register_memory(self, addr: int, size: int) -> None:
        """Expose ``[addr, addr + size)`` to peers and as a read destination. The same
        region again, or (``registers_by_base``) one inside a registered region, is only
        recorded."""
        with self._named():
            self._add_regions([(addr, size)])

    def batch_read(
        self,
        session: str,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Copy ``lengths[i]`` bytes from ``remote_addrs[i]`` of peer ``session`` to
        ``local_addrs[i]`` here, for all i. The batch is checked as a whole before the
        first byte moves; what a failed read leaves copied is the transport's to say."""
        try:  # (``_named`` inline: this is the per-message hot path)
            self._check_open()
            local, remote, lens = validate_batch(local_addrs, remote_addrs, lengths)
            peer = self._peer(session)
            if lens.size == 0:
                return
            self._book.regions.require_inside(local, lens, "local")
            self._read(peer, local, remote, lens)
        except TransferError as exc:
            self._name_error(exc, session)
            raise

    def close(self) -> None:
        """Unregister and forget every region, then release the transport. Idempotent.
        Raises ``TransferError`` naming what failed, after releasing all it could."""
        with self._named():
            book = self._book
            with book.lock:
                if self._closed:
                    return
                self._closed = True
                if not self._last_handle() or book.closed:
                    return
                book.closed = True
                failed = []
                for addr in list(book.library):
                    try:
                        rc = self._unregister(addr)
                    except Exception as exc:
                        rc = repr(exc)
                    if rc != 0:
                        failed.append(f"unregister_memory({addr:#x}) returned {rc}")
                book.library.clear()
                book.regions.clear()
            failed += self._close()
            if failed:
                raise TransferError(f"close: {'; '.join(failed)}")

    # --- for subclasses ------------------------------------------------------------------

    @contextlib.contextmanager
    def _named(self, peer: str | None = None) -> Iterator[None]:
        """Lead the message of a ``TransferError`` raised inside with this engine's name
        and session (and the peer read from); the exception is otherwise kept as it is
        (type, attributes, cause, traceback)."""
        try:
            yield
        except TransferError as exc:
            self._name_error(exc, peer)
            raise

    def _name_error(self, exc: TransferError, peer: str | None) -> None:
        where = "" if peer is None else f" reading from {peer!r}"
        exc.args = (f"{self.engine_name} engine {self.session_id}{where}: {exc}",)

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError("the engine is closed")

    def _add_regions(self, regions: Iterable[tuple[object, object]]) -> None:
        """Check and record ``regions``; hand the library (``_register``) the new ones."""
        checked = sorted((as_region(a, s) for a, s in regions), key=lambda r: (r[0], -r[1]))
        book = self._book
        with book.lock:
            self._check_open()
            if self.registers_by_base:
                fresh = book.new_for_library(checked, self.engine_name)
                if fresh:
                    self._register(list(fresh.items()))
                    book.library.update(fresh)
            for addr, size in checked:
                book.regions.add(addr, size)

    # --- hooks ---------------------------------------------------------------------------

    def _peer(self, session: str) -> Any:
        """Check the peer's ``session`` and return what ``_read`` needs to reach it (by
        default the session itself); ``TransferError`` for one this transport refuses."""
        return session

    @abstractmethod
    def _read(self, peer: Any, local: np.ndarray, remote: np.ndarray, lens: np.ndarray) -> None:
        """Move a checked, non-empty batch (1-D int64 arrays) from ``peer``."""

    def _register(self, regions: list[tuple[int, int]]) -> None:  # noqa: B027
        """(``registers_by_base``) Register the new, disjoint ``regions`` with the library,
        all or none. Called with the registrations' lock held."""

    def _unregister(self, addr: int) -> object:
        """(``registers_by_base``) Unregister the region at ``addr``; the library's return
        code, 0 for success. Called once per region on close."""
        return 0

    def _last_handle(self) -> bool:
        """Release this handle; True if it was the last one (the registrations go)."""
        return True

    def _close(self) -> list[str]:
        """Release the transport after the registrations; what failed, as phrases."""
        return []

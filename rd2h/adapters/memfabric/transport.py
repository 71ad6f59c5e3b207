"""MemFabric transfer engine: one-sided batched reads on Ascend (``memfabric_hybrid``).

Facts about memfabric-hybrid 1.3.0 this adapter relies on (see also ``library.py``):

* ``TransferEngine.initialize(store_url, session_id, role, device_id, data_op_type,
  store_server_role, nic)``: ``role`` is ``'Prefill'`` or ``'Decode'``; ``data_op_type``
  must be a ``TransDataOpType`` member (an int raises ``TypeError``). The library keeps
  one transfer context per process.
* ``get_rpc_port()`` returns 0 (and logs a warning) before a successful ``initialize``.
  rd2h initialises with the session id ``"<host>:0"`` (the library picks its RPC port,
  as other integrations do) and publishes ``"<host>:<get_rpc_port()>"`` afterwards.
* ``register_memory(addr, size)`` / ``batch_register_memory(addrs, sizes)`` register by
  base address (``unregister_memory(addr)`` takes only the address), so rd2h keeps the
  library's registrations disjoint.
* ``batch_transfer_sync_read(dest_session, local_addrs, peer_addrs, lengths)`` takes
  lists of ints and returns 0, or non-zero when the peer is unknown or gone, a range is
  outside registered memory, or the context is not initialised.
* Tear-down is ``destroy()`` (the transfer handle) then ``unInitialize()`` (the context).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from rd2h.adapters.memfabric.config import MemFabricConfig, parse_host_port, parse_store_url
from rd2h.adapters.memfabric.library import MemFabricLibrary, call_checked, load_library
from rd2h.adapters.regions import RegionTable, validate_batch
from rd2h.domain.errors import TransferError, TransportBindingError

_INIT_HINT = (
    "check that the Ascend driver and CANN are installed, the device id exists and is "
    "visible (ASCEND_RT_VISIBLE_DEVICES), and the config store is reachable"
)
_READ_HINT = (
    "the peer is gone or unreachable, or a remote range lies outside the memory it "
    "registered"
)


class _Bound:
    """The process's initialised library engine, shared by every handle on it."""

    def __init__(self, library: Any, config: MemFabricConfig, engine: Any, session: str) -> None:
        self.library = library
        self.config = config
        self.engine = engine
        self.session_id = session
        self.lock = threading.Lock()
        self.regions = RegionTable()  # read destinations: every range we may write
        self.library_regions: dict[int, int] = {}  # disjoint, as registered in the library
        self.handles = 1
        self.closed = False


# Per library (the real module, or a test's fake): the configuration the process is bound
# to (for the process's life, set on the first successful initialise) and the live engine.
_registry_lock = threading.Lock()
_configs: weakref.WeakKeyDictionary[Any, MemFabricConfig] = weakref.WeakKeyDictionary()
_live: weakref.WeakKeyDictionary[Any, _Bound] = weakref.WeakKeyDictionary()


def _op_type(library: Any, name: str) -> Any:
    member = getattr(getattr(library, "TransDataOpType", None), name, None)
    if member is None:
        raise TransferError(f"this memfabric_hybrid has no TransDataOpType.{name}")
    return member


def _start(library: Any, config: MemFabricConfig) -> _Bound:
    """Create and initialise the library engine; nothing is published unless it worked."""
    try:
        engine = library.TransferEngine()
    except Exception as exc:
        raise TransferError(f"MemFabric TransferEngine() raised {exc!r}") from exc
    op_type = _op_type(library, config.transfer_type)
    try:
        call_checked(
            library, "initialize", engine.initialize,
            config.store_url, f"{config.host}:0", config.role, config.device_id, op_type,
            config.store_server_role, config.nic,
            detail=(
                f"(role {config.role}, device {config.device_id}, {config.transfer_type}, "
                f"host {config.host}, store {config.store_url})"
            ),
            hint=_INIT_HINT,
        )
        try:
            port = int(engine.get_rpc_port())
        except Exception as exc:
            raise TransferError(f"MemFabric get_rpc_port raised {exc!r}") from exc
        if not 0 < port < 65536:
            raise TransferError(
                f"MemFabric initialised but get_rpc_port() returned {port}: no session to publish"
            )
    except BaseException:
        _teardown(library, engine, initialised=False)
        raise
    return _Bound(library, config, engine, f"{config.host}:{port}")


def _teardown(library: Any, engine: Any, *, initialised: bool = True) -> list[str]:
    """``destroy`` then ``unInitialize``; returns what failed instead of raising."""
    failed = []
    for name in ("destroy", "unInitialize") if initialised else ("destroy",):
        try:
            getattr(engine, name)()
        except Exception as exc:
            failed.append(f"{name} raised {exc!r}")
    return failed


def _acquire(library: Any, config: MemFabricConfig) -> _Bound:
    with _registry_lock:
        bound_config = _configs.get(library)
        if bound_config is not None and bound_config != config:
            raise TransportBindingError(
                "this process's MemFabric engine is bound to "
                f"role {bound_config.role}, device {bound_config.device_id}, host "
                f"{bound_config.host}; a different configuration was requested ("
                + ", ".join(bound_config.differences(config))
                + "); use one MemFabric configuration per process"
            )
        live = _live.get(library)
        if live is not None and not live.closed:
            live.handles += 1
            return live
        bound = _start(library, config)
        _configs[library] = config
        _live[library] = bound
        return bound


def _as_region(addr: object, size: object) -> tuple[int, int]:
    try:
        a, s = int(addr), int(size)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TransferError(f"cannot register region at {addr!r} of size {size!r}") from None
    if a <= 0 or s <= 0 or a + s > 2**63 - 1:
        raise TransferError(f"cannot register region at address {a} of size {s}")
    return a, s


class MemFabricTransferEngine:
    """Transfer engine on ``memfabric_hybrid.TransferEngine``.

    The library keeps one engine per process, bound to one role, one device and one host:
    the first instance initialises it; another instance with an equal ``config`` is a
    handle on that same engine (same session id and registrations, no second
    ``initialize``); a different ``config`` raises ``TransportBindingError``. Closing the
    last handle unregisters the memory and tears the engine down; a later instance must
    use the same configuration again.

    ``library`` is the ``memfabric_hybrid`` module (imported here when omitted) or any
    object with the same surface. Every non-zero return becomes ``TransportLibraryError``
    with the library's own explanation. ``session_id`` is ``"<host>:<rpc port>"``.
    """

    def __init__(self, config: MemFabricConfig, library: MemFabricLibrary | None = None) -> None:
        if not isinstance(config, MemFabricConfig):
            raise TypeError(f"config must be a MemFabricConfig, got {type(config).__name__}")
        self._library = library if library is not None else load_library()
        self._bound = _acquire(self._library, config)
        self._closed = False

    @property
    def session_id(self) -> str:
        """``"<host>:<rpc port>"``: how peers name this engine (after ``initialize``)."""
        return self._bound.session_id

    @property
    def config(self) -> MemFabricConfig:
        return self._bound.config

    def _check_open(self) -> None:
        if self._closed or self._bound.closed:
            raise TransferError(f"MemFabric engine {self._bound.session_id} is closed")

    def register_memory(self, addr: int, size: int) -> None:
        """Expose ``[addr, addr + size)`` to peers and as a read destination.

        The same region again, or a region inside a registered one, is only recorded (the
        library sees each region once). A region partly overlapping or enclosing a
        registered one is refused: the library registers by base address.
        """
        self.register_regions([addr], [size])

    def register_regions(self, addrs: list[int], sizes: list[int]) -> None:
        """Register several regions with one ``batch_register_memory`` call.

        Unequal list lengths, bad regions and overlaps are refused before the library is
        called; regions already registered (or inside one) are skipped.
        """
        addrs, sizes = list(addrs), list(sizes)
        if len(addrs) != len(sizes):
            raise TransferError(
                f"register_regions: {len(addrs)} addresses but {len(sizes)} sizes"
            )
        # Enclosing regions first, so a region inside another of the same call is skipped.
        regions = sorted(
            (_as_region(a, s) for a, s in zip(addrs, sizes)), key=lambda r: (r[0], -r[1])
        )
        bound = self._bound
        with bound.lock:
            self._check_open()
            fresh: dict[int, int] = {}
            inside: list[tuple[int, int]] = []
            for addr, size in regions:
                if (
                    _containing(bound.library_regions, addr, size) is not None
                    or _containing(fresh, addr, size) is not None
                ):
                    inside.append((addr, size))
                    continue
                _refuse_overlap(bound.library_regions, addr, size, "already registered")
                _refuse_overlap(fresh, addr, size, "in the same call")
                fresh[addr] = size
            if len(fresh) == 1:
                [(addr, size)] = fresh.items()
                call_checked(
                    bound.library, "register_memory", bound.engine.register_memory, addr, size,
                    detail=f"([{addr:#x}, +{size}))",
                )
            elif fresh:
                call_checked(
                    bound.library, "batch_register_memory", bound.engine.batch_register_memory,
                    list(fresh), list(fresh.values()), detail=f"({len(fresh)} regions)",
                )
            for addr, size in fresh.items():
                bound.library_regions[addr] = size
                bound.regions.add(addr, size)
            for addr, size in inside:
                bound.regions.add(addr, size)

    def batch_read(
        self,
        session: str,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Copy ``lengths[i]`` bytes from ``remote_addrs[i]`` of peer ``session`` to
        ``local_addrs[i]`` here, for all i, in one ``batch_transfer_sync_read``.

        The batch is checked as a whole (shapes, lengths, local ranges inside registered
        memory) before the library is called; remote ranges are checked by the library.
        A failed read may leave a partial copy.
        """
        self._check_open()
        local, remote, lens = validate_batch(local_addrs, remote_addrs, lengths)
        try:
            parse_host_port(session, "MemFabric session")
        except ValueError as exc:
            raise TransferError(str(exc)) from None
        n = lens.size
        if n == 0:
            return
        bound = self._bound
        bound.regions.require_inside(local, lens, "local")
        call_checked(
            bound.library, "batch_transfer_sync_read", bound.engine.batch_transfer_sync_read,
            session, local.tolist(), remote.tolist(), lens.tolist(),
            detail=f"from {session} ({n} descriptors, {int(lens.sum())} bytes)",
            hint=_READ_HINT,
        )

    def close(self) -> None:
        """Release this handle. The last one unregisters every region and tears the
        library engine down (``destroy``, ``unInitialize``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        bound = self._bound
        with _registry_lock, bound.lock:
            bound.handles -= 1
            if bound.handles > 0 or bound.closed:
                return
            bound.closed = True
            failed = []
            for addr in list(bound.library_regions):
                try:
                    rc = bound.engine.unregister_memory(addr)
                except Exception as exc:
                    rc = repr(exc)
                if rc != 0:
                    failed.append(f"unregister_memory({addr:#x}) -> {rc}")
            bound.library_regions.clear()
            bound.regions.clear()
            failed += _teardown(bound.library, bound.engine)
            if _live.get(bound.library) is bound:
                del _live[bound.library]
        if failed:
            raise TransferError(f"MemFabric close: {'; '.join(failed)}")


def _containing(regions: dict[int, int], addr: int, size: int) -> int | None:
    """The base of a region in ``regions`` that contains ``[addr, addr + size)``."""
    end = addr + size
    for start, length in regions.items():
        if start <= addr and end <= start + length:
            return start
    return None


def _refuse_overlap(regions: dict[int, int], addr: int, size: int, what: str) -> None:
    end = addr + size
    for start, length in regions.items():
        if addr < start + length and start < end and (start, length) != (addr, size):
            raise TransferError(
                f"region [{addr:#x}, +{size}) overlaps the region [{start:#x}, +{length}) "
                f"{what}; MemFabric registers by base address: register the enclosing "
                "region once"
            )


def start_config_store(store_url: str, library: MemFabricLibrary | None = None) -> None:
    """Start a MemFabric config store listening at ``store_url`` in this process (it runs
    on the library's threads until the process exits). ``TransportLibraryError`` if the
    library refuses, e.g. the port is taken."""
    try:
        parse_store_url(store_url)
    except ValueError as exc:
        raise TransferError(str(exc)) from None
    lib = library if library is not None else load_library()
    call_checked(
        lib, "create_config_store", lib.create_config_store, store_url, detail=f"({store_url})",
        hint="is the address this host's and the port free?",
    )

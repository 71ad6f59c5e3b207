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
from rd2h.adapters.transport_base import BaseTransferEngine, Registrations
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
        self.registrations = Registrations()  # shared by every handle
        self.handles = 1


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
        if live is not None and not live.registrations.closed:
            live.handles += 1
            return live
        bound = _start(library, config)
        _configs[library] = config
        _live[library] = bound
        return bound


class MemFabricTransferEngine(BaseTransferEngine):
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

    Regions: the library registers by base address, so it sees each region once and
    disjoint; a region inside a registered one is only recorded. A batch is checked as a
    whole (local ranges too) before the library is called, which checks the remote
    ranges; a failed read may leave a partial copy.
    """

    engine_name = "MemFabric"
    registers_by_base = True

    def __init__(self, config: MemFabricConfig, library: MemFabricLibrary | None = None) -> None:
        if not isinstance(config, MemFabricConfig):
            raise TypeError(f"config must be a MemFabricConfig, got {type(config).__name__}")
        self._library = library if library is not None else load_library()
        self._bound = _acquire(self._library, config)
        super().__init__(self._bound.registrations)

    @property
    def session_id(self) -> str:
        """``"<host>:<rpc port>"``: how peers name this engine (after ``initialize``)."""
        return self._bound.session_id

    @property
    def config(self) -> MemFabricConfig:
        return self._bound.config

    def register_regions(self, addrs: list[int], sizes: list[int]) -> None:
        """Register several regions with one ``batch_register_memory`` call.

        Unequal list lengths, bad regions and overlaps are refused before the library is
        called; regions already registered (or inside one) are skipped.
        """
        with self._named():
            addrs, sizes = list(addrs), list(sizes)
            if len(addrs) != len(sizes):
                raise TransferError(
                    f"register_regions: {len(addrs)} addresses but {len(sizes)} sizes"
                )
            self._add_regions(zip(addrs, sizes))

    def close(self) -> None:
        """Release this handle. The last one unregisters every region and tears the
        library engine down (``destroy``, ``unInitialize``). Idempotent."""
        with _registry_lock:  # no other handle may be acquired on a closing engine
            super().close()

    # --- BaseTransferEngine's hooks ----------------------------------------------------

    def _register(self, regions: list[tuple[int, int]]) -> None:
        bound = self._bound
        if len(regions) == 1:
            [(addr, size)] = regions
            call_checked(
                bound.library, "register_memory", bound.engine.register_memory, addr, size,
                detail=f"([{addr:#x}, +{size}))",
            )
        else:
            call_checked(
                bound.library, "batch_register_memory", bound.engine.batch_register_memory,
                [a for a, _ in regions], [s for _, s in regions],
                detail=f"({len(regions)} regions)",
            )

    def _peer(self, session: str) -> str:
        try:
            parse_host_port(session, "MemFabric session")
        except ValueError as exc:
            raise TransferError(str(exc)) from None
        return session

    def _read(self, session: str, local: np.ndarray, remote: np.ndarray, lens: np.ndarray) -> None:
        """One ``batch_transfer_sync_read`` (the library checks the remote ranges)."""
        bound = self._bound
        call_checked(
            bound.library, "batch_transfer_sync_read", bound.engine.batch_transfer_sync_read,
            session, local.tolist(), remote.tolist(), lens.tolist(),
            detail=f"from {session} ({lens.size} descriptors, {int(lens.sum())} bytes)",
            hint=_READ_HINT,
        )

    def _unregister(self, addr: int) -> object:
        return self._bound.engine.unregister_memory(addr)

    def _last_handle(self) -> bool:
        self._bound.handles -= 1
        return self._bound.handles == 0

    def _close(self) -> list[str]:
        bound = self._bound
        failed = _teardown(bound.library, bound.engine)
        if _live.get(bound.library) is bound:
            del _live[bound.library]
        return failed


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

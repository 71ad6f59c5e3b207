"""Mooncake transfer engine: one-sided batched reads over TCP or RDMA (``mooncake.engine``).

Facts about the library this adapter relies on (``mooncake-transfer-engine`` 0.3.13.post1):

* The engine is started with ``initialize(host, metadata_server, protocol, device)``; with
  ``metadata_server="P2PHANDSHAKE"`` no metadata service is needed and a peer is named
  ``"<host>:<rpc port>"``.
* ``batch_transfer_sync_read`` takes Python lists of ints (numpy arrays are accepted too but
  converted element by element, which is slower than ``ndarray.tolist()``), releases the GIL
  and returns 0 or -1; the reason only goes to the library's log.
* TCP queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` transfers per peer (default
  1024, at most 65535), plus ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` waiting for a slot;
  beyond that a transfer is rejected ("queue-full") and the whole call fails. Batches are
  therefore cut into chunks of at most ``max_batch`` descriptors, read one after the other,
  and reads to one peer from this engine are serialised.
* When one descriptor of a call fails, the call returns at once while the others may still
  be in flight: the destination of a failed chunk may be written for a moment after
  ``batch_read`` raised.
* The peer's server refuses reads outside the memory it registered. Registrations must be
  disjoint (a region overlapping a registered one is refused by the library); a region
  inside one already registered is only recorded here.
* ``MC_*`` settings are read from the environment when an engine is initialised, except
  ``MC_LOG_LEVEL``, read once when ``mooncake.engine`` is first imported.
* The listening sockets (handshake RPC port and TCP data port) bind the wildcard address
  (``0.0.0.0`` and ``[::]``) whatever ``host`` is; no setting of this version changes that.
  ``host`` is only the address advertised to peers. Confine the ports with a firewall or a
  network namespace where that matters.
* There is no destroy call; dropping the last reference stops the engine and takes about a
  second.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rd2h.adapters.transport_base import BaseTransferEngine
from rd2h.domain.errors import TransferError, TransportLibraryError

PROTOCOLS = frozenset({"tcp", "rdma"})

TCP_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TCP_ADMISSIONS_ENV = "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"
TCP_QUEUE_DEFAULT = 1024
"""The library's per-peer TCP queue length when its variable is unset."""
TCP_QUEUE_LIMIT = 65535
"""The largest per-peer TCP queue length the library accepts."""

LOG_LEVEL_ENV = "MC_LOG_LEVEL"
DEFAULT_LOG_LEVEL = "WARNING"
"""Applied when neither ``env`` nor the environment sets ``MC_LOG_LEVEL`` (the library's
default, INFO, logs a dozen lines per engine)."""


@dataclass(frozen=True)
class _Config:
    host: str
    protocol: str
    device_name: str
    metadata_server: str
    env: tuple[tuple[str, str], ...]


# The library's engine is shared by the whole process: the first one initialised fixes the
# configuration, and it is kept for reuse after ``close()`` (stopping it costs a second).
_process_lock = threading.Lock()
_process_config: _Config | None = None
_process_engine: Any = None
_process_in_use = False


def _queue_setting(name: str, env: Mapping[str, str]) -> int:
    """The per-peer TCP queue setting the library will read (its default when unset)."""
    text = env.get(name, os.environ.get(name))
    if text is None:
        return TCP_QUEUE_DEFAULT
    if not text.isdigit() or not 1 <= int(text) <= TCP_QUEUE_LIMIT:
        raise ValueError(f"{name} must be an integer in [1, {TCP_QUEUE_LIMIT}], got {text!r}")
    return int(text)


def _check_arguments(
    host: str,
    protocol: str,
    device_name: str,
    metadata_server: str,
    env: Mapping[str, str],
    max_batch: int,
) -> None:
    if not isinstance(host, str) or not host or ":" in host or host != host.strip():
        raise ValueError(f"host must be an IPv4 address or host name, got {host!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {sorted(PROTOCOLS)}, got {protocol!r}")
    if not isinstance(device_name, str):
        raise ValueError(f"device_name must be a string, got {device_name!r}")
    if not isinstance(metadata_server, str) or not metadata_server:
        raise ValueError(f"metadata_server must be a non-empty string, got {metadata_server!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
            raise ValueError(f"env must map variable names to strings, got {key!r}: {value!r}")
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    if protocol == "tcp":
        queue = _queue_setting(TCP_QUEUE_ENV, env)
        _queue_setting(TCP_ADMISSIONS_ENV, env)
        if max_batch > queue:
            raise ValueError(
                f"max_batch {max_batch} exceeds the per-peer TCP queue ({TCP_QUEUE_ENV}="
                f"{queue}); raise {TCP_QUEUE_ENV} (at most {TCP_QUEUE_LIMIT}) in env"
            )


def _acquire_engine(config: _Config) -> Any:
    """Return the process's initialised library engine for ``config`` and mark it in use."""
    global _process_config, _process_engine, _process_in_use
    with _process_lock:
        if _process_in_use:
            raise TransferError(
                "a MooncakeTransferEngine is already open in this process; the library's "
                "engine is process-wide: share that instance, or close it first"
            )
        if _process_config is not None and _process_config != config:
            raise TransferError(
                "this process already initialised the Mooncake engine with a different "
                f"configuration ({_process_config}); requested {config}. Its settings are "
                "process-wide: use one configuration per process"
            )
        if _process_engine is None:
            _process_engine = _start_engine(config)
            _process_config = config
        _process_in_use = True
        return _process_engine


def _release_engine() -> None:
    global _process_in_use
    with _process_lock:
        _process_in_use = False


def _start_engine(config: _Config) -> Any:
    os.environ.update(dict(config.env))
    os.environ.setdefault(LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL)  # read when the module loads
    try:
        from mooncake.engine import TransferEngine as _LibraryEngine
    except ImportError as exc:
        raise TransferError(
            f"cannot import mooncake.engine ({exc}); install the 'mooncake' extra "
            "(mooncake-transfer-engine-non-cuda, or the CUDA build)"
        ) from exc
    engine = _LibraryEngine()
    try:
        rc = engine.initialize(
            config.host, config.metadata_server, config.protocol, config.device_name
        )
    except Exception as exc:
        raise TransferError(f"Mooncake initialize raised {exc!r}") from exc
    if rc != 0:
        hint = (
            "check that the RDMA device name exists (ibv_devices) and libibverbs finds it"
            if config.protocol == "rdma"
            else "check the host address and that a TCP port in the RPC range is free"
        )
        if config.metadata_server != "P2PHANDSHAKE":
            hint += f", and that the metadata server {config.metadata_server!r} is reachable"
        raise TransferError(
            f"Mooncake initialize(host={config.host!r}, protocol={config.protocol!r}, "
            f"device={config.device_name!r}) returned {rc}: {hint}; the library's log on "
            "stderr has the cause"
        )
    return engine


class MooncakeTransferEngine(BaseTransferEngine):
    """Transfer engine on the Mooncake transfer engine library.

    ``session_id`` is ``"<host>:<rpc port>"``. ``register_memory`` exposes a region to peers
    (and records it as a read destination: every descriptor's local range must lie inside a
    registered region). Registrations must be disjoint: a region inside a registered one is
    only recorded, one partly overlapping (or enclosing) it is refused. Remote ranges are
    checked by the peer, which refuses reads outside the memory it registered.

    One instance may be open per process at a time (the library's engine and its ``MC_*``
    settings are process-wide). The first instance fixes the configuration: a later one,
    after ``close()``, must use the same ``host``, ``protocol``, ``device_name``,
    ``metadata_server`` and ``env``, and reuses the same library engine and ports. Closing
    unregisters the memory; the library's engine (and its listening ports) stays up for
    reuse by the next instance, and with nothing registered peers can read nothing from it.

    ``env`` is written to ``os.environ`` before the library's engine starts, e.g.
    ``{"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}`` to allow ``max_batch`` up to
    65535. ``max_batch`` is the most descriptors handed to the library in one call; with
    TCP it may not exceed the per-peer queue length. ``MC_LOG_LEVEL`` defaults to WARNING.

    A failed read may leave a partial copy: chunks before the failing one are complete, the
    failing chunk may be partly copied (and written for a moment after the error).
    """

    engine_name = "Mooncake"
    registers_by_base = True

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        env: Mapping[str, str] | None = None,
        max_batch: int = 1024,
    ) -> None:
        env = dict(env or {})
        _check_arguments(host, protocol, device_name, metadata_server, env, max_batch)
        config = _Config(host, protocol, device_name, metadata_server, tuple(sorted(env.items())))
        self._engine = _acquire_engine(config)
        try:
            port = int(self._engine.get_rpc_port())
        except Exception as exc:
            _release_engine()
            raise TransferError(f"Mooncake get_rpc_port failed: {exc!r}") from exc
        super().__init__()
        self._session_id = f"{host}:{port}"
        self._max_batch = max_batch
        self._peer_locks: dict[str, threading.Lock] = {}

    @property
    def session_id(self) -> str:
        """``"<host>:<rpc port>"``: how peers name this engine."""
        return self._session_id

    # --- BaseTransferEngine's hooks ----------------------------------------------------

    def _register(self, regions: list[tuple[int, int]]) -> None:
        for addr, size in regions:  # one region: register_memory passes one at a time
            try:
                rc = self._engine.register_memory(addr, size)
            except Exception as exc:
                raise TransferError(f"Mooncake register_memory raised {exc!r}") from exc
            if rc != 0:
                raise TransportLibraryError(
                    f"Mooncake register_memory([{addr:#x}, +{size})) returned {rc}",
                    operation="register_memory", rc=rc,
                )

    def _peer(self, session: str) -> str:
        host, sep, port = session.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise TransferError(
                f"malformed Mooncake session {session!r}; expected '<host>:<port>'"
            )
        return session

    def _read(self, session: str, local: np.ndarray, remote: np.ndarray, lens: np.ndarray) -> None:
        """In chunks of at most ``max_batch`` descriptors, one after the other; reads to
        one peer from this engine are serialised."""
        n = lens.size
        local_list, remote_list, len_list = local.tolist(), remote.tolist(), lens.tolist()
        engine, step = self._engine, self._max_batch
        with self._peer_lock(session):
            for start in range(0, n, step):
                stop = min(start + step, n)
                if self.closed:
                    raise TransferError(
                        f"the engine was closed during batch_read (descriptors [0, {start}) "
                        f"of {n} were copied)"
                    )
                try:
                    rc = engine.batch_transfer_sync_read(
                        session,
                        local_list[start:stop],
                        remote_list[start:stop],
                        len_list[start:stop],
                    )
                except Exception as exc:
                    raise TransferError(
                        f"Mooncake batch_transfer_sync_read raised {exc!r}"
                    ) from exc
                if rc != 0:
                    raise TransportLibraryError(
                        f"Mooncake batch_transfer_sync_read returned {rc} for descriptors "
                        f"[{start}, {stop}) of {n} ({int(lens[start:stop].sum())} bytes): the "
                        "peer is gone or unreachable, or a remote range lies outside the "
                        "memory it registered (the library's log on stderr says which)",
                        operation="batch_transfer_sync_read", rc=rc,
                    )

    def _peer_lock(self, session: str) -> threading.Lock:
        with self._book.lock:
            lock = self._peer_locks.get(session)
            if lock is None:
                lock = self._peer_locks[session] = threading.Lock()
            return lock

    def _unregister(self, addr: int) -> object:
        return self._engine.unregister_memory(addr)

    def _close(self) -> list[str]:
        """Free the process slot; the library's engine stays up for the next instance."""
        _release_engine()
        return []

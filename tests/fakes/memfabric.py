"""A recording fake of ``memfabric_hybrid`` (1.3.0) that moves real bytes in one process.

``FakeMemFabricNetwork`` plays the wire: the config stores and the live sessions every
fake process can reach. ``network.process()`` is what one process gets from
``import memfabric_hybrid``: its ``TransferEngine``, ``TransDataOpType``,
``create_config_store``, ``get_last_err_msg`` and friends, and one transfer context per
process, as in the real library. Reads are ``ctypes.memmove`` by raw address, so two
fake "processes" in one Python process exchange real bytes.

It enforces the library's return-code behaviour. Observed on the real package (without
an Ascend driver), and checked against it in ``tests/integration/test_memfabric_real.py``:

* ``get_rpc_port()`` is 0 before a successful ``initialize``;
* ``initialize`` with a role other than 'Prefill'/'Decode' returns -1, explained only on
  stdout (not through the logger nor ``get_last_err_msg``);
* without a driver ``initialize`` returns -1, explained only through the log callback;
* ``register_memory`` before ``initialize`` returns 0 (recorded, used once initialised);
* ``batch_register_memory`` with unequal lists returns -1;
* ``batch_transfer_sync_read`` before ``initialize`` returns -1 and sets the last error
  "smem trans not initialized yet";
* ``create_config_store`` refuses a URL that is not ``tcp://<IPv4>:<port>`` (-2000, sets
  the last error) and a port already listening (-1); the same URL twice in one process
  returns 0;
* arguments of the wrong type raise ``TypeError`` (pybind), an int ``data_op_type`` too.

Assumed where a driver would be needed to observe it (documented, conservative):
``initialize`` with an unknown config store, a second ``initialize`` in one process, a read
from an unknown or closed session, or a local/peer range outside registered memory return
-1; registering a region that overlaps a registered one returns -1.

Every call is recorded in ``module.calls`` as ``Call(target, name, args, result)``.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import ipaddress
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ERROR, WARN = 3, 2
DRIVER_MISSING_LOG = (
    (WARN, "[HYBM hybm_gva_version.cpp:47 LoadValueFromFile] driver version path is not a "
           "valid real path:/usr/local/Ascend/driver/version.info"),
    (ERROR, "[HYBM hybm_gva_version.cpp:203 HalGvaPrecheck] Failed to determine driver version"),
    (ERROR, "[HYBM hybm_entry.cpp:97 hybm_init] the current version of ascend driver does not "
            "support mf!"),
    (ERROR, "[SMEM smem_trans.cpp:52 smem_trans_init] hybm core init failed: -1"),
)


class TransDataOpType(enum.Enum):
    """Like the pybind enum: its members are not ints, and ints are not members."""

    SDMA = 1
    HOST_RDMA = 2
    DEVICE_RDMA = 8
    DEVICE_URMA = 64
    DEVICE_UBOE = 128


@dataclass(frozen=True)
class Call:
    target: str
    name: str
    args: tuple[Any, ...]
    result: Any


def _int(value: Any, what: str) -> int:
    if isinstance(value, (bool, float)):
        raise TypeError(f"{what}: incompatible function arguments ({value!r} is not an int)")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: incompatible function arguments ({value!r})") from None


def _ints(values: Any, what: str) -> list[int]:
    is_sequence = isinstance(values, Sequence) or hasattr(values, "__array__")
    if isinstance(values, (str, bytes)) or not is_sequence:
        raise TypeError(f"{what}: incompatible function arguments (not a sequence of ints)")
    return [_int(v, what) for v in values]


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what}: incompatible function arguments ({value!r} is not a str)")
    return value


def _host_port(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        return None
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return None
    return host, int(port)


class _Regions:
    """Registered ``[addr, addr + size)`` regions, disjoint, sorted by start."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.sizes: dict[int, int] = {}

    def overlaps(self, addr: int, size: int) -> bool:
        i = bisect.bisect_right(self.starts, addr + size - 1)
        return i > 0 and self.starts[i - 1] + self.sizes[self.starts[i - 1]] > addr

    def add(self, addr: int, size: int) -> None:
        bisect.insort(self.starts, addr)
        self.sizes[addr] = size

    def remove(self, addr: int) -> bool:
        if addr not in self.sizes:
            return False
        del self.sizes[addr]
        self.starts.remove(addr)
        return True

    def covers(self, addr: int, size: int) -> bool:
        i = bisect.bisect_right(self.starts, addr)
        return i > 0 and addr + size <= self.starts[i - 1] + self.sizes[self.starts[i - 1]]


class FakeMemFabricNetwork:
    """What fake processes share: config stores, listening ports and live sessions."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stores: set[str] = set()
        self.listening: set[tuple[str, int]] = set()
        self.sessions: dict[str, FakeTransferEngine] = {}
        self._next_port = 41000
        self.processes: list[FakeMemFabricModule] = []
        # Whether something outside the fake listens on (host, port); tests that compare
        # the fake with the real library plug in a real bind check.
        self.port_in_use: Callable[[str, int], bool] = lambda host, port: False

    def process(self, *, driver: bool = True) -> FakeMemFabricModule:
        """A fresh ``memfabric_hybrid`` as one process sees it; ``driver=False`` behaves
        like a machine without the Ascend driver (``initialize`` fails)."""
        module = FakeMemFabricModule(self, driver=driver)
        self.processes.append(module)
        return module

    def allocate_port(self, host: str) -> int:
        with self.lock:
            while (host, self._next_port) in self.listening:
                self._next_port += 1
            port = self._next_port
            self._next_port += 1
            self.listening.add((host, port))
            return port


class FakeMemFabricModule:
    """One process's ``memfabric_hybrid``: records every call in ``calls``."""

    TransDataOpType = TransDataOpType

    def __init__(self, network: FakeMemFabricNetwork, *, driver: bool) -> None:
        self.network = network
        self.driver = driver
        self.calls: list[Call] = []
        self.stdout: list[str] = []  # what the real library prints instead of logging
        self.engines: list[FakeTransferEngine] = []
        self.context: FakeTransferEngine | None = None  # the process's initialised engine
        self._last_err = ""
        self._logger: Callable[[int, str], None] | None = None
        self._failures: dict[str, list[tuple[int, str, bool]]] = {}

    # --- test controls ---------------------------------------------------------------

    def fail_next(
        self, name: str, rc: int = -1, message: str = "injected failure", *, sticky: bool = True
    ) -> None:
        """Make the next call of method ``name`` return ``rc``, logging ``message`` as an
        error (and, if ``sticky``, setting it as the last error message)."""
        self._failures.setdefault(name, []).append((rc, message, sticky))

    def names(self, target: str | None = None) -> list[str]:
        """The recorded call names, optionally of one target ('module' or 'engine0'...)."""
        return [c.name for c in self.calls if target is None or c.target == target]

    # --- library surface ------------------------------------------------------------

    def TransferEngine(self) -> FakeTransferEngine:  # the library's name
        engine = FakeTransferEngine(self, f"engine{len(self.engines)}")
        self.engines.append(engine)
        self.calls.append(Call("module", "TransferEngine", (), engine))
        return engine

    def create_config_store(self, store_url: str) -> int:
        store_url = _str(store_url, "create_config_store")
        return self._record("module", "create_config_store", (store_url,),
                            lambda: self._create_store(store_url))

    def get_last_err_msg(self) -> str:
        self.calls.append(Call("module", "get_last_err_msg", (), self._last_err))
        return self._last_err

    def get_and_clear_last_err_msg(self) -> str:
        msg, self._last_err = self._last_err, ""
        self.calls.append(Call("module", "get_and_clear_last_err_msg", (), msg))
        return msg

    def set_extern_logger(self, log_fn: Callable[[int, str], None]) -> int:
        if not callable(log_fn):
            raise TypeError("set_extern_logger: incompatible function arguments")
        self._logger = log_fn
        self.calls.append(Call("module", "set_extern_logger", (log_fn,), 0))
        return 0

    def set_log_level(self, level: int) -> int:
        _int(level, "set_log_level")
        self.calls.append(Call("module", "set_log_level", (level,), 0))
        return 0

    # --- internals ------------------------------------------------------------------

    def _record(self, target: str, name: str, args: tuple[Any, ...], run: Callable[[], Any]) -> Any:
        injected = self._failures.get(name)
        if injected:
            rc, message, sticky = injected.pop(0)
            self.error(message, sticky=sticky)
            result: Any = rc
        else:
            result = run()
        self.calls.append(Call(target, name, args, result))
        return result

    def log(self, level: int, message: str) -> None:
        """A line of the library's own log: to the callback if one is set, else stdout."""
        if self._logger is not None:
            self._logger(level, message)
        else:
            self.stdout.append(message)

    def error(self, message: str, *, sticky: bool = True) -> None:
        """An SMEM-layer error: logged, and (``sticky``) kept as the last error message."""
        if sticky:
            self._last_err = message
        self.log(ERROR, f"[SMEM fake.cpp:1 Fake] {message}")

    def _create_store(self, url: str) -> int:
        shown = url if url.startswith("tcp://") else f"tcp://{url}"
        where = _host_port(shown[len("tcp://"):])
        if where is None:
            self.error(f"CreateParser failed, url: {shown}")
            return -2000
        if where[1] == 0:
            self.error(f"Invalid url, ip: {where[0]} port: 0 url: {url}", sticky=False)
            return -2000
        with self.network.lock:
            if url in self.network.stores:
                return 0
            if where in self.network.listening or self.network.port_in_use(*where):
                self.error(f"address in use for bind listen on {where[0]}:{where[1]}",
                           sticky=False)
                return -1
            self.network.stores.add(url)
            self.network.listening.add(where)
        return 0


class FakeTransferEngine:
    """``memfabric_hybrid.TransferEngine`` of one fake process (same method signatures)."""

    def __init__(self, module: FakeMemFabricModule, name: str) -> None:
        self._module = module
        self._name = name
        self.session = ""
        self.port = 0
        self.role = ""
        self.device_id = -1
        self.op_type: TransDataOpType | None = None
        self.initialized = False
        self.destroyed = False
        self.regions = _Regions()

    def _record(self, name: str, args: tuple[Any, ...], run: Callable[[], Any]) -> Any:
        return self._module._record(self._name, name, args, run)

    # --- the library's methods --------------------------------------------------------

    def initialize(
        self,
        store_url: str,
        session_id: str,
        role: str,
        device_id: int,
        data_op_type: TransDataOpType = TransDataOpType.SDMA,
        store_server_role: str = "Decode",
        nic: str = "",
    ) -> int:
        args = (
            _str(store_url, "initialize"), _str(session_id, "initialize"),
            _str(role, "initialize"), _int(device_id, "initialize"), data_op_type,
            _str(store_server_role, "initialize"), _str(nic, "initialize"),
        )
        if not isinstance(data_op_type, TransDataOpType):
            raise TypeError("initialize(): incompatible function arguments (data_op_type)")
        return self._record("initialize", args, lambda: self._initialize(*args))

    def get_rpc_port(self) -> int:
        if not self.initialized:
            self._module.log(WARN, "[ADAPTER pytransfer.cpp:178 GetRpcPort] get_rpc_port "
                                   "returns 0; call initialize() first")
        return self._record("get_rpc_port", (), lambda: self.port if self.initialized else 0)

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        args = (_int(buffer_addr, "register_memory"), _int(capacity, "register_memory"))
        return self._record("register_memory", args, lambda: self._register([args[0]], [args[1]]))

    def batch_register_memory(self, buffer_addrs: Sequence[int], capacities: Sequence[int]) -> int:
        args = (_ints(buffer_addrs, "batch_register_memory"),
                _ints(capacities, "batch_register_memory"))
        return self._record("batch_register_memory", args, lambda: self._register(*args))

    def unregister_memory(self, buffer_addr: int) -> int:
        addr = _int(buffer_addr, "unregister_memory")
        return self._record("unregister_memory", (addr,), lambda: self._unregister(addr))

    def batch_transfer_sync_read(
        self,
        dest_session: str,
        buffers: Sequence[int],
        peer_buffers: Sequence[int],
        lengths: Sequence[int],
        flags: int = 0,
    ) -> int:
        args = (
            _str(dest_session, "batch_transfer_sync_read"),
            _ints(buffers, "batch_transfer_sync_read"),
            _ints(peer_buffers, "batch_transfer_sync_read"),
            _ints(lengths, "batch_transfer_sync_read"),
            _int(flags, "batch_transfer_sync_read"),
        )
        return self._record("batch_transfer_sync_read", args, lambda: self._read(*args[:4]))

    def destroy(self) -> None:
        self._record("destroy", (), self._destroy)

    def unInitialize(self) -> None:  # the library's name
        self._record("unInitialize", (), self._uninitialize)

    # --- behaviour --------------------------------------------------------------------

    def _initialize(
        self, store_url: str, session_id: str, role: str, device_id: int,
        data_op_type: TransDataOpType, store_server_role: str, nic: str,
    ) -> int:
        module, network = self._module, self._module.network
        if role not in ("Prefill", "Decode") or store_server_role not in ("Prefill", "Decode"):
            module.stdout.append("The value of role is invalid. Expected 'Prefill' or 'Decode.")
            return -1
        if not module.driver:
            for level, line in DRIVER_MISSING_LOG:
                module.log(level, line)
            return -1
        if self.destroyed or self.initialized or module.context is not None:
            module.error("smem trans already initialized in this process")
            return -1
        where = _host_port(session_id)
        if where is None:
            module.error(f"invalid session id {session_id!r}")
            return -1
        with network.lock:
            if store_url not in network.stores:
                module.error(f"connect to config store {store_url} failed")
                return -1
            if device_id < 0:
                module.error(f"invalid device id {device_id}")
                return -1
            host, port = where
            if port == 0:
                port = network.allocate_port(host)
            elif (host, port) in network.listening:
                module.error(f"address in use: {session_id}")
                return -1
            else:
                network.listening.add((host, port))
            self.session, self.port = f"{host}:{port}", port
            self.role, self.device_id, self.op_type = role, device_id, data_op_type
            self.initialized = True
            module.context = self
            network.sessions[self.session] = self
        return 0

    def _register(self, addrs: list[int], sizes: list[int]) -> int:
        if len(addrs) != len(sizes):
            self._module.stdout.append("Size of buffer_addrs and capacities is not equal.")
            return -1
        staged = _Regions()
        for addr, size in zip(addrs, sizes):
            if addr <= 0 or size <= 0:
                self._module.error(f"invalid region addr={addr:#x} size={size}")
                return -1
            if self.regions.overlaps(addr, size) or staged.overlaps(addr, size):
                self._module.error(f"region addr={addr:#x} size={size} overlaps a registered one")
                return -1
            staged.add(addr, size)
        for addr, size in zip(addrs, sizes):
            self.regions.add(addr, size)
        return 0

    def _unregister(self, addr: int) -> int:
        if self.regions.remove(addr) or not self.initialized:
            return 0
        self._module.error(f"unregister: no region at {addr:#x}")
        return -1

    def _read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        module = self._module
        if not self.initialized:
            module.error("smem trans not initialized yet")
            return -1
        if not len(local) == len(remote) == len(lengths):
            module.error("buffers, peer_buffers and lengths differ in size")
            return -1
        with module.network.lock:
            peer = module.network.sessions.get(session)
        if peer is None or not peer.initialized:
            module.stdout.append(f"lazy smem_trans_create failed for session: {session}")
            module.error(f"connect to session {session} failed")
            return -1
        for i, (dst, src, n) in enumerate(zip(local, remote, lengths)):
            if n <= 0:
                module.error(f"descriptor {i}: invalid length {n}")
                return -1
            if not self.regions.covers(dst, n):
                module.error(f"descriptor {i}: local buffer {dst:#x}+{n} is not registered")
                return -1
            if not peer.regions.covers(src, n):
                module.error(f"descriptor {i}: peer buffer {src:#x}+{n} is not registered")
                return -1
        memmove = ctypes.memmove
        for dst, src, n in zip(local, remote, lengths):
            memmove(dst, src, n)
        return 0

    def _destroy(self) -> None:
        network = self._module.network
        with network.lock:
            if network.sessions.get(self.session) is self:
                del network.sessions[self.session]
            if self.session:
                network.listening.discard((self.session.rpartition(":")[0], self.port))
        self.destroyed = True

    def _uninitialize(self) -> None:
        if self._module.context is self:
            self._module.context = None
        self.initialized = False
        self.regions = _Regions()


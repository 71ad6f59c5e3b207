"""An in-memory control network implementing the control ports the way ZeroMQ does.

``MemoryNetwork.server(endpoint)`` binds a ``ControlServer`` (Decode's ROUTER);
``MemoryNetwork.clients()`` makes a ``ControlClients`` (Prefill's DEALERs). The
behaviour follows ``rd2h.adapters.zmq`` and is checked against it by one contract
suite (``tests/integration/test_control_contract.py``):

* a connection is made on the first send after ``connect``; each connection has its
  own identity on the server; a send with no server bound raises ``ConnectionError``
  (ZeroMQ's ``IMMEDIATE``: nothing is queued for an absent peer);
* empty frames never reach the other side (ZeroMQ delimiters);
* a server that closes is a loss for every client connected to it
  (``disconnected()``), reported after the replies that arrived before it; a client
  that disconnects is a loss for the server; after a loss the next send connects
  again (a new identity), like a DEALER reconnecting;
* ``wake`` interrupts a ``poll`` (clients) or a ``recv`` (server) from any thread;
  every wait takes a timeout; a ``poll`` also returns once a server binds an endpoint
  a send found none at (the send can go now, like a DEALER's ``POLLOUT``).

``ScriptedDecode`` serves endpoints of a network the way a test scripts it (ACK every
MF_META; answer, fail or hold each announcement): a Prefill sender against it talks to
servers like any other, through the network's own clients.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rd2h.domain.wire.protocol import MetaAck, MfMeta, ReadDone, ReadFailed, ReadReadyBatch
from rd2h.ports.codec import WireCodec

_WAKE = ("", b"")


@dataclass(eq=False)
class _Conn:
    identity: bytes
    clients: MemoryClients
    endpoint: str
    server: MemoryServer
    alive: bool = True


class MemoryNetwork:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._servers: dict[str, MemoryServer] = {}
        self._ids = itertools.count(1)
        self._clients: weakref.WeakSet[MemoryClients] = weakref.WeakSet()

    def server(self, endpoint: str) -> MemoryServer:
        with self._lock:
            if endpoint in self._servers:
                raise OSError(f"cannot bind {endpoint}: address already in use")
            server = MemoryServer(self, endpoint)
            self._servers[endpoint] = server
            for clients in list(self._clients):
                clients._bound(endpoint)
            return server

    def clients(self) -> MemoryClients:
        clients = MemoryClients(self)
        with self._lock:
            self._clients.add(clients)
        return clients

    @property
    def endpoints(self) -> set[str]:
        with self._lock:
            return set(self._servers)

    def _lookup(self, endpoint: str) -> MemoryServer | None:
        with self._lock:
            return self._servers.get(endpoint)

    def _identity(self) -> bytes:
        return b"mem-%d" % next(self._ids)

    def _unbind(self, server: MemoryServer) -> None:
        with self._lock:
            if self._servers.get(server.endpoint) is server:
                del self._servers[server.endpoint]


class MemoryServer:
    """Decode side (``rd2h.ports.control.ControlServer``)."""

    def __init__(self, net: MemoryNetwork, endpoint: str) -> None:
        self._net = net
        self._endpoint = endpoint
        self._inbox: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._conns: dict[bytes, _Conn] = {}
        self._lost: list[bytes] = []
        self._closed = False
        self._woken = False

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._net._lock:
                woken, self._woken = self._woken, False
                if self._lost or woken:
                    return None  # let the caller handle the loss (or look at the time)
            try:
                item = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if item is not None and item[1]:
                return item
            if time.monotonic() >= deadline:
                return None

    def recv_many(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        """What is queued (up to ``limit``), else ``recv``'s one, as the ZeroMQ server."""
        first = self.recv(timeout)
        if first is None:
            return []
        out = [first]
        while len(out) < limit and (item := self.recv(0.0)) is not None:
            out.append(item)
        return out

    def send(self, identity: bytes, payload: bytes) -> bool:
        with self._net._lock:
            conn = self._conns.get(identity)
            if conn is None or not conn.alive or self._closed:
                return False
            conn.clients._deliver(conn, payload)
            return True

    def disconnected(self) -> list[bytes]:
        with self._net._lock:
            lost, self._lost = list(dict.fromkeys(self._lost)), []
            return lost

    def wake(self) -> None:
        with self._net._lock:
            self._woken = True
        self._inbox.put(None)

    def shed(self) -> list[tuple[bytes, int, int]]:
        return []  # an in-memory peer cannot outrun the loop's queue: nothing is dropped

    def close(self) -> None:
        with self._net._lock:
            if self._closed:
                return
            self._closed = True
            self._net._unbind(self)
            for conn in self._conns.values():
                if conn.alive:
                    conn.alive = False
                    conn.clients._lose(conn)
            self._conns.clear()

    # -- called by clients, under the network lock
    def _accept(self, clients: MemoryClients) -> _Conn:
        conn = _Conn(self._net._identity(), clients, self._endpoint, self)
        self._conns[conn.identity] = conn
        return conn

    def _deliver(self, conn: _Conn, payload: bytes) -> None:
        self._inbox.put((conn.identity, payload))

    def _drop(self, conn: _Conn) -> None:
        conn.alive = False
        self._conns.pop(conn.identity, None)
        self._lost.append(conn.identity)
        self._inbox.put(None)  # a waiting ``recv`` returns to report the loss


class MemoryClients:
    """Prefill side (``rd2h.ports.control.ControlClients``)."""

    def __init__(self, net: MemoryNetwork) -> None:
        self._net = net
        self._conns: dict[str, _Conn | None] = {}  # connected endpoint -> live connection
        self._replies: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._lost: list[str] = []
        self._gone: set[str] = set()  # lost, not reconnected since
        self._blocked: set[str] = set()  # a send found no server there

    def connect(self, endpoint: str) -> None:
        with self._net._lock:
            self._conns.setdefault(endpoint, None)

    def disconnect(self, endpoint: str) -> None:
        with self._net._lock:
            conn = self._conns.pop(endpoint, None)
            if conn is not None and conn.alive:
                conn.server._drop(conn)
            self._lost = [ep for ep in self._lost if ep != endpoint]
            self._gone.discard(endpoint)

    def send(self, endpoint: str, payload: bytes, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._net._lock:
                if endpoint not in self._conns:
                    raise ConnectionError(f"not connected to {endpoint}")
                conn = self._conns[endpoint]
                if conn is None or not conn.alive:
                    server = self._net._lookup(endpoint)
                    conn = None if server is None else server._accept(self)
                    self._conns[endpoint] = conn
                if conn is not None:
                    if payload:
                        conn.server._deliver(conn, payload)
                    return
            if time.monotonic() >= deadline:
                with self._net._lock:
                    self._blocked.add(endpoint)
                raise ConnectionError(
                    f"decode endpoint {endpoint} is not reachable within {timeout:g} s"
                )
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))

    def poll(self, timeout: float) -> list[tuple[str, bytes]]:
        try:
            out = [self._replies.get(timeout=max(0.0, timeout))]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._replies.get_nowait())
            except queue.Empty:
                return [(ep, payload) for ep, payload in out if payload]

    def disconnected(self) -> list[str]:
        with self._net._lock:
            lost, self._lost = list(dict.fromkeys(self._lost)), []
            return lost

    def reconnected(self) -> list[str]:
        """Like ZeroMQ, which reconnects by itself: a lost endpoint is back once a server
        listens there again."""
        with self._net._lock:
            back = sorted(ep for ep in self._gone if self._net._lookup(ep) is not None)
            self._gone.difference_update(back)
            return back

    def wake(self) -> None:
        self._replies.put(_WAKE)

    def _bound(self, endpoint: str) -> None:
        """Under the network lock: a server now listens at ``endpoint``."""
        if endpoint in self._blocked and endpoint in self._conns:
            self._blocked.discard(endpoint)
            self.wake()

    def close(self) -> None:
        for endpoint in list(self._conns):
            self.disconnect(endpoint)

    # -- called by a server, under the network lock
    def _deliver(self, conn: _Conn, payload: bytes) -> None:
        if self._conns.get(conn.endpoint) is conn and payload:
            self._replies.put((conn.endpoint, payload))

    def _lose(self, conn: _Conn) -> None:
        if self._conns.get(conn.endpoint) is conn:
            self._conns[conn.endpoint] = None
            self._lost.append(conn.endpoint)
            self._gone.add(conn.endpoint)
            self._replies.put(_WAKE)


class ScriptedDecode:
    """Decode endpoints on a ``MemoryNetwork`` that answer by script instead of reading
    (each binds its endpoint and serves it on a thread): every MF_META gets its ACK;
    a READ_READY_BATCH gets, per endpoint (``mode``, else ``default``), READ_DONE
    (``done``), READ_FAILED (``fail``) or nothing until ``answer_held`` (``hold``).
    Records the endpoints MF_META came to (``metas``), every batch and every connection
    Prefill dropped (``disconnects``)."""

    def __init__(self, net: MemoryNetwork, endpoints: list[str], codec: WireCodec,
                 default: str = "done") -> None:
        self.codec = codec
        self.default = default
        self.mode: dict[str, str] = {}
        self.metas: list[str] = []
        self.batches: list[tuple[str, ReadReadyBatch]] = []
        self.held: list[tuple[str, bytes, ReadReadyBatch]] = []
        self.disconnects: list[str] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._servers = [net.server(ep) for ep in endpoints]
        self._threads = [threading.Thread(target=self._serve, args=(s,), daemon=True,
                                          name=f"scripted-decode {s.endpoint}")
                         for s in self._servers]
        for t in self._threads:
            t.start()

    def _serve(self, server: MemoryServer) -> None:
        while not self._stop.is_set():
            item = server.recv(1.0)
            lost = server.disconnected()
            if lost:
                with self._cond:
                    self.disconnects += [server.endpoint] * len(lost)
                    self._cond.notify_all()
            if item is not None:
                self._answer(server, *item)

    def _answer(self, server: MemoryServer, identity: bytes, payload: bytes) -> None:
        msg = self.codec.decode(payload)
        ep = server.endpoint
        with self._cond:
            if isinstance(msg, MfMeta):
                self.metas.append(ep)
                server.send(identity, self.codec.encode(MetaAck()))
            elif isinstance(msg, ReadReadyBatch):
                self.batches.append((ep, msg))
                mode = self.mode.get(ep, self.default)
                if mode == "hold":
                    self.held.append((ep, identity, msg))
                else:
                    server.send(identity, self.codec.encode(
                        ReadDone(msg.layer_idx, msg.seq) if mode == "done" else
                        ReadFailed(msg.layer_idx, "destination blocks do not fit", msg.seq)))
            self._cond.notify_all()

    def answer_held(self, error: str | None = None) -> None:
        """Answer every held batch: READ_DONE, or READ_FAILED with ``error``."""
        with self._cond:
            held, self.held = self.held, []
        servers = {s.endpoint: s for s in self._servers}
        for ep, identity, b in held:
            reply = (ReadDone(b.layer_idx, b.seq) if error is None
                     else ReadFailed(b.layer_idx, error, b.seq))
            servers[ep].send(identity, self.codec.encode(reply))

    def wait_for(self, what: Callable[[ScriptedDecode], Any], timeout: float = 5.0) -> Any:
        """Wait (bounded) until ``what(self)`` holds; its value."""
        with self._cond:
            got = self._cond.wait_for(lambda: what(self), timeout)
        assert got, f"scripted decode: condition not met within {timeout:g} s"
        return got

    def wait_batches(self, n: int, timeout: float = 5.0) -> list[tuple[str, ReadReadyBatch]]:
        self.wait_for(lambda d: len(d.batches) >= n, timeout)
        with self._cond:
            return list(self.batches)

    def close(self) -> None:
        self._stop.set()
        for s in self._servers:
            s.wake()
        for t in self._threads:
            t.join(5.0)
        for s in self._servers:
            s.close()

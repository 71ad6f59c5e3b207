"""pyzmq ROUTER/DEALER sockets with the framing of spec 4.

Prefill sends one frame holding the encoded tuple. The ROUTER sees
``[identity, payload]``, possibly with empty delimiter frames, which are
dropped. Decode replies ``[identity, b"", payload]``; Prefill drops empty
frames. Sockets are not thread-safe: each object is used by one thread.

Liveness: ZMTP heartbeats (``HEARTBEAT_IVL`` / ``HEARTBEAT_TIMEOUT`` /
``HEARTBEAT_TTL``) close a connection whose peer went silent, and a socket
monitor reports every closed connection (``EVENT_DISCONNECTED``). On Prefill
each DEALER has its own monitor, so a loss names the Decode endpoint. On Decode
the ROUTER's monitor names a file descriptor; each message's source descriptor
(``SRCFD``) maps it to the peer identity the receiver knows.

Security: with ``curve`` keys both sides run CURVE (encrypted, authenticated; see
``curve.py``); a CURVE server owns its context and ZAP handler. Without keys the
wire is plain ZMTP (NULL mechanism), as before.
"""

from __future__ import annotations

import contextlib
import os
import time

import zmq

from rd2h.adapters.zmq.curve import (
    CurveClientKeys,
    CurveServerKeys,
    ZapGate,
    apply_client_keys,
    apply_server_keys,
    require_curve,
    term_bounded,
)
from rd2h.adapters.zmq.sockets import (
    DEFAULT_RECV_HWM,
    check_hwm,
    close_monitor,
    monitor_events,
    non_empty,
    set_heartbeat,
    source_fd,
)
from rd2h.domain.errors import Rd2hError
from rd2h.domain.topology import tcp_endpoint

DEFAULT_HEARTBEAT_IVL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0


class BindError(Rd2hError):
    """The Decode control socket could not bind its port."""


class ZmqControlServer:
    """A bound ROUTER socket. Binding happens in the constructor so that a port
    clash is reported to the caller at once."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_frame_bytes: int = 64 * 1024 * 1024,
        heartbeat_ivl_s: float = DEFAULT_HEARTBEAT_IVL_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        context: zmq.Context | None = None,
        curve: CurveServerKeys | None = None,
        recv_hwm: int = DEFAULT_RECV_HWM,
    ) -> None:
        check_hwm(recv_hwm)
        if curve is not None:
            require_curve()
            if context is not None:
                raise ValueError("a CURVE server owns its zmq context: do not pass one")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise BindError(
                f"cannot bind decode control socket on {host!r}: port {port!r} is outside "
                "1..65535 (check kv_port, global_dp_rank and tp_size)"
            )
        self._endpoint = tcp_endpoint(host, port)
        self._gate: ZapGate | None = None
        self._own_ctx = curve is not None
        # Curve: a context of our own, so its ZAP handler governs this server only.
        self._ctx = zmq.Context() if self._own_ctx else context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        try:
            if curve is not None:
                self._gate = ZapGate(self._ctx, curve.allowed_raw())
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.setsockopt(zmq.RCVHWM, recv_hwm)
            set_heartbeat(self._sock, heartbeat_ivl_s, heartbeat_timeout_s)
            if curve is not None:
                apply_server_keys(self._sock, curve)
            if ":" in host:
                self._sock.setsockopt(zmq.IPV6, 1)
            try:
                self._sock.bind(self._endpoint)
            except zmq.ZMQError as exc:
                raise BindError(
                    f"cannot bind decode control socket {self._endpoint}: {exc}"
                ) from exc
        except BaseException:
            self._release()
            raise
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        # Self-pipe: wake() interrupts a recv from any thread (e.g. the receiver's stop).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._peer_of_fd: dict[int, bytes] = {}
        self._lost: list[bytes] = []

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _drain_monitor(self) -> set[int]:
        """Apply queued connection events in order; the descriptors that closed (and
        were not accepted again since). Known peers on them are queued as lost."""
        gone: set[int] = set()
        for event, fd in monitor_events(self._monitor):
            if event == zmq.EVENT_DISCONNECTED:
                gone.add(fd)
                identity = self._peer_of_fd.pop(fd, None)
                if identity is not None:
                    self._lost.append(identity)
            elif event == zmq.EVENT_ACCEPTED:
                gone.discard(fd)
                self._peer_of_fd.pop(fd, None)  # a reused descriptor: the mapping is stale
        return gone

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            self._drain_monitor()
            if self._lost:
                return None  # let the caller handle the loss at once
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(self._poller.poll(wait_ms))
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
                return None
            if self._sock not in events:
                if not events:
                    return None
                continue  # connection events only: apply them and keep waiting
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            # Events queued before this message (a closed or reused descriptor) first.
            gone = self._drain_monitor()
            if len(frames) < 2:
                continue
            identity = frames[0].bytes
            rest = non_empty([f.bytes for f in frames[1:]])
            fd = source_fd(frames[-1])
            if fd is not None:
                if fd in gone:  # sent just before its connection closed
                    self._lost.append(identity)
                else:
                    self._peer_of_fd[fd] = identity
            if not rest:
                continue
            # Exactly one payload frame is the contract; extra frames make it
            # malformed, which the decoder reports (we pass the joined bytes on).
            payload = rest[0] if len(rest) == 1 else b"".join(rest)
            return identity, payload

    def wake(self) -> None:
        """Make a concurrent or the next ``recv`` return None at once. Thread-safe."""
        with contextlib.suppress(OSError):  # already woken (pipe full) or closed
            os.write(self._wake_w, b"\0")

    def disconnected(self) -> list[bytes]:
        self._drain_monitor()  # also losses that happened since the last ``recv``
        lost, self._lost = list(dict.fromkeys(self._lost)), []
        return lost

    def send(self, identity: bytes, payload: bytes) -> bool:
        """Reply to ``identity``; False if it cannot be delivered (peer gone, queue full).
        The peer's own deadline covers an undelivered reply."""
        try:
            self._sock.send_multipart([identity, b"", payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _release(self) -> None:
        """Close the socket, then (curve) stop the ZAP handler and end the own context;
        every wait is bounded."""
        if self._sock is not None and not self._sock.closed:
            self._sock.close(0)
        stopped = True
        if self._gate is not None:
            stopped = self._gate.stop()
            self._gate = None
        if self._own_ctx and stopped and not self._ctx.closed:
            term_bounded(self._ctx)

    def close(self) -> None:
        if self._sock is not None and not self._sock.closed:
            close_monitor(self._sock, self._monitor)
        self._release()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1


class ZmqControlClients:
    """DEALER sockets, one per Decode endpoint, polled together."""

    def __init__(
        self,
        *,
        heartbeat_ivl_s: float = DEFAULT_HEARTBEAT_IVL_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        context: zmq.Context | None = None,
        curve: CurveClientKeys | None = None,
        recv_hwm: int = DEFAULT_RECV_HWM,
    ) -> None:
        self._recv_hwm = check_hwm(recv_hwm)
        if curve is not None:
            require_curve()
        self._curve = curve
        if heartbeat_ivl_s > 0 and heartbeat_timeout_s <= heartbeat_ivl_s:
            raise ValueError(f"heartbeat timeout {heartbeat_timeout_s:g} s must exceed the "
                             f"interval {heartbeat_ivl_s:g} s")
        self._ctx = context or zmq.Context.instance()
        self._heartbeat = (heartbeat_ivl_s, heartbeat_timeout_s)
        self._by_endpoint: dict[str, zmq.Socket] = {}
        self._by_socket: dict[zmq.Socket, str] = {}
        self._monitor_of: dict[zmq.Socket, zmq.Socket] = {}
        self._by_monitor: dict[zmq.Socket, str] = {}
        self._lost: list[str] = []
        self._back: list[str] = []  # reconnected after a reported loss
        self._gone: set[str] = set()  # reported lost, not connected since
        self._poller = zmq.Poller()
        # Self-pipe: wake() interrupts a poll from any thread (e.g. a new task queued).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def connect(self, endpoint: str) -> None:
        if endpoint in self._by_endpoint:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RCVHWM, self._recv_hwm)
        if self._curve is not None:
            apply_client_keys(sock, self._curve)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        set_heartbeat(sock, *self._heartbeat)
        # One monitor per DEALER: a closed connection names its endpoint, and so does
        # its next connection (Decode back behind the same address).
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        sock.connect(endpoint)
        self._by_endpoint[endpoint] = sock
        self._by_socket[sock] = endpoint
        self._monitor_of[sock] = monitor
        self._by_monitor[monitor] = endpoint
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def disconnect(self, endpoint: str) -> None:
        sock = self._by_endpoint.pop(endpoint, None)
        if sock is None:
            return
        self._by_socket.pop(sock, None)
        self._poller.unregister(sock)
        monitor = self._monitor_of.pop(sock)
        self._by_monitor.pop(monitor, None)
        self._poller.unregister(monitor)
        close_monitor(sock, monitor)
        sock.close(0)
        # A loss seen before must not fail work sent over a later connection.
        self._lost = [ep for ep in self._lost if ep != endpoint]
        self._back = [ep for ep in self._back if ep != endpoint]
        self._gone.discard(endpoint)

    def send(self, endpoint: str, payload: bytes, timeout: float = 5.0) -> None:
        """Queue one frame; waits at most ``timeout`` for the connection to exist."""
        sock = self._by_endpoint.get(endpoint)
        if sock is None:
            raise ConnectionError(f"not connected to {endpoint}")
        try:
            sock.send(payload, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        # IMMEDIATE: nothing is queued until the connection completes.
        if not sock.poll(max(0, int(timeout * 1000)), zmq.POLLOUT):
            raise ConnectionError(
                f"decode endpoint {endpoint} is not reachable within {timeout:g} s"
            )
        sock.send(payload, zmq.NOBLOCK)

    def wake(self) -> None:
        """Make a concurrent or the next ``poll`` return at once. Thread-safe."""
        with contextlib.suppress(OSError):  # already woken (pipe full) or closed
            os.write(self._wake_w, b"\0")

    def poll(self, timeout: float) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        events = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        # Losses first: a reply that arrived before its connection closed is already
        # queued on the DEALER, so reading the sockets afterwards returns it too.
        for monitor, endpoint in self._by_monitor.items():
            for ev, _ in monitor_events(monitor):
                self._note_event(endpoint, ev)
        for sock in self._by_socket:
            if sock not in events and not self._lost:
                continue
            endpoint = self._by_socket.get(sock)
            if endpoint is None:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for frame in non_empty(frames):
                    out.append((endpoint, frame))
        return out

    def _note_event(self, endpoint: str, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            if endpoint in self._gone:
                self._gone.discard(endpoint)
                self._back.append(endpoint)
        elif event == zmq.EVENT_DISCONNECTED:
            self._gone.add(endpoint)
            self._lost.append(endpoint)
            self._back = [ep for ep in self._back if ep != endpoint]

    def disconnected(self) -> list[str]:
        lost, self._lost = list(dict.fromkeys(self._lost)), []
        return lost

    def reconnected(self) -> list[str]:
        back, self._back = list(dict.fromkeys(self._back)), []
        return back

    def close(self) -> None:
        for endpoint in list(self._by_endpoint):
            self.disconnect(endpoint)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

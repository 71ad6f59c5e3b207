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

Backpressure never reaches libzmq: every socket's ``RCVHWM`` is 0 (no limit), so a
connection's engine never stops reading. libzmq 4.3.5 aborts the whole process when a
connection whose input it stopped (its queue to the application full) also errors:
a heartbeat timeout, or the peer closing it (``Assertion failed: !_io_error``,
``_input_stopped``; libzmq issues 3937, 4364, 4767, 4841). A Decode that was only slow
(stopped, or stuck in a long read) met exactly that. What a connection queues on
Decode is bounded by its sender instead: an rd2h Prefill has only its unanswered
announcements in flight, each ended by ``layer_ack_s``. ``recv_hwm`` is only what one
Prefill poll takes per connection (the server accepts it for the same settings).

Security: with ``curve`` keys both sides run CURVE (encrypted, authenticated; see
``curve.py``); a CURVE server owns its context and ZAP handler. Without keys the
wire is plain ZMTP (NULL mechanism), as before.
"""

from __future__ import annotations

import contextlib
import os
import time

import zmq

from rd2h.adapters.zmq.clients import ZmqControlClients
from rd2h.adapters.zmq.curve import (
    CurveServerKeys,
    ZapGate,
    apply_server_keys,
    require_curve,
    term_bounded,
)
from rd2h.adapters.zmq.sockets import (
    DEFAULT_HEARTBEAT_IVL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_RECV_HWM,
    MonitorReader,
    check_hwm,
    close_monitor,
    non_empty,
    set_heartbeat,
    source_fd,
)
from rd2h.domain.errors import Rd2hError
from rd2h.domain.planning.topology import tcp_endpoint

__all__ = ["BindError", "ZmqControlClients", "ZmqControlServer"]

_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
# pyzmq's compiled send: the Python layer above it only adds DRAFT routing_id/group
# handling and the zero-copy threshold (replies are far below it); once per frame.
_send = zmq.backend.Socket.send


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
            self._sock.setsockopt(zmq.RCVHWM, 0)  # see the module docstring
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
        self._events = MonitorReader(self._monitor)
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
        for event, fd in self._events.events():
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
            self._events.polled()  # the poll reads the monitor's ZMQ_EVENTS
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
            item = self._take()
            if item is not None:
                return item

    def recv_many(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        """Every message already queued, up to ``limit``, without waiting; if none is,
        ``recv(timeout)``'s one. Stops early at a lost connection (the caller applies
        losses before the next batch). Each message's connection events apply first,
        as in ``recv``."""
        out: list[tuple[bytes, bytes]] = []
        while len(out) < limit and not self._lost:
            item = self._take()
            if item is None:
                break
            out.append(item)
        if out or self._lost:
            return out
        item = self.recv(timeout)
        return [] if item is None else [item]

    def _take(self) -> tuple[bytes, bytes] | None:
        """The next queued message, without waiting; None when nothing is queued."""
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
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
            return identity, rest[0] if len(rest) == 1 else b"".join(rest)

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
        sock = self._sock
        try:  # the frames one by one, with plain int flags (no IntFlag arithmetic per frame)
            _send(sock, identity, _MORE_NOBLOCK)
            _send(sock, b"", _MORE_NOBLOCK)
            _send(sock, payload, _NOBLOCK)
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

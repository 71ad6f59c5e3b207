"""pyzmq ROUTER/DEALER sockets with the framing of spec 4.

Prefill sends one frame holding the encoded tuple. The ROUTER sees
``[identity, payload]``, possibly with empty delimiter frames, which are
dropped. Decode replies ``[identity, b"", payload]``; Prefill drops empty
frames. Sockets are not thread-safe: a client object is used by one thread; the
server's socket is shared by its loop and its drain thread under a lock.

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
(stopped, or stuck in a long read) met exactly that. So on Decode the bound is
ours: whenever the loop is away from the socket for 5 ms, a drain thread takes what
libzmq holds into an inbox bounded in bytes per peer and in all (``inbox.py``);
what is over the budget is dropped undecoded, and the peer's own deadline covers it
(an rd2h Prefill has only its unanswered announcements in flight, far below its share).
``recv_hwm`` is only what one Prefill poll takes per connection (the server accepts
it for the same settings).

Security: with ``curve`` keys both sides run CURVE (encrypted, authenticated; see
``curve.py``); a CURVE server owns its context and ZAP handler. Without keys the
wire is plain ZMTP (NULL mechanism), as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
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
from rd2h.adapters.zmq.inbox import Inbox
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
_DRAIN_PERIOD_S = 0.02  # how long the loop may be away before libzmq's input is drained
_DRAIN_IDLE_S = 1.0  # the drain thread's longest sleep while the loop reads (bounds it)
_DRAIN_CHUNK = 64  # messages drained per hold of the lock (a reply waits at most this)
_CATCH_UP = 256  # messages the loop moves from libzmq into the inbox per take, at most
_DRAIN_STOP_S = 2.0


class BindError(Rd2hError):
    """The Decode control socket could not bind its port."""


class ZmqControlServer:
    """A bound ROUTER socket. Binding happens in the constructor so that a port
    clash is reported to the caller at once.

    While the loop waits in ``recv`` it reads the socket itself, as fast as before. Once
    it has been away (handling a batch, reading KV) for ``_DRAIN_PERIOD_S``, a drain
    thread empties libzmq into a bounded ``Inbox`` (``max_queued_bytes_per_peer``,
    ``max_queued_bytes``; see ``inbox.py``), so a peer sending faster than the loop
    handles cannot grow the process; the loop takes the inbox first when it is back.
    """

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
        max_queued_bytes_per_peer: int | None = None,
        max_queued_bytes: int | None = None,
    ) -> None:
        check_hwm(recv_hwm)
        per_peer = (2 * max_frame_bytes if max_queued_bytes_per_peer is None
                    else max_queued_bytes_per_peer)
        total = 4 * per_peer if max_queued_bytes is None else max_queued_bytes
        if per_peer < Inbox.cost(b"", max_frame_bytes):
            raise ValueError(f"max_queued_bytes_per_peer ({per_peer}) must hold one frame of "
                             f"max_frame_bytes ({max_frame_bytes}) and its overhead")
        self._inbox = Inbox(per_peer, total)  # validates total >= per_peer
        self._max_frame = max_frame_bytes
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
        # Two threads use the socket, never at once (``_lock``): the loop, which reads it
        # itself while it waits in ``recv``, and the drain thread, which empties it into
        # the inbox while the loop is away (handling, reading KV) for ``_DRAIN_PERIOD_S``.
        self._lock = threading.Lock()
        self._reading = False  # the loop is in ``recv``: the socket's input is its own
        self._away_since = time.monotonic()
        self._caught_up_at = self._away_since  # the loop's last move into the inbox
        self._stopping = threading.Event()
        # Set while the loop is away (out of ``recv``): the drain thread sleeps without
        # waking while the loop reads the socket itself (an idle Decode: no wake-ups).
        self._away = threading.Event()
        self._away.set()
        self._drainer = threading.Thread(target=self._drain_loop, daemon=True,
                                         name=f"rd2h-zmq-drain-{port}")
        self._drainer.start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    # ------------------------------------------------------------ input
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

    def _take(self, budgeted: bool) -> tuple[bytes, bytes] | bool | None:
        """The next message out of libzmq, without waiting (under ``_lock``): None when
        nothing is queued, False when one was taken but is not for the loop (empty, or
        over the inbox's budget when ``budgeted``: dropped, never copied out)."""
        assert self._sock is not None
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        # Events queued before this message (a closed or reused descriptor) first.
        gone = self._drain_monitor()
        if len(frames) < 2:
            return False
        identity = frames[0].bytes
        fd = source_fd(frames[-1])
        if fd is not None:
            if fd in gone:  # sent just before its connection closed
                self._lost.append(identity)
            else:
                self._peer_of_fd[fd] = identity
        if budgeted:
            size = len(frames[1]) if len(frames) == 2 else sum(len(f) for f in frames[1:])
            if not size:
                return False
            if not self._inbox.admits(identity, size):
                self._inbox.drop(identity, size)
                return False
        rest = non_empty([f.bytes for f in frames[1:]])
        if not rest:
            return False
        # Exactly one payload frame is the contract; extra frames make it malformed,
        # which the decoder reports (we pass the joined bytes on).
        return identity, rest[0] if len(rest) == 1 else b"".join(rest)

    def _drain_some(self, most: int) -> bool:
        """Move up to ``most`` messages from libzmq into the inbox (under ``_lock``); True
        when libzmq had nothing more."""
        for _ in range(most):
            item = self._take(budgeted=True)
            if item is None:
                self._drain_monitor()
                return True
            if item is not False:  # ``_take`` asked the inbox: it admits it
                self._inbox.put(*item, admitted=True)  # type: ignore[misc]
        return False

    def _drain_loop(self) -> None:
        """While the loop is away, every ``_DRAIN_PERIOD_S``: when it has been away about
        that long, move what libzmq holds into the inbox (a chunk per hold of the lock, so
        the loop's replies interleave). While the loop reads, this thread sleeps."""
        try:
            while not self._stopping.is_set():
                if not self._away.wait(_DRAIN_IDLE_S):
                    continue  # the loop is in ``recv`` (bounded, to see ``_stopping``)
                if self._stopping.wait(_DRAIN_PERIOD_S):
                    break
                drained = False
                while not drained and not self._stopping.is_set():
                    with self._lock:
                        if self._reading or (time.monotonic() - self._away_since
                                             < _DRAIN_PERIOD_S / 2):
                            break
                        drained = self._drain_some(_DRAIN_CHUNK)
        except Exception:  # the socket closed under us: the loop sees it too
            return

    def _take_some(self, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` messages (and about a frame's worth of bytes); stops at a lost
        connection. With the inbox empty they come straight from libzmq. A loop that
        returns often but takes less than arrives would let libzmq grow, so at most every
        ``_DRAIN_PERIOD_S`` (like the drain thread while it is away) it first moves up to
        ``_CATCH_UP`` messages from libzmq into the inbox, whose budget bounds them."""
        box = self._inbox
        now = time.monotonic()
        if now - self._caught_up_at >= _DRAIN_PERIOD_S:
            self._caught_up_at = now
            self._drain_some(_CATCH_UP)
        if len(box):
            return box.take(limit, self._max_frame)
        out: list[tuple[bytes, bytes]] = []
        taken = 0
        while len(out) < limit and not self._lost and (not out or taken < self._max_frame):
            item = self._take(budgeted=False)
            if item is None:
                break
            if item is not False:
                out.append(item)  # type: ignore[arg-type]
                taken += len(item[1])  # type: ignore[index]
        return out

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        got = self._wait_take(timeout, 1)
        return got[0] if got else None

    def recv_many(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        """Every message already queued, up to ``limit`` (and about one frame's worth of
        bytes), without waiting; if none is, ``recv(timeout)``'s one. Stops early at a
        lost connection (the caller applies losses before the next batch). Each
        message's connection events apply first, as in ``recv``."""
        return self._wait_take(timeout, limit)

    def _wait_take(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            self._reading = True
            self._away.clear()
        try:
            while True:
                with self._lock:
                    self._drain_monitor()
                    out = [] if self._lost else self._take_some(limit)
                if out or self._lost:
                    return out  # losses first: the caller applies them at once
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
                self._events.polled()  # the poll reads the monitor's ZMQ_EVENTS
                events = dict(self._poller.poll(wait_ms))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):
                            pass
                    return []
                if not events:
                    return []
        finally:
            with self._lock:
                self._reading = False
                self._away_since = time.monotonic()
                self._away.set()

    def wake(self) -> None:
        """Make a concurrent or the next ``recv`` return None at once. Thread-safe."""
        with contextlib.suppress(OSError):  # already woken (pipe full) or closed
            os.write(self._wake_w, b"\0")

    def disconnected(self) -> list[bytes]:
        with self._lock:
            self._drain_monitor()  # also losses that happened since the last ``recv``
            lost, self._lost = list(dict.fromkeys(self._lost)), []
        return lost

    def shed(self) -> list[tuple[bytes, int, int]]:
        """``(identity, messages, bytes)`` dropped over the receive budget since the last
        call (never decoded: the peer's own deadline covers what it waits for)."""
        with self._lock:
            return [(s.identity, s.messages, s.nbytes) for s in self._inbox.shed()]

    def queue_figures(self) -> dict[str, int]:
        """Bytes held now and at most, messages and bytes dropped ever (benchmarks)."""
        with self._lock:
            box = self._inbox
            return {"held_bytes": box.nbytes, "peak_bytes": box.peak,
                    "dropped": box.dropped, "dropped_bytes": box.dropped_bytes,
                    "per_peer": box.per_peer, "total": box.total}

    def send(self, identity: bytes, payload: bytes) -> bool:
        """Reply to ``identity``; False if it cannot be delivered (peer gone, queue full).
        The peer's own deadline covers an undelivered reply."""
        sock = self._sock
        with self._lock:
            try:  # the frames one by one, with plain int flags (no IntFlag arithmetic)
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
        """Stop the drain thread (bounded), then close the monitor and the socket."""
        self._stopping.set()
        self._away.set()  # a drain thread asleep while the loop reads wakes now
        self._drainer.join(_DRAIN_STOP_S)
        with self._lock:
            if self._sock is not None and not self._sock.closed:
                close_monitor(self._sock, self._monitor)
            self._release()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

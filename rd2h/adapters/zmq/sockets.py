"""Socket-level helpers of the ZeroMQ control channel (``channel.py``): options,
frames and socket-monitor events."""

from __future__ import annotations

import contextlib
import select

import zmq
from zmq.utils.monitor import parse_monitor_message

DEFAULT_RECV_HWM = 64
DEFAULT_HEARTBEAT_IVL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0
"""A DEALER's TCP connect whose SYN goes unanswered (a link down, a host gone without a
reset) is given up after this and tried again (libzmq's ``RECONNECT_IVL``, 100 ms), so
a link that comes back is used within about this long, not at the kernel's next SYN
retransmission (back-off doubling up to about two minutes)."""


def check_hwm(recv_hwm: int) -> int:
    if isinstance(recv_hwm, bool) or not isinstance(recv_hwm, int) or recv_hwm < 1:
        raise ValueError(f"recv_hwm must be an integer >= 1, got {recv_hwm!r}")
    return recv_hwm


def non_empty(frames: list[bytes]) -> list[bytes]:
    return [f for f in frames if f]


def set_heartbeat(sock: zmq.Socket, ivl_s: float, timeout_s: float) -> None:
    """Ping every ``ivl_s``; drop the connection when nothing came back within
    ``timeout_s`` (and ask the peer to do the same: TTL). ``ivl_s`` 0 disables."""
    if ivl_s <= 0:
        return
    if timeout_s <= ivl_s:
        raise ValueError(f"heartbeat timeout {timeout_s:g} s must exceed the interval {ivl_s:g} s")
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(ivl_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(100, int(timeout_s * 1000))))


_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def monitor_events(monitor: zmq.Socket) -> list[tuple[int, int]]:
    """Every queued ``(event, value)`` of a monitor socket, without blocking.

    ``EVENTS`` says whether a message is queued (libzmq processes the socket's pending
    commands first, as a receive would), so the common case, nothing queued, costs one
    option read instead of a failed receive and its ``zmq.Again``."""
    out = []
    while monitor.get(_EVENTS) & _POLLIN:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:  # not expected after POLLIN; harmless if it happens
            return out
        event = parse_monitor_message(frames)
        out.append((int(event["event"]), int(event["value"])))
    return out


class MonitorReader:
    """``monitor_events`` of one monitor socket, without asking libzmq while nothing can
    have arrived.

    A socket's ``ZMQ_FD`` is edge-triggered (zmq_getsockopt(3)): once ``ZMQ_EVENTS`` has
    been read and showed nothing queued, the descriptor turns readable before anything
    new can be received. So after a look that found the monitor empty, a ``poll(0)`` of
    that descriptor (one cheap syscall, no libzmq call) tells whether another look is
    needed; a readable descriptor only means "look again" (it may be spurious).
    """

    def __init__(self, monitor: zmq.Socket) -> None:
        self.socket = monitor
        self._poll = select.poll()
        self._poll.register(monitor.get(zmq.FD), select.POLLIN)
        self._empty = False  # the last look drained it and nothing signalled since

    def polled(self) -> None:
        """Someone else asked libzmq about the monitor (``zmq.Poller`` reads ZMQ_EVENTS,
        which consumes the descriptor's signal): the next ``events`` looks for real."""
        self._empty = False

    def events(self) -> list[tuple[int, int]]:
        """Every queued ``(event, value)``, in order (``monitor_events``)."""
        if self._empty and not self._poll.poll(0):
            return []
        self._empty = False
        out = monitor_events(self.socket)
        self._empty = True  # ``monitor_events`` stops only when ZMQ_EVENTS shows nothing
        return out


def close_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(0)


def source_fd(frame: zmq.Frame) -> int | None:
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None

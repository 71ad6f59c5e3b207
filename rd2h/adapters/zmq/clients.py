"""Prefill's side of the ZeroMQ control channel: one DEALER per Decode endpoint, polled
together (framing, liveness and backpressure: ``rd2h.adapters.zmq.channel``)."""

from __future__ import annotations

import contextlib
import os

import zmq

from rd2h.adapters.zmq.curve import CurveClientKeys, apply_client_keys, require_curve
from rd2h.adapters.zmq.sockets import (
    CONNECT_TIMEOUT_S,
    DEFAULT_HEARTBEAT_IVL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_RECV_HWM,
    check_hwm,
    close_monitor,
    monitor_events,
    non_empty,
    set_heartbeat,
)


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
        sock.setsockopt(zmq.CONNECT_TIMEOUT, int(CONNECT_TIMEOUT_S * 1000))
        sock.setsockopt(zmq.RCVHWM, 0)  # see the module docstring; ``poll`` bounds a take
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
            self._poller.register(sock, zmq.POLLIN | zmq.POLLOUT)  # ``poll`` says when
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
        for sock, flags in events.items():
            if flags & zmq.POLLOUT and sock in self._by_socket:  # a refused send can go
                self._poller.register(sock, zmq.POLLIN)
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
            for _ in range(self._recv_hwm):  # the rest waits for the next poll
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

"""pyzmq ROUTER/DEALER sockets with the framing of spec 4.

Prefill sends one frame holding the encoded tuple. The ROUTER sees
``[identity, payload]``, possibly with empty delimiter frames, which are
dropped. Decode replies ``[identity, b"", payload]``; Prefill drops empty
frames. Sockets are not thread-safe: each object is used by one thread.
"""

from __future__ import annotations

import contextlib
import os

import zmq

from rd2h.domain.errors import Rd2hError


class BindError(Rd2hError):
    """The Decode control socket could not bind its port."""


def tcp_endpoint(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _non_empty(frames: list[bytes]) -> list[bytes]:
    return [f for f in frames if f]


class ZmqControlServer:
    """A bound ROUTER socket. Binding happens in the constructor so that a port
    clash is reported to the caller at once."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_frame_bytes: int = 64 * 1024 * 1024,
        context: zmq.Context | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._endpoint = tcp_endpoint(host, port)
        try:
            self._sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise BindError(f"cannot bind decode control socket {self._endpoint}: {exc}") from exc
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        while True:
            if not self._poller.poll(max(0, int(timeout * 1000))):
                return None
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) < 2:
                timeout = 0
                continue
            identity, rest = frames[0], _non_empty(frames[1:])
            if not rest:
                timeout = 0
                continue
            # Exactly one payload frame is the contract; extra frames make it
            # malformed, which the decoder reports (we pass the joined bytes on).
            payload = rest[0] if len(rest) == 1 else b"".join(rest)
            return identity, payload

    def send(self, identity: bytes, payload: bytes) -> bool:
        """Reply to ``identity``; False if it cannot be delivered (peer gone, queue full).
        The peer's own deadline covers an undelivered reply."""
        try:
            self._sock.send_multipart([identity, b"", payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(0)


class ZmqControlClients:
    """DEALER sockets, one per Decode endpoint, polled together."""

    def __init__(self, *, context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._by_endpoint: dict[str, zmq.Socket] = {}
        self._by_socket: dict[zmq.Socket, str] = {}
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
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        self._by_endpoint[endpoint] = sock
        self._by_socket[sock] = endpoint
        self._poller.register(sock, zmq.POLLIN)

    def disconnect(self, endpoint: str) -> None:
        sock = self._by_endpoint.pop(endpoint, None)
        if sock is None:
            return
        self._by_socket.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(0)

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
        for sock in list(events):
            if not isinstance(sock, zmq.Socket):
                continue
            endpoint = self._by_socket.get(sock)
            if endpoint is None:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for frame in _non_empty(frames):
                    out.append((endpoint, frame))
        return out

    def close(self) -> None:
        for endpoint in list(self._by_endpoint):
            self.disconnect(endpoint)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

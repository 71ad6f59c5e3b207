"""One contract suite over every implementation of the control ports: the ZeroMQ
adapter (real ROUTER / DEALER sockets on loopback) and the in-memory network the unit
tests use (``fakes.control``), so the fake stays honest."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fakes.control import MemoryNetwork
from fakes.net import HOST, free_port

from rd2h.adapters.zmq.channel import BindError, ZmqControlClients, ZmqControlServer

pytestmark = pytest.mark.integration

WAIT = 5.0


class ZmqNet:
    def server(self) -> ZmqControlServer:
        for _ in range(20):  # a free port can be taken between probing and binding
            try:
                return ZmqControlServer(HOST, free_port(), heartbeat_ivl_s=0.2,
                                        heartbeat_timeout_s=1.0)
            except BindError:
                continue
        raise RuntimeError("no free port")

    def server_at(self, endpoint: str) -> ZmqControlServer:
        return ZmqControlServer(HOST, int(endpoint.rsplit(":", 1)[1]), heartbeat_ivl_s=0.2,
                                heartbeat_timeout_s=1.0)

    def clients(self) -> ZmqControlClients:
        return ZmqControlClients(heartbeat_ivl_s=0.2, heartbeat_timeout_s=1.0)

    def unbound_endpoint(self) -> str:
        return f"tcp://{HOST}:{free_port()}"


class MemNet:
    def __init__(self) -> None:
        self.net = MemoryNetwork()
        self.n = 0

    def server(self) -> Any:
        self.n += 1
        return self.net.server(f"tcp://{HOST}:{40000 + self.n}")

    def server_at(self, endpoint: str) -> Any:
        return self.net.server(endpoint)

    def clients(self) -> Any:
        return self.net.clients()

    def unbound_endpoint(self) -> str:
        return f"tcp://{HOST}:1"


@pytest.fixture(params=["zmq", "memory"])
def net(request: pytest.FixtureRequest) -> Iterator[Any]:
    made: list[Any] = []
    factory = ZmqNet() if request.param == "zmq" else MemNet()

    class Tracking:
        def server(self) -> Any:
            made.append(factory.server())
            return made[-1]

        def server_at(self, endpoint: str) -> Any:
            made.append(factory.server_at(endpoint))
            return made[-1]

        def clients(self) -> Any:
            made.append(factory.clients())
            return made[-1]

        def unbound_endpoint(self) -> str:
            return factory.unbound_endpoint()

    yield Tracking()
    for thing in reversed(made):
        thing.close()


def recv(server: Any, timeout: float = WAIT) -> tuple[bytes, bytes]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = server.recv(0.05)
        if item is not None:
            return item
    raise AssertionError("the server received nothing")


def poll(clients: Any, count: int = 1, timeout: float = WAIT) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        out += clients.poll(0.05)
    return out


def connected(net: Any) -> tuple[Any, Any, bytes]:
    """A server, a client and the client's identity after one round trip."""
    server, clients = net.server(), net.clients()
    clients.connect(server.endpoint)
    clients.send(server.endpoint, b"hello", timeout=WAIT)
    identity, payload = recv(server)
    assert payload == b"hello"
    return server, clients, identity


def test_frames_go_both_ways_naming_both_ends(net: Any) -> None:
    server, clients, identity = connected(net)
    assert server.send(identity, b"reply") is True
    assert poll(clients) == [(server.endpoint, b"reply")]
    clients.send(server.endpoint, b"second", timeout=WAIT)
    assert recv(server) == (identity, b"second")  # one connection, one identity


def test_each_client_has_its_own_identity(net: Any) -> None:
    server = net.server()
    a, b = net.clients(), net.clients()
    for c, payload in ((a, b"a"), (b, b"b")):
        c.connect(server.endpoint)
        c.send(server.endpoint, payload, timeout=WAIT)
    got = dict((payload, ident) for ident, payload in (recv(server), recv(server)))
    assert set(got) == {b"a", b"b"} and got[b"a"] != got[b"b"]
    server.send(got[b"b"], b"to b")
    assert poll(b) == [(server.endpoint, b"to b")]
    assert a.poll(0.1) == []


def test_empty_frames_never_arrive(net: Any) -> None:
    server, clients, identity = connected(net)
    clients.send(server.endpoint, b"", timeout=WAIT)
    clients.send(server.endpoint, b"after", timeout=WAIT)
    assert recv(server) == (identity, b"after")
    server.send(identity, b"")
    server.send(identity, b"reply")
    assert poll(clients) == [(server.endpoint, b"reply")]


def test_sending_where_nothing_listens_fails_within_the_timeout(net: Any) -> None:
    clients = net.clients()
    with pytest.raises(ConnectionError, match="not connected"):
        clients.send(net.unbound_endpoint(), b"x", timeout=0.1)
    endpoint = net.unbound_endpoint()
    clients.connect(endpoint)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="not reachable"):
        clients.send(endpoint, b"x", timeout=0.2)
    assert time.monotonic() - t0 < 2.0


def test_a_poll_returns_once_a_refused_send_can_go(net: Any) -> None:
    """A send refused because nothing took the frame yet (no peer, ``timeout`` 0) makes
    ``poll`` return once it can go: the Prefill sender's outbox needs no retry timer."""
    clients = net.clients()
    endpoint = net.unbound_endpoint()
    clients.connect(endpoint)
    with pytest.raises(ConnectionError, match="not reachable"):
        clients.send(endpoint, b"x", timeout=0.0)
    threading.Timer(0.2, net.server_at, (endpoint,)).start()
    t0 = time.monotonic()
    while True:  # each poll ends on a transport event; the last one on the send's
        assert clients.poll(WAIT) == []
        assert time.monotonic() - t0 < WAIT / 2
        try:
            clients.send(endpoint, b"hello", timeout=0.0)
            break
        except ConnectionError:
            continue


def test_waits_end_at_their_timeout(net: Any) -> None:
    server, clients = net.server(), net.clients()
    t0 = time.monotonic()
    assert server.recv(0.1) is None
    assert clients.poll(0.1) == []  # no connection at all: still bounded
    assert time.monotonic() - t0 < 2.0


def test_wake_interrupts_a_poll(net: Any) -> None:
    clients = net.clients()
    timer = threading.Timer(0.1, clients.wake)
    timer.start()
    t0 = time.monotonic()
    assert clients.poll(WAIT) == []
    assert time.monotonic() - t0 < WAIT / 2
    timer.join()


def test_wake_interrupts_a_recv_and_a_later_one_still_receives(net: Any) -> None:
    server, clients, _ = connected(net)
    timer = threading.Timer(0.1, server.wake)
    timer.start()
    t0 = time.monotonic()
    assert server.recv(WAIT) is None
    assert time.monotonic() - t0 < WAIT / 2
    timer.join()
    clients.send(server.endpoint, b"after", timeout=WAIT)
    assert recv(server)[1] == b"after"


def test_a_reply_to_an_unknown_identity_is_not_delivered(net: Any) -> None:
    server, clients, _ = connected(net)
    assert server.send(b"nobody-by-this-name", b"x") is False
    assert clients.poll(0.1) == []


def test_a_closed_server_is_a_loss_for_its_clients(net: Any) -> None:
    server, clients, identity = connected(net)
    server.send(identity, b"last words")
    assert poll(clients) == [(server.endpoint, b"last words")]
    server.close()
    lost: list[str] = []
    deadline = time.monotonic() + WAIT
    while not lost and time.monotonic() < deadline:
        assert clients.poll(0.05) == []
        lost += clients.disconnected()
    assert lost == [server.endpoint]
    assert clients.disconnected() == []  # reported once


def test_a_client_that_disconnects_is_a_loss_for_the_server(net: Any) -> None:
    server, clients, identity = connected(net)
    clients.disconnect(server.endpoint)
    lost: list[bytes] = []
    deadline = time.monotonic() + WAIT
    while not lost and time.monotonic() < deadline:
        server.recv(0.05)
        lost += server.disconnected()
    assert lost == [identity]
    assert server.send(identity, b"too late") is False or server.disconnected() == []


def test_a_new_connection_after_a_loss_has_a_new_identity(net: Any) -> None:
    server, clients, identity = connected(net)
    clients.disconnect(server.endpoint)
    lost: list[bytes] = []
    deadline = time.monotonic() + WAIT
    while not lost and time.monotonic() < deadline:
        assert server.recv(0.05) is None  # a pending loss is reported before anything
        lost += server.disconnected()
    clients.connect(server.endpoint)
    deadline = time.monotonic() + WAIT
    while True:
        try:
            clients.send(server.endpoint, b"again", timeout=0.2)
            break
        except ConnectionError:
            assert time.monotonic() < deadline
    new_identity, payload = recv(server)
    assert payload == b"again" and new_identity != identity

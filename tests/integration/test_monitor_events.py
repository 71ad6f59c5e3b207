"""The socket monitor's fast path: ``monitor_events`` looks at ``EVENTS`` before it
receives, so an idle check raises nothing; queued events and lost connections are still
all reported, in order."""

from __future__ import annotations

import time

import pytest
import zmq
from fakes.net import free_port

from rd2h.adapters.zmq.channel import ZmqControlClients, ZmqControlServer
from rd2h.adapters.zmq.sockets import MonitorReader, monitor_events

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
WAIT = 10.0


class _CountingMonitor:
    """A monitor socket that counts receive attempts."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self.recvs = 0

    def get(self, option: int) -> int:
        return self._sock.get(option)

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        self.recvs += 1
        return self._sock.recv_multipart(flags)


def test_an_idle_monitor_is_checked_without_a_failed_receive() -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    try:
        spy = _CountingMonitor(monitor)
        for _ in range(3):
            assert monitor_events(spy) == []  # type: ignore[arg-type]
        assert spy.recvs == 0
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def test_queued_events_are_all_returned_in_order() -> None:
    ctx = zmq.Context.instance()
    port = free_port()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://{HOST}:{port}")
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    dealers = []
    try:
        for _ in range(2):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://{HOST}:{port}")
            d.send(b"x")
            dealers.append(d)
        for _ in range(2):
            assert sock.poll(int(WAIT * 1000))
            sock.recv_multipart()
        for d in dealers:
            d.close(0)
        events: list[tuple[int, int]] = []
        deadline = time.monotonic() + WAIT
        while len(events) < 4 and time.monotonic() < deadline:
            events += monitor_events(monitor)
            time.sleep(0.01)
        kinds = [e for e, _ in events]
        assert sorted(kinds) == sorted([zmq.EVENT_ACCEPTED] * 2 + [zmq.EVENT_DISCONNECTED] * 2)
        for fd in {v for _, v in events}:  # per descriptor: accepted, then closed
            assert [e for e, v in events if v == fd] == [zmq.EVENT_ACCEPTED,
                                                        zmq.EVENT_DISCONNECTED]
        assert monitor_events(monitor) == []
    finally:
        for d in dealers:
            d.close(0)
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def test_a_lost_connection_is_still_reported_by_disconnected() -> None:
    port = free_port()
    server = ZmqControlServer(HOST, port)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://{HOST}:{port}")
        dealer.send(b"hello")
        item = server.recv(WAIT)
        assert item is not None and item[1] == b"hello"
        assert server.disconnected() == []
        dealer.close(0)
        lost: list[bytes] = []
        deadline = time.monotonic() + WAIT
        while not lost and time.monotonic() < deadline:
            lost = server.disconnected()  # polled only here, never through recv
            time.sleep(0.01)
        assert lost == [item[0]]
        assert server.disconnected() == []
    finally:
        dealer.close(0)
        server.close()


def test_clients_still_see_a_server_that_went_away() -> None:
    port = free_port()
    server = ZmqControlServer(HOST, port)
    clients = ZmqControlClients()
    endpoint = f"tcp://{HOST}:{port}"
    try:
        clients.connect(endpoint)
        clients.send(endpoint, b"hello", timeout=WAIT)
        assert server.recv(WAIT) is not None
        server.close()
        lost: list[str] = []
        deadline = time.monotonic() + WAIT
        while not lost and time.monotonic() < deadline:
            clients.poll(0.05)
            lost = clients.disconnected()
        assert lost == [endpoint]
    finally:
        clients.close()
        server.close()


class _CountingEvents(_CountingMonitor):
    """A monitor socket that also counts its ``ZMQ_EVENTS`` look-ups."""

    def __init__(self, sock: zmq.Socket) -> None:
        super().__init__(sock)
        self.looks = 0

    def get(self, option: int) -> int:
        self.looks += option == zmq.EVENTS
        return self._sock.get(option)


def _until(pred, what: str):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {WAIT} s")


def test_monitor_reader_asks_libzmq_only_after_its_descriptor_signalled() -> None:
    """Idle looks cost no ZMQ_EVENTS; a connection and its loss are each still seen, in
    order, by ``events`` alone; after someone else's poll of the monitor (which consumes
    the descriptor's signal) ``polled`` makes the next look a real one."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    raw = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    monitor = _CountingEvents(raw)
    reader = MonitorReader(monitor)  # type: ignore[arg-type]
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert reader.events() == []
        looks = monitor.looks
        for _ in range(100):
            assert reader.events() == []
        assert monitor.looks == looks  # nothing signalled: libzmq never asked
        dealer.connect(f"tcp://{HOST}:{port}")
        (accepted,) = _until(reader.events, "EVENT_ACCEPTED")
        assert accepted[0] == zmq.EVENT_ACCEPTED
        dealer.close(0)
        (lost,) = _until(reader.events, "EVENT_DISCONNECTED")
        assert lost == (zmq.EVENT_DISCONNECTED, accepted[1])
        # Another connection's event, first seen by a zmq poll of the monitor.
        again = ctx.socket(zmq.DEALER)
        again.setsockopt(zmq.LINGER, 0)
        again.connect(f"tcp://{HOST}:{port}")
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        assert _until(lambda: poller.poll(10), "a readable monitor")
        reader.polled()
        (event,) = reader.events()
        assert event[0] == zmq.EVENT_ACCEPTED
        again.close(0)
    finally:
        dealer.close(0)
        raw.close(0)
        sock.close(0)

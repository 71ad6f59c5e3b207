"""CURVE on the control channel, over real ZeroMQ sockets on loopback.

A CURVE Decode server talks to the Prefill keys it lists, and to nothing else: an
unlisted key, a plain client, or a CURVE client of a plain server never delivers a
byte, and nothing crashes. The bytes on the wire are encrypted (a relay on loopback
keeps a copy of them). Every wait is short and bounded.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from fakes.net import HOST, free_port

from rd2h.adapters.zmq import (
    BindError,
    CurveClientKeys,
    CurveServerKeys,
    ZmqControlClients,
    ZmqControlServer,
    curve_available,
    generate_keypair,
    public_key_of,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not curve_available(), reason="libzmq without CURVE"),
]

WAIT = 3.0  # for what must arrive
QUIET = 1.5  # for what must not
PAYLOAD = b"rd2h-plain-payload-" * 8
HB = {"heartbeat_ivl_s": 0.2, "heartbeat_timeout_s": 1.0}


@pytest.fixture
def made() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


@pytest.fixture(scope="module")
def keys() -> dict[str, tuple[str, str]]:
    """Named ``(public, secret)`` pairs: the server, an allowed and a stranger client."""
    return {name: generate_keypair() for name in ("server", "client", "stranger")}


def make_server(made: list[Any], port: int | None = None, **kw: Any) -> ZmqControlServer:
    for _ in range(20):  # a free port can be taken between probing and binding
        try:
            server = ZmqControlServer(HOST, port or free_port(), **HB, **kw)
        except BindError:
            if port is not None:
                raise
            continue
        made.append(server)
        return server
    raise RuntimeError("no free port")


def make_clients(made: list[Any], **kw: Any) -> ZmqControlClients:
    clients = ZmqControlClients(**HB, **kw)
    made.append(clients)
    return clients


def server_keys(keys: dict[str, tuple[str, str]], *allowed: str) -> CurveServerKeys:
    return CurveServerKeys(keys["server"][1], tuple(keys[a][0] for a in allowed))


def client_keys(keys: dict[str, tuple[str, str]], who: str) -> CurveClientKeys:
    return CurveClientKeys(keys[who][1], keys["server"][0])


def try_send(clients: ZmqControlClients, endpoint: str, payload: bytes,
             timeout: float = 0.5) -> bool:
    """True if queued; a refused handshake never lets the DEALER queue anything."""
    clients.connect(endpoint)
    try:
        clients.send(endpoint, payload, timeout=timeout)
    except ConnectionError:
        return False
    return True


def recv_within(server: ZmqControlServer, timeout: float) -> tuple[bytes, bytes] | None:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        got = server.recv(min(left, 0.1))
        if got is not None:
            return got
    return None


def reply_within(clients: ZmqControlClients, timeout: float) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        got = clients.poll(min(left, 0.1))
        if got:
            return got
    return []


def round_trip(server: ZmqControlServer, clients: ZmqControlClients, endpoint: str,
               payload: bytes = PAYLOAD) -> None:
    assert try_send(clients, endpoint, payload, timeout=WAIT)
    got = recv_within(server, WAIT)
    assert got is not None and got[1] == payload
    assert server.send(got[0], payload[::-1])
    assert reply_within(clients, WAIT) == [(endpoint, payload[::-1])]


def assert_refused(server: ZmqControlServer, clients: ZmqControlClients,
                   endpoint: str) -> None:
    try_send(clients, endpoint, b"let me in")
    assert recv_within(server, QUIET) is None


# --- admission ---------------------------------------------------------------------


def test_allowed_client_round_trip_both_ways(made: list[Any], keys: Any) -> None:
    server = make_server(made, curve=server_keys(keys, "client"))
    clients = make_clients(made, curve=client_keys(keys, "client"))
    round_trip(server, clients, server.endpoint)
    round_trip(server, clients, server.endpoint, b"again")


def test_unlisted_key_is_refused_and_the_server_keeps_serving(made: list[Any],
                                                              keys: Any) -> None:
    server = make_server(made, curve=server_keys(keys, "client"))
    stranger = make_clients(made, curve=client_keys(keys, "stranger"))
    assert_refused(server, stranger, server.endpoint)
    round_trip(server, make_clients(made, curve=client_keys(keys, "client")),
               server.endpoint)
    assert recv_within(server, 0.3) is None  # still nothing from the stranger


def test_client_that_trusts_another_server_key_is_refused(made: list[Any],
                                                          keys: Any) -> None:
    server = make_server(made, curve=server_keys(keys, "client"))
    wrong = CurveClientKeys(keys["client"][1], keys["stranger"][0])
    assert_refused(server, make_clients(made, curve=wrong), server.endpoint)


def test_plain_client_gets_nothing_through_a_curve_server(made: list[Any],
                                                         keys: Any) -> None:
    server = make_server(made, curve=server_keys(keys, "client"))
    assert_refused(server, make_clients(made), server.endpoint)


def test_curve_client_gets_nothing_through_a_plain_server(made: list[Any],
                                                         keys: Any) -> None:
    server = make_server(made)
    assert_refused(server, make_clients(made, curve=client_keys(keys, "client")),
                   server.endpoint)
    round_trip(server, make_clients(made), server.endpoint)  # plain still works


def test_curve_servers_side_by_side_each_admit_their_own(made: list[Any],
                                                        keys: Any) -> None:
    one = make_server(made, curve=server_keys(keys, "client"))
    two = make_server(made, curve=server_keys(keys, "stranger"))
    round_trip(one, make_clients(made, curve=client_keys(keys, "client")), one.endpoint)
    round_trip(two, make_clients(made, curve=client_keys(keys, "stranger")), two.endpoint)
    assert_refused(two, make_clients(made, curve=client_keys(keys, "client")),
                   two.endpoint)


def test_no_zap_handler_on_the_shared_context(made: list[Any], keys: Any) -> None:
    make_server(made, curve=server_keys(keys, "client"))
    with pytest.raises(ValueError, match="owns its zmq context"):
        ZmqControlServer(HOST, free_port(), context=zmq.Context.instance(),
                         curve=server_keys(keys, "client"))
    zap = zmq.Context.instance().socket(zmq.REP)
    try:
        zap.bind("inproc://zeromq.zap.01")  # free: the server did not take it
    finally:
        zap.close(0)


# --- the wire ----------------------------------------------------------------------


class Tap:
    """A loopback TCP relay to ``upstream`` that keeps a copy of every byte."""

    def __init__(self, upstream: int) -> None:
        self._upstream = upstream
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.05)
        self.endpoint = f"tcp://{HOST}:{self._listener.getsockname()[1]}"
        self._seen = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = [self._listener]
        self._threads = [self._start(self._accept)]

    def _start(self, target: Callable[..., None], *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        return t

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection((HOST, self._upstream), timeout=1.0)
            except (TimeoutError, OSError):
                continue
            self._socks += [down, up]
            self._threads += [self._start(self._pump, down, up),
                              self._start(self._pump, up, down)]

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            with self._lock:
                self._seen += data
            try:
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def seen(self) -> bytes:
        with self._lock:
            return bytes(self._seen)

    def close(self) -> None:
        self._stop.set()
        for t in list(self._threads):
            t.join(2.0)
        for s in self._socks:
            s.close()


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "curve"])
def test_payload_bytes_are_encrypted_on_the_wire(made: list[Any], keys: Any,
                                                 secure: bool) -> None:
    server = make_server(made, curve=server_keys(keys, "client") if secure else None)
    tap = Tap(int(server.endpoint.rsplit(":", 1)[1]))
    made.append(tap)
    clients = make_clients(made, curve=client_keys(keys, "client") if secure else None)
    round_trip(server, clients, tap.endpoint)
    wire = tap.seen()
    assert len(wire) > len(PAYLOAD)
    # The plain run shows the relay sees payloads at all; with CURVE neither the
    # request nor the reply is readable.
    assert (PAYLOAD in wire) is not secure
    assert (PAYLOAD[::-1] in wire) is not secure


# --- options -----------------------------------------------------------------------


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "curve"])
def test_libzmq_never_stops_reading_a_connection(made: list[Any], keys: Any,
                                                 secure: bool) -> None:
    """RCVHWM 0 on every socket: libzmq aborts the process when a connection whose input
    it stopped errors (see the channel's docstring); ``recv_hwm`` is what one Prefill poll
    takes per connection."""
    server = make_server(made, recv_hwm=7,
                         curve=server_keys(keys, "client") if secure else None)
    clients = make_clients(made, recv_hwm=5,
                           curve=client_keys(keys, "client") if secure else None)
    clients.connect(server.endpoint)
    assert server._sock.getsockopt(zmq.RCVHWM) == 0
    assert clients._by_endpoint[server.endpoint].getsockopt(zmq.RCVHWM) == 0
    assert clients._recv_hwm == 5 and make_clients(made)._recv_hwm == 64


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "64", None])
def test_invalid_recv_hwm_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="recv_hwm"):
        ZmqControlServer(HOST, free_port(), recv_hwm=bad)
    with pytest.raises(ValueError, match="recv_hwm"):
        ZmqControlClients(recv_hwm=bad)


# --- keys --------------------------------------------------------------------------


def test_generated_pairs_match() -> None:
    public, secret = generate_keypair()
    assert len(public) == len(secret) == 40 and public != secret
    assert public_key_of(secret) == public
    assert CurveClientKeys(secret, public).public_key == public


def _bad_secrets() -> list[str]:
    _, good = generate_keypair()
    return [good[:-1], good + "0", "~" + good[1:], " " + good[1:], good[:35] + "%%%%%",
            "é" * 40, ""]


@pytest.mark.parametrize("bad", _bad_secrets(), ids=lambda s: f"len{len(s)}")
def test_bad_secret_key_text_is_refused_without_echo(bad: str, keys: Any) -> None:
    server_public, client_public = keys["server"][0], keys["client"][0]
    attempts: list[Callable[[], object]] = [
        lambda: CurveServerKeys(bad, (client_public,)),
        lambda: CurveClientKeys(bad, server_public),
        lambda: public_key_of(bad),
    ]
    for attempt in attempts:
        with pytest.raises(ValueError, match="secret key must be 40 Z85") as err:
            attempt()
        if bad:
            assert bad not in str(err.value)
            assert bad[:20] not in str(err.value) and bad[-20:] not in str(err.value)


def test_bad_public_keys_and_lists_are_refused(keys: Any) -> None:
    secret = keys["server"][1]
    with pytest.raises(ValueError, match="server public key"):
        CurveClientKeys(secret, "short")
    with pytest.raises(ValueError, match="allowed client public key #1"):
        CurveServerKeys(secret, (keys["client"][0], "x" * 39))
    with pytest.raises(ValueError, match="at least one"):
        CurveServerKeys(secret, ())
    with pytest.raises(ValueError, match="sequence"):
        CurveServerKeys(secret, keys["client"][0])  # type: ignore[arg-type]
    listed = CurveServerKeys(secret, [keys["client"][0]])  # type: ignore[arg-type]
    assert listed.allowed_client_keys == (keys["client"][0],)


def test_repr_never_shows_a_secret(keys: Any) -> None:
    server = server_keys(keys, "client")
    client = client_keys(keys, "client")
    assert keys["server"][1] not in repr(server)
    assert keys["client"][1] not in repr(client)


# --- lifecycle ---------------------------------------------------------------------


def test_curve_server_closes_promptly_and_frees_its_port(made: list[Any],
                                                        keys: Any) -> None:
    server = make_server(made, curve=server_keys(keys, "client"))
    clients = make_clients(made, curve=client_keys(keys, "client"))
    round_trip(server, clients, server.endpoint)
    port = int(server.endpoint.rsplit(":", 1)[1])
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 3.0
    server.close()  # twice is harmless
    again = make_server(made, port=port, curve=server_keys(keys, "client"))
    round_trip(again, make_clients(made, curve=client_keys(keys, "client")), again.endpoint)
    again.close()
    make_server(made, port=port).close()  # and plain, too


def test_curve_server_that_cannot_bind_leaves_nothing_behind(made: list[Any],
                                                            keys: Any) -> None:
    first = make_server(made, curve=server_keys(keys, "client"))
    port = int(first.endpoint.rsplit(":", 1)[1])
    threads = threading.active_count()
    for _ in range(3):
        with pytest.raises(BindError):
            ZmqControlServer(HOST, port, curve=server_keys(keys, "client"))
    assert threading.active_count() <= threads  # no ZAP thread left running

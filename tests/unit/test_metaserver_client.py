"""Metaserver client (spec 3.1 item 4) over httpx.MockTransport: no sockets.

Waits are on events and ``drain`` with deadlines; retry delays are shortened.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from rd2h.adapters.http.metaserver import MetaserverClient
from rd2h.adapters.logging import make_logger
from rd2h.ports.metaserver import MetaserverPoster

URL = "http://proxy:8000/v1/metaserver"
PAYLOAD = {"request_id": "cmpl-1-0", "do_remote_decode": True, "remote_port": 30000}


class Server:
    """A MockTransport handler scripted per attempt; records every attempt."""

    def __init__(self, script: Callable[[int, httpx.Request], httpx.Response]) -> None:
        self._script = script
        self._lock = threading.Lock()
        self.attempts: list[tuple[float, str, dict]] = []
        self.reached: dict[int, threading.Event] = {}

    def event_at(self, n: int) -> threading.Event:
        """Set once ``n`` attempts have been made."""
        with self._lock:
            return self.reached.setdefault(n, threading.Event())

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.attempts.append((time.monotonic(), str(request.url), json.loads(request.content)))
            n = len(self.attempts)
            event = self.reached.setdefault(n, threading.Event())
        event.set()
        return self._script(n, request)


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def client_for(server: Server, **kw: object) -> MetaserverClient:
    opts: dict = {"timeout_s": 2.0, "retries": 3, "retry_delay_s": 0.05, "idle_wake_s": 0.2}
    opts.update(kw)
    return MetaserverClient(transport=httpx.MockTransport(server),
                            log=make_logger("test-metaserver", 0), **opts)


@pytest.fixture
def clients():
    made: list[MetaserverClient] = []
    yield made
    for c in made:
        assert c.shutdown(5.0), "client threads did not stop"


def test_implements_the_port(clients) -> None:
    client: MetaserverPoster = client_for(Server(lambda n, r: httpx.Response(200)))
    clients.append(client)
    client.post("r", URL, PAYLOAD)
    assert client.drain(5.0)  # type: ignore[attr-defined]


def test_post_is_delivered_as_json(clients) -> None:
    server = Server(lambda n, r: httpx.Response(200, json={"status": "dispatched"}))
    client = client_for(server)
    clients.append(client)
    client.post("cmpl-1-0", URL, PAYLOAD)
    assert client.drain(5.0)
    assert [(url, body) for _, url, body in server.attempts] == [(URL, PAYLOAD)]
    stats = client.stats()
    assert (stats.delivered, stats.http_errors, stats.transport_errors) == (1, 0, 0)
    assert stats.pending == 0


def test_transport_errors_retry_three_times_at_once_then_every_delay(clients) -> None:
    delay = 0.3
    server = Server(lambda n, r: refuse(r) if n <= 5 else httpx.Response(200))
    client = client_for(server, retry_delay_s=delay)
    clients.append(client)
    client.post("cmpl-1-0", URL, PAYLOAD)
    assert client.drain(10.0)
    times = [t for t, _, _ in server.attempts]
    assert len(times) == 6
    assert times[3] - times[0] < delay  # first try + 3 immediate retries
    assert times[4] - times[3] >= delay * 0.95  # then one retry per delay
    assert times[5] - times[4] >= delay * 0.95
    stats = client.stats()
    assert (stats.delivered, stats.transport_errors, stats.pending) == (1, 5, 0)


def test_timeouts_are_transport_errors_and_retried(clients) -> None:
    def script(n: int, request: httpx.Request) -> httpx.Response:
        if n == 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200)

    server = Server(script)
    client = client_for(server)
    clients.append(client)
    client.post("cmpl-1-0", URL, PAYLOAD)
    assert client.drain(5.0)
    assert len(server.attempts) == 2
    assert (client.stats().transport_errors, client.stats().delivered) == (1, 1)


@pytest.mark.parametrize("status", [404, 500, 503])
def test_http_error_status_counts_as_delivered(clients, status: int) -> None:
    server = Server(lambda n, r: httpx.Response(status, text="no such request"))
    client = client_for(server)
    clients.append(client)
    client.post("cmpl-1-0", URL, PAYLOAD)
    assert client.drain(5.0)
    assert len(server.attempts) == 1  # not retried
    stats = client.stats()
    assert (stats.delivered, stats.http_errors, stats.transport_errors) == (1, 1, 0)


def test_cancel_stops_retry_timers_for_that_request_only(clients) -> None:
    def script(n: int, request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["request_id"] == "dead":
            return refuse(request)
        return httpx.Response(200)

    server = Server(script)
    client = client_for(server, retry_delay_s=0.05)
    clients.append(client)
    client.post("dead", URL, {"request_id": "dead"})
    assert server.event_at(6).wait(5.0), "slow retries did not happen"
    client.post("live", URL, {"request_id": "live"})
    client.cancel("dead")
    assert client.drain(5.0)
    seen = len(server.attempts)
    # No further attempt for the cancelled request within several retry periods.
    assert not server.event_at(seen + 1).wait(0.4)
    ids = [body["request_id"] for _, _, body in server.attempts]
    assert ids.count("live") == 1
    stats = client.stats()
    assert stats.pending == 0 and stats.cancelled == 1 and stats.delivered == 1


def test_cancel_while_on_the_wire_is_not_retried(clients) -> None:
    release = threading.Event()

    def script(n: int, request: httpx.Request) -> httpx.Response:
        assert release.wait(5.0)
        return refuse(request)

    server = Server(script)
    client = client_for(server)
    clients.append(client)
    client.post("r1", URL, {"request_id": "r1"})
    assert server.event_at(1).wait(5.0)
    assert client.cancel("r1") == 0  # on the wire: it finishes but is not retried
    assert client.pending() == 0
    release.set()
    assert not server.event_at(2).wait(0.3)
    assert client.shutdown(5.0)  # joins the worker, so the attempt has been settled
    assert client.stats().cancelled == 1 and client.stats().transport_errors == 1


def test_shutdown_cancels_retries_and_joins(clients) -> None:
    server = Server(lambda n, r: refuse(r))
    client = client_for(server, retry_delay_s=0.05)
    client.post("a", URL, {"request_id": "a"})
    client.post("b", URL, {"request_id": "b"})
    assert server.event_at(10).wait(5.0)
    assert client.shutdown(5.0)
    assert client.pending() == 0 and client.stats().cancelled == 2
    seen = len(server.attempts)
    assert not server.event_at(seen + 1).wait(0.2)
    with pytest.raises(RuntimeError, match="shut down"):
        client.post("c", URL, {"request_id": "c"})
    assert client.shutdown(1.0)  # idempotent


def test_shutdown_meets_its_deadline_with_an_attempt_on_the_wire() -> None:
    release = threading.Event()
    server = Server(lambda n, r: (release.wait(5.0), httpx.Response(200))[1])
    client = client_for(server, workers=1)
    client.post("slow", URL, {"request_id": "slow"})
    assert server.event_at(1).wait(5.0)
    started = time.monotonic()
    assert client.shutdown(0.2) is False  # a worker is still busy at the deadline
    assert time.monotonic() - started < 2.0
    release.set()
    assert client.shutdown(5.0)  # and it exits once its attempt returns


def test_unrecoverable_errors_are_dropped_not_retried(clients) -> None:
    def script(n: int, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("handler bug")

    server = Server(script)
    client = client_for(server)
    clients.append(client)
    client.post("r", URL, PAYLOAD)
    assert client.drain(5.0)
    assert len(server.attempts) == 1 and client.stats().failed == 1


def test_bad_posts_fail_at_once(clients) -> None:
    client = client_for(Server(lambda n, r: httpx.Response(200)))
    clients.append(client)
    for url in ("ftp://proxy/v1/metaserver", "not a url", "http:///v1/metaserver"):
        with pytest.raises(ValueError, match="metaserver URL"):
            client.post("r", url, PAYLOAD)
    with pytest.raises(ValueError, match="not JSON"):
        client.post("r", URL, {"x": object()})
    with pytest.raises(ValueError, match="not JSON"):
        client.post("r", URL, {"x": float("nan")})
    assert client.pending() == 0


@pytest.mark.parametrize("kw", [{"timeout_s": 0}, {"retries": -1}, {"retry_delay_s": 0},
                                {"workers": 0}])
def test_bad_settings_are_rejected(kw: dict) -> None:
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        MetaserverClient(**kw)

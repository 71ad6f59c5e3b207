"""Metaserver client against a real local HTTP server (stdlib http.server on loopback)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fakes.net import wait_until

from rd2h.adapters.http.metaserver import MetaserverClient
from rd2h.adapters.logging import make_logger

pytestmark = pytest.mark.integration


class Metaserver(ThreadingHTTPServer):
    """Records posted JSON; answers ``status``. Bound at construction, listening only
    after ``start``: until then connections are refused, as with a proxy still down."""

    daemon_threads = True

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.posts: list[dict] = []
        self.got_post = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self.server_bind()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/metaserver"

    def start(self) -> None:
        self.server_activate()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(5.0)
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: Metaserver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts.append(json.loads(body))
        reply = json.dumps({"ok": self.server.status < 400}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        self.server.got_post.set()

    def log_message(self, *args: object) -> None:
        pass




def _client(**kw: object) -> MetaserverClient:
    return MetaserverClient(timeout_s=2.0, retries=3, log=make_logger("test-metaserver", 0), **kw)


def test_post_reaches_a_live_server() -> None:
    server = Metaserver()
    server.start()
    client = _client()
    try:
        payload = {"request_id": "cmpl-x-0", "do_remote_decode": True, "remote_port": 31000}
        client.post("cmpl-x-0", server.url, payload)
        assert client.drain(10.0)
        assert server.posts == [payload]
        assert client.stats().delivered == 1 and client.stats().transport_errors == 0
    finally:
        assert client.shutdown(5.0)
        server.stop()


def test_server_down_then_up_is_delivered_by_a_later_retry() -> None:
    server = Metaserver()  # bound, not listening: connection refused
    client = _client(retry_delay_s=0.2)
    try:
        client.post("cmpl-y-0", server.url, {"request_id": "cmpl-y-0"})
        # First try and three immediate retries spent; the slow retries are running.
        wait_until(lambda: client.stats().transport_errors >= 5, "5 transport errors", 10.0)
        assert client.pending() == 1 and server.posts == []
        server.start()
        assert client.drain(10.0)
        assert server.posts == [{"request_id": "cmpl-y-0"}]
        assert client.stats().delivered == 1
    finally:
        assert client.shutdown(5.0)
        server.stop()


def test_http_error_reply_is_delivered_not_retried() -> None:
    server = Metaserver(status=404)
    server.start()
    client = _client(retry_delay_s=0.1)
    try:
        client.post("cmpl-z-0", server.url, {"request_id": "cmpl-z-0"})
        assert client.drain(10.0)
        stats = client.stats()
        assert (stats.delivered, stats.http_errors, len(server.posts)) == (1, 1, 1)
    finally:
        assert client.shutdown(5.0)
        server.stop()


def test_shutdown_while_server_is_down_cancels_the_retries() -> None:
    server = Metaserver()
    client = _client(retry_delay_s=0.1)
    try:
        client.post("cmpl-w-0", server.url, {"request_id": "cmpl-w-0"})
        wait_until(lambda: client.stats().transport_errors >= 4, "4 transport errors", 10.0)
        assert client.shutdown(5.0)
        assert client.pending() == 0 and client.stats().cancelled == 1
        server.start()
        assert not server.got_post.wait(0.5)
    finally:
        server.stop()

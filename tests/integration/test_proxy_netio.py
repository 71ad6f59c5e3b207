"""The proxy's upstream sockets on asyncio (``rd2h.proxy.netio``) under httpx, against real
loopback servers: bytes in and out, connections pooled and reused, and every failure
raised as the exception httpcore's default backend raises for it, so that
``upstream.resend_reason`` sends a request again exactly where it did before.

Each case runs on all three clients the proxy can use (``--upstream-sockets``): aiohttp's
(``rd2h.proxy.aioclient``, the default), httpx on asyncio's streams and httpx on
httpcore's default (anyio) sockets: they must agree."""

from __future__ import annotations

import asyncio
import gzip
import json as jsonlib
import socket
import ssl
import struct
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fakes.net import HOST, free_port

from rd2h.proxy.netio import AsyncioBackend
from rd2h.proxy.upstream import (
    CONNECT,
    STALE,
    AttemptTrace,
    Upstream,
    UpstreamError,
    asyncio_transport,
)

pytestmark = pytest.mark.integration

SOCKETS = ["aiohttp", "asyncio", "anyio"]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _answer(body: bytes = b'{"ok": true}', *, close: bool = False) -> bytes:
    head = (f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n")
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + body


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (headers and a content-length body); b"" at end of stream."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


class Server:
    """A loopback server whose connections ``handler`` drives; counts connections."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> str:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_connect, HOST, 0, ssl=self.tls)
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{HOST}:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()


def _upstream(sockets: str, read_timeout_s: float = 5.0) -> Upstream:
    return Upstream(connect_timeout_s=2.0, read_timeout_s=read_timeout_s,
                    keepalive_expiry_s=30.0, sockets=sockets)


def _run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_the_asyncio_backend_is_the_one_under_the_default_clients() -> None:
    pool = asyncio_transport(httpx.Limits())._pool  # type: ignore[attr-defined]
    assert isinstance(pool._network_backend, AsyncioBackend)


@pytest.mark.parametrize("sockets", SOCKETS)
def test_requests_and_a_streamed_answer_go_through_and_reuse_the_connection(sockets) -> None:
    chunks = [b'data: {"n": %d}\n\n' % i for i in range(5)]

    async def handler(reader, writer):
        while True:
            request = await _read_request(reader)
            if b"/stream" in request.split(b"\r\n", 1)[0]:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for c in chunks:  # one chunk at a time, as an engine streams tokens
                    writer.write(b"%x\r\n%s\r\n" % (len(c), c))
                    await writer.drain()
                    await asyncio.sleep(0.005)
                writer.write(b"0\r\n\r\n")
            else:
                body = request.split(b"\r\n\r\n", 1)[1]
                writer.write(_answer(body))
            await writer.drain()

    async def main():
        server = Server(handler)
        async with server as url:
            up = _upstream(sockets)
            traces = [AttemptTrace() for _ in range(3)]
            r = await up.send("POST", url + "/v1/completions", content=b"x" * 70_000,
                              trace=traces[0])
            assert r.status_code == 200 and r.content == b"x" * 70_000
            r = await up.send("POST", url + "/v1/completions", json={"a": 1}, trace=traces[1])
            assert r.json() == {"a": 1}
            r = await up.send("POST", url + "/stream", json={}, stream=True, trace=traces[2])
            got = [c async for c in r.aiter_raw()]
            await up.close(r)
            assert b"".join(got) == b"".join(chunks)
            await up.aclose()
            # One connection, opened for the first request and reused by the others.
            assert [t.connected for t in traces] == [True, False, False]
            assert [t.reused for t in traces] == [False, True, True]
            assert all(t.sent_at is not None for t in traces)
            assert server.connections == 1

    _run(main())


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, made by openssl."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = str(where / "cert.pem"), str(where / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={HOST}", "-addext", f"subjectAltName=IP:{HOST}",
                    "-keyout", key, "-out", cert], check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.parametrize("sockets", SOCKETS)
def test_an_https_engine_is_trusted_through_httpx_tls_settings(sockets, certificate,
                                                               monkeypatch) -> None:
    """The replaced pool keeps httpx's TLS context: an engine whose certificate
    ``SSL_CERT_FILE`` names is reached over TLS; without it the handshake is refused."""
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def handler(reader, writer):
        request = await _read_request(reader)
        writer.write(_answer(request.split(b"\r\n\r\n", 1)[1]))
        await writer.drain()

    async def main(trusted: bool):
        async with Server(handler, tls) as url:
            assert url.startswith("https://")
            up = _upstream(sockets)
            try:
                if trusted:
                    r = await up.send("POST", url + "/v1/completions", json={"tls": 1})
                    assert r.json() == {"tls": 1}
                    return
                with pytest.raises(UpstreamError) as info:
                    await up.send("POST", url + "/v1/completions", json={})
                assert isinstance(info.value.cause, httpx.ConnectError)
                assert "CERTIFICATE_VERIFY_FAILED" in str(info.value.cause)
            finally:
                await up.aclose()

    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    _run(main(trusted=False))
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    _run(main(trusted=True))


def test_the_replaced_pool_trusts_exactly_what_httpx_trusts(certificate, monkeypatch) -> None:
    """With ``SSL_CERT_FILE`` set httpx trusts that file alone; httpcore's own default
    context would add the system store and certifi's bundle to it."""
    monkeypatch.setenv("SSL_CERT_FILE", certificate[0])
    pool = asyncio_transport(httpx.Limits())._pool  # type: ignore[attr-defined]
    assert isinstance(pool._network_backend, AsyncioBackend)
    trusted = pool._ssl_context.get_ca_certs()
    assert [dict(c["subject"][0])["commonName"] for c in trusted] == [HOST]
    assert pool._ssl_context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize("sockets", SOCKETS)
def test_a_refused_connection_is_a_connect_error_sent_again(sockets) -> None:
    async def main():
        up = _upstream(sockets)
        with pytest.raises(UpstreamError) as info:
            await up.send("POST", f"http://{HOST}:{free_port()}/v1/completions", json={})
        await up.aclose()
        assert isinstance(info.value.cause, httpx.ConnectError)
        assert (info.value.label, info.value.resend) == ("connect", CONNECT)

    _run(main())


@pytest.mark.parametrize("sockets", SOCKETS)
def test_an_engine_that_never_answers_is_a_read_timeout_never_sent_again(sockets) -> None:
    async def handler(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(30)

    async def main():
        async with Server(handler) as url:
            up = _upstream(sockets, read_timeout_s=0.3)
            with pytest.raises(UpstreamError) as info:
                await up.send("POST", url + "/v1/completions", json={})
            await up.aclose()
        assert isinstance(info.value.cause, httpx.ReadTimeout)
        assert (info.value.label, info.value.resend) == ("timeout", None)

    _run(main())


@pytest.mark.parametrize("sockets", SOCKETS)
@pytest.mark.parametrize("how", ["fin", "rst"])
@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_pooled_connection_closed_under_the_request_is_stale(sockets, how, method) -> None:
    """The engine answers once, then closes the idle connection just as the proxy reuses
    it (its keep-alive timer): the request is sent again (``STALE``), by FIN or RST. A GET
    too: no client sends it again on its own (aiohttp would), so the proxy's resend is
    the only one and is counted."""
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(_answer())
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the second request's headers arrived
        if how == "rst":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort() if how == "rst" else writer.close()

    server = Server(handler)

    async def main():
        async with server as url:
            up = _upstream(sockets)
            r = await up.send("POST", url + "/v1/completions", json={})
            assert r.status_code == 200
            with pytest.raises(UpstreamError) as info:
                await up.send(method, url + "/v1/completions",
                              **({"json": {}} if method == "POST" else {}))
            await up.aclose()
        assert info.value.trace.reused and not info.value.trace.response_started
        assert info.value.resend == STALE, info.value
        assert server.connections == 1

    _run(main())


@pytest.mark.parametrize("sockets", SOCKETS)
def test_an_idle_connection_the_engine_closed_is_not_reused(sockets) -> None:
    """The engine closed the pooled connection while it was idle: the pool sees the
    end of stream on the socket (``is_readable``) and opens a new one; no error."""
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(_answer())
        await writer.drain()
        writer.close()

    async def main():
        server = Server(handler)
        async with server as url:
            up = _upstream(sockets)
            assert (await up.send("POST", url + "/v1/completions", json={})).status_code == 200
            await asyncio.sleep(0.1)  # the close reaches the proxy's socket
            trace = AttemptTrace()
            r = await up.send("POST", url + "/v1/completions", json={}, trace=trace)
            await up.aclose()
        assert r.status_code == 200 and trace.connected
        assert server.connections == 2

    _run(main())


@pytest.mark.parametrize("sockets", SOCKETS)
def test_a_close_mid_answer_is_a_broken_stream_never_sent_again(sockets) -> None:
    """Response headers came, then the engine died: an error on the body, not resent
    (bytes may have reached the client)."""
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"y" * 10)
        await writer.drain()
        writer.close()

    async def main():
        async with Server(handler) as url:
            up = _upstream(sockets)
            trace = AttemptTrace()
            r = await up.send("POST", url + "/v1/completions", json={}, stream=True,
                              trace=trace)
            with pytest.raises(httpx.RemoteProtocolError):
                async for _ in r.aiter_raw():
                    pass
            await up.close(r)
            await up.aclose()
        assert trace.response_started

    _run(main())


@pytest.mark.parametrize("sockets", SOCKETS)
def test_every_client_sends_the_same_request_and_decodes_the_same_answer(sockets) -> None:
    """What an engine sees is the same whichever client sends (httpx's JSON encoding, its
    ``accept-encoding``, the caller's headers), and a gzip answer reaches the relay
    decoded, streamed or not."""
    payload = {"prompt": "caf\u00e9", "n": [1, 2]}
    answer = b'{"text": "ok", "tokens": [1, 2, 3]}'
    seen: list[bytes] = []

    async def handler(reader, writer):
        while True:
            request = await _read_request(reader)
            seen.append(request)
            body = gzip.compress(answer)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()

    async def main():
        async with Server(handler) as url:
            up = _upstream(sockets)
            r = await up.send("POST", url + "/v1/completions", json=payload,
                              headers={"X-Request-Id": "r-1"})
            assert r.json() == jsonlib.loads(answer)
            r = await up.send("POST", url + "/v1/completions", json=payload, stream=True)
            got = b"".join([c async for c in r.aiter_bytes()])
            await up.close(r)
            assert got == answer
            await up.aclose()

    _run(main())
    head, body = seen[0].split(b"\r\n\r\n", 1)
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    assert body == jsonlib.dumps(payload, ensure_ascii=False,
                                 separators=(",", ":")).encode()
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"content-length"] == str(len(body)).encode()
    assert headers[b"x-request-id"] == b"r-1"
    with httpx.Client() as plain:  # what httpx asks for on its own
        assert headers[b"accept-encoding"] == plain.headers["accept-encoding"].encode()


@pytest.mark.parametrize("sockets", SOCKETS)
def test_a_deadline_ends_the_attempt_as_a_timeout_never_sent_again(sockets) -> None:
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # the body never comes; each read is inside its timeout

    async def main():
        async with Server(handler) as url:
            up = _upstream(sockets, read_timeout_s=10)
            started = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamError) as info:
                await up.send("POST", url + "/v1/completions", json={}, deadline_s=0.3)
            took = asyncio.get_running_loop().time() - started
            await up.aclose()
        assert (info.value.label, info.value.resend) == ("timeout", None)
        assert took < 5

    _run(main())


@pytest.mark.parametrize("sockets", SOCKETS)
def test_fresh_requests_each_open_a_connection_and_keep_none(sockets) -> None:
    async def handler(reader, writer):
        while True:
            await _read_request(reader)
            writer.write(_answer())
            await writer.drain()

    async def main():
        server = Server(handler)
        async with server as url:
            up = _upstream(sockets)
            traces = [AttemptTrace() for _ in range(3)]
            for t in traces:
                r = await up.send("POST", url + "/v1/completions", json={}, fresh=True,
                                  trace=t)
                assert r.status_code == 200
            await up.aclose()
        assert [t.connected for t in traces] == [True, True, True]
        assert server.connections == 3

    _run(main())

"""The proxy's asyncio network backend (``rd2h.proxy.netbackend``) under httpx, against
raw HTTP servers on loopback sockets: streamed bodies arrive whole and in order,
connections are reused and a closed idle one is noticed without a read, every failure
is httpx's usual error (so the proxy's resend rule reads it unchanged), and a body
larger than the read buffer crosses both flow-control paths."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import httpx
import pytest

from rd2h.proxy import netbackend
from rd2h.proxy.netbackend import AsyncioBackend
from rd2h.proxy.upstream import (
    CONNECT,
    STALE,
    AttemptTrace,
    Upstream,
    UpstreamError,
    _AsyncioTransport,
)

pytestmark = pytest.mark.integration

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (Content-Length only): its body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length) if length else b""


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve(handler: Handler) -> tuple[asyncio.base_events.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _client(**kw: object) -> httpx.AsyncClient:
    limits = httpx.Limits(max_keepalive_connections=8, keepalive_expiry=30)
    return httpx.AsyncClient(transport=_AsyncioTransport(limits), **kw)  # type: ignore[arg-type]


def test_streamed_events_arrive_in_order_and_the_connection_is_reused() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for i in range(16):  # one write per event, as an engine's decode steps
                writer.write(_chunk(b"data: %d\n\n" % i))
                await writer.drain()
                await asyncio.sleep(0.001)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await _serve(handler)
        async with server, _client() as client:
            traces = []
            for _ in range(3):
                trace = AttemptTrace()
                req = client.build_request("POST", url + "/v1/completions", json={"a": 1},
                                           extensions={"trace": trace})
                resp = await client.send(req, stream=True)
                parts = [c async for c in resp.aiter_bytes()]
                await resp.aclose()
                assert b"".join(parts) == b"".join(b"data: %d\n\n" % i for i in range(16))
                traces.append(trace)
            assert [t.reused for t in traces] == [False, True, True]
        assert connections == 1

    asyncio.run(main())


def test_an_idle_connection_the_server_closed_is_readable_and_not_reused() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # the keep-alive timer of an engine, while the proxy is idle

    async def main() -> None:
        server, url = await _serve(handler)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1]))
            await stream.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert b"ok" in await stream.read(65536)
            assert stream.get_extra_info("is_readable") is False
            await asyncio.sleep(0.2)
            assert stream.get_extra_info("is_readable") is True  # known without a syscall
            assert await stream.read(65536) == b""
            await stream.aclose()
            async with _client() as client:
                for _ in range(2):
                    assert (await client.get(url)).text == "ok"
                    await asyncio.sleep(0.2)
                trace = AttemptTrace()
                r = await client.send(client.build_request("GET", url,
                                                           extensions={"trace": trace}))
                assert r.text == "ok" and not trace.reused  # a new connection, no error
        assert connections == 4

    asyncio.run(main())


def test_failures_are_httpx_errors_the_resend_rule_reads() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)  # never answers
        writer.close()

    async def resets(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST with the request read and nothing answered

    async def main() -> None:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        up = Upstream(connect_timeout_s=1.0, read_timeout_s=0.3, keepalive_expiry_s=5.0)
        try:
            with pytest.raises(UpstreamError) as info:
                await up.send("POST", f"http://127.0.0.1:{closed}/v1/completions", json={})
            assert isinstance(info.value.cause, httpx.ConnectError)
            assert info.value.resend == CONNECT
            server, url = await _serve(silent)
            async with server:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(UpstreamError) as info:
                    await up.send("POST", url + "/v1/completions", json={})
                assert isinstance(info.value.cause, httpx.ReadTimeout)
                assert info.value.label == "timeout" and info.value.resend is None
                assert loop.time() - t0 < 3.0
            server, url = await _serve(resets)
            async with server:
                with pytest.raises(UpstreamError) as info:
                    await up.send("POST", url + "/v1/completions", json={})
                # a new connection: the engine may have read it, so it is not sent again
                assert isinstance(info.value.cause, httpx.ReadError | httpx.RemoteProtocolError)
                assert info.value.resend is None
        finally:
            await up.aclose()

    asyncio.run(main())


def test_a_reused_connection_reset_by_the_engine_is_stale() -> None:
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await _read_request(reader)
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await _read_request(reader)  # the second request on this connection: reset
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def main() -> None:
        server, url = await _serve(handler)
        up = Upstream(connect_timeout_s=1.0, read_timeout_s=2.0, keepalive_expiry_s=5.0)
        try:
            async with server:
                assert (await up.send("POST", url + "/x", json={})).text == "ok"
                with pytest.raises(UpstreamError) as info:
                    await up.send("POST", url + "/x", json={})
                assert info.value.trace.reused and info.value.resend == STALE
        finally:
            await up.aclose()
        assert served == 1

    asyncio.run(main())


def test_a_body_larger_than_the_read_buffer_crosses_both_ways(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netbackend, "READ_BUFFER_LIMIT", 64 * 1024)
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 256 * 1024):
            writer.write(body[i:i + 256 * 1024])
            await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await _serve(echo)
        async with server, _client(timeout=10.0) as client:
            resp = await client.send(client.build_request("POST", url, content=payload),
                                     stream=True)
            got = bytearray()
            async for part in resp.aiter_raw():
                got += part
                await asyncio.sleep(0)  # a slow reader: the buffer fills, reading pauses
            await resp.aclose()
            assert bytes(got) == payload

    asyncio.run(main())


def test_a_cancelled_read_leaves_the_stream_usable() -> None:
    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.2)
        writer.write(b"late")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()

    async def main() -> None:
        server, url = await _serve(late)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1]))
            task = asyncio.ensure_future(stream.read(1024))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await stream.read(1024, timeout=2.0) == b"late"
            await stream.aclose()

    asyncio.run(main())


def test_plain_http_engines_get_the_asyncio_backend_unless_a_proxy_is_configured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)

    async def transports() -> list[type]:
        up = Upstream(connect_timeout_s=1.0, read_timeout_s=1.0, keepalive_expiry_s=1.0)
        try:
            return [type(up._shard(u).client._transport)
                    for u in ("http://127.0.0.1:1/a", "https://127.0.0.1:2/a")]
        finally:
            await up.aclose()

    assert asyncio.run(transports()) == [_AsyncioTransport, httpx.AsyncHTTPTransport]
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:3")
    assert asyncio.run(transports())[0] is httpx.AsyncHTTPTransport

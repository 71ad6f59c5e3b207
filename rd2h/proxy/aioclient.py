"""The proxy's requests to its engines on aiohttp's client (``--upstream-sockets aiohttp``,
the default).

httpx and httpcore parse and build HTTP/1.1 in Python (h11) and build several objects per
request; aiohttp's client parses responses in C (llhttp) and keeps its pool in one
connector. A POST with a JSON answer plus a POST with a streamed answer, at 8 in flight
against a local uvicorn, cost 1.5-1.6 ms of CPU through httpx on asyncio sockets and
0.26 ms through aiohttp; the whole proxy spends about 40% less CPU per request on
aiohttp (``benchmarks/proxy_overhead.py``).

Everything above this module still sees httpx: a request's answer is an
``httpx.Response`` whose body streams from aiohttp's connection (undecoded, so httpx
decodes ``content-encoding`` exactly as before), and every aiohttp failure is raised as
the httpx exception httpcore raises for the same event on the wire, so that
``upstream.resend_reason`` sends a request again where it always did:

* the connection could not be opened: ``ConnectError`` (TLS refusals included);
  ``ConnectTimeout`` when opening it timed out;
* no response bytes within the read deadline: ``ReadTimeout``;
* the engine closed the connection before any response: ``RemoteProtocolError``
  ("Server disconnected without sending a response."); reset: ``ReadError`` /
  ``WriteError``;
* the body ended early or is malformed: ``RemoteProtocolError``.

The ``AttemptTrace`` of a request is filled from aiohttp's tracing signals: a new
connection (``connected``) or a pooled one (``request_started`` without ``connected``),
the request written (``sent_at``) and the response headers in (``response_started``).
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx

SERVER_CLOSED = "Server disconnected without sending a response."
_BODY_CUT = "peer closed connection without sending complete message body"


def _accept_encoding() -> str:
    """What httpx's own clients ask for: the encodings httpx can decode."""
    try:
        from httpx._decoders import SUPPORTED_DECODERS
    except ImportError:  # an httpx that moved it: what every httpx decodes
        return "gzip, deflate"
    return ", ".join(k for k in SUPPORTED_DECODERS if k != "identity")


def as_httpx(exc: BaseException, *, response_started: bool) -> BaseException:
    """The httpx exception for an aiohttp failure (others are returned as they are)."""
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg)
    if isinstance(exc, aiohttp.ServerTimeoutError):  # a socket read timed out
        return httpx.ReadTimeout(msg)
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unreachable, TLS
        return httpx.ConnectError(msg)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(_BODY_CUT if response_started else SERVER_CLOSED)
    if isinstance(exc, aiohttp.ClientConnectionResetError):  # written to a closed socket
        return httpx.WriteError(msg)
    if isinstance(exc, aiohttp.ClientOSError):  # reset while reading
        return httpx.ReadError(msg)
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return httpx.RemoteProtocolError(msg)
    if isinstance(exc, aiohttp.ClientError):
        return httpx.TransportError(msg)
    return exc


class _Body(httpx.AsyncByteStream):
    """A response body read from aiohttp's connection as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            raise as_httpx(exc, response_started=True) from exc
        self._done = True

    async def aclose(self) -> None:
        # Read to its end: the connection goes back to the pool; otherwise it is closed
        # (bytes of this answer may still come on it).
        if self._done:
            self._response.release()
        else:
            self._response.close()


async def _on_connected(session: Any, ctx: SimpleNamespace, params: Any) -> None:
    trace = ctx.trace_request_ctx
    if trace is not None:
        trace.connected = trace.request_started = True


async def _on_reused(session: Any, ctx: SimpleNamespace, params: Any) -> None:
    trace = ctx.trace_request_ctx
    if trace is not None:
        trace.request_started = True


async def _on_sent(session: Any, ctx: SimpleNamespace, params: Any) -> None:
    trace = ctx.trace_request_ctx
    if trace is not None:
        trace.sent_at = time.monotonic()


def _trace_config() -> aiohttp.TraceConfig:
    config = aiohttp.TraceConfig()
    config.on_connection_create_end.append(_on_connected)
    config.on_connection_reuseconn.append(_on_reused)
    config.on_request_headers_sent.append(_on_sent)
    return config


class AiohttpClient:
    """A pooled aiohttp session to every engine and one that opens a new connection for
    each request (``fresh``). Sessions are made on first use, on the running loop."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float,
                 keepalive_expiry_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s,
                                              sock_read=read_timeout_s)
        self._keepalive_expiry_s = keepalive_expiry_s
        # httpx's TLS context: certifi's bundle, or what SSL_CERT_FILE / SSL_CERT_DIR name.
        self._ssl = httpx.create_ssl_context()
        self._headers = {"Accept-Encoding": _accept_encoding()}
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None

    def _session(self, fresh: bool) -> aiohttp.ClientSession:
        session = self._fresh if fresh else self._pooled
        if session is None:
            # The system's resolver (getaddrinfo, as httpx and asyncio use), whether or
            # not aiodns is installed; no connection cap (the clients bound concurrency).
            kw: dict[str, Any] = {"limit": 0, "ssl": self._ssl,
                                  "resolver": aiohttp.ThreadedResolver()}
            connector = (aiohttp.TCPConnector(force_close=True, **kw) if fresh else
                         aiohttp.TCPConnector(keepalive_timeout=self._keepalive_expiry_s,
                                              **kw))
            session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(), headers=self._headers,
                trace_configs=[_trace_config()], raise_for_status=False)
            # aiohttp sends an idempotent request (GET) again by itself when a connection
            # breaks under it; rd2h has one resend rule for every request and counts each
            # resend (``upstream.resend_reason``), so aiohttp's own is turned off.
            if hasattr(session, "_retry_connection"):
                session._retry_connection = False
            if fresh:
                self._fresh = session
            else:
                self._pooled = session
        return session

    def _timeout_of(self, timeout: httpx.Timeout | None) -> aiohttp.ClientTimeout:
        if timeout is None:
            return self._timeout
        return aiohttp.ClientTimeout(total=None, sock_connect=timeout.connect,
                                     sock_read=timeout.read)

    async def send(self, method: str, url: str, *, trace: Any, fresh: bool, stream: bool,
                   headers: dict[str, str] | None = None, json: Any = None,
                   content: bytes | None = None,
                   timeout: httpx.Timeout | None = None) -> httpx.Response:
        """One attempt; aiohttp's failures come out as httpx's (``as_httpx``)."""
        sent_headers = dict(headers or {})
        if json is not None:  # as httpx encodes it
            content = jsonlib.dumps(json, ensure_ascii=False, separators=(",", ":"),
                                    allow_nan=False).encode("utf-8")
            if not any(k.lower() == "content-type" for k in sent_headers):
                sent_headers["Content-Type"] = "application/json"
        try:
            raw = await self._session(fresh).request(
                method, url, data=content, headers=sent_headers,
                timeout=self._timeout_of(timeout), trace_request_ctx=trace,
                allow_redirects=False)
        except aiohttp.ClientError as exc:
            raise as_httpx(exc, response_started=False) from exc
        trace.response_started = True
        response = httpx.Response(raw.status, headers=raw.raw_headers, stream=_Body(raw))
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    async def aclose(self) -> None:
        for session in (self._pooled, self._fresh):
            if session is not None:
                await session.close()
        self._pooled = self._fresh = None
        # Let the connectors' transports finish closing on this loop.
        await asyncio.sleep(0)

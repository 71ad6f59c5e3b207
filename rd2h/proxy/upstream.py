"""The proxy's HTTP client to its engines, and the rule for sending a request again.

The client is aiohttp's (``aioclient``, the default) or httpx's (``--upstream-sockets
asyncio`` or ``anyio``, and in tests through an httpx transport); either way callers get
``httpx.Response`` objects and httpx's exceptions. Two kinds of clients share one
configuration: pooled ones (httpx: a few per engine, ``POOL_SHARD_SIZE``; aiohttp: one
connector) keep idle connections for ``keepalive_expiry_s``, below the engines' own
keep-alive (uvicorn's and vLLM's default is 5 s), so the proxy drops an idle connection
before the engine closes it and the race where an engine closes a connection just as
the proxy reuses it becomes rare; ``fresh`` never keeps one, so a request sent through
it always gets a new connection.

When a request may be sent again (``resend_reason``)
-----------------------------------------------------
The proxy's requests are POSTs that start work on an engine (a Decode request
also makes the engine post to the metaserver and wait for KV), so a failed one is
sent again only where the engine cannot have read it:

* ``connect``: the TCP connection could not be opened (``ConnectError``,
  ``ConnectTimeout``). Nothing was sent.
* ``stale_connection``: the connection came from the pool (httpcore's ``trace``
  extension reported no ``connect_tcp`` for this request), the request was written
  to it, and the engine closed it before any response came back: a reset
  (``ReadError``/``WriteError``: the engine's socket was closed with our bytes
  unread, so the kernel answered with RST) or an orderly close
  (``RemoteProtocolError`` "Server disconnected without sending a response").
  This is what an engine's keep-alive timer does to an idle connection (uvicorn's
  ``timeout_keep_alive_handler`` closes the transport; it never reads a request
  first); an engine that read the request and then crashed looks the same from
  here, and sending again then reaches a dead engine (or a restarted one that
  never saw the request). httpx cannot tell a close after part of a status line
  (an engine that started answering, then died) from a close before any byte;
  both end as that same error, and the rare first case is treated as the second.
  The same rule drives browsers' resends on reused connections.

Never sent again: timeouts (the engine may be working on it), any error after the
response headers arrived (bytes may have reached the client), any error on a new
connection other than failing to open it, and any HTTP status. Callers add their
own conditions (the Decode leg also requires that no metaserver post arrived for
the request: a post proves the engine admitted it) and send again at most once.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpcore
import httpx

from rd2h.proxy.aioclient import SERVER_CLOSED, AiohttpClient
from rd2h.proxy.netio import AsyncioBackend

STALE = "stale_connection"
CONNECT = "connect"
FAILOVER = "failover"

_SERVER_CLOSED = SERVER_CLOSED.rstrip(".")


@dataclass
class AttemptTrace:
    """What httpcore reported about one request (its ``trace`` extension callback)."""

    connected: bool = False  # a new TCP connection was opened for this request
    request_started: bool = False  # request headers were being written to a connection
    sent_at: float | None = None  # monotonic time the whole request had been written
    response_started: bool = False  # response headers arrived

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        if name.startswith("connection.connect_"):
            self.connected = True
        elif name.endswith(".send_request_headers.started"):
            self.request_started = True
        elif name.endswith(".send_request_body.complete"):
            self.sent_at = time.monotonic()
        elif name.endswith(".receive_response_headers.complete"):
            self.response_started = True

    @property
    def reused(self) -> bool:
        """The request went out on a pooled connection (False when nothing was traced)."""
        return self.request_started and not self.connected


def resend_reason(exc: BaseException, trace: AttemptTrace) -> str | None:
    """``CONNECT`` or ``STALE`` when the engine cannot have read the request, else None."""
    if trace.response_started:
        return None
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return CONNECT
    if not trace.reused:
        return None
    if isinstance(exc, (httpx.ReadError, httpx.WriteError)):
        return STALE
    if isinstance(exc, httpx.RemoteProtocolError) and str(exc).startswith(_SERVER_CLOSED):
        return STALE
    return None


def failure_label(exc: BaseException) -> str:
    """A short, bounded label for a transport failure (a metrics label value)."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError)):
        return "connection_reset"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection_closed"
    return "transport"


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class UpstreamError(Exception):
    """A request that got no response: ``cause``, ``label``, ``resend`` and ``trace``."""

    def __init__(self, cause: BaseException, trace: AttemptTrace) -> None:
        super().__init__(describe(cause))
        self.cause = cause
        self.trace = trace
        self.label = failure_label(cause)
        self.resend = resend_reason(cause, trace)


# Requests in flight on one pooled client before the next client of the same engine
# is used. httpcore's pool scans all its connections on every request and every
# response end (polling the idle ones' sockets, and quadratic in places), which at 64
# requests in flight cost the proxy more CPU than the requests themselves; pools of a
# few connections keep that scan short. At low concurrency every request uses the
# first pool, so connections are reused exactly as with one pool.
POOL_SHARD_SIZE = 8


class _NoCookies(http.cookiejar.CookieJar):
    """Keeps no cookie: what an engine sets is never stored and sent along with other
    clients' requests (nor parsed, on every response)."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def add_cookie_header(self, request: Any) -> None:
        return None


def _client(transport: httpx.AsyncBaseTransport | None, timeout: httpx.Timeout,
            limits: httpx.Limits, sockets: str = "asyncio") -> httpx.AsyncClient:
    if transport is None and sockets == "asyncio":  # asyncio's streams (``netio``)
        transport = asyncio_transport(limits)
    return httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits,
                             cookies=_NoCookies())


def asyncio_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's own transport (its request and error mapping) over a connection pool
    whose sockets are ``netio.AsyncioBackend``'s. httpx takes no network backend, so the
    pool it built is replaced by one with the same settings (its TLS context, with
    ``SSL_CERT_FILE``/``SSL_CERT_DIR`` applied, among them); an httpx without that pool
    keeps its own."""
    transport = httpx.AsyncHTTPTransport(limits=limits)
    built = getattr(transport, "_pool", None)
    if isinstance(built, httpcore.AsyncConnectionPool) and hasattr(built, "_ssl_context"):
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=built._ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=getattr(built, "_http1", True),
            http2=getattr(built, "_http2", False),
            retries=getattr(built, "_retries", 0),
            local_address=getattr(built, "_local_address", None),
            uds=getattr(built, "_uds", None),
            socket_options=getattr(built, "_socket_options", None),
            network_backend=AsyncioBackend(),
        )
    return transport


@dataclass(eq=False)
class _Shard:
    client: httpx.AsyncClient
    busy: int = 0


class Upstream:
    """The pooled clients to the engines and the fresh-connection one: aiohttp's
    (``aioclient``) by default, httpx's with ``sockets`` "asyncio" or "anyio" or with a
    ``transport`` (tests). Either way a request's answer is an ``httpx.Response`` and a
    failure an ``UpstreamError`` wrapping an httpx exception.

    A response sent with ``stream=True`` must be closed with ``close``.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_expiry_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        sockets: str = "aiohttp",
    ) -> None:
        """``transport``: one httpx transport for every client (tests); otherwise each
        client gets real sockets, ``sockets`` saying whose (``ProxyConfig``)."""
        self._sockets = sockets
        self._aio = (AiohttpClient(connect_timeout_s=connect_timeout_s,
                                   read_timeout_s=read_timeout_s,
                                   keepalive_expiry_s=keepalive_expiry_s)
                     if transport is None and sockets == "aiohttp" else None)
        self._timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self._keepalive_expiry_s = keepalive_expiry_s
        self._transport = transport
        self._shards: dict[tuple[str, str], list[_Shard]] = {}
        self._streaming: dict[int, _Shard] = {}  # id(response) -> its shard
        # httpx's fresh-connection client; aiohttp's is ``self._aio``'s own.
        self.fresh = None if self._aio is not None else _client(
            transport, self._timeout,
            httpx.Limits(max_connections=None, max_keepalive_connections=0), sockets)

    def _shard(self, url: str) -> _Shard:
        """The first pool of ``url``'s engine with room, a new one if none has."""
        parts = urlsplit(url)
        shards = self._shards.setdefault((parts.scheme, parts.netloc), [])
        for shard in shards:
            if shard.busy < POOL_SHARD_SIZE:
                return shard
        # No cap on connections: the clients bound the concurrency, and a cap would
        # queue client requests behind each other.
        shard = _Shard(_client(
            self._transport, self._timeout,
            httpx.Limits(max_connections=None, max_keepalive_connections=64,
                         keepalive_expiry=self._keepalive_expiry_s),
            self._sockets,
        ))
        shards.append(shard)
        return shard

    async def send(
        self,
        method: str,
        url: str,
        *,
        fresh: bool = False,
        trace: AttemptTrace | None = None,
        deadline_s: float | None = None,
        stream: bool = False,
        **kw: Any,
    ) -> httpx.Response:
        """One attempt; raises ``UpstreamError`` when no response came back.

        ``fresh``: on a new connection. ``deadline_s`` bounds the whole attempt (body
        included unless ``stream``).
        """
        trace = AttemptTrace() if trace is None else trace
        if self._aio is not None:
            try:
                if deadline_s is None:
                    return await self._aio.send(method, url, trace=trace, fresh=fresh,
                                                stream=stream, **kw)
                async with asyncio.timeout(deadline_s):
                    return await self._aio.send(method, url, trace=trace, fresh=fresh,
                                                stream=stream, **kw)
            except (httpx.TransportError, TimeoutError) as exc:
                raise UpstreamError(exc, trace) from exc
        shard = None if fresh else self._shard(url)
        client = shard.client if shard is not None else self.fresh
        assert client is not None  # httpx clients whenever there is no aiohttp one
        request = client.build_request(method, url, extensions={"trace": trace}, **kw)
        if shard is not None:
            shard.busy += 1
        try:
            if deadline_s is None:
                response = await client.send(request, stream=stream)
            else:
                with anyio.fail_after(deadline_s):
                    response = await client.send(request, stream=stream)
        except BaseException as exc:
            if shard is not None:
                shard.busy -= 1
            if isinstance(exc, (httpx.TransportError, TimeoutError)):
                raise UpstreamError(exc, trace) from exc
            raise
        if shard is not None:
            if stream:
                self._streaming[id(response)] = shard
            else:
                shard.busy -= 1
        return response

    async def close(self, response: httpx.Response) -> None:
        """Close a streamed response (its connection goes back to its pool)."""
        shard = self._streaming.pop(id(response), None)
        try:
            await response.aclose()
        finally:
            if shard is not None:
                shard.busy -= 1

    def pools(self) -> int:
        return sum(len(shards) for shards in self._shards.values())

    async def aclose(self) -> None:
        if self._aio is not None:
            await self._aio.aclose()
        clients = [s.client for shards in self._shards.values() for s in shards]
        for client in [*clients, *([self.fresh] if self.fresh is not None else [])]:
            await client.aclose()

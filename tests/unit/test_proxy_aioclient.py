"""aiohttp's failures as the httpx exceptions the proxy's resend rule reads
(``rd2h.proxy.aioclient.as_httpx``); the same events on real sockets are in
tests/integration/test_proxy_netio.py."""

from __future__ import annotations

import errno

import aiohttp
import httpx
import pytest

from rd2h.proxy.aioclient import SERVER_CLOSED, as_httpx
from rd2h.proxy.upstream import CONNECT, STALE, AttemptTrace, UpstreamError

REUSED = AttemptTrace(request_started=True)
NEW = AttemptTrace(connected=True, request_started=True)


@pytest.mark.parametrize(("exc", "started", "want", "label"), [
    (aiohttp.ConnectionTimeoutError("connect"), False, httpx.ConnectTimeout,
     "connect_timeout"),
    (aiohttp.SocketTimeoutError("read"), False, httpx.ReadTimeout, "timeout"),
    (aiohttp.ServerDisconnectedError(), False, httpx.RemoteProtocolError,
     "connection_closed"),
    (aiohttp.ServerDisconnectedError(), True, httpx.RemoteProtocolError,
     "connection_closed"),
    (aiohttp.ClientConnectionResetError("closing transport"), False, httpx.WriteError,
     "connection_reset"),
    (aiohttp.ClientOSError(errno.ECONNRESET, "reset by peer"), False, httpx.ReadError,
     "connection_reset"),
    (aiohttp.ClientPayloadError("Response payload is not completed"), True,
     httpx.RemoteProtocolError, "connection_closed"),
    (aiohttp.ClientError("other"), False, httpx.TransportError, "transport"),
])
def test_each_aiohttp_failure_is_the_httpx_one(exc, started, want, label) -> None:
    mapped = as_httpx(exc, response_started=started)
    assert type(mapped) is want
    assert UpstreamError(mapped, AttemptTrace(response_started=started)).label == label


def test_a_close_before_any_answer_reads_as_httpcore_says_it() -> None:
    """Only "Server disconnected without sending a response" on a reused connection is
    stale; after the headers the same close is a cut body, never sent again."""
    before = as_httpx(aiohttp.ServerDisconnectedError(), response_started=False)
    assert str(before) == SERVER_CLOSED
    assert UpstreamError(before, REUSED).resend == STALE
    assert UpstreamError(before, NEW).resend is None
    after = as_httpx(aiohttp.ServerDisconnectedError(), response_started=True)
    assert not str(after).startswith(SERVER_CLOSED.rstrip("."))
    assert UpstreamError(after, REUSED).resend is None


def test_resets_on_a_reused_connection_are_stale_and_connect_timeouts_go_elsewhere() -> None:
    reset = as_httpx(aiohttp.ClientOSError(errno.ECONNRESET, "reset"), response_started=False)
    assert UpstreamError(reset, REUSED).resend == STALE
    assert UpstreamError(reset, NEW).resend is None
    timeout = as_httpx(aiohttp.ConnectionTimeoutError("t"), response_started=False)
    assert UpstreamError(timeout, NEW).resend == CONNECT
    read = as_httpx(aiohttp.SocketTimeoutError("t"), response_started=False)
    assert UpstreamError(read, REUSED).resend is None


def test_other_exceptions_pass_through() -> None:
    err = ValueError("not a transport failure")
    assert as_httpx(err, response_started=False) is err

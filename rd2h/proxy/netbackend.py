"""The proxy's plain-TCP connections to its engines, on asyncio itself.

httpcore's default network backend wraps every socket read and write in an AnyIO
cancel scope (``fail_after``) and, before reusing a pooled connection, polls its socket
with a ``select`` call. On the proxy's hot path (each streamed token of every answer is
one read) that machinery was about a sixth of the proxy's CPU
(``benchmarks/proxy_overhead.py --tokens 16 --token-gap-ms 2`` under ``py-spy``). This
backend gives httpcore the same interface on an ``asyncio.Protocol``:

- a read takes what the event loop already buffered, or waits on one future (its
  deadline is a loop timer, not a cancel scope);
- a write hands the bytes to the transport and waits only while the transport asks
  the writer to pause;
- whether an idle connection is readable (the server closed it, or sent bytes
  nobody asked for) is known from the protocol's callbacks, with no system call.

Errors are httpcore's own (``ConnectError``, ``ConnectTimeout``, ``ReadError``,
``ReadTimeout``, ``WriteError``, ``WriteTimeout``), which httpx maps as for its default
backend, so the proxy's rule for sending a request again (``upstream.resend_reason``)
reads them unchanged; httpcore's ``trace`` events come from httpcore, not from here.
Plain ``http://`` engines only: TLS stays on httpcore's default backend.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from typing import Any

import httpcore

# Bytes buffered from one connection before the loop stops reading it (httpcore reads
# at most 64 KiB at a time, so a connection whose reader keeps up never reaches this).
READ_BUFFER_LIMIT = 1 << 20


class _Protocol(asyncio.Protocol):
    """Buffers what arrives and wakes the one reader or writer waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.lost: BaseException | None = None  # why the connection ended (None: open)
        self.closed = False
        self.reader: asyncio.Future[None] | None = None
        self.writer: asyncio.Future[None] | None = None  # set while writing is paused
        self.paused_reading = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_BUFFER_LIMIT and not self.paused_reading:
            self.paused_reading = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # the transport closes itself: HTTP/1.1 never half-closes here

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = exc
        self._wake_reader()
        writer, self.writer = self.writer, None
        if writer is not None and not writer.done():
            writer.set_result(None)

    def pause_writing(self) -> None:
        if self.writer is None:
            self.writer = self.loop.create_future()

    def resume_writing(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None and not writer.done():
            writer.set_result(None)

    def _wake_reader(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None and not reader.done():
            reader.set_result(None)


def _expire(future: asyncio.Future[None], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One TCP connection to an engine (see the module's docstring)."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._protocol
        if not p.buffer and not p.eof and not p.closed:
            await self._wait(p, "reader", timeout, httpcore.ReadTimeout)
        if p.buffer:
            if len(p.buffer) <= max_bytes:
                data = bytes(p.buffer)
                p.buffer.clear()
            else:
                data = bytes(p.buffer[:max_bytes])
                del p.buffer[:max_bytes]
            if p.paused_reading and len(p.buffer) <= READ_BUFFER_LIMIT // 2 and not p.closed:
                p.paused_reading = False
                self._transport.resume_reading()
            return data
        if p.lost is not None:
            raise httpcore.ReadError(_describe(p.lost)) from p.lost
        return b""  # the engine closed the connection (httpcore says so as its error)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        p = self._protocol
        if p.closed or self._transport.is_closing():
            raise httpcore.WriteError(_describe(p.lost) if p.lost else "connection closed")
        self._transport.write(buffer)
        if p.writer is not None:  # the kernel's buffer is full: wait for room
            await self._wait(p, "writer", timeout, httpcore.WriteTimeout)
            if p.closed:
                raise httpcore.WriteError(_describe(p.lost) if p.lost else "connection closed")

    @staticmethod
    async def _wait(p: _Protocol, slot: str, timeout: float | None,
                    error: type[Exception]) -> None:
        if slot == "reader":
            future = p.reader = p.loop.create_future()
        else:
            future = p.writer  # type: ignore[assignment]
            assert future is not None
        timer = None if timeout is None else p.loop.call_later(
            timeout, _expire, future, error(f"no progress within {timeout:g} s"))
        try:
            await future
        finally:
            if timer is not None:
                timer.cancel()
            if slot == "reader" and p.reader is future:
                p.reader = None

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("the asyncio backend carries plain http:// only; "
                                    "https engines use httpcore's default backend")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle connection the engine closed or wrote to
            p = self._protocol
            return bool(p.buffer) or p.eof or p.closed
        if info == "socket":
            return self._transport.get_extra_info("socket")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        return None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend for plain TCP on the running asyncio loop."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None
                          ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = None if local_address is None else (local_address, 0)
        try:
            transport, protocol = await asyncio.wait_for(loop.create_connection(
                lambda: _Protocol(loop), host, port, local_addr=local), timeout)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise httpcore.ConnectTimeout(f"connecting to {host}:{port} took over "
                                          f"{timeout:g} s") from exc
        except OSError as exc:
            raise httpcore.ConnectError(_describe(exc)) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            for option in socket_options or ():
                sock.setsockopt(*option)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return AsyncioStream(transport, protocol)  # type: ignore[arg-type]

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("the asyncio backend carries TCP only")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

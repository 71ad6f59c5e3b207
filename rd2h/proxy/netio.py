"""The proxy's sockets to its engines: an httpcore network backend on asyncio's own
streams, in place of httpcore's default (anyio).

Why. httpcore's default backend wraps every socket read and write in an anyio cancel
scope (``fail_after``), and each scope asks which async library runs (sniffio) and
which task is current. Under ``rd2h proxy``'s load (two upstream requests per client
request, the Decode one streamed chunk by chunk) that bookkeeping was about a tenth of
the proxy's CPU in py-spy (``benchmarks/RESULTS.md``, "The proxy's sockets on asyncio").
Here a read or write with a deadline is one ``asyncio.timeout``; without one, none.

What stays the same. httpcore keeps the pool, HTTP/1.1 parsing, keep-alive expiry and
its ``trace`` extension (``upstream.AttemptTrace``); this module only moves bytes, and
raises httpcore's own exceptions where the default backend does, so httpx reports the
same errors and ``upstream.resend_reason`` sees what it always saw:

* connect: ``ConnectTimeout`` past the deadline, ``ConnectError`` for any ``OSError``
  (refused, unreachable);
* read: ``b""`` at end of stream (httpcore then raises "Server disconnected without
  sending a response" when no response came), ``ReadError`` for a reset,
  ``ReadTimeout`` past the deadline;
* write: ``WriteError`` when the connection is lost, ``WriteTimeout`` past the
  deadline;
* ``get_extra_info("is_readable")``: whether an idle pooled socket has bytes or EOF
  waiting (httpcore then drops it instead of reusing it).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore

# httpcore's own readiness check for pooled sockets (public in all 1.x releases).
from httpcore._utils import is_socket_readable

SocketOption = tuple[int, int, Any]


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connection: an asyncio ``StreamReader`` / ``StreamWriter`` pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc) or "read timed out") from exc
        except OSError as exc:
            raise httpcore.ReadError(_describe(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            if self._writer.is_closing():  # asyncio would drop the bytes silently
                raise ConnectionResetError("connection closed")
            self._writer.write(buffer)
            if timeout is None:
                await self._writer.drain()
            else:
                async with asyncio.timeout(timeout):
                    await self._writer.drain()
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc) or "write timed out") from exc
        except OSError as exc:
            raise httpcore.WriteError(_describe(exc)) from exc

    async def aclose(self) -> None:
        # Closing the transport is immediate; waiting for the peer's side is not needed
        # (and could wait on an engine that stopped answering).
        self._writer.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc) or "TLS handshake timed out") from exc
        except (OSError, ssl.SSLError) as exc:
            self._writer.close()
            raise httpcore.ConnectError(_describe(exc)) from exc
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return is_socket_readable(self._writer.get_extra_info("socket"))
        key = {"socket": "socket", "ssl_object": "ssl_object", "client_addr": "sockname",
               "server_addr": "peername"}.get(info)
        return None if key is None else self._writer.get_extra_info(key)


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Opens ``AsyncioStream`` connections (TCP, or a Unix socket)."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[SocketOption] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        local = None if local_address is None else (local_address, 0)
        return await self._connect(
            asyncio.open_connection(host, port, local_addr=local), timeout, socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[SocketOption] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        return await self._connect(asyncio.open_unix_connection(path), timeout,
                                   socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    @staticmethod
    async def _connect(opening: Any, timeout: float | None,
                       socket_options: Iterable[SocketOption] | None) -> AsyncioStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await opening
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc) or "connect timed out") from exc
        except OSError as exc:
            raise httpcore.ConnectError(_describe(exc)) from exc
        sock: socket.socket | None = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets TCP_NODELAY on its TCP sockets, as anyio does.
            for option in socket_options or ():
                sock.setsockopt(*option)
        return AsyncioStream(reader, writer)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

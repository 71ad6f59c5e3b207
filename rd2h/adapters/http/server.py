"""Runs an ASGI app under uvicorn (kept here so only adapters import uvicorn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    """Calls ``before_shutdown`` (on the event loop) as soon as shutdown begins, before
    uvicorn waits for open connections: long polls can end at once instead of holding
    the graceful shutdown to its deadline."""

    def __init__(self, config: uvicorn.Config, before_shutdown: Callable[[], None] | None):
        super().__init__(config)
        self._before_shutdown = before_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        if self._before_shutdown is not None:
            self._before_shutdown()
        await super().shutdown(sockets)


def serve(app: Any, host: str, port: int, *, log_level: str = "info",
          graceful_shutdown_s: int = 5, keep_alive_s: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM; open connections get ``graceful_shutdown_s`` to finish.

    ``keep_alive_s``: idle client connections are closed after this long. An app whose
    ``state.before_shutdown`` is set has it called when shutdown begins."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(),
        timeout_graceful_shutdown=graceful_shutdown_s, timeout_keep_alive=keep_alive_s,
        # A line per request is I/O on the request path; the proxy's /metrics counts them.
        access_log=log_level.lower() == "debug",
    )
    hook = getattr(getattr(app, "state", None), "before_shutdown", None)
    _Server(config, hook).run()

"""Runs an ASGI app under uvicorn (kept here so only adapters import uvicorn)."""

from __future__ import annotations

from typing import Any

import uvicorn


def serve(app: Any, host: str, port: int, *, log_level: str = "info",
          graceful_shutdown_s: int = 5, keep_alive_s: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM; open connections get ``graceful_shutdown_s`` to finish.

    ``keep_alive_s``: idle client connections are closed after this long."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(),
        timeout_graceful_shutdown=graceful_shutdown_s, timeout_keep_alive=keep_alive_s,
        # A line per request is I/O on the request path; the proxy's /metrics counts them.
        access_log=log_level.lower() == "debug",
    )
    uvicorn.Server(config).run()

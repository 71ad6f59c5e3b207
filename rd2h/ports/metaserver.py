"""Metaserver port (spec 3.1 item 4): Decode's scheduler posts its contact
information for a request to the proxy's metaserver without blocking the step.

The Decode scheduler depends on this port, not on an HTTP library; the httpx
adapter (``rd2h.adapters.http.metaserver``) implements it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class MetaserverStats:
    """Counters since the client started.

    ``delivered`` counts posts the metaserver answered, including the
    ``http_errors`` among them (an HTTP error status counts as delivered, spec
    10). ``transport_errors`` counts failed attempts (each one retried);
    ``failed`` counts posts dropped for a reason a retry cannot fix;
    ``cancelled`` counts posts dropped undelivered by ``cancel``/``shutdown``.
    """

    delivered: int = 0
    http_errors: int = 0
    transport_errors: int = 0
    failed: int = 0
    cancelled: int = 0
    pending: int = 0


class MetaserverPoster(Protocol):
    def post(self, request_id: str, url: str, payload: Mapping[str, Any]) -> None:
        """Queue one JSON post for ``request_id`` and return at once.

        Raises ``ValueError`` at once for a post that can never succeed (a URL that
        is not http(s) with a host, a payload that is not JSON-serialisable), so
        the caller can fail that request instead of waiting for it.
        """
        ...

    def cancel(self, request_id: str) -> int:
        """Drop the request's queued posts and retry timers; returns how many were dropped.
        A post already on the wire finishes but is not retried."""
        ...

    def pending(self) -> int:
        """Posts queued, waiting for a retry, or on the wire."""
        ...

    def take_failed(self) -> dict[str, str]:
        """Posted requests the metaserver reported will get no KV (request id -> reason),
        since the last call; a request is reported at most once."""
        ...

    def stats(self) -> MetaserverStats: ...

    def shutdown(self, timeout: float) -> bool:
        """Cancel everything and stop the background threads within ``timeout`` seconds;
        False if a thread was still busy at the deadline (it is a daemon and exits after
        its current attempt)."""
        ...

"""Control channel ports (spec 4): Decode binds one ROUTER per rank; Prefill
connects one DEALER per Decode endpoint. Payloads are already-encoded frames.

Liveness: both sides report connections the transport saw close (peer process
gone, TCP reset, heartbeat timeout) through ``disconnected()``, so the app can
fail the work that depended on them at once instead of waiting out a deadline.
"""

from __future__ import annotations

from typing import Protocol


class ControlServer(Protocol):
    """Decode side: a bound socket that receives ``(identity, payload)`` pairs."""

    @property
    def endpoint(self) -> str: ...

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        """Next message (empty delimiter frames removed), or None after ``timeout``."""
        ...

    def recv_many(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        """Every message already queued (up to ``limit``), else wait ``timeout`` for one
        (an empty list: none came, a connection was lost or ``wake`` was called). The
        Decode loop handles a backlog in one wake this way."""
        ...

    def send(self, identity: bytes, payload: bytes) -> bool:
        """Reply; False when the reply cannot be delivered."""
        ...

    def disconnected(self) -> list[bytes]:
        """Identities (as ``recv`` returned them) whose connection closed since the last
        call. ``recv`` returns early (None) when one is seen, so the loop reacts at once."""
        ...

    def wake(self) -> None:
        """Make a concurrent or the next ``recv`` return None at once (thread-safe)."""
        ...

    def shed(self) -> list[tuple[bytes, int, int]]:
        """``(identity, messages, bytes)`` the server dropped since the last call, unread,
        because that peer sent more than its receive budget (a flood faster than the
        loop); empty for a server without one."""
        ...

    def close(self) -> None: ...


class ControlClients(Protocol):
    """Prefill side: one connection per Decode endpoint, polled together."""

    def connect(self, endpoint: str) -> None:
        """Open a connection to ``endpoint`` (e.g. ``tcp://host:port``); idempotent."""
        ...

    def disconnect(self, endpoint: str) -> None: ...

    def send(self, endpoint: str, payload: bytes, timeout: float = 5.0) -> None:
        """Queue one frame; raises ``ConnectionError`` if the endpoint is unreachable
        (or cannot take the frame) within ``timeout``; ``poll`` then returns once it can."""
        ...

    def poll(self, timeout: float) -> list[tuple[str, bytes]]:
        """Replies that arrived, as ``(endpoint, payload)``; waits at most ``timeout``
        (also with no connection), or less when ``wake`` is called or a connection whose
        ``send`` raised can take a frame now (it may return nothing then)."""
        ...

    def disconnected(self) -> list[str]:
        """Endpoints whose established connection closed since the last call (Decode
        gone or silent past the heartbeat timeout). Replies that arrived before the
        loss are returned by ``poll`` first; ``poll`` returns early when one is seen."""
        ...

    def reconnected(self) -> list[str]:
        """Endpoints reported by ``disconnected`` whose connection was established again
        since (Decode back behind the same address); reported after their loss."""
        ...

    def wake(self) -> None:
        """Interrupt a poll from another thread (thread-safe)."""
        ...

    def close(self) -> None: ...

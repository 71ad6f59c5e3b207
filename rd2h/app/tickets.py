"""Per-announcement completion for Prefill: which ``submit`` a reply belongs to.

Replies from one Decode endpoint arrive in the order the announcements were
sent (one DEALER/ROUTER connection, one receive loop), so the oldest open
ticket of ``(layer, endpoint)`` owns the next reply. A ticket resolves when
every endpoint it targeted replied, or when its layer failed or expired; the
error, if any, is the first one seen. The connector uses tickets to know when a
request's blocks may be freed (``finished_sending``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable


class AnnouncementTickets:
    def __init__(self) -> None:
        self._fifo: dict[tuple[int, str], deque[Hashable]] = {}
        self._left: dict[Hashable, int] = {}
        self._error: dict[Hashable, str] = {}
        self._resolved: list[tuple[Hashable, str | None]] = []

    def open(self, ticket: Hashable, layer_idx: int, endpoints: Iterable[str]) -> None:
        eps = list(endpoints)
        if ticket in self._left:
            raise ValueError(f"ticket {ticket!r} is already open")
        if not eps:
            self._resolved.append((ticket, None))
            return
        self._left[ticket] = len(eps)
        for ep in eps:
            self._fifo.setdefault((layer_idx, ep), deque()).append(ticket)

    def reply(self, layer_idx: int, endpoint: str, error: str | None) -> None:
        """One reply (or a local failure) for the oldest open announcement."""
        q = self._fifo.get((layer_idx, endpoint))
        if not q:
            return
        ticket = q.popleft()
        if not q:
            del self._fifo[(layer_idx, endpoint)]
        self._count(ticket, error)

    def fail_layer(self, layer_idx: int, error: str) -> None:
        for key in [k for k in self._fifo if k[0] == layer_idx]:
            for ticket in self._fifo.pop(key):
                self._count(ticket, error)

    def fail_endpoint(self, endpoint: str, error: str) -> None:
        """No reply will come from ``endpoint`` (connection lost or reset)."""
        for key in [k for k in self._fifo if k[1] == endpoint]:
            for ticket in self._fifo.pop(key):
                self._count(ticket, error)

    def fail_all(self, error: str) -> None:
        for layer_idx in sorted({k[0] for k in self._fifo}):
            self.fail_layer(layer_idx, error)

    def take_resolved(self) -> list[tuple[Hashable, str | None]]:
        out, self._resolved = self._resolved, []
        return out

    @property
    def open_count(self) -> int:
        return len(self._left)

    def _count(self, ticket: Hashable, error: str | None) -> None:
        if ticket not in self._left:
            return
        if error is not None:
            self._error.setdefault(ticket, error)
        self._left[ticket] -= 1
        if self._left[ticket] <= 0:
            del self._left[ticket]
            self._resolved.append((ticket, self._error.pop(ticket, None)))

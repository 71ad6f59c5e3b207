"""The vLLM role's window on the Prefill session's request book: every call takes the
sender's one lock (the session owns the book; nothing else holds request state)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from rd2h.domain.prefill.prefill_session import PrefillSession, RequestNews
from rd2h.ports.runtime import Clock


class SessionRequestsView:
    def __init__(self, cond: threading.Condition, session: PrefillSession,
                 clock: Clock) -> None:
        self._cond = cond
        self._session = session
        self._clock = clock

    def start_step(self, sends: Iterable[tuple[str, int]]) -> frozenset[str]:
        """The requests whose sends this step announces (see ``PrefillRequestBook``)."""
        with self._cond:
            return self._session.start_step(sends)

    def release(self, finished_by_vllm: Iterable[str]) -> tuple[str, ...]:
        with self._cond:
            return self._session.book.release(finished_by_vllm)

    def open_requests(self, request_ids: Iterable[str]) -> dict[str, int]:
        with self._cond:
            return self._session.book.open_tickets(request_ids)

    def wait_settled(self, request_ids: Iterable[str], timeout: float) -> dict[str, int]:
        """Block until no announcement naming ``request_ids`` is open, at most ``timeout``
        seconds; returns those still open (empty: all settled)."""
        rids = tuple(request_ids)
        deadline = self._clock.now() + timeout
        with self._cond:
            while still := self._session.book.open_tickets(rids):
                remaining = deadline - self._clock.now()
                if remaining <= 0:
                    return still
                self._cond.wait(min(remaining, 1.0))
            return {}

    def errors(self, request_ids: Iterable[str]) -> dict[str, str]:
        with self._cond:
            return self._session.book.errors(request_ids)

    def held(self) -> dict[str, int]:
        with self._cond:
            return self._session.book.held()

    def take_news(self) -> list[RequestNews]:
        with self._cond:
            return self._session.take_news()

    @property
    def failed(self) -> int:
        with self._cond:
            return self._session.book.requests_failed

    @property
    def skipped(self) -> int:
        with self._cond:
            return self._session.book.requests_skipped

    def counters(self) -> dict[str, int]:
        with self._cond:
            return self._session.book.counters()

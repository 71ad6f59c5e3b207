"""The request book a ``PrefillSession`` owns (``rd2h.domain.prefill_book``), and what
the session tells its driver about requests: the vLLM role asks the session, under the
driver's one lock, which sends to announce, which requests are settled or released.

An announcement that names requests is one ticket per Decode endpoint, keyed by the
announcement id; the session resolves it in the book as each entry ends (with the
requests that endpoint skipped), so nothing outside the session tracks tickets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rd2h.domain.prefill_book import (
    Announced,
    BookEvent,
    PrefillRequestBook,
    RequestWithheld,
)

# What happened to requests, in order, for the driver to log (``take_news``).
RequestNews = BookEvent | RequestWithheld | Announced
Named = Mapping[str, Sequence[tuple[str, str]]]  # endpoint -> (request id, ext id) pairs


class SessionRequests:
    """The request half of ``PrefillSession`` (it sets ``_book`` and ``_news``)."""

    _book: PrefillRequestBook
    _news: list[RequestNews]

    def start_step(self, sends: Iterable[tuple[str, int]]) -> frozenset[str]:
        """This step's sends as (request id, main blocks announced once it went); returns
        the requests to announce (``PrefillRequestBook.start_step``)."""
        verdict = self._book.start_step(sends)
        self._news += verdict.withheld
        return verdict.kept

    def release(self, finished_by_vllm: Iterable[str]) -> tuple[str, ...]:
        """The requests vLLM finished whose announcements were all answered (forgotten)."""
        return self._book.release(finished_by_vllm)

    def open_requests(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Open tickets per request, for those of ``request_ids`` that still have any."""
        return self._book.open_tickets(request_ids)

    def request_errors(self, request_ids: Iterable[str]) -> dict[str, str]:
        return self._book.errors(request_ids)

    def held_requests(self) -> dict[str, int]:
        """Requests (and their main blocks) this rank still holds for Decode."""
        return self._book.held()

    @property
    def requests_failed(self) -> int:
        return self._book.requests_failed

    @property
    def requests_skipped(self) -> int:
        """Requests Decode no longer knew (aborted there)."""
        return self._book.requests_skipped

    def request_counters(self) -> dict[str, int]:
        return self._book.counters()

    def take_news(self) -> list[RequestNews]:
        """What happened to requests since the last call, in order."""
        out, self._news = self._news, []
        return out

    # -- the session's own calls
    def _open_tickets(self, aid: int, named: Named, final: Iterable[str]) -> None:
        news = self._book.announce(aid, named, final)
        if news.first or news.final:
            self._news.append(news)

    def _close_ticket(self, aid: int, endpoint: str, error: str | None,
                      skipped: tuple[str, ...] | None) -> None:
        self._news += self._book.record_answers(
            [(aid, endpoint, error)], {(aid, endpoint): skipped} if skipped else {})

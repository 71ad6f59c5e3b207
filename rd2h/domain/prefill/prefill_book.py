"""One Prefill rank's request state from its first send to its release (spec 11).

Owned by ``PrefillSession`` (``rd2h.domain.prefill.prefill_session``); the ticket is the
session's announcement id. Flow per worker step: ``start_step(sends)`` (which sends
are announced), then per layer ``announce(ticket, targets)``; Decode's answers come
back through ``record_answers`` (or ``resolve`` / ``skip`` one ticket at a time);
``release`` hands vLLM the requests it finished whose announcements were all
answered. A ticket is one layer announcement to one Decode endpoint: a slow Decode
instance holds back only the requests it reads, not those other instances read in
the same layer.

Nothing here locks, logs or reads a clock: every call returns what happened
(requests withheld, failed, skipped, released) and the driver logs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

Ticket = tuple[int, str]  # (announcement id, Decode endpoint)


@dataclass(frozen=True)
class RequestWithheld:
    """A send of ``request`` is not announced: an earlier announcement of it failed.
    Reported once per request (its first withheld send)."""

    request: str
    error: str


@dataclass(frozen=True)
class RequestFailed:
    """Decode did not read a layer of ``request`` (its first failure; counted once)."""

    request: str
    error: str


@dataclass(frozen=True)
class RequestSkipped:
    """Decode at ``endpoint`` answered without reading ``request``: it no longer knows
    it (aborted, or failed there). No more of it is announced."""

    request: str
    endpoint: str


BookEvent = RequestFailed | RequestSkipped


@dataclass(frozen=True)
class StepSends:
    """``start_step``'s verdict: the requests whose sends are announced this step, and
    those newly withheld."""

    kept: frozenset[str]
    withheld: tuple[RequestWithheld, ...] = ()


@dataclass(frozen=True)
class Announced:
    """``announce``'s news: requests announced for the first time (``first``) and those
    whose final send went with this announcement (``final``)."""

    first: tuple[str, ...] = ()
    final: tuple[str, ...] = ()


@dataclass
class _Request:
    open_tickets: set[Ticket] = field(default_factory=set)
    finished: bool = False  # vLLM finished it here
    error: str | None = None
    withheld: bool = False  # a later send was not announced because of ``error``
    announced: bool = False  # a layer of it was announced
    ext: str = ""  # the id announcements carry (Decode's replies name it)
    blocks: int = 0  # main blocks of it announced so far (the held-blocks gauge)


class PrefillRequestBook:
    """State per internal request id, kept until vLLM finished the request and every
    ticket naming it was answered or failed (then ``release`` drops it)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}
        self._ticket_reqs: dict[Ticket, tuple[str, ...]] = {}
        self.requests_failed = 0
        self.requests_skipped = 0  # Decode no longer knew them (aborted there)

    # -- per step
    def start_step(self, sends: Iterable[tuple[str, int]]) -> StepSends:
        """This step's sends as (request id, main blocks announced once it went). A
        request with a failed announcement gets no more: Decode failed it, or never
        read the failed part and must not complete it without that (it fails at its
        own deadline instead)."""
        kept: set[str] = set()
        withheld: list[RequestWithheld] = []
        for rid, blocks in sends:
            r = self._requests.setdefault(rid, _Request())
            if r.error is None:
                kept.add(rid)
                r.blocks = max(r.blocks, blocks)
            elif not r.withheld:
                r.withheld = True
                withheld.append(RequestWithheld(rid, r.error))
        return StepSends(frozenset(kept), tuple(withheld))

    def announce(
        self,
        ticket: int,
        targets: Mapping[str, Sequence[tuple[str, str]]],
        final: Iterable[str] = (),
    ) -> Announced:
        """One layer announcement: per Decode endpoint, the (request id, ext id) pairs
        it names; each endpoint opens the ticket ``(ticket, endpoint)``. ``final``: the
        requests whose last send this announcement carries."""
        first: list[str] = []
        for endpoint, pairs in targets.items():
            key = (ticket, endpoint)
            self._ticket_reqs[key] = tuple(dict.fromkeys(rid for rid, _ in pairs))
            for rid, ext in pairs:
                r = self._requests.setdefault(rid, _Request())
                r.open_tickets.add(key)
                r.ext = ext
                if not r.announced:
                    r.announced = True
                    first.append(rid)
        for rid in final:
            self._requests.setdefault(rid, _Request())
        return Announced(tuple(first), tuple(dict.fromkeys(final)))

    # -- Decode's answers
    def record_answers(
        self,
        resolved: Iterable[tuple[int, str, str | None]],
        skipped: Mapping[Ticket, tuple[str, ...]],
    ) -> list[BookEvent]:
        """Tickets answered (error None) or failed, in the order the answers came, with
        the ext ids each answer said Decode skipped. Returns what happened, in order."""
        events: list[BookEvent] = []
        for ticket, endpoint, error in resolved:
            key = (ticket, endpoint)
            exts = skipped.get(key)
            if exts is not None:
                events.extend(self.skip(key, exts))
            events.extend(self.resolve(key, error))
        return events

    def skip(self, ticket: Ticket, exts: Iterable[str]) -> list[RequestSkipped]:
        """Decode answered ``ticket`` without reading these requests (by ext id): it no
        longer knows them. No more of them is announced; they are released once vLLM
        finished them here."""
        gone = set(exts)
        out = []
        for rid in self._ticket_reqs.get(ticket, ()):
            r = self._requests.get(rid)
            if r is None or r.ext not in gone or r.error is not None:
                continue
            r.error = (f"decode endpoint {ticket[1]} no longer reads the request "
                       f"(aborted, or failed there)")
            self.requests_skipped += 1
            out.append(RequestSkipped(rid, ticket[1]))
        return out

    def resolve(self, ticket: Ticket, error: str | None) -> list[RequestFailed]:
        """``ticket`` was answered (``error`` None) or failed: it no longer holds its
        requests. Returns the requests it failed for the first time."""
        out = []
        for rid in self._ticket_reqs.pop(ticket, ()):
            r = self._requests.get(rid)
            if r is None:
                continue
            r.open_tickets.discard(ticket)
            if error is not None and r.error is None:
                r.error = error
                self.requests_failed += 1
                out.append(RequestFailed(rid, error))
        return out

    # -- release
    def release(self, finished_by_vllm: Iterable[str]) -> tuple[str, ...]:
        """vLLM finished these requests (ids not held here are ignored). Returns, and
        forgets, every request it finished whose tickets were all answered."""
        for rid in finished_by_vllm:
            r = self._requests.get(rid)
            if r is not None:
                r.finished = True
        done = tuple(rid for rid, r in self._requests.items()
                     if r.finished and not r.open_tickets)
        for rid in done:
            del self._requests[rid]
        return done

    # -- queries
    def open_tickets(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Open tickets per request, for those of ``request_ids`` that still have any
        (preemption's settle waits until this is empty)."""
        return {rid: len(r.open_tickets) for rid in request_ids
                if (r := self._requests.get(rid)) is not None and r.open_tickets}

    def errors(self, request_ids: Iterable[str]) -> dict[str, str]:
        """The error of each of ``request_ids`` that has one."""
        return {rid: r.error for rid in request_ids
                if (r := self._requests.get(rid)) is not None and r.error is not None}

    def held(self) -> dict[str, int]:
        """Requests (and their main blocks) this rank still holds for Decode."""
        return {"held_requests": len(self._requests),
                "held_blocks": sum(r.blocks for r in self._requests.values())}

    # -- leak accounting
    def counters(self) -> dict[str, int]:
        return {"requests": len(self._requests), "tickets": len(self._ticket_reqs)}

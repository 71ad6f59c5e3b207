"""Every lifecycle in one table, every change through it: a Prefill entry's phases
(``ENTRY_TRANSITIONS``, ``Entry.move``), a Decode endpoint link's states
(``TRANSITIONS``, ``Link.move``), its connection as the transport reports it
(``CONNECTIONS``, ``Link.report``) and a Decode request's phases in its rank's book
(``REQUEST_TRANSITIONS``, ``DecodeRequestBook._move``). Each allowed pair moves to its
state; each other pair raises; and no code outside the tables assigns a phase or a
state."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from rd2h.domain.decode.request_book import (
    REQUEST_TRANSITIONS,
    TERMINAL_PHASES,
    DecodeRequestBook,
    RequestEvent,
    RequestPhase,
    RequestTransitionError,
    next_phase,
)
from rd2h.domain.prefill.prefill_state import (
    CONNECTIONS,
    ENTRY_TRANSITIONS,
    TRANSITIONS,
    Entry,
    EntryEvent,
    EntryTransitionError,
    Link,
    LinkEvent,
    LinkState,
    LinkTransitionError,
    Phase,
    Transport,
    TransportEvent,
)
from rd2h.domain.wire.protocol import ReadReadyBatch

ROOT = Path(__file__).resolve().parents[2] / "rd2h"


def _entry(phase: Phase) -> Entry:
    batch = ReadReadyBatch("tcp://d:1", 0, 0, 0, 0, 0, ())
    return Entry(1, 0, "tcp://d:1", batch, phase, deadline=5.0)


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, EntryEvent)))
def test_every_entry_pair_moves_by_the_table_or_is_refused(phase: Phase,
                                                           event: EntryEvent) -> None:
    entry = _entry(phase)
    want = ENTRY_TRANSITIONS.get((phase, event))
    if want is None:
        with pytest.raises(EntryTransitionError, match=f"entry {phase.value}"):
            entry.move(event, 9.0)
        assert (entry.phase, entry.deadline) == (phase, 5.0)  # unchanged
    else:
        assert entry.move(event, 9.0) == want == entry.phase
        assert entry.deadline == 9.0


def test_the_entry_table_reaches_every_phase_and_ends_from_each() -> None:
    reached = {Phase.EVENT} | set(ENTRY_TRANSITIONS.values())
    assert reached == set(Phase)
    live = set(Phase) - {Phase.ENDED}
    assert {p for (p, e) in ENTRY_TRANSITIONS if e == EntryEvent.END} == live
    assert not any(p == Phase.ENDED for p, _ in ENTRY_TRANSITIONS)  # ENDED is final


@pytest.mark.parametrize(("state", "event"), list(itertools.product(LinkState, LinkEvent)))
def test_every_link_pair_moves_by_the_table_or_is_refused(state: LinkState,
                                                          event: LinkEvent) -> None:
    link = Link(state=state)
    want = TRANSITIONS.get((state, event))
    if want is None:
        with pytest.raises(LinkTransitionError, match=f"link {state.value}"):
            link.move(event)
        assert link.state == state
    else:
        assert link.move(event) == want == link.state


@pytest.mark.parametrize(("state", "event"), list(itertools.product(Transport,
                                                                     TransportEvent)))
def test_every_connection_report_moves_by_its_table(state: Transport,
                                                    event: TransportEvent) -> None:
    link = Link(transport=state)
    assert link.report(event, "lost: why") == CONNECTIONS[(state, event)] == link.transport
    assert link.gone == ("lost: why" if link.transport == Transport.LOST else "")


def test_refused_and_lost_are_what_notify_and_gone_read() -> None:
    from rd2h.domain.prefill.prefill_state import LinkState

    assert Link(state=LinkState.REFUSED).notify and not Link(state=LinkState.BACKOFF).notify
    link = Link()
    link.report(TransportEvent.LOSS, "gone")
    assert link.gone == "gone"
    link.report(TransportEvent.RESTORED)
    assert link.gone == "" and link.transport == Transport.CONNECTED


@pytest.mark.parametrize(("attr", "allowed"), [("phase", "def move"), ("state", "def move"),
                                               ("transport", "def report")])
def test_nothing_outside_the_tables_assigns_a_phase_or_a_state(attr: str, allowed: str) -> None:
    """``x.phase = ...`` / ``x.state = ...`` appear only in the ``move`` methods."""
    pattern = re.compile(rf"\.{attr}\s*=[^=]|\.{attr},.*=(?!=)")
    found = []
    for path in (ROOT / "domain" / "prefill").glob("*.py"):
        text = path.read_text().splitlines()
        for i, line in enumerate(text):
            if pattern.search(line) and "self." + attr not in line:
                found.append(f"{path.name}:{i + 1}: {line.strip()}")
            elif pattern.search(line):
                # self.phase / self.state: only inside a ``move`` method
                above = next((x for x in reversed(text[:i]) if x.strip().startswith("def ")),
                             "")
                if allowed not in above:
                    found.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert found == []


# ====================================================================== a Decode request


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(RequestPhase,
                                                                     RequestEvent)))
def test_every_request_pair_moves_by_the_table_or_is_refused(phase: RequestPhase,
                                                             event: RequestEvent) -> None:
    want = REQUEST_TRANSITIONS.get((phase, event))
    if want is None:
        with pytest.raises(RequestTransitionError, match=f"'r' {phase.value}: .*{event.value}"):
            next_phase(phase, event, "r")
    else:
        assert next_phase(phase, event, "r") == want


def test_the_request_table_reaches_every_phase_and_forgets_from_each_live_one() -> None:
    assert {RequestPhase.NEW} | set(REQUEST_TRANSITIONS.values()) == set(RequestPhase)
    live = set(RequestPhase) - {RequestPhase.NEW, RequestPhase.GONE}
    assert {p for (p, e) in REQUEST_TRANSITIONS if e == RequestEvent.FORGET} == live
    assert not any(p == RequestPhase.GONE for p, _ in REQUEST_TRANSITIONS)  # final
    # Once over here, a request never waits for its KV again.
    assert not any(p in TERMINAL_PHASES and new == RequestPhase.WAITING
                   for (p, _), new in REQUEST_TRANSITIONS.items())


def test_a_book_walks_its_requests_through_the_table() -> None:
    """Each path a request takes in a two-rank book, phase by phase."""
    a, b = DecodeRequestBook(), DecodeRequestBook()
    sfx = "X" * 9

    def step(busy: tuple[str, ...] = ()) -> None:
        reports = [a.local_report(), b.local_report()]
        a.finish_step(reports, busy=busy)
        b.finish_step(reports)

    a.admit("r" + sfx, [1], [], 0.0)
    assert a.phase("r") == RequestPhase.WAITING and b.phase("r") == RequestPhase.NEW
    a.record_done(["r"], 0, 1)
    b.record_done(["r"], 0, 1)  # before its admission on b: an orphan, ended there
    assert a.phase("r") == b.phase("r") == RequestPhase.ENDED_HERE
    step(busy=("r",))  # ended on every rank; a read in flight on a, b has not admitted
    assert a.phase("r") == RequestPhase.HELD
    assert b.phase("r") == RequestPhase.AWAITING_ADMISSION
    b.admit("r" + sfx, [1], [], 1.0)
    assert b.phase("r") == RequestPhase.AWAITING_ADMISSION
    step()
    assert a.phase("r") == b.phase("r") == RequestPhase.NEW  # reported and forgotten
    assert all(v == 0 for book in (a, b) for v in book.counters().values())


def test_nothing_outside_move_assigns_a_request_phase() -> None:
    """The book's ``_phase`` map is written only inside ``_move``."""
    path = ROOT / "domain" / "decode" / "request_book.py"
    text = path.read_text().splitlines()
    found = []
    for i, line in enumerate(text):
        if re.search(r"_phase\[[^]]*\]\s*=[^=]|del self\._phase|_phase\.(pop|clear|update|"
                     r"setdefault)", line):
            above = next((x for x in reversed(text[:i]) if x.strip().startswith("def ")), "")
            if "def _move" not in above:
                found.append(f"{i + 1}: {line.strip()}")
    assert found == []

"""Every lifecycle in one table, every change through it: a Prefill entry's phases
(``ENTRY_TRANSITIONS``, ``Entry.move``), a Decode endpoint link's states
(``TRANSITIONS``, ``Link.move``) and its connection as the transport reports it
(``CONNECTIONS``, ``Link.report``). Each allowed pair moves to its state; each other pair
raises; and no code outside the tables assigns a phase or a state."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

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

"""A Prefill link's states change through one table (``TRANSITIONS``), as h11 does:
``Link.move`` takes every allowed (state, event) pair to its new state and refuses any
other pair."""

from __future__ import annotations

import pytest

from rd2h.domain.prefill.prefill_state import (
    TRANSITIONS,
    Link,
    LinkEvent,
    LinkState,
    LinkTransitionError,
)

S, E = LinkState, LinkEvent

EXPECTED = {
    (S.DOWN, E.HANDSHAKE): S.HANDSHAKING,
    (S.HANDSHAKING, E.ACK): S.READY,
    (S.HANDSHAKING, E.HANDSHAKE_FAILED): S.BACKOFF,
    (S.HANDSHAKING, E.INCOMPATIBLE): S.REFUSED,
    (S.BACKOFF, E.BACKOFF_OVER): S.DOWN,
    (S.REFUSED, E.BACKOFF_OVER): S.DOWN,
    (S.READY, E.READ_FAILED): S.DOWN,
    (S.DOWN, E.RESET): S.DOWN,
    (S.HANDSHAKING, E.RESET): S.DOWN,
    (S.READY, E.RESET): S.DOWN,
    (S.BACKOFF, E.RESET): S.BACKOFF,
    (S.REFUSED, E.RESET): S.REFUSED,
    (S.DOWN, E.STOP): S.DOWN,
    (S.HANDSHAKING, E.STOP): S.DOWN,
    (S.READY, E.STOP): S.DOWN,
    (S.BACKOFF, E.STOP): S.DOWN,
    (S.REFUSED, E.STOP): S.DOWN,
}


def test_the_table_is_exactly_the_expected_one() -> None:
    assert dict(TRANSITIONS) == EXPECTED


@pytest.mark.parametrize(("state", "event"), sorted(EXPECTED))
def test_every_allowed_transition_moves_the_link(state: LinkState, event: LinkEvent) -> None:
    link = Link(state=state)
    assert link.move(event) == EXPECTED[(state, event)]
    assert link.state == EXPECTED[(state, event)]


REFUSED = sorted((state, event) for state in LinkState for event in LinkEvent
                 if (state, event) not in EXPECTED)


@pytest.mark.parametrize(("state", "event"), REFUSED)
def test_a_transition_not_in_the_table_raises_and_changes_nothing(
        state: LinkState, event: LinkEvent) -> None:
    link = Link(state=state)
    with pytest.raises(LinkTransitionError, match=f"{state.value}.*{event.value}"):
        link.move(event)
    assert link.state == state


def test_an_ack_on_a_ready_link_is_refused() -> None:
    with pytest.raises(LinkTransitionError):
        Link(state=S.READY).move(E.ACK)

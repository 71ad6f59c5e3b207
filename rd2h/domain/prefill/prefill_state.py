"""The state a ``PrefillSession`` keeps: its timeouts, entries, announcements, links."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from rd2h.domain.wire.protocol import ReadReadyBatch

# How late the sender's loop may notice a deadline (it ticks between polls and sends).
GATE_SLACK_S = 5.0


@dataclass(frozen=True)
class PrefillTimeouts:
    meta_ack_s: float = 10.0
    layer_ack_s: float = 30.0
    device_event_s: float = 30.0
    # After a failed handshake, sends to that endpoint fail at once for this long.
    reconnect_after_s: float = 5.0
    # A connection with nothing in flight for this long is closed and forgotten.
    idle_link_s: float = 300.0

    @property
    def longest_entry_s(self) -> float:
        """The longest one announcement to one endpoint can stay open under these
        deadlines: its device event, then a handshake, then a frame that waits in the
        outbox up to its reply deadline and, once it goes, a full reply deadline."""
        return self.device_event_s + self.meta_ack_s + 2 * self.layer_ack_s

    @property
    def gate_budget_s(self) -> float:
        """The one bound on how long a layer's storage may stay in use after it was
        announced: every entry ends within ``longest_entry_s``, and the driver fails
        one within ``GATE_SLACK_S`` of its deadline. The buffer-reuse wait, the
        preemption settle and the demo's gates all wait this long, never less."""
        return self.longest_entry_s + GATE_SLACK_S


class Phase(StrEnum):
    """Where an announcement entry waits (each under exactly one deadline)."""

    EVENT = "event"  # the layer's device event (device_event_s)
    HANDSHAKE = "handshake"  # the endpoint's MF_META ACK (meta_ack_s)
    SENT = "sent"  # the READ_READY_BATCH's reply (layer_ack_s)
    # Failed before its reply deadline (the connection reset) after it went out: Decode
    # may still read its blocks until that deadline (the hold the frame stated), so its
    # storage stays in use until then; the failure was reported already.
    HELD = "held"
    ENDED = "ended"  # answered or failed, its gate and ticket resolved: it is forgotten


class EntryEvent(StrEnum):
    """What moves an ``Entry`` from one ``Phase`` to another (``ENTRY_TRANSITIONS``)."""

    AWAIT_HANDSHAKE = "await_handshake"  # its link has no MF_META acknowledged yet
    SEND = "send"  # its READ_READY_BATCH goes out
    HOLD = "hold"  # failed after it went out, with its hold still ahead
    END = "end"  # answered or failed (a held one: its hold is over)


_P, _EE = Phase, EntryEvent
# Every allowed (phase, event) -> new phase; ``Entry.move`` refuses any other pair. Each
# phase but ENDED runs under one deadline, which the move sets.
ENTRY_TRANSITIONS: Mapping[tuple[Phase, EntryEvent], Phase] = {
    (_P.EVENT, _EE.AWAIT_HANDSHAKE): _P.HANDSHAKE,
    (_P.EVENT, _EE.SEND): _P.SENT,
    (_P.HANDSHAKE, _EE.SEND): _P.SENT,
    (_P.SENT, _EE.HOLD): _P.HELD,
    **{(phase, _EE.END): _P.ENDED for phase in (_P.EVENT, _P.HANDSHAKE, _P.SENT, _P.HELD)},
}


class LinkState(StrEnum):
    """A Decode endpoint's connection, as ``Link`` documents."""

    DOWN = "down"
    HANDSHAKING = "handshaking"
    READY = "ready"
    BACKOFF = "backoff"
    # Decode refused our MF_META (an incompatible build): a backoff in which announcements
    # still go out, unread there, so that Decode fails the requests they name at once.
    REFUSED = "refused"


class LinkEvent(StrEnum):
    """What moves a ``Link`` from one ``LinkState`` to another (``TRANSITIONS``)."""

    HANDSHAKE = "handshake"  # MF_META goes out on a link with none acknowledged
    ACK = "ack"  # Decode acknowledged it
    HANDSHAKE_FAILED = "handshake_failed"  # unsent, unauthenticated, lost or timed out
    INCOMPATIBLE = "incompatible"  # Decode answered MF_META with its refusal
    BACKOFF_OVER = "backoff_over"  # ``reconnect_after_s`` passed since
    READ_FAILED = "read_failed"  # READ_FAILED: Decode may have restarted; handshake again
    RESET = "reset"  # no reply will come on the connection (lost, or a reply was late)
    STOP = "stop"  # the session stopped


_S, _E = LinkState, LinkEvent
# Every allowed (state, event) -> new state; ``Link.move`` refuses any other pair. A
# reset leaves a backoff as it is (its handshake failed already; it ends at its deadline).
TRANSITIONS: Mapping[tuple[LinkState, LinkEvent], LinkState] = {
    (_S.DOWN, _E.HANDSHAKE): _S.HANDSHAKING,
    (_S.HANDSHAKING, _E.ACK): _S.READY,
    (_S.HANDSHAKING, _E.HANDSHAKE_FAILED): _S.BACKOFF,
    (_S.HANDSHAKING, _E.INCOMPATIBLE): _S.REFUSED,
    (_S.BACKOFF, _E.BACKOFF_OVER): _S.DOWN,
    (_S.REFUSED, _E.BACKOFF_OVER): _S.DOWN,
    (_S.READY, _E.READ_FAILED): _S.DOWN,
    (_S.DOWN, _E.RESET): _S.DOWN,
    (_S.HANDSHAKING, _E.RESET): _S.DOWN,
    (_S.READY, _E.RESET): _S.DOWN,
    (_S.BACKOFF, _E.RESET): _S.BACKOFF,
    (_S.REFUSED, _E.RESET): _S.REFUSED,
    **{(state, _E.STOP): _S.DOWN for state in LinkState},
}
BACKING_OFF = frozenset({LinkState.BACKOFF, LinkState.REFUSED})
"""States in which sends fail at once until the link's ``deadline``."""


class Transport(StrEnum):
    """What the transport last reported of the endpoint's connection (``CONNECTIONS``)."""

    CONNECTED = "connected"  # connected, or never reported lost
    LOST = "lost"  # reported lost and not re-established: sends fail at once


class TransportEvent(StrEnum):
    LOSS = "loss"  # the transport saw the connection close
    RESTORED = "restored"  # the transport connected to the endpoint again


_T, _TE = Transport, TransportEvent
# A link's connection, beside its handshake state (``TRANSITIONS``): every report of the
# transport moves it here, and nothing else does.
CONNECTIONS: Mapping[tuple[Transport, TransportEvent], Transport] = {
    (_T.CONNECTED, _TE.LOSS): _T.LOST,
    (_T.LOST, _TE.LOSS): _T.LOST,
    (_T.LOST, _TE.RESTORED): _T.CONNECTED,
    (_T.CONNECTED, _TE.RESTORED): _T.CONNECTED,
}


class LinkTransitionError(ValueError):
    """A ``Link.move`` that ``TRANSITIONS`` does not allow (a bug in the session)."""


class EntryTransitionError(ValueError):
    """An ``Entry.move`` that ``ENTRY_TRANSITIONS`` does not allow (a bug in the session)."""


@dataclass(eq=False)
class Entry:
    aid: int
    layer_idx: int
    endpoint: str
    batch: ReadReadyBatch
    phase: Phase
    deadline: float
    sent_at: float = 0.0
    on_wire: bool = False  # the frame went out (``PrefillSession.sent``)
    frame: int = -1  # which frame carried it (a layer run carries several entries)
    held_error: str = ""  # HELD: the failure its storage release will report

    def move(self, event: EntryEvent, deadline: float | None = None) -> Phase:
        """The one way ``phase`` changes: by ``ENTRY_TRANSITIONS`` (any other pair raises
        ``EntryTransitionError``), with the new phase's ``deadline`` when it has one."""
        new = ENTRY_TRANSITIONS.get((self.phase, event))
        if new is None:
            raise EntryTransitionError(f"entry {self.phase.value}: no transition on "
                                       f"{event.value}")
        self.phase = new
        if deadline is not None:
            self.deadline = deadline
        return new


@dataclass(eq=False)
class Announcement:
    layer_idx: int
    named: bool  # it names requests: the book holds them until each entry ended
    entries: dict[str, Entry] = field(default_factory=dict)
    error: str | None = None


@dataclass(eq=False)
class Link:
    """One Decode endpoint: ``down`` (no MF_META acknowledged on this connection),
    ``handshaking`` (until ``deadline``), ``ready``, ``backoff`` (a handshake failed for
    ``reason``; sends fail at once until ``deadline``) or ``refused`` (Decode refused our
    MF_META: a backoff in which announcements still go out, unread there, so that
    Decode fails the requests they name at once).

    ``transport``, beside it: ``lost`` once the transport reported the connection closed
    and until it connected again (``lost_reason`` says so); a handshake would only wait
    for ``meta_ack_s``, so sends fail at once meanwhile."""

    state: LinkState = LinkState.DOWN
    deadline: float = 0.0
    reason: str = ""
    waiting: list[Entry] = field(default_factory=list)
    inflight: list[Entry] = field(default_factory=list)
    last_used: float = 0.0
    transport: Transport = Transport.CONNECTED
    lost_reason: str = ""
    generation: int | None = None  # the Decode process's, from its ACK (None: unknown)
    layer_runs: bool = False  # its ACK said it reads layer runs (READ_READY_BATCH field 10)

    @property
    def notify(self) -> bool:
        """Announcements still go out to a refusing Decode (``refused``)."""
        return self.state == LinkState.REFUSED

    @property
    def gone(self) -> str:
        """Why sends fail at once while the connection is lost ("" when it is not)."""
        return self.lost_reason if self.transport == Transport.LOST else ""

    def move(self, event: LinkEvent) -> LinkState:
        """The one way ``state`` changes: by ``TRANSITIONS``; any other pair raises
        ``LinkTransitionError``. Returns the new state."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            raise LinkTransitionError(f"link {self.state.value}: no transition on "
                                      f"{event.value}")
        self.state = new
        return new

    def report(self, event: TransportEvent, reason: str = "") -> Transport:
        """The one way ``transport`` changes: by ``CONNECTIONS`` (every pair is allowed:
        the transport may repeat itself). A loss records ``reason``."""
        self.transport = CONNECTIONS[(self.transport, event)]
        self.lost_reason = reason if event == TransportEvent.LOSS else ""
        return self.transport


class Links(dict[str, Link]):
    """The session's links by endpoint."""

    def at(self, endpoint: str, now: float) -> Link:
        """The endpoint's link (new: ``down``); a backoff that ran out is ``down`` again."""
        link = self.get(endpoint)
        if link is None:
            link = self[endpoint] = Link(last_used=now)
        if link.state in BACKING_OFF and now >= link.deadline:
            link.move(LinkEvent.BACKOFF_OVER)
            link.reason = ""
        return link

    def deadlines(self, idle_s: float) -> list[float]:
        """When each link changes on its own: a handshake's deadline, or when
        ``close_idle`` forgets a link with nothing waiting (a backoff ends first)."""
        out = []
        for link in self.values():
            if link.state == LinkState.HANDSHAKING:
                out.append(link.deadline)
            elif not (link.waiting or link.inflight):
                idle_at = link.last_used + idle_s
                backoff = link.state in BACKING_OFF
                out.append(max(idle_at, link.deadline) if backoff else idle_at)
        return out

    def stop(self) -> list[str]:
        """Every link down; returns the endpoints whose handshake was under way."""
        handshaking = [ep for ep, link in self.items() if link.state == LinkState.HANDSHAKING]
        for link in self.values():
            link.move(LinkEvent.STOP)
        return handshaking

    def close_idle(self, now: float, idle_s: float) -> list[str]:
        """Forget links with nothing in flight for ``idle_s`` (Decode instances come and
        go; their connections must not pile up); returns their endpoints."""
        idle = [ep for ep, link in self.items()
                if (link.state in (LinkState.READY, LinkState.DOWN) or now >= link.deadline)
                and not (link.waiting or link.inflight or link.state == LinkState.HANDSHAKING)
                and link.last_used + idle_s <= now]  # the time ``deadlines`` names
        for ep in idle:
            del self[ep]
        return idle

"""What a ``PrefillSession`` answers about itself (its queries, split out of
``rd2h.domain.prefill_session``, which owns every rule)."""

from __future__ import annotations

from rd2h.domain.gates import GateState, StorageSlotGates
from rd2h.domain.prefill_state import Announcement, Links, Phase, PrefillTimeouts


class SessionQueries:
    """The session's state, read-only (the attributes ``PrefillSession`` sets)."""

    timeouts: PrefillTimeouts
    _gates: StorageSlotGates
    _announcements: dict[int, Announcement]
    _links: Links
    _dead: str | None

    def gate(self, layer_idx: int) -> GateState:
        return self._gates.state(layer_idx)

    def event_deadline(self, aid: int) -> float | None:
        """Until when announcement ``aid`` waits for its device event (None: it does not,
        e.g. its entries ended meanwhile)."""
        ann = self._announcements.get(aid)
        return None if ann is None else min(
            (e.deadline for e in ann.entries.values() if e.phase == Phase.EVENT), default=None)

    def next_deadline(self) -> float | None:
        """When ``tick`` next acts: an entry, a handshake, an idle link (None: never)."""
        times = [e.deadline for a in self._announcements.values() for e in a.entries.values()
                 if e.phase != Phase.HANDSHAKE]
        times += self._links.deadlines(self.timeouts.idle_link_s)
        return min(times, default=None)

    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def idle(self) -> bool:
        """Nothing announced is unresolved and every gate is open."""
        return not self._announcements and not self._gates.pending_layers

    @property
    def pending_layers(self) -> tuple[int, ...]:
        return self._gates.pending_layers

    def counters(self) -> dict[str, int]:
        """Leak accounting: every value is 0 when no announcement is in flight."""
        return {
            "pending_layers": len(self._gates.pending_layers),
            "closed_slots": self._gates.closed_slots,
            "unacked_sends": sum(len(link.inflight) for link in self._links.values()),
            "open_tickets": sum(1 for a in self._announcements.values() if a.named),
        }


"""Who contributes to a Decode request (spec 7.2, 8): contributor groups and peers.

``ContributorTracker`` counts which members of a request's contributor group
(the ``ratio`` Prefill ranks mapped to this Decode rank) reported its final
layer. ``PeerContributions`` remembers which Prefill connections announced
blocks of which unfinished requests, so that a connection that disappears fails
exactly the requests it was still contributing to. Pure bookkeeping.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from rd2h.domain.errors import ProtocolError


class ContributorTracker:
    """Which contributor members reported a request's final layer (spec 7.2)."""

    def __init__(self) -> None:
        self._members: dict[str, set[int]] = {}
        self._ratio: dict[str, int] = {}

    def report(self, ext_id: str, member: int, ratio: int) -> bool:
        """Record member's final-layer report; True exactly once, when the set is full."""
        ratio = max(1, ratio)
        if not 0 <= member < ratio:
            raise ProtocolError(f"member {member} is outside a group of ratio {ratio}")
        expected = self._ratio.setdefault(ext_id, ratio)
        if expected != ratio:
            raise ProtocolError(
                f"request {ext_id!r}: contributor ratio changed from {expected} to {ratio}"
            )
        members = self._members.setdefault(ext_id, set())
        if member in members:
            return False
        members.add(member)
        return len(members) == expected

    def is_complete(self, ext_id: str) -> bool:
        return len(self._members.get(ext_id, ())) >= self._ratio.get(ext_id, 1 << 30)

    def discard(self, ext_id: str) -> None:
        self._members.pop(ext_id, None)
        self._ratio.pop(ext_id, None)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._members


class PeerContributions:
    """Which unfinished requests each Prefill connection ("peer") has announced blocks
    of and not yet reported final, so that a peer that disappears fails exactly the
    requests it was still contributing to (liveness). Pure bookkeeping."""

    def __init__(self) -> None:
        self._by_peer: dict[Hashable, set[str]] = {}
        self._by_request: dict[str, set[Hashable]] = {}

    def note(self, peer: Hashable, ext_ids: Iterable[str]) -> None:
        for ext in ext_ids:
            self._by_peer.setdefault(peer, set()).add(ext)
            self._by_request.setdefault(ext, set()).add(peer)

    def done(self, peer: Hashable, ext_ids: Iterable[str]) -> None:
        """``peer`` announced the final layer of ``ext_ids``: its part is complete."""
        mine = self._by_peer.get(peer)
        if not mine:
            return
        for ext in ext_ids:
            if ext in mine:
                mine.discard(ext)
                self._drop_link(ext, peer)
        if not mine:
            del self._by_peer[peer]

    def take_peer(self, peer: Hashable) -> set[str]:
        """Forget ``peer``; the requests it was still contributing to."""
        mine = self._by_peer.pop(peer, set())
        for ext in mine:
            self._drop_link(ext, peer)
        return mine

    def discard_request(self, ext: str) -> None:
        for peer in self._by_request.pop(ext, ()):
            mine = self._by_peer.get(peer)
            if mine is not None:
                mine.discard(ext)
                if not mine:
                    del self._by_peer[peer]

    def _drop_link(self, ext: str, peer: Hashable) -> None:
        peers = self._by_request.get(ext)
        if peers is not None:
            peers.discard(peer)
            if not peers:
                del self._by_request[ext]

    @property
    def peers(self) -> int:
        return len(self._by_peer)

    def __len__(self) -> int:
        """(peer, request) pairs held."""
        return sum(len(v) for v in self._by_peer.values())

"""Ids a Decode rank holds state for but never admitted (spec 7.2): bounded and dated.

A peer can name any request id: a READ_READY_BATCH's done ids or a failure can
arrive before this rank admitted the request (another TP rank heard Prefill
first), for a request this rank already forgot, or from a hostile peer that
invents ids. Such *orphans* are kept, because the admission may still come, but

- each expires ``timeout`` after it was first seen (the request deadline), and
- each owner (the connection that brought it, or ``None`` for state learned from
  the other Decode ranks, which are bounded by their own caps) holds at most
  ``per_owner`` of them, and all owners together at most ``total``.

An id refused by a cap leaves no state at all. Each time an owner (or the total)
reaches its cap, one ``CapHit`` is recorded for the caller to report; the next is
recorded only after it went below the cap again.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

DEFAULT_ORPHANS_PER_PEER = 4096
DEFAULT_ORPHANS_TOTAL = 65536
ALL_OWNERS = "all peers"


@dataclass(frozen=True)
class CapHit:
    """``owner`` (a peer, or ``ALL_OWNERS`` for the total) reached ``limit`` orphan ids."""

    owner: Hashable
    limit: int


class OrphanLedger:
    def __init__(self, per_owner: int = DEFAULT_ORPHANS_PER_PEER,
                 total: int = DEFAULT_ORPHANS_TOTAL) -> None:
        if per_owner < 1 or total < 1:
            raise ValueError("orphan caps must be >= 1")
        self.per_owner = per_owner
        self.total = total
        self._since: dict[str, float] = {}
        self._owner: dict[str, Hashable] = {}
        self._count: dict[Hashable, int] = {}
        self._capped: set[Hashable] = set()
        self._hits: list[CapHit] = []
        self.refused = 0  # ids refused by a cap, ever

    def add(self, ext: str, owner: Hashable, now: float) -> bool:
        """Keep ``ext`` (first seen ``now``) for ``owner``; False (nothing kept) when a
        cap is reached. An id already held stays with its first owner."""
        if ext in self._since:
            return True
        if len(self._since) >= self.total:
            return self._refuse(ALL_OWNERS, self.total)
        held = self._count.get(owner, 0)
        if owner is not None and held >= self.per_owner:
            return self._refuse(owner, self.per_owner)
        self._since[ext] = now
        self._owner[ext] = owner
        self._count[owner] = held + 1
        return True

    def discard(self, ext: str) -> None:
        if self._since.pop(ext, None) is None:
            return
        owner = self._owner.pop(ext)
        left = self._count[owner] - 1
        if left:
            self._count[owner] = left
        else:
            del self._count[owner]
        if left < self.per_owner:
            self._capped.discard(owner)
        if len(self._since) < self.total:
            self._capped.discard(ALL_OWNERS)

    def stale(self, now: float, timeout: float) -> list[str]:
        """Ids first seen ``timeout`` or more before ``now`` (oldest first)."""
        out = []
        for ext, since in self._since.items():  # insertion order = age order
            if since + timeout > now:
                break
            out.append(ext)
        return out

    def oldest(self) -> float | None:
        """When the oldest id held was first seen (None: none held)."""
        return next(iter(self._since.values()), None)

    def take_hits(self) -> list[CapHit]:
        out, self._hits = self._hits, []
        return out

    def held_by(self, owner: Hashable) -> int:
        return self._count.get(owner, 0)

    def _refuse(self, owner: Hashable, limit: int) -> bool:
        self.refused += 1
        if owner not in self._capped:
            self._capped.add(owner)
            self._hits.append(CapHit(owner, limit))
        return False

    def __contains__(self, ext: object) -> bool:
        return ext in self._since

    def __len__(self) -> int:
        return len(self._since)

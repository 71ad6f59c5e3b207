"""What the Decode control socket's receive thread holds for the loop: bounded in bytes,
per peer and in all, and served round-robin across peers.

libzmq buffers a connection's input without limit (``RCVHWM`` is 0, see
``channel.py``), so whatever a peer sends faster than Decode's loop handles it would
pile up there. The server's receive thread (the socket's owner) takes every message
out of libzmq as it arrives and puts it here; this is where the bound is.

- A peer may hold at most ``per_peer`` bytes here; a message that would take it over
  is dropped, never decoded.
- All peers together hold at most ``total`` bytes. A message that would take the
  total over evicts the newest messages of the peer holding the most, as long as that
  peer holds more than the newcomer's would then; otherwise the newcomer is dropped.
  A peer that stays within its share (a valid Prefill has only its unanswered
  announcements in flight) is not starved by many that flood.
- The loop takes one message per peer in turn, so a valid peer's next message waits
  behind at most one message of each other peer, not behind a flood's backlog.

A message's cost is its payload and identity plus ``OVERHEAD`` bytes for the objects
that hold it, so a flood of empty frames is bounded too. Dropped messages are counted
per peer until ``shed`` reports them (the loop logs and counts them; the peer's own
deadline covers what it waits for).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

OVERHEAD = 160  # bytes object, tuple and deque slot around one held message (CPython)


@dataclass
class Shed:
    """``messages`` of ``identity`` (``nbytes`` in all) dropped over the budget."""

    identity: bytes
    messages: int
    nbytes: int


class Inbox:
    """Not thread-safe: the server guards it with its condition."""

    def __init__(self, per_peer: int, total: int) -> None:
        if per_peer < 1 or total < per_peer:
            raise ValueError(f"inbox budget needs 1 <= per_peer ({per_peer}) <= total ({total})")
        self.per_peer = per_peer
        self.total = total
        self._queues: dict[bytes, deque[tuple[bytes, int]]] = {}
        self._held: dict[bytes, int] = {}
        self._turns: deque[bytes] = deque()  # peers with a message, in serving order
        self.nbytes = 0
        self._count = 0  # messages held
        self.peak = 0
        self._shed: dict[bytes, Shed] = {}
        self.dropped = 0  # messages, ever
        self.dropped_bytes = 0

    def __len__(self) -> int:
        return self._count

    @staticmethod
    def cost(identity: bytes, size: int) -> int:
        return size + len(identity) + OVERHEAD

    def admits(self, identity: bytes, size: int) -> bool:
        """Whether a message of ``size`` payload bytes can be kept (evicting others if
        needed); answered before the payload is copied out of libzmq."""
        cost = self.cost(identity, size)
        mine = self._held.get(identity, 0) + cost
        if mine > self.per_peer:
            return False
        if self.nbytes + cost <= self.total:
            return True
        # Over the total: only a peer holding more than this one would then can give way.
        need = self.nbytes + cost - self.total
        others = sum(h - mine for p, h in self._held.items() if p != identity and h > mine)
        return others >= need

    def put(self, identity: bytes, payload: bytes, *, admitted: bool = False) -> bool:
        """Keep ``payload`` (``admits`` decides, unless the caller just asked it:
        ``admitted``); False when it was dropped instead."""
        if not admitted and not self.admits(identity, len(payload)):
            self.drop(identity, len(payload))
            return False
        cost = self.cost(identity, len(payload))
        while self.nbytes + cost > self.total:
            self._evict_from_largest(identity)
        queue = self._queues.get(identity)
        if queue is None:
            queue = self._queues[identity] = deque()
        if not queue:
            self._turns.append(identity)
        queue.append((payload, cost))
        self._count += 1
        self._held[identity] = self._held.get(identity, 0) + cost
        self.nbytes += cost
        self.peak = max(self.peak, self.nbytes)
        return True

    def drop(self, identity: bytes, size: int) -> None:
        """Count a message of ``identity`` that was not kept."""
        shed = self._shed.get(identity)
        if shed is None:
            shed = self._shed[identity] = Shed(identity, 0, 0)
        shed.messages += 1
        shed.nbytes += size
        self.dropped += 1
        self.dropped_bytes += size

    def _evict_from_largest(self, keep: bytes) -> None:
        victim = max((p for p in self._held if p != keep), key=self._held.__getitem__)
        payload, cost = self._queues[victim].pop()  # its newest
        if not self._release(victim, cost):
            self._turns = deque(p for p in self._turns if p != victim)
        self.drop(victim, len(payload))

    def _release(self, identity: bytes, cost: int) -> bool:
        """Count one message of ``identity`` out; False when it held no more."""
        self._count -= 1
        self.nbytes -= cost
        left = self._held[identity] - cost
        if left:
            self._held[identity] = left
            return True
        del self._held[identity]
        del self._queues[identity]
        return False

    def take(self, limit: int, max_bytes: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` messages, one per peer in turn, stopping once ``max_bytes``
        of payload were taken (at least one message when any is held)."""
        out: list[tuple[bytes, bytes]] = []
        taken = 0
        turns = self._turns
        while turns and len(out) < limit and (not out or taken < max_bytes):
            identity = turns.popleft()
            queue = self._queues[identity]
            payload, cost = queue.popleft()
            out.append((identity, payload))
            taken += len(payload)
            if self._release(identity, cost):
                turns.append(identity)
        return out

    def shed(self) -> list[Shed]:
        """What was dropped since the last call, per peer."""
        out, self._shed = list(self._shed.values()), {}
        return out

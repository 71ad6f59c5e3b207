"""What a Decode read must pass before it may complete requests: Prefill's hold on the
blocks (they must not have been reused) and, with ``verify_kv``, the KV digests."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from rd2h.app.telemetry import DecodeStats
from rd2h.domain.decode.decode_session import Read
from rd2h.domain.planning.digests import BlockChecks
from rd2h.domain.wire.wire_values import clip, few
from rd2h.ports import runtime as rt


class ReadChecks:
    """``hold_ended`` and ``verify`` for a ``DecodeReceiver``; they count in its stats."""

    def __init__(self, stats: DecodeStats, log: rt.Logger,
                 wall: Callable[[], float] = time.time, hold_margin_s: float = 0.25,
                 digest: rt.Digest | None = None) -> None:
        self.stats = stats
        self._log = log
        self._wall = wall
        self._margin_s = hold_margin_s
        self._digest = digest  # checks the digests an announcement states (verify_kv)
        self._digest_peers: set[str] = set()  # Prefill sessions seen stating digests

    def hold_ended(self, read: Read, when: str) -> str | None:
        """Why the read must not complete requests: Prefill's hold on the blocks ended
        ``when`` (less ``hold_margin_s``), so they may be refilled; None if not (or no
        hold stated: older builds)."""
        if read.hold_until_ms is None:
            return None
        late_ms = self._wall() * 1000.0 + self._margin_s * 1000.0 - read.hold_until_ms
        if late_ms < 0:
            return None
        self.stats.reads_past_hold += 1
        return (f"Prefill's hold on the announced blocks ended {when} ({late_ms / 1000:.3f} s "
                f"past it, with a {self._margin_s:g} s margin for clock skew): Prefill "
                f"may have reused them, so this layer is not completed from them")

    def verify(self, read: Read, checks: BlockChecks) -> str | None:
        """``verify_kv``: digests of the blocks as they landed vs Prefill's (None: equal)."""
        if self._digest is None:
            return None
        if read.p_session not in self._digest_peers and len(self._digest_peers) < 1024:
            self._digest_peers.add(read.p_session)  # once per peer (bounded)
            self._log.info("verify_kv: this prefill peer states KV digests; each read of it "
                           "is checked", session=clip(read.p_session, 128))
        got = np.asarray(self._digest(checks.addrs, checks.sizes), dtype=np.int64)
        wrong = np.flatnonzero(got != checks.expected)
        self.stats.blocks_verified += int(got.size)
        if not wrong.size:
            return None
        self.stats.digest_mismatches += int(wrong.size)
        named = [f"{ext} {tensor} block {block}"
                 for ext, tensor, block in checks.describe(wrong[:16].tolist())]
        self._log.error("KV digest mismatch: bytes read differ from Prefill's",
                        layer=read.layer_idx, **few(named))
        return (f"KV digest mismatch in {wrong.size} of {got.size} blocks read (request, "
                f"tensor, Prefill block: {', '.join(named[:3])}"
                f"{', ...' if len(named) > 3 else ''})")

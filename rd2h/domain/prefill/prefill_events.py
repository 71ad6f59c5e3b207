"""What a ``PrefillSession`` asks its driver to do (actions) and tells it (events)."""

from __future__ import annotations

from dataclasses import dataclass

from rd2h.domain.wire.protocol import ReadReadyBatch


@dataclass(frozen=True)
class Connect:
    endpoint: str


@dataclass(frozen=True)
class Disconnect:
    endpoint: str


@dataclass(frozen=True)
class SendMeta:
    """Send this session's MF_META; report ``send_failed(action, ...)`` if it cannot go."""

    endpoint: str


@dataclass(frozen=True)
class SendBatch:
    """Send ``batch``; report ``sent(...)`` once it went, ``send_failed(...)`` if not."""

    endpoint: str
    batch: ReadReadyBatch
    announcement: int


@dataclass(frozen=True)
class HandshakeDone:
    endpoint: str
    error: str | None


@dataclass(frozen=True)
class LayerAnswered:
    """One entry ended: READ_DONE (``error`` None) or failed with ``error``."""

    layer_idx: int
    endpoint: str
    error: str | None
    latency_s: float | None = None  # send -> reply, for answered entries


@dataclass(frozen=True)
class EndpointReset:
    """Every entry waiting on ``endpoint`` failed at once (its connection is gone)."""

    endpoint: str
    reason: str
    layers: tuple[int, ...]


Action = Connect | Disconnect | SendMeta | SendBatch
Event = HandshakeDone | LayerAnswered | EndpointReset
Output = Action | Event

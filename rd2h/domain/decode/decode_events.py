"""What a ``DecodeSession`` asks its driver to do (actions) and tells it (events)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import StrEnum

from rd2h.domain.planning.planning import ReadPlan
from rd2h.domain.wire.compat import MetaRefused
from rd2h.domain.wire.protocol import ReadDone, ReadFailed

Peer = Hashable  # a control connection (the ROUTER identity)


# ---------------------------------------------------------------- what comes out


@dataclass(frozen=True)
class SendAck:
    peer: Peer
    generation: int | None = None  # this Decode's, to a Prefill that stated its own
    layer_runs: bool = False  # it reads layer runs (to a Prefill that stated the feature)


@dataclass(frozen=True)
class SendRefusal:
    """Refuse the peer's MF_META (``b"NAK"``, naming why): nothing of it was stored."""

    peer: Peer
    refusal: MetaRefused


@dataclass(frozen=True)
class Reply:
    peer: Peer
    message: ReadDone | ReadFailed


@dataclass(frozen=True)
class Read:
    """Perform this batched read, then report ``read_done(token, ...)``; call
    ``begin_read(token)`` first (False: the peer is gone, skip the read)."""

    token: int
    peer: Peer
    p_session: str
    plan: ReadPlan
    hold_until_ms: int | None = None  # the announcement's hold (``ReadReadyBatch``)
    layer_idx: int = -1


@dataclass(frozen=True)
class MetaStored:
    peer: Peer
    p_session: str
    layers: int


@dataclass(frozen=True)
class LayerDone:
    layer_idx: int
    completed: tuple[str, ...]  # requests whose KV is now complete on this rank


@dataclass(frozen=True)
class LayerFailed:
    layer_idx: int
    reason: str
    unexpected: bool = False  # the planner itself failed (a bug, not the peer)


@dataclass(frozen=True)
class Incomplete:
    """A peer reported its final layer for requests before every layer they need from it
    was read here: they fail instead of completing (each with the layers not read)."""

    layer_idx: int
    requests: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Skipped:
    """Requests of a layer's announcement this rank no longer knows (aborted, finished,
    never admitted): not read, named in the READ_DONE; the others were read."""

    layer_idx: int
    requests: tuple[str, ...]


@dataclass(frozen=True)
class Parked:
    """A layer's announcement kept until this rank admits the requests it ``awaits``
    (parallel dispatch), at most until ``until`` (monotonic seconds)."""

    layer_idx: int
    awaiting: tuple[str, ...]
    until: float


@dataclass(frozen=True)
class Unparked:
    """A kept announcement handled now: its requests were admitted (``expired``
    False), or its wait ended first (the requests still unknown are answered skipped)."""

    layer_idx: int
    waited_s: float
    expired: bool


@dataclass(frozen=True)
class PeerLost:
    p_session: str
    failed: tuple[str, ...]


@dataclass(frozen=True)
class Expired:
    requests: tuple[str, ...]
    timeout_s: float


@dataclass(frozen=True)
class Capped:
    """A bound on what peers can make this rank hold was reached (``what``: ``orphans``
    or ``peers``); state beyond it is not kept. Once per episode."""

    what: str
    owner: str
    limit: int


class RejectKind(StrEnum):
    """Why a frame could not be used."""

    UNKNOWN = "unknown"  # a message type rd2h does not know
    UNEXPECTED = "unexpected"  # a known type Decode never receives (e.g. READ_DONE)
    UNAUTHENTICATED = "unauthenticated"  # its signature did not verify
    MALFORMED = "malformed"  # it did not decode (a READ_FAILED went back if it named a layer)
    CAPPED = "capped"  # MF_META from a new connection while the peer cap is full
    INCOMPATIBLE = "incompatible"  # MF_META refused by its compat map


@dataclass(frozen=True)
class Rejected:
    """A frame that could not be used (``kind``); a READ_FAILED went back when it named
    its layer."""

    kind: RejectKind
    detail: str
    layer_idx: int | None = None


@dataclass(frozen=True)
class Forget:
    """Nothing is kept for this connection (its MF_META refused, or evicted by the peer
    cap): drop what else is kept for it (the codec's signing state)."""
    peer: Peer


Output = (SendAck | SendRefusal | Reply | Read | MetaStored | LayerDone | LayerFailed
          | Incomplete | Skipped
          | Parked | Unparked
          | PeerLost | Expired | Rejected | Capped | Forget)

"""Wire codec port: control-channel frames <-> typed messages (spec 4).

``conn`` names the connection a frame travels on (Decode: the peer identity;
Prefill: the Decode endpoint). A plain codec ignores it; a signing codec binds
every frame to its connection and refuses replays, keeping a little state per
connection until ``forget``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from rd2h.domain.wire.compat import MetaRefused
from rd2h.domain.wire.protocol import Message


class WireCodec(Protocol):
    max_frame_bytes: int
    # The signing envelope version ("none" unsigned), stated in MF_META's compat map.
    signing: str

    def encode(self, message: Message, conn: Hashable = None) -> bytes:
        """One frame holding the message's positional tuple."""
        ...

    def decode(self, frame: bytes, conn: Hashable = None) -> Message:
        """The message in ``frame``; anything malformed raises ``ProtocolError`` only
        (``AuthenticationError`` when a configured signature is missing, wrong, or
        replayed)."""
        ...

    def encode_ack(self, conn: Hashable = None, generation: int | None = None) -> bytes:
        """Decode's MF_META acknowledgement frame (raw ``b"ACK"`` without authentication),
        stating Decode's ``generation`` when given."""
        ...

    def ack_generation(self, frame: bytes, conn: Hashable = None) -> int | None:
        """The Decode generation an acknowledgement (``is_ack``) states, if any."""
        ...

    def is_ack(self, frame: bytes, conn: Hashable = None) -> bool:
        """Whether ``frame`` is an acknowledgement; raises ``AuthenticationError`` for an
        acknowledgement that lacks or fails the configured signature."""
        ...

    def encode_refusal(self, refusal: MetaRefused, conn: Hashable = None) -> bytes:
        """Decode's refusal of an MF_META (raw ``b"NAK"`` + the refusal), signed like the
        acknowledgement."""
        ...

    def refusal(self, frame: bytes, conn: Hashable = None) -> MetaRefused | None:
        """The refusal in ``frame``, None when it is not one; ``ProtocolError`` when it is
        malformed, ``AuthenticationError`` when it lacks or fails the signature."""
        ...

    def forget(self, conn: Hashable) -> None:
        """The connection is gone: drop whatever the codec kept for it."""
        ...

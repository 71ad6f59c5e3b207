"""Wire codec port: control-channel frames <-> typed messages (spec 4).

``conn`` names the connection a frame travels on (Decode: the peer identity;
Prefill: the Decode endpoint). A plain codec ignores it; a signing codec binds
every frame to its connection and refuses replays, keeping a little state per
connection until ``forget``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from rd2h.domain.wire.protocol import Message


class WireCodec(Protocol):
    max_frame_bytes: int
    # The signing envelope version ("none" unsigned), stated in MF_META's compat map.
    signing: str

    def encode(self, message: Message, conn: Hashable = None) -> bytes:
        """One frame holding the message: its positional tuple, or for the handshake's
        answers the raw ``b"ACK"`` / ``b"NAK"`` framing (signed like any frame when a
        secret is configured)."""
        ...

    def decode(self, frame: bytes, conn: Hashable = None) -> Message:
        """The message in ``frame``, any kind in either direction (Prefill's one read of
        every reply); anything malformed raises ``ProtocolError`` only
        (``AuthenticationError`` when a configured signature is missing, wrong, or
        replayed). ``handshake`` is set on the error when the frame is an acknowledgement
        or refusal that cannot be taken."""
        ...

    def forget(self, conn: Hashable) -> None:
        """The connection is gone: drop whatever the codec kept for it."""
        ...

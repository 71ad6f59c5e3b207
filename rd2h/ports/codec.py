"""Wire codec port: control-channel frames <-> typed messages (spec 4)."""

from __future__ import annotations

from typing import Protocol

from rd2h.domain.protocol import Message


class WireCodec(Protocol):
    def encode(self, message: Message) -> bytes:
        """One frame holding the message's positional tuple."""
        ...

    def decode(self, frame: bytes) -> Message:
        """The message in ``frame``; anything malformed raises ``ProtocolError`` only."""
        ...

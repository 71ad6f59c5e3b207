"""Wire codec port: control-channel frames <-> typed messages (spec 4)."""

from __future__ import annotations

from typing import Protocol

from rd2h.domain.protocol import Message


class WireCodec(Protocol):
    def encode(self, message: Message) -> bytes:
        """One frame holding the message's positional tuple."""
        ...

    def decode(self, frame: bytes) -> Message:
        """The message in ``frame``; anything malformed raises ``ProtocolError`` only
        (``AuthenticationError`` when a configured signature is missing or wrong)."""
        ...

    def encode_ack(self) -> bytes:
        """Decode's MF_META acknowledgement frame (raw ``b"ACK"`` without authentication)."""
        ...

    def is_ack(self, frame: bytes) -> bool:
        """Whether ``frame`` is an acknowledgement; raises ``AuthenticationError`` for an
        acknowledgement that lacks or fails the configured signature."""
        ...

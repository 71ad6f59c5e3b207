"""Optional shared-secret authentication of control messages (HMAC-SHA256).

The framing rule lives here and nowhere else:

- A signed message is the plain positional array with one element appended: a
  32-byte bin (msgpack ``bin 8``: ``c4 20`` + tag) holding
  ``HMAC-SHA256(secret, P)``, where ``P`` is the plain message's msgpack encoding
  with its array header in the shortest form (as every msgpack packer writes it).
  On the wire: ``header(n + 1) + P[len(header(n)):] + c4 20 + tag``. Dropping the
  last 34 bytes and rewriting the header gives ``P`` back byte for byte, so a
  receiver verifies the exact bytes it got and never re-encodes.
- The signed MF_META acknowledgement is ``b"ACK" + HMAC-SHA256(secret, b"ACK")``.
- Protocol extensions only append fields, so a peer without a secret reads a
  signed message as the plain one and ignores the tag. Signed messages always
  carry every field of the current layout (``fields_of`` writes all seven of
  READ_READY_BATCH), so the tag is never mistaken for an optional field.

What it gives: nobody without the secret can make Decode store metadata, read,
or fail a request, and Prefill accepts no acknowledgement or reply it did not get
from a holder of the secret. What it does not give: confidentiality, or replay
protection (an on-path attacker can resend a captured signed frame).
"""

from __future__ import annotations

import hashlib
import hmac

from rd2h.adapters.msgpack.codec import MsgpackCodec
from rd2h.domain.errors import AuthenticationError, ProtocolError
from rd2h.domain.protocol import ACK, Message, ReadReadyBatch

DIGEST_BYTES = 32
_TAG_HEADER = b"\xc4\x20"  # msgpack bin 8 of 32 bytes
_TAG_FIELD = len(_TAG_HEADER) + DIGEST_BYTES
_HINT = "configure the same auth_secret on Prefill and Decode"


def array_header(count: int) -> bytes:
    """The shortest msgpack array header for ``count`` elements."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def read_array_header(frame: bytes) -> tuple[int, int] | None:
    """``(element count, header bytes)`` of a frame that starts with an array header."""
    if not frame:
        return None
    first = frame[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1
    if first == 0xDC and len(frame) >= 3:
        return int.from_bytes(frame[1:3], "big"), 3
    if first == 0xDD and len(frame) >= 5:
        return int.from_bytes(frame[1:5], "big"), 5
    return None


def split_signed(frame: bytes) -> tuple[bytes, bytes] | None:
    """``(plain encoding, tag)`` of a frame whose last element is a 32-byte bin,
    or None when it carries no such field (an unsigned message)."""
    if len(frame) <= _TAG_FIELD or frame[-_TAG_FIELD:-DIGEST_BYTES] != _TAG_HEADER:
        return None
    header = read_array_header(frame)
    if header is None or header[0] < 2:
        return None
    count, size = header
    return array_header(count - 1) + frame[size:-_TAG_FIELD], frame[-DIGEST_BYTES:]


class AuthenticatedCodec:
    """A ``WireCodec`` that signs every frame it encodes and accepts only frames signed
    with the same secret; refusals are ``AuthenticationError`` (a ``ProtocolError``)
    carrying the layer index when the refused message names one."""

    def __init__(self, inner: MsgpackCodec, secret: bytes) -> None:
        if not secret:
            raise ValueError("the shared secret must not be empty")
        self._inner = inner
        self._key = bytes(secret)
        self._ack = ACK + self._mac(ACK)
        self.max_frame_bytes = inner.max_frame_bytes + _TAG_FIELD + 4

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    # -- encode
    def encode(self, message: Message) -> bytes:
        plain = self._inner.encode(message)
        header = read_array_header(plain)
        assert header is not None, "rd2h messages are arrays"
        count, size = header
        return array_header(count + 1) + plain[size:] + _TAG_HEADER + self._mac(plain)

    def encode_ack(self) -> bytes:
        return self._ack

    # -- decode
    def decode(self, frame: bytes) -> Message:
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
        raw = bytes(frame)
        if len(raw) > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {len(raw)} bytes exceeds the {self.max_frame_bytes}-byte limit"
            )
        signed = split_signed(raw)
        if signed is not None:
            plain, tag = signed
            if hmac.compare_digest(tag, self._mac(plain)):
                return self._inner.decode(plain)
            reason = "control message signature does not match (the shared secrets differ)"
            readable = plain
        else:
            reason = "control message is not signed (the sender has no shared secret)"
            readable = raw
        raise AuthenticationError(f"{reason}; {_HINT}", self._layer_of(readable))

    def _layer_of(self, frame: bytes) -> int | None:
        """The layer a refused frame names, so Decode can answer READ_FAILED for it
        (nothing else in it is used)."""
        try:
            message = self._inner.decode(frame)
        except ProtocolError as exc:
            return exc.layer_idx
        return message.layer_idx if isinstance(message, ReadReadyBatch) else None

    def is_ack(self, frame: bytes) -> bool:
        raw = bytes(frame)
        if hmac.compare_digest(raw, self._ack):
            return True
        if raw == ACK:
            raise AuthenticationError(
                f"MF_META acknowledgement is not signed (the decode endpoint has no shared "
                f"secret); {_HINT}"
            )
        if len(raw) == len(self._ack) and raw.startswith(ACK):
            raise AuthenticationError(
                f"MF_META acknowledgement signature does not match (the shared secrets "
                f"differ); {_HINT}"
            )
        return False

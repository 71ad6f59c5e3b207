"""Shared-secret authentication of control messages (HMAC-SHA256), replay-proof.

The framing rule lives here and nowhere else:

- A signed message is the plain positional array with one element appended: a
  56-byte bin (msgpack ``bin 8``: ``c4 38``) holding ``nonce (16) | seq (8, big
  endian) | tag (32)``, where ``tag = HMAC-SHA256(secret, "rd2h-auth-2" | peer
  nonce | nonce | seq | P)`` and ``P`` is the plain message's msgpack encoding
  with its array header in the shortest form (as every msgpack packer writes it).
  On the wire: ``header(n + 1) + P[len(header(n)):] + c4 38 + envelope``. Dropping
  the last 58 bytes and rewriting the header gives ``P`` back byte for byte, so a
  receiver verifies the exact bytes it got and never re-encodes.
- ``nonce`` is the sender's random 16 bytes for this connection and ``peer nonce``
  the receiver's, as the sender learned it (16 zero bytes in MF_META, the first
  message, when Prefill knows no Decode nonce yet); ``seq`` counts the sender's
  signed frames on the connection from 1.
- The signed MF_META acknowledgement is ``b"ACK" + nonce + seq + tag`` with
  ``P = b"ACK"``: it tells Prefill the Decode nonce of the connection. Decode's
  refusal of an MF_META (``rd2h.domain.wire.compat``) is signed the same way:
  ``P + nonce + seq + tag`` with ``P = b"NAK" + msgpack(refusal)``.

So every frame after MF_META is bound to both nonces of its connection: a frame
captured on one connection is refused on any other, and one sent again on its own
connection is refused by its sequence number. A replayed MF_META earns the replayer
an ACK it cannot use and unproven state only (below). A receiver seeing a new nonce
from its peer takes it as a restarted peer and restarts the count. Protocol
extensions only append fields, so a peer without a secret reads a signed message as
the plain one and ignores the envelope.

What it gives: nobody without the secret can make Decode store metadata, read, or
fail a request, nor replay what a holder of the secret sent; Prefill accepts no
acknowledgement or reply it did not get from a holder of the secret on that
connection. What it does not give: confidentiality or protection from an attacker
inside an established TCP connection (configure CURVE for those).

State per connection (``conn``: Decode's peer identity, Prefill's endpoint) is
created only by a verified MF_META (Decode) or by sending it (Prefill), and dropped
by ``forget``. It starts *unproven*; the connection *proves* itself with the first
verified frame whose MAC binds this side's own nonce too (Decode: any signed frame
after the ACK; Prefill: the ACK), which only a holder of the secret that got this
side's nonce on this connection can sign (never a replayed MF_META). Each kind holds
at most ``max_connections`` connections: a new unproven one evicts the oldest
unproven one only; proven state is never evicted, and while ``max_connections`` are
proven a further connection's proving frame is refused ("too many authenticated
connections") until one is forgotten. Decode forgets a connection when it closes and
when its session keeps no peer for it (refused by the peer cap, or evicted).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from rd2h.adapters.msgpack.codec import MsgpackCodec
from rd2h.domain.errors import AuthenticationError, ProtocolError
from rd2h.domain.wire.compat import NAK, MetaRefused
from rd2h.domain.wire.protocol import ACK, Message, MetaAck, ReadReadyBatch, meta_ack, parse_ack

DIGEST_BYTES = 32
NONCE_BYTES = 16
SEQ_BYTES = 8
ENVELOPE_BYTES = NONCE_BYTES + SEQ_BYTES + DIGEST_BYTES
_ENVELOPE_HEADER = b"\xc4" + bytes((ENVELOPE_BYTES,))  # msgpack bin 8 of 56 bytes
_ENVELOPE_FIELD = len(_ENVELOPE_HEADER) + ENVELOPE_BYTES
_CONTEXT = b"rd2h-auth-2"
_NO_NONCE = bytes(NONCE_BYTES)
_HINT = "configure the same auth_secret on Prefill and Decode"
DEFAULT_MAX_CONNECTIONS = 4096


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
    """``(plain encoding, envelope)`` of a frame whose last element is a 56-byte bin,
    or None when it carries no such field (an unsigned message)."""
    if len(frame) <= _ENVELOPE_FIELD or (
            frame[-_ENVELOPE_FIELD:-ENVELOPE_BYTES] != _ENVELOPE_HEADER):
        return None
    header = read_array_header(frame)
    if header is None or header[0] < 2:
        return None
    count, size = header
    return array_header(count - 1) + frame[size:-_ENVELOPE_FIELD], frame[-ENVELOPE_BYTES:]


_META_TAG = b"\xc4\x07mf_meta"  # MF_META's type tag as msgpack bin


def _is_meta(plain: bytes) -> bool:
    header = read_array_header(plain)
    return header is not None and plain[header[1]:header[1] + len(_META_TAG)] == _META_TAG


@dataclass
class _Conn:
    mine: bytes = field(default_factory=lambda: os.urandom(NONCE_BYTES))
    theirs: bytes | None = None  # the peer's nonce, once a verified frame told it
    sent: int = 0  # last sequence number this side signed
    received: int = 0  # last sequence number accepted from the peer


class AuthenticatedCodec:
    """A ``WireCodec`` that signs every frame it encodes and accepts only frames signed
    with the same secret for the same connection, each once; refusals are
    ``AuthenticationError`` (a ``ProtocolError``) carrying the layer index when the
    refused message names one. Thread-safe."""

    def __init__(self, inner: MsgpackCodec, secret: bytes,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if not secret:
            raise ValueError("the shared secret must not be empty")
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self._inner = inner
        self._key = bytes(secret)
        self._max_conns = max_connections
        self._proven: dict[Hashable, _Conn] = {}
        self._unproven: OrderedDict[Hashable, _Conn] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.max_frame_bytes = inner.max_frame_bytes + _ENVELOPE_FIELD + 4

    # -- connection state
    def forget(self, conn: Hashable) -> None:
        """The connection is gone: its nonces and counters go too."""
        with self._lock:
            self._proven.pop(conn, None)
            self._unproven.pop(conn, None)
        self._inner.forget(conn)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._proven) + len(self._unproven)

    def proven(self, conn: Hashable) -> bool:
        """Whether ``conn`` proved itself (see the module docstring)."""
        with self._lock:
            return conn in self._proven

    def _conn(self, conn: Hashable, create: bool) -> _Conn | None:
        state = self._proven.get(conn)
        if state is None:
            state = self._unproven.get(conn)
        if state is None and create:
            state = self._unproven[conn] = _Conn()
            while len(self._unproven) > self._max_conns:
                self._unproven.popitem(last=False)  # never a proven connection's state
        return state

    def _prove(self, conn: Hashable) -> str | None:
        """``conn`` just verified a frame bound to this side's nonce: its state becomes
        proven, unless ``max_connections`` are proven already (then why not)."""
        if conn in self._proven:
            return None
        if len(self._proven) >= self._max_conns:
            return (f"too many authenticated connections ({self._max_conns}); this one is "
                    f"refused until one of them closes")
        self._proven[conn] = self._unproven.pop(conn)
        return None

    def _envelope(self, plain: bytes, conn: Hashable) -> bytes:
        """Only the opening MF_META creates a connection's state; anything else sent on
        a connection without one (a refusal to an unknown peer) is signed with a
        throwaway nonce and keeps nothing."""
        opening = _is_meta(plain)
        with self._lock:
            state = self._conn(conn, create=opening)
            if state is None:
                state = _Conn()
            state.sent += 1
            seq = state.sent.to_bytes(SEQ_BYTES, "big")
            # MF_META may reach a Decode that never saw this connection (or restarted).
            mine, theirs = state.mine, (None if opening else state.theirs) or _NO_NONCE
        return mine + seq + self._mac(theirs, mine, seq, plain)

    def _mac(self, receiver: bytes, sender: bytes, seq: bytes, plain: bytes) -> bytes:
        return hmac.new(self._key, b"".join((_CONTEXT, receiver, sender, seq, plain)),
                        hashlib.sha256).digest()

    def _verify(self, plain: bytes, envelope: bytes, conn: Hashable, first: bool) -> str | None:
        """None when ``envelope`` is a fresh, valid signature of ``plain`` on ``conn``
        (and the connection's state now records it); else why not."""
        nonce, seq = envelope[:NONCE_BYTES], envelope[NONCE_BYTES:NONCE_BYTES + SEQ_BYTES]
        tag = envelope[-DIGEST_BYTES:]
        with self._lock:
            state = self._conn(conn, create=False)
            bound = not first and state is not None  # the MAC must cover this side's nonce
            mine = state.mine if bound and state is not None else _NO_NONCE
            if not hmac.compare_digest(tag, self._mac(mine, nonce, seq, plain)):
                if state is None and not first:
                    return "control message is signed for another connection (no MF_META " \
                           "was accepted on this one)"
                return ("control message signature does not match (the shared secrets "
                        "differ, or it was signed for another connection)")
            count = int.from_bytes(seq, "big")
            if state is None:
                state = self._conn(conn, create=True)
                assert state is not None
            if state.theirs == nonce and count <= state.received:
                return f"control message replayed (sequence {count} already seen on this " \
                       f"connection)"
            state.theirs, state.received = nonce, count  # a new nonce: the peer restarted
            # A MAC over this side's nonce: only who got it on this connection signs that.
            return self._prove(conn) if bound else None

    # -- encode
    def encode(self, message: Message, conn: Hashable = None) -> bytes:
        plain = self._inner.encode(message)
        if isinstance(message, MetaAck | MetaRefused):  # raw bytes: the envelope follows
            return plain + self._envelope(plain, conn)
        header = read_array_header(plain)
        assert header is not None, "rd2h messages are arrays"
        count, size = header
        return (array_header(count + 1) + plain[size:] + _ENVELOPE_HEADER
                + self._envelope(plain, conn))

    # -- decode
    def decode(self, frame: bytes, conn: Hashable = None) -> Message:
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
        raw = bytes(frame)
        if raw.startswith(NAK):
            return self._refusal(raw, conn)
        if raw.startswith(ACK) and (ack := self._ack(raw, conn)) is not None:
            return ack
        if len(raw) > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {len(raw)} bytes exceeds the {self.max_frame_bytes}-byte limit"
            )
        signed = split_signed(raw)
        if signed is None:
            reason = "control message is not signed (the sender has no shared secret)"
            raise AuthenticationError(f"{reason}; {_HINT}", self._layer_of(raw))
        plain, envelope = signed
        reason = self._verify(plain, envelope, conn, first=_is_meta(plain))
        if reason is not None:
            raise AuthenticationError(f"{reason}; {_HINT}", self._layer_of(plain))
        return self._inner.decode(plain, conn)

    def _layer_of(self, frame: bytes) -> int | None:
        """The layer a refused frame names, so Decode can answer READ_FAILED for it
        (nothing else in it is used)."""
        try:
            message = self._inner.decode(frame)
        except ProtocolError as exc:
            return exc.layer_idx
        return message.layer_idx if isinstance(message, ReadReadyBatch) else None

    def _ack(self, raw: bytes, conn: Hashable) -> MetaAck | None:
        """The verified acknowledgement in ``raw``; None when it is not one (then it is
        read as an array, and refused like any malformed frame)."""
        if parse_ack(raw)[0]:
            raise AuthenticationError(
                f"MF_META acknowledgement is not signed (the decode endpoint has no shared "
                f"secret); {_HINT}", handshake=True)
        plain = raw[:-ENVELOPE_BYTES] if len(raw) > ENVELOPE_BYTES else b""
        ack = meta_ack(plain)
        if ack is None:
            return None
        reason = self._verify(plain, raw[len(plain):], conn, first=False)
        if reason is not None:
            raise AuthenticationError(f"MF_META acknowledgement refused: {reason}; {_HINT}",
                                      handshake=True)
        return ack

    signing = _CONTEXT.decode()  # the envelope version MF_META's compat map states

    def _refusal(self, raw: bytes, conn: Hashable) -> MetaRefused:
        """The verified refusal in ``raw`` (it starts ``b"NAK"``); an unsigned or wrongly
        signed refusal raises ``AuthenticationError`` (the handshake fails either way, as
        for an unsigned ACK; an unsigned one's claim is quoted)."""
        if len(raw) > self.max_frame_bytes:
            raise ProtocolError(f"MF_META refusal of {len(raw)} bytes exceeds the "
                                f"{self.max_frame_bytes}-byte limit", handshake=True)
        try:  # the whole frame one refusal, nothing after it: no envelope
            claim = self._inner.handshake_answer(raw)
        except ProtocolError:
            claim = None
        if claim is not None or len(raw) <= len(NAK) + ENVELOPE_BYTES:
            said = f" (it said: {claim.describe()})" if isinstance(claim, MetaRefused) else ""
            raise AuthenticationError(f"MF_META refusal is not signed (the decode endpoint "
                                      f"has no shared secret){said}; {_HINT}", handshake=True)
        plain = raw[:-ENVELOPE_BYTES]
        reason = self._verify(plain, raw[-ENVELOPE_BYTES:], conn, first=False)
        if reason is not None:
            raise AuthenticationError(f"MF_META refusal not verified: {reason}; {_HINT}",
                                      handshake=True)
        refusal = self._inner.handshake_answer(plain)
        assert isinstance(refusal, MetaRefused)
        return refusal

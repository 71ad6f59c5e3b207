"""msgpack encoding of the exact wire layout of spec 4.

Tags travel as bin, strings as str, MF_META's layer metadata as a nested
msgpack map inside a bin field. Decoding is bounded and every failure is one
``ProtocolError``.

The decode budget. Per-container limits alone do not bound a frame: 4 million
empty arrays fit in 4 MiB and cost hundreds of MiB to build. So every frame
gets one total budget, shared with the MF_META layer map nested in it:

- objects: each value inside a container costs one unit, and each array one
  more and each map two more (their own headers and hash tables). msgpack's C
  unpacker calls a hook as each container completes; the hook charges it and
  aborts the decode the moment the budget is spent. A piece (the frame, or the
  nested map) too short to overrun what is left (3 units per byte at most) is
  decoded without hooks and charged that worst case instead. The nested layer
  map also has its own, smaller cap (``max_metadata_objects``).
- bytes: the wire bytes decoded (the frame, then the nested map's bin again),
  checked before each piece is decoded. No str or bin payload is longer than
  the bytes carrying it.

What the hooks cannot see yet are the values sitting in containers still open
(the scalars before the nested array in ``[1, 2, ..., [...]]``). A check pass
(msgpack's ``skip``, which builds nothing) runs first on any piece over 256
bytes: it refuses truncated or trailing data, so no open container's declared
length exceeds the bytes that follow it, and, for pieces longer than
``max_depth * max_items`` bytes, nesting deeper than ``max_depth``. Either way
open containers hold at most ``min(piece length, max_depth * max_items)`` values
not charged yet. ``worst_case_decode_bytes`` turns all this into a bound.

Repeated read entries. Every layer of a chunk announces the same requests and blocks,
byte for byte. Per connection the codec keeps the wire bytes of the last
READ_READY_BATCH's read entries (at most ``MEMO_MAX_BYTES``, from a frame of at most
``MEMO_MAX_FRAME_BYTES``) with the entries validated from them; a frame whose entries
are the same bytes gets those (msgpack decoding is deterministic), skipping
the per-id checks. The frame is still decoded whole and charged to its budget. At
most ``MEMO_MAX_CONNECTIONS`` connections are remembered (the oldest goes first);
``forget`` drops one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import msgpack

from rd2h.adapters.msgpack.entries import element_bytes, entries_at
from rd2h.domain.errors import ProtocolError
from rd2h.domain.wire.compat import NAK, MetaRefused, refusal_fields, refusal_from_fields
from rd2h.domain.wire.protocol import (
    ACK,
    ACK_FLAG_LAYER_RUNS,
    READ_READY_BATCH,
    Message,
    MetaAck,
    ReadReadyBatch,
    ack_plain,
    fields_of,
    message_from_fields,
    meta_ack,
)

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
# Longest array (a map: half of it, in entries). The largest legitimate arrays are
# one request's block ids; 2**18 of 16-token blocks is a 4M-token context.
DEFAULT_MAX_ITEMS = 1 << 18
# Total units per frame. A READ_READY_BATCH of 256 requests x 4096 main and 4096
# indexer block ids is ~2.1M units: this leaves 2x headroom.
DEFAULT_MAX_OBJECTS = 1 << 22
# Deepest nesting of a long frame. rd2h's messages nest 4 deep (READ_READY_BATCH:
# message, requests, request, block ids) and the layer map 3 deep.
DEFAULT_MAX_DEPTH = 8
# Units the MF_META layer map may use (61 layers are ~2,000 units; 1,000 layers of
# 8 tensors ~70,000). It also draws on the frame's budget.
DEFAULT_MAX_METADATA_OBJECTS = 1 << 18
MAX_STR_BYTES = 1 << 20

# The read-entry memo (module docstring): entries longer than this are not kept, and
# at most this many connections are remembered.
MEMO_MAX_BYTES = 64 * 1024
# Frames longer than this are not scanned again for their entries' bytes (the scan
# would cost as much as a large frame's decode; such frames are never memoised).
MEMO_MAX_FRAME_BYTES = 2 * MEMO_MAX_BYTES
MEMO_MAX_CONNECTIONS = 64

# msgpack's C unpacker refuses nesting deeper than this (its fixed stack size).
_STACK_LIMIT = 1024

# ---- the cost model behind worst_case_decode_bytes. tracemalloc peak per unit of
# the worst frames at the default limits (CPython 3.11, 64-bit, msgpack 1.2 C
# unpacker; each value's 8-byte slot in its container included; rerun with
# `benchmarks/codec_worst_frame.py`): 1-char astral str 88 (a 5-byte value), the
# same behind open containers 84, 2-char str 59, uint64 44, 2-byte bin 43, int
# outside the small-int cache 40, {"ab": {}} 37, empty array 32, float 32, empty
# map 24; a legitimate READ_READY_BATCH 45 (the message's tuples included).
UNIT_COST_BYTES = 96
# A str payload may decode to UCS-4 (4 bytes per ASCII byte when one astral
# character is present); a bin payload is copied once.
PAYLOAD_BYTE_FACTOR = 4
_UNITS_PER_BYTE = 3  # an empty map as a value: 1 byte, 3 units
# Pieces up to this size skip the check pass; with lengths capped by their size the
# declared-but-unfilled slots of their open containers stay under 8 * 256**2 / 3 bytes.
_SHORT_PIECE_BYTES = 256
# That, and bookkeeping: the check pass's unpacker (its 1024-entry stack, ~40 KiB),
# the nesting prefix, hook closures, exception objects.
FIXED_COST_BYTES = 256 * 1024


def worst_case_decode_bytes(
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_objects: int = DEFAULT_MAX_OBJECTS,
    *,
    max_items: int = DEFAULT_MAX_ITEMS,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_bytes: int | None = None,
) -> int:
    """Upper bound on the memory one ``MsgpackCodec.decode`` call allocates.

    ``UNIT_COST_BYTES * (max_objects + open_slack)`` for the objects (the budget plus
    the values in still-open containers, ``open_slack = min(max_frame_bytes,
    max_depth * max_items)`` plus one for the root) +
    ``PAYLOAD_BYTE_FACTOR * max_bytes + MAX_STR_BYTES`` for str and bin payloads
    (the last term: the UTF-8 decoder's transient copy of one string) +
    ``max_frame_bytes`` for the check pass's copy of the frame + ``FIXED_COST_BYTES``.
    The frame itself (the caller's) is not included.
    """
    max_bytes = max_frame_bytes if max_bytes is None else max_bytes
    per_container = min(max_items, max_objects)
    open_slack = min(max_frame_bytes, max_depth * per_container) + 1
    return (
        UNIT_COST_BYTES * (max_objects + open_slack)
        + PAYLOAD_BYTE_FACTOR * max_bytes
        + min(MAX_STR_BYTES, max_bytes)
        + max_frame_bytes
        + FIXED_COST_BYTES
    )


class _Budget:
    """What is left of one frame's decode budget (the frame and its nested map)."""

    __slots__ = ("bytes", "objects")

    def __init__(self, objects: int, nbytes: int) -> None:
        self.objects = objects
        self.bytes = nbytes


def _counting_hooks(
    allowance: int, what: str
) -> tuple[Callable[[list], list], Callable[[dict], dict], Callable[[], int]]:
    """msgpack hooks charging each completed container against ``allowance`` units,
    and a function returning the units charged so far."""
    left = allowance

    def on_array(items: list) -> list:
        nonlocal left
        left -= len(items) + 1
        if left < 0:
            raise ProtocolError(f"{what} exceeds the decode budget of {allowance} objects")
        return items

    def on_map(entries: dict) -> dict:
        nonlocal left
        left -= 2 * len(entries) + 2
        if left < 0:
            raise ProtocolError(f"{what} exceeds the decode budget of {allowance} objects")
        return entries

    def used() -> int:
        return allowance - left

    return on_array, on_map, used


class MsgpackCodec:
    """Encode and decode control messages; bounded and total on the decode side.

    ``max_frame_bytes``: longest frame. ``max_items``: longest array (maps: half).
    ``max_objects``: a frame's total budget in units (module docstring), nested
    metadata included. ``max_bytes``: wire bytes one frame may decode, the nested
    metadata's bin counted again (default ``max_frame_bytes``). ``max_depth``: deepest
    nesting of pieces longer than ``max_depth * max_items`` bytes.
    ``max_metadata_objects``: units the MF_META layer map may use.
    """

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_items: int = DEFAULT_MAX_ITEMS,
        *,
        max_objects: int = DEFAULT_MAX_OBJECTS,
        max_bytes: int | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_metadata_objects: int = DEFAULT_MAX_METADATA_OBJECTS,
    ) -> None:
        if max_frame_bytes < 16:
            raise ValueError(f"max_frame_bytes must be >= 16, got {max_frame_bytes}")
        for name, value in (("max_items", max_items), ("max_objects", max_objects),
                            ("max_metadata_objects", max_metadata_objects)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 1 <= max_depth < _STACK_LIMIT:
            raise ValueError(f"max_depth must be in [1, {_STACK_LIMIT}), got {max_depth}")
        max_bytes = max_frame_bytes if max_bytes is None else max_bytes
        if max_bytes < 16:
            raise ValueError(f"max_bytes must be >= 16, got {max_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.max_items = max_items
        self.max_objects = max_objects
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self.max_metadata_objects = max_metadata_objects
        per_container = min(max_items, max_objects)
        self._depth_checked_above = max_depth * per_container
        self._depth_prefix = b"\x91" * (_STACK_LIMIT - max_depth)
        self._limits = {
            "max_str_len": min(max_bytes, MAX_STR_BYTES),
            "max_bin_len": max_bytes,
            "max_array_len": per_container,
            "max_map_len": max(1, per_container // 2),
            "max_ext_len": 0,
        }
        # A short piece skips the check pass; its lengths are capped by its size instead.
        self._short_limits = {
            key: min(value, _SHORT_PIECE_BYTES) for key, value in self._limits.items()
        }
        # conn -> (wire bytes of the last READ_READY_BATCH's read entries, their entries)
        self._entries: dict[Hashable, tuple[bytes, tuple[Any, ...]]] = {}

    def worst_case_decode_bytes(self) -> int:
        """``worst_case_decode_bytes`` for this codec's limits."""
        return worst_case_decode_bytes(
            self.max_frame_bytes, self.max_objects, max_items=self.max_items,
            max_depth=self.max_depth, max_bytes=self.max_bytes,
        )

    # -- encode (``conn``, the connection of the ``WireCodec`` port, is ignored: a
    # plain codec keeps no per-connection state)
    def encode(self, message: Message, conn: Hashable = None) -> bytes:
        """The message's frame: its positional array; the handshake's answers as raw
        ``b"ACK"`` (+ generation) and ``b"NAK"`` + the refusal's array."""
        if isinstance(message, MetaAck):
            return ack_plain(message.generation,
                             ACK_FLAG_LAYER_RUNS if message.layer_runs else None)
        if isinstance(message, MetaRefused):
            return NAK + self._pack(refusal_fields(message))
        return self._pack(fields_of(message, encode_nested_metadata=self._pack))

    # The signing envelope version MF_META's compat map states: none without a secret.
    signing = "none"

    def handshake_answer(self, raw: bytes) -> MetaAck | MetaRefused | None:
        """The acknowledgement or refusal ``raw`` holds, None when it is neither (then it
        is an array message). A malformed refusal is a ``ProtocolError`` that fails the
        handshake (bounded like any frame)."""
        ack = meta_ack(raw)
        if ack is not None:
            return ack
        if not raw.startswith(NAK):
            return None
        try:
            body = self._unpack(raw[len(NAK):], "MF_META refusal",
                                _Budget(self.max_objects, self.max_bytes),
                                self.max_metadata_objects)
            return refusal_from_fields(body)
        except ProtocolError as exc:
            raise ProtocolError(exc.detail, handshake=True) from exc

    def forget(self, conn: Hashable) -> None:
        """Drop what is kept for the connection (its last read entries)."""
        self._entries.pop(conn, None)

    @staticmethod
    def _pack(value: Any) -> bytes:
        return msgpack.packb(value, use_bin_type=True)

    # -- decode
    def decode(self, frame: bytes, conn: Hashable = None) -> Message:
        # The handshake's answers are raw bytes; an array never starts so (0x9X, 0xdc, 0xdd).
        if isinstance(frame, bytes | bytearray | memoryview) and bytes(frame[:3]) in (ACK, NAK):
            answer = self.handshake_answer(bytes(frame))
            if answer is not None:
                return answer
        budget = _Budget(self.max_objects, self.max_bytes)
        fields = self._unpack(frame, "frame", budget, self.max_objects)

        def nested(raw: bytes) -> Any:
            return self._unpack_nested(raw, budget)

        wire = known = None
        if (conn is not None and len(frame) <= MEMO_MAX_FRAME_BYTES
                and type(fields) is list and len(fields) > 3
                and fields[0] == READ_READY_BATCH):
            seen = self._entries.get(conn)
            if seen is not None and entries_at(frame, fields, seen[0]):
                wire, known = seen
            else:
                wire = element_bytes(frame, 3)
                if seen is not None and wire is not None and seen[0] == wire:
                    known = seen[1]
        try:
            message = message_from_fields(fields, decode_nested_metadata=nested,
                                          read_requests=known)
        except ProtocolError:
            raise
        except Exception as exc:  # a bug-shaped input must still be only a ProtocolError
            raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc
        if (known is None and wire is not None and len(wire) <= MEMO_MAX_BYTES
                and isinstance(message, ReadReadyBatch)):
            entries = self._entries
            entries.pop(conn, None)
            while len(entries) >= MEMO_MAX_CONNECTIONS:
                del entries[next(iter(entries))]
            entries[conn] = (wire, message.read_reqs)
        return message

    def _unpack_nested(self, raw: bytes, budget: _Budget | None = None) -> Any:
        """MF_META's layer map, drawing on ``budget`` (the enclosing frame's)."""
        if budget is None:
            budget = _Budget(self.max_objects, self.max_bytes)
        return self._unpack(raw, "MF_META layer metadata", budget, self.max_metadata_objects)

    def _unpack(self, raw: Any, what: str, budget: _Budget, cap: int) -> Any:
        if type(raw) is bytes:
            size = len(raw)
        elif isinstance(raw, (bytes, bytearray, memoryview)):
            size = raw.nbytes if isinstance(raw, memoryview) else len(raw)
        else:
            raise ProtocolError(f"{what} must be bytes, got {type(raw).__name__}")
        if size > self.max_frame_bytes:
            raise ProtocolError(
                f"{what} of {size} bytes exceeds the {self.max_frame_bytes}-byte limit"
            )
        if size > budget.bytes:
            raise ProtocolError(
                f"{what} of {size} bytes exceeds the decode budget of {self.max_bytes} bytes "
                f"({budget.bytes} left)"
            )
        budget.bytes -= size
        allowance = cap if cap < budget.objects else budget.objects
        worst = _UNITS_PER_BYTE * (size + 1)
        if worst <= allowance:  # too short to overrun the budget: no hooks
            if size <= _SHORT_PIECE_BYTES:
                value = self._run(raw, what, self._short_limits)
            else:
                self._check(raw, size, what)
                value = self._run(raw, what, self._limits)
            budget.objects -= worst
            return value
        self._check(raw, size, what)
        on_array, on_map, used = _counting_hooks(allowance, what)
        value = self._run(raw, what, self._limits, on_array, on_map)
        budget.objects -= used()
        return value

    @staticmethod
    def _run(
        raw: Any, what: str, limits: dict[str, int],
        on_array: Callable[[list], list] | None = None,
        on_map: Callable[[dict], dict] | None = None,
    ) -> Any:
        try:
            return msgpack.unpackb(
                raw, raw=False, use_list=True, strict_map_key=True,
                list_hook=on_array, object_hook=on_map, **limits,
            )
        except ProtocolError:  # the budget hooks
            raise
        except RecursionError as exc:  # deeply nested input
            raise ProtocolError(f"{what} is nested too deeply") from exc
        except Exception as exc:  # msgpack raises many types; all mean "malformed"
            raise ProtocolError(f"{what} is not valid msgpack: {_detail(exc)}") from exc

    def _check(self, raw: Any, size: int, what: str) -> None:
        """The check pass: complete, no trailing bytes, and, for long pieces, nested
        at most ``max_depth`` deep. ``skip`` builds no objects."""
        prefix = self._depth_prefix if size > self._depth_checked_above else b""
        unpacker = msgpack.Unpacker(max_buffer_size=max(size + len(prefix), 1))
        try:
            if prefix:
                unpacker.feed(prefix)
            unpacker.feed(raw)
            unpacker.skip()
        except msgpack.OutOfData as exc:
            raise ProtocolError(f"{what} is not valid msgpack: truncated") from exc
        except msgpack.StackError as exc:
            limit = self.max_depth if prefix else _STACK_LIMIT
            raise ProtocolError(f"{what} is nested deeper than {limit} levels") from exc
        except Exception as exc:
            raise ProtocolError(f"{what} is not valid msgpack: {_detail(exc)}") from exc
        if unpacker.tell() != size + len(prefix):
            raise ProtocolError(f"{what} is not valid msgpack: extra data after the value")


def _detail(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"

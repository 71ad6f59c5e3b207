"""msgpack encoding of the exact wire layout of spec 4.

Tags travel as bin, strings as str, MF_META's layer metadata as a nested
msgpack map inside a bin field. Decoding is bounded (frame size, string, bin,
array and map lengths, nesting depth) and every failure is one ``ProtocolError``.
"""

from __future__ import annotations

from typing import Any

import msgpack

from rd2h.domain.errors import ProtocolError
from rd2h.domain.protocol import ACK, Message, fields_of, message_from_fields

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_ITEMS = 4 * 1024 * 1024


class MsgpackCodec:
    """Encode and decode control messages; bounded and total on the decode side."""

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_items: int = DEFAULT_MAX_ITEMS,
    ) -> None:
        if max_frame_bytes < 16:
            raise ValueError(f"max_frame_bytes must be >= 16, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._limits = {
            "max_str_len": min(max_frame_bytes, 1 << 20),
            "max_bin_len": max_frame_bytes,
            "max_array_len": max_items,
            "max_map_len": min(max_items, 1 << 20),
            "max_ext_len": 0,
        }

    # -- encode
    def encode(self, message: Message) -> bytes:
        return self._pack(fields_of(message, encode_nested_metadata=self._pack))

    @staticmethod
    def encode_ack() -> bytes:
        return ACK

    @staticmethod
    def is_ack(frame: bytes) -> bool:
        return bytes(frame) == ACK

    @staticmethod
    def _pack(value: Any) -> bytes:
        return msgpack.packb(value, use_bin_type=True)

    # -- decode
    def decode(self, frame: bytes) -> Message:
        fields = self._unpack(frame, "frame")
        try:
            return message_from_fields(fields, decode_nested_metadata=self._unpack_nested)
        except ProtocolError:
            raise
        except Exception as exc:  # a bug-shaped input must still be only a ProtocolError
            raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc

    def _unpack_nested(self, raw: bytes) -> Any:
        return self._unpack(raw, "MF_META layer metadata")

    def _unpack(self, raw: Any, what: str) -> Any:
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"{what} must be bytes, got {type(raw).__name__}")
        if len(raw) > self.max_frame_bytes:
            raise ProtocolError(
                f"{what} of {len(raw)} bytes exceeds the {self.max_frame_bytes}-byte limit"
            )
        try:
            return msgpack.unpackb(
                raw, raw=False, use_list=True, strict_map_key=True, **self._limits
            )
        except RecursionError as exc:  # deeply nested input
            raise ProtocolError(f"{what} is nested too deeply") from exc
        except Exception as exc:  # msgpack raises many types; all mean "malformed"
            detail = f"{type(exc).__name__}: {exc}"
            raise ProtocolError(f"{what} is not valid msgpack: {detail}") from exc

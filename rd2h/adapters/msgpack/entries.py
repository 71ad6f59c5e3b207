"""Where a READ_READY_BATCH frame's read entries lie, for the codec's per-connection memo
of them (``codec.py``): their wire bytes, and whether a frame holds remembered ones."""

from __future__ import annotations

import threading
from typing import Any

import msgpack

_local = threading.local()  # a Packer per thread (one is not safe to share)


def _packer() -> msgpack.Packer:
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


def entries_at(frame: Any, fields: list[Any], wire: bytes) -> bool:
    """Whether ``frame`` (which decoded whole to ``fields``) holds exactly ``wire`` as its
    element 3, found without a second parse: when the frame's first bytes are the
    canonical encoding of its array header and elements 0-2, element 3 starts right
    after them (msgpack is prefix-free: a complete encoding at a position is what a parse
    from there reads), and ``wire``, one complete value, is element 3 if it starts there.
    Anything else (a non-canonical encoding, other entries) answers False."""
    if type(frame) is not bytes or len(fields) > 15:
        return False
    head = _packer().pack(fields[:3])
    return (frame[0] == 0x90 | len(fields) and frame.startswith(head[1:], 1)
            and frame.startswith(wire, len(head)))


def element_bytes(frame: Any, index: int) -> bytes | None:
    """The wire bytes of element ``index`` of the array ``frame`` holds (a frame that
    already decoded whole), or None."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(frame), 1))
    try:
        unpacker.feed(frame)
        if unpacker.read_array_header() <= index:
            return None
        for _ in range(index):
            unpacker.skip()
        start = unpacker.tell()
        unpacker.skip()
    except Exception:  # not what decoded above: no memo for this frame
        return None
    return bytes(frame[start:unpacker.tell()])

"""msgpack wire codec for the rd2h control channel (optionally HMAC-signed)."""

from rd2h.adapters.msgpack.auth import AuthenticatedCodec
from rd2h.adapters.msgpack.codec import DEFAULT_MAX_FRAME_BYTES, MsgpackCodec

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "AuthenticatedCodec", "MsgpackCodec"]

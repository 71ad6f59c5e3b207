"""MF_META's compatibility map (an extension: field 3) and Decode's refusal of it.

Prefill states, in one small map, rd2h's protocol version and the facts that Decode
must share with it regardless of either side's TP size: block size (tokens per
block), KV dtype, model geometry (layers, head or latent size, total KV heads, MLA or
not), main-KV sharing mode and the signing envelope version. Decode compares the
protocol version and every key both maps carry; keys it does not know are ignored
(a newer peer may state more), keys one side does not state are not compared. On a
difference Decode stores nothing and answers the raw refusal ``b"NAK"`` + a msgpack
array ``[reason, [[key, prefill value, decode value], ...]]`` instead of ``b"ACK"``
(signed like the ACK when a secret is configured), so Prefill fails that endpoint's
layers at once, naming the field. A peer that sends no map (older builds, the
original implementation) is acknowledged as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rd2h.domain.errors import ProtocolError

# Bump only for a change that breaks interoperability; appended fields need none.
PROTOCOL_VERSION = 1
PROTOCOL = "protocol"
# The MF_META refusal: these raw bytes, then the msgpack-encoded refusal.
NAK = b"NAK"

Value = int | str | bool
# Known keys and the type of their value (int: >= 0, str: at most MAX_VALUE_CHARS).
KNOWN: dict[str, type] = {
    PROTOCOL: int,
    "block_size": int,  # tokens per block
    "kv_dtype": str,
    "num_layers": int,  # the model's hidden layers
    "head_size": int,  # head dim (MLA: the latent, e.g. 576)
    "kv_heads": int,  # total KV heads, before any TP split
    "mla": bool,
    "main_sharing": str,  # rank_local | shared_pool
    "auth": str,  # the signing envelope version, "none" without a secret
    "kv_groups": str,  # the KV cache groups rd2h moves: kind, window, block size, layers
    "spec_decode": str,  # speculative decoding (its draft layers own KV), "none" without
    "state_tp": int,  # TP size of an engine whose state moves between equal TP only
    # How the model's recurrent state splits over TP ranks (``state_split``), the same
    # at every TP size: a Decode rank of another TP size reads its parts
    "state_layout": str,
}
MAX_KEYS = 32
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 128
MAX_MISMATCHES = MAX_KEYS
MAX_REASON_CHARS = 1024
_MAX_INT = (1 << 63) - 1


@dataclass(frozen=True)
class Compat:
    """What one side states; ``values`` always holds ``protocol``."""

    values: Mapping[str, Value]

    def with_values(self, **values: Value | None) -> Compat:
        """These values added (None: not stated), e.g. the codec's ``auth``."""
        return Compat({**self.values, **{k: v for k, v in values.items() if v is not None}})

    def to_wire(self) -> dict[str, Value]:
        return dict(self.values)


def compat_of(*, block_size: int | None = None, kv_dtype: str | None = None,
              num_layers: int | None = None, head_size: int | None = None,
              kv_heads: int | None = None, mla: bool | None = None,
              main_sharing: str | None = None, auth: str | None = None,
              protocol: int = PROTOCOL_VERSION) -> Compat:
    """The map a side states: the protocol version and every value given (None: not
    stated, so never compared)."""
    values: dict[str, Value | None] = {
        PROTOCOL: protocol, "block_size": block_size, "kv_dtype": kv_dtype,
        "num_layers": num_layers, "head_size": head_size, "kv_heads": kv_heads, "mla": mla,
        "main_sharing": main_sharing, "auth": auth,
    }
    out = {k: v for k, v in values.items() if v is not None}
    for key, value in out.items():
        _check(key, value, ValueError)
    return Compat(out)


@dataclass(frozen=True)
class Mismatch:
    key: str
    prefill: str
    decode: str

    def __str__(self) -> str:
        return f"{self.key}: prefill {self.prefill}, decode {self.decode}"


@dataclass(frozen=True)
class MetaRefused:
    """Decode's answer to an MF_META it will not store (``b"NAK"`` on the wire)."""

    reason: str
    mismatches: tuple[Mismatch, ...] = ()

    def describe(self) -> str:
        named = "; ".join(str(m) for m in self.mismatches)
        return f"{self.reason}: {named}" if named else self.reason


INCOMPATIBLE = "incompatible builds (MF_META compat)"


def compare(prefill: Compat, decode: Compat) -> MetaRefused | None:
    """The refusal naming every key both sides state with different values (the
    protocol version is always stated), or None when they agree."""
    diffs = tuple(
        Mismatch(key, _text(value), _text(decode.values[key]))
        for key, value in prefill.values.items()
        if key in decode.values and not _same(value, decode.values[key])
    )
    return MetaRefused(INCOMPATIBLE, diffs[:MAX_MISMATCHES]) if diffs else None


def _same(a: Value, b: Value) -> bool:
    return type(a) is type(b) and a == b


def _text(value: Value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------- the wire


def _check(key: str, value: Any, error: type[Exception] = ProtocolError) -> Value:
    kind = KNOWN[key]
    if kind is bool:
        ok = type(value) is bool
    elif kind is int:
        ok = type(value) is int and 0 <= value <= _MAX_INT
    else:
        ok = type(value) is str and len(value) <= MAX_VALUE_CHARS
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        what = {bool: "a bool", int: "an int in [0, 2**63)",
                str: f"a str of at most {MAX_VALUE_CHARS} characters"}[kind]
        raise error(f"MF_META compat {key!r} must be {what}, got {shown}")
    return value  # type: ignore[no-any-return]


def decode_compat(value: Any) -> Compat | None:
    """MF_META's field 3. Absent (None) -> None, and so is a bin there (the signature
    envelope of a signing peer read without the secret); keys not known here are
    dropped unread; anything else malformed raises ``ProtocolError``."""
    if value is None or isinstance(value, (bytes, bytearray)):
        return None
    if not isinstance(value, Mapping):
        raise ProtocolError(f"MF_META compat must be a map, got {type(value).__name__}")
    if len(value) > MAX_KEYS:
        raise ProtocolError(f"MF_META compat has {len(value)} entries (at most {MAX_KEYS})")
    out: dict[str, Value] = {}
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise ProtocolError(f"MF_META compat keys must be str of at most {MAX_KEY_CHARS} "
                                f"characters, got {type(key).__name__} {str(key)[:80]!r}")
        if key in KNOWN:
            out[key] = _check(key, item)
    if PROTOCOL not in out:
        raise ProtocolError(f"MF_META compat lacks {PROTOCOL!r}")
    return Compat(out)


def compat_at(fields: Any) -> Compat | None:
    """MF_META's optional field 3 (``decode_compat``) of a positional array."""
    return decode_compat(fields[3]) if len(fields) > 3 else None


def compat_field(compat: Compat | None) -> list[dict[str, Value]]:
    """MF_META's field 3 to append: nothing when no map is stated."""
    return [] if compat is None else [compat.to_wire()]


def refusal_fields(refusal: MetaRefused) -> list[Any]:
    """The refusal's positional array (after ``b"NAK"``), ready for a codec."""
    return [refusal.reason, [[m.key, m.prefill, m.decode] for m in refusal.mismatches]]


def refusal_from_fields(value: Any) -> MetaRefused:
    """A decoded refusal array; extra fields are ignored, long texts clipped."""
    if not isinstance(value, (list, tuple)) or len(value) < 2:
        raise ProtocolError("MF_META refusal must be an array [reason, mismatches]")
    reason, items = value[0], value[1]
    if not isinstance(reason, str) or not isinstance(items, (list, tuple)):
        raise ProtocolError("MF_META refusal must hold a str reason and an array")
    if len(items) > MAX_MISMATCHES:
        raise ProtocolError(f"MF_META refusal names {len(items)} fields "
                            f"(at most {MAX_MISMATCHES})")
    out = []
    for item in items:
        if (not isinstance(item, (list, tuple)) or len(item) < 3
                or not all(isinstance(s, str) for s in item[:3])):
            raise ProtocolError("MF_META refusal entries must be [key, prefill, decode] strs")
        key, p, d = (_clip(s, MAX_VALUE_CHARS) for s in item[:3])
        out.append(Mismatch(_clip(key, MAX_KEY_CHARS), p, d))
    return MetaRefused(_clip(reason, MAX_REASON_CHARS), tuple(out))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

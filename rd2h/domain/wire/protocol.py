"""The control-channel messages and their decoding rules (spec 4), codec-agnostic.

A codec (``rd2h.adapters.msgpack``) turns frames into plain Python values
(lists, ints, str, bytes, dicts); this module turns those values into typed,
validated messages and back, with every legacy length guard in one place.
Protocol extensions only ever append fields.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

from rd2h.domain.errors import ProtocolError, UnknownMessageType
from rd2h.domain.wire.compat import Compat, MetaRefused, compat_at, compat_field
from rd2h.domain.wire.layer_meta import (  # noqa: F401 (re-exported: the protocol's names)
    LAYER_METADATA_KEYS,
    MAIN_HEADS_KEY,
    NUM_BLOCKS_KEY,
    LayerMetadata,
    decode_layer_map,
    decode_layer_metadata,
)
from rd2h.domain.wire.wire_values import (  # noqa: F401 (re-exported)
    MAX_ERROR_CHARS,
    MAX_WIRE_INT,
    clip,
)
from rd2h.domain.wire.wire_values import as_int as _int
from rd2h.domain.wire.wire_values import as_seq as _seq
from rd2h.domain.wire.wire_values import as_str as _str

# Type tags are msgpack bin (bytes), never str.
MF_META = b"mf_meta"
READ_READY_BATCH = b"read_ready_batch"
READ_DONE = b"read_done"
READ_FAILED = b"read_failed"
# The MF_META acknowledgement is these raw bytes, not a msgpack value.
ACK = b"ACK"
# Extension (MF_META field 5, the ACK's flag byte): what a Prefill can send and a Decode
# acknowledges it reads. ``layer runs``: several layers that announce the same read
# entries in one READ_READY_BATCH (field 10), answered by one reply (field 4).
FEATURE_LAYER_RUNS = "layer_runs"
ACK_FLAG_LAYER_RUNS = 0x01
# Most layers one READ_READY_BATCH may carry (the first and field 10's); Decode fails
# every layer of a longer run.
MAX_RUN_LAYERS = 256

_INT_ONLY = {int}
_STR_ONLY = {str}
_LIST_ONLY = {list}
_FIVE_ONLY = {5}
_FOUR_ONLY = {4}
# The most significant byte of each item of a packed uint64 array.
_PACKED_U64 = array("Q").itemsize == 8
_TOP_BYTES = slice(7, None, 8) if sys.byteorder == "little" else slice(0, None, 8)


@dataclass(frozen=True)
class MfMeta:
    p_session: str
    layers: Mapping[str, LayerMetadata]
    compat: Compat | None = None  # extension (field 3): facts both builds must share
    # Extension (field 4, only after ``compat``): the sender's generation, a nonce drawn
    # when it starts. A new one under a known ``p_session`` is a restarted peer.
    generation: int | None = None
    # Extension (field 5, only after ``generation``): protocol features this Prefill can
    # use (``FEATURE_LAYER_RUNS``); Decode states in its ACK which it reads.
    features: tuple[str, ...] = ()


class RunLayer(NamedTuple):
    """One more layer of a layer run (READ_READY_BATCH field 10): it announces the same
    read entries, member, ratio, hold and awaited requests as the message's first layer."""

    layer_idx: int
    layer_name: str
    seq: int
    done_ext_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReadRequest:
    """One request's ready blocks in a READ_READY_BATCH (spec 4.2)."""

    ext_req_id: str
    p_main_block_ids: tuple[int, ...]
    p_indexer_block_ids: tuple[int, ...]
    main_start_block: int = 0
    indexer_start_block: int = 0
    # Extension (entry field 5, ``verify_kv``): per tensor, the digests of its blocks
    # (``rd2h.domain.planning.digests``); None: not stated. Older peers ignore the field.
    digests: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class ReadReadyBatch:
    layer_idx: int
    layer_name: str
    read_reqs: tuple[ReadRequest, ...]
    done_ext_ids: tuple[str, ...] = ()
    group_member_idx: int = 0
    tp_ratio: int = 1
    # Extension (field 7): the sender's id of this announcement, echoed in the reply so
    # that Prefill matches every answer to exactly the announcement it answers.
    seq: int | None = None
    # Extension (field 8, only after ``seq``): until when, in milliseconds of the Unix
    # epoch on Prefill's clock, Prefill keeps the announced blocks whatever happens
    # (unless answered). A read that may end later must not complete a request.
    hold_until_ms: int | None = None
    # Extension (field 9, only after ``hold_until_ms``): requests of this message that
    # Prefill was given before Decode admitted them (the proxy's parallel dispatch):
    # Decode keeps the message, within its hold, until it admits them, instead of
    # answering them skipped. Older peers ignore the field.
    awaits: tuple[str, ...] = ()
    # Extension (field 10, only after field 9, to a Decode that acknowledged
    # ``FEATURE_LAYER_RUNS``): more layers announcing the same read entries, each with
    # its own announcement id and done ids; one batched read and one reply for them all.
    also: tuple[RunLayer, ...] = ()

    def numbered(self, seq: int) -> ReadReadyBatch:
        """The same announcement with ``seq`` set (``dataclasses.replace`` without its
        per-call field introspection: once per layer and endpoint on Prefill)."""
        return ReadReadyBatch(self.layer_idx, self.layer_name, self.read_reqs,
                              self.done_ext_ids, self.group_member_idx, self.tp_ratio, seq,
                              self.hold_until_ms, self.awaits, self.also)

    def layers(self) -> tuple[ReadReadyBatch, ...]:
        """One single-layer announcement per layer of this message (itself without
        ``also``, then each ``RunLayer``), sharing the read entries and the rest."""
        if not self.also:
            return (self,)
        # Copies of this frozen instance's fields with the layer's own (the dataclass'
        # ``__init__`` sets each field through ``object.__setattr__``: 2-3x slower, per
        # layer of a run on Decode's hot path).
        base = self.__dict__
        out = []
        for idx, name, seq, done in ((self.layer_idx, self.layer_name, self.seq,
                                      self.done_ext_ids), *self.also):
            lay = object.__new__(ReadReadyBatch)
            fields = lay.__dict__
            fields.update(base)
            fields["layer_idx"], fields["layer_name"], fields["seq"] = idx, name, seq
            fields["done_ext_ids"], fields["also"] = done, ()
            out.append(lay)
        return tuple(out)

    @property
    def named_ext_ids(self) -> tuple[str, ...]:
        """Every request this message names (read entries, then done ids of each of its
        layers), no repeats."""
        seen: dict[str, None] = {}
        for req in self.read_reqs:
            seen.setdefault(req.ext_req_id, None)
        for ext in self.done_ext_ids:
            seen.setdefault(ext, None)
        for lay in self.also:
            for ext in lay.done_ext_ids:
                seen.setdefault(ext, None)
        return tuple(seen)


@dataclass(frozen=True)
class ReadDone:
    layer_idx: int
    seq: int | None = None  # extension (field 2): the answered announcement's ``seq``
    # Extension (field 3, only after ``seq``): requests of the announcement that Decode
    # did not read because it no longer knows them (aborted, finished, never admitted
    # here); every other request of the layer was read as usual.
    skipped: tuple[str, ...] = ()
    # Extension (field 4, only after ``skipped``): the other layers of a layer run this
    # reply answers, as (layer index, announcement id); ``skipped`` is theirs too.
    also: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ReadFailed:
    layer_idx: int
    error: str = field(default="")
    seq: int | None = None  # extension (field 3): the answered announcement's ``seq``
    # Extension (field 4, only after ``seq``): the other layers of a layer run that
    # failed with it, as (layer index, announcement id).
    also: tuple[tuple[int, int], ...] = ()


def answered(message: ReadDone | ReadFailed) -> tuple[ReadDone | ReadFailed, ...]:
    """One single-layer reply per layer a reply answers (itself without ``also``, then
    one per ``also`` pair), for a Prefill that tracks its announcements one by one."""
    if not message.also:
        return (message,)
    if isinstance(message, ReadDone):
        return (ReadDone(message.layer_idx, message.seq, message.skipped),
                *(ReadDone(idx, seq, message.skipped) for idx, seq in message.also))
    return (ReadFailed(message.layer_idx, message.error, message.seq),
            *(ReadFailed(idx, message.error, seq) for idx, seq in message.also))


@dataclass(frozen=True)
class MetaAck:
    """Decode stored the MF_META: the raw bytes ``b"ACK"`` on the wire (not a msgpack
    array), then (extension, only to a Prefill that stated its own generation) Decode's
    generation, 8 bytes big-endian, then (extension, only to a Prefill that stated
    features) one byte of flags: what of them Decode reads (``ACK_FLAG_LAYER_RUNS``)."""

    generation: int | None = None
    layer_runs: bool = False


# Every control message, each direction. The handshake's answers (``MetaAck``, and
# ``MetaRefused`` from ``compat``: raw ``b"NAK"`` + its array) are framed apart from the
# arrays; a codec decodes them all through one ``decode``.
Message = MfMeta | ReadReadyBatch | ReadDone | ReadFailed | MetaAck | MetaRefused


# ---------------------------------------------------------------- the acknowledgement

GENERATION_BYTES = 8


def ack_plain(generation: int | None, flags: int | None = None) -> bytes:
    """The MF_META acknowledgement: ``b"ACK"``, then (extension, only to a Prefill that
    stated its own generation) Decode's generation, 8 bytes big-endian, then (extension,
    only to a Prefill that stated features; needs the generation) one byte of flags."""
    if generation is None:
        return ACK
    tail = b"" if flags is None else bytes((flags,))
    return ACK + generation.to_bytes(GENERATION_BYTES, "big") + tail


def parse_ack(raw: bytes) -> tuple[bool, int | None, int]:
    """``(is an acknowledgement, the generation it states, its flags)`` of unsigned
    bytes (flags 0 when it states none)."""
    if raw == ACK:
        return True, None, 0
    if len(raw) in (_ACK_GEN, _ACK_GEN + 1) and raw.startswith(ACK):
        flags = raw[_ACK_GEN] if len(raw) > _ACK_GEN else 0
        return True, int.from_bytes(raw[len(ACK):_ACK_GEN], "big"), flags
    return False, None, 0


_ACK_GEN = len(ACK) + GENERATION_BYTES


def meta_ack(raw: bytes) -> MetaAck | None:
    """The acknowledgement unsigned bytes hold (None: they are none)."""
    is_ack, generation, flags = parse_ack(raw)
    if not is_ack:
        return None
    return MetaAck(generation, bool(flags & ACK_FLAG_LAYER_RUNS))


# ---------------------------------------------------------------- helpers


def _seq_field(fields: Sequence[Any], index: int, layer_idx: int | None,
               what: str = "announcement id") -> int | None:
    """The optional int at ``index`` (an announcement id, a hold): absent (older peers)
    -> None, and so is a value of another type there (e.g. the signature envelope of a
    signing peer read without the secret): these fields are only ever ints."""
    if len(fields) <= index or type(fields[index]) is not int:
        return None
    return _int(fields[index], what, layer_idx, minimum=0, maximum=MAX_WIRE_INT)


def _ids_in_range(items: Sequence[int]) -> bool:
    """Whether plain ints all lie in [0, 2**63): packing them as uint64 (in C) refuses
    negative values and values from 2**64 on; those from 2**63 on have their top bit set."""
    if not _PACKED_U64:  # pragma: no cover - no platform in use has a wider long long
        return min(items) >= 0 and max(items) <= MAX_WIRE_INT
    try:
        packed = array("Q", items)
    except OverflowError:
        return False
    return packed.tobytes()[_TOP_BYTES].isascii()


def _block_ids(value: Any, what: str, layer_idx: int) -> tuple[int, ...]:
    items = _seq(value, what, layer_idx)
    # type() is int excludes bool and every other type; map/set and the range check
    # run in C.
    if items and (set(map(type, items)) != _INT_ONLY or not _ids_in_range(items)):
        bad = next(
            (i for i in items if type(i) is not int or not 0 <= i <= MAX_WIRE_INT), None
        )
        raise ProtocolError(
            f"{what} must hold ints in [0, 2**63), got {clip(repr(bad), 80)}", layer_idx
        )
    return tuple(items)


# ---------------------------------------------------------------- decoding


def decode_read_request(entry: Any, layer_idx: int) -> ReadRequest:
    """One read entry; a 2-field entry shares its ids between main and indexer."""
    fields = _seq(entry, "read request", layer_idx)
    if len(fields) == 2:
        ext = _str(fields[0], "read request id", layer_idx)
        ids = _block_ids(fields[1], "read request block ids", layer_idx)
        return ReadRequest(ext, ids, ids, 0, 0)
    if len(fields) < 5:
        raise ProtocolError(
            f"read request must have 2 or 5 fields, got {len(fields)}", layer_idx
        )
    digests = None
    if len(fields) > 5 and isinstance(fields[5], (list, tuple)):
        digests = tuple(_block_ids(d, "KV digests", layer_idx)
                        for d in _seq(fields[5], "KV digest lists", layer_idx))
    return ReadRequest(
        ext_req_id=_str(fields[0], "read request id", layer_idx),
        p_main_block_ids=_block_ids(fields[1], "main block ids", layer_idx),
        p_indexer_block_ids=_block_ids(fields[2], "indexer block ids", layer_idx),
        main_start_block=_int(
            fields[3], "main start block", layer_idx, minimum=0, maximum=MAX_WIRE_INT
        ),
        indexer_start_block=_int(
            fields[4], "indexer start block", layer_idx, minimum=0, maximum=MAX_WIRE_INT
        ),
        digests=digests,
    )


def _plain_read_requests(entries: Sequence[Any]) -> tuple[ReadRequest, ...] | None:
    """The read entries when every one is a plain, valid 5-field entry (what rd2h's
    encoder sends), checked column by column in a few C-level passes instead of entry
    by entry; None when anything differs, and ``decode_read_request`` decides (and
    names the first fault). Accepts exactly what that path accepts, with equal values."""
    if not entries:
        return ()
    if set(map(type, entries)) != _LIST_ONLY or set(map(len, entries)) != _FIVE_ONLY:
        return None
    exts, mains, idxs, m_starts, i_starts = zip(*entries)
    if (set(map(type, exts)) != _STR_ONLY or set(map(type, mains)) != _LIST_ONLY
            or set(map(type, idxs)) != _LIST_ONLY):
        return None
    starts = m_starts + i_starts
    if set(map(type, starts)) != _INT_ONLY or min(starts) < 0 or max(starts) > MAX_WIRE_INT:
        return None
    ids = list(chain.from_iterable(mains + idxs))
    if ids and (set(map(type, ids)) != _INT_ONLY or not _ids_in_range(ids)):
        return None
    return tuple(map(ReadRequest, exts, map(tuple, mains), map(tuple, idxs), m_starts,
                     i_starts))


def _decode_read_ready(fields: Sequence[Any],
                       known: tuple[ReadRequest, ...] | None = None) -> ReadReadyBatch:
    if len(fields) < 4:
        raise ProtocolError(f"READ_READY_BATCH needs at least 4 fields, got {len(fields)}")
    layer_idx = _int(fields[1], "layer index", minimum=0)
    layer_name = _str(fields[2], "layer name", layer_idx)
    entries = _seq(fields[3], "read requests", layer_idx)
    reqs = known if known is not None else _plain_read_requests(entries)
    if reqs is None:
        reqs = tuple(decode_read_request(e, layer_idx) for e in entries)
    done: tuple[str, ...] = ()
    if len(fields) > 4:
        done = tuple(
            _str(e, "done request id", layer_idx) for e in _seq(fields[4], "done ids", layer_idx)
        )
    member, ratio = 0, 1
    if len(fields) > 6:
        member = _int(fields[5], "group member index", layer_idx, minimum=0, maximum=MAX_WIRE_INT)
        ratio = max(1, _int(fields[6], "tp ratio", layer_idx, maximum=MAX_WIRE_INT))
        if member >= ratio:
            raise ProtocolError(
                f"group member index {member} is outside its group of ratio {ratio}", layer_idx
            )
    elif len(fields) == 6:
        raise ProtocolError("READ_READY_BATCH carries a member index without its ratio", layer_idx)
    seq = _seq_field(fields, 7, layer_idx)
    hold = None if seq is None else _seq_field(fields, 8, layer_idx, "announcement hold")
    awaits: tuple[str, ...] = ()
    also: tuple[RunLayer, ...] = ()
    # Only after a hold; anything but a list there (a signing envelope read without the
    # secret) is not this field.
    if hold is not None and len(fields) > 9 and isinstance(fields[9], (list, tuple)):
        awaits = tuple(_str(e, "awaited request id", layer_idx) for e in fields[9])
        if len(fields) > 10 and isinstance(fields[10], (list, tuple)):
            also = _run_layers(fields[10], layer_idx)
    return ReadReadyBatch(layer_idx, layer_name, reqs, done, member, ratio, seq, hold, awaits,
                          also)


def _run_layers(value: Sequence[Any], layer_idx: int) -> tuple[RunLayer, ...]:
    """READ_READY_BATCH field 10: ``[layer_idx, layer_name, seq, done ids]`` per layer."""
    if len(value) + 1 > MAX_RUN_LAYERS:
        raise ProtocolError(f"a layer run of {len(value) + 1} layers exceeds the limit of "
                            f"{MAX_RUN_LAYERS}", layer_idx)
    fast = _plain_run_layers(value)
    if fast is not None:
        return fast
    out = []
    for item in value:
        parts = _seq(item, "run layer", layer_idx)
        if len(parts) < 4:
            raise ProtocolError(f"run layer must have 4 fields, got {len(parts)}", layer_idx)
        out.append(RunLayer(
            _int(parts[0], "run layer index", layer_idx, minimum=0, maximum=MAX_WIRE_INT),
            _str(parts[1], "run layer name", layer_idx),
            _int(parts[2], "run layer announcement id", layer_idx, minimum=0,
                 maximum=MAX_WIRE_INT),
            tuple(_str(e, "run layer done id", layer_idx)
                  for e in _seq(parts[3], "run layer done ids", layer_idx))))
    return tuple(out)


def _plain_run_layers(value: Sequence[Any]) -> tuple[RunLayer, ...] | None:
    """Field 10 when every item is a plain, valid 4-field list (what rd2h sends), checked
    column by column; None when anything differs (``_run_layers`` then names the fault)."""
    if not value:
        return ()
    if set(map(type, value)) != _LIST_ONLY or set(map(len, value)) != _FOUR_ONLY:
        return None
    idxs, names, seqs, dones = zip(*value)
    ints = idxs + seqs
    if (set(map(type, ints)) != _INT_ONLY or min(ints) < 0 or max(ints) > MAX_WIRE_INT
            or set(map(type, names)) != _STR_ONLY or set(map(type, dones)) != _LIST_ONLY):
        return None
    ids = list(chain.from_iterable(dones))
    if ids and set(map(type, ids)) != _STR_ONLY:
        return None
    return tuple(map(RunLayer, idxs, names, seqs, map(tuple, dones)))


def _answered_also(fields: Sequence[Any], index: int, layer_idx: int
                   ) -> tuple[tuple[int, int], ...]:
    """A reply's optional ``[[layer_idx, seq], ...]`` at ``index`` (a layer run's other
    layers); anything but a list there (a signing envelope) is not this field."""
    if len(fields) <= index or not isinstance(fields[index], (list, tuple)):
        return ()
    value = fields[index]
    if len(value) + 1 > MAX_RUN_LAYERS:
        raise ProtocolError(f"a reply for {len(value) + 1} layers exceeds the limit of "
                            f"{MAX_RUN_LAYERS}", layer_idx)
    out = []
    for item in value:
        pair = _seq(item, "answered run layer", layer_idx)
        if len(pair) < 2:
            raise ProtocolError("answered run layer must be [layer index, announcement id]",
                                layer_idx)
        out.append((_int(pair[0], "run layer index", layer_idx, minimum=0,
                         maximum=MAX_WIRE_INT),
                    _int(pair[1], "run layer announcement id", layer_idx, minimum=0,
                         maximum=MAX_WIRE_INT)))
    return tuple(out)


def message_from_fields(
    fields: Any, decode_nested_metadata: Any = None,
    read_requests: tuple[ReadRequest, ...] | None = None,
) -> Message:
    """Turn a decoded positional tuple into a typed message.

    ``decode_nested_metadata(bytes) -> Any`` decodes MF_META's encoded layer map
    (a codec concern); it may raise ``ProtocolError``. ``read_requests``: a
    READ_READY_BATCH's read entries, already validated from the very same wire bytes
    as this message's (a codec's memo); every other field is checked as usual.
    """
    if not isinstance(fields, (list, tuple)) or not fields:
        raise ProtocolError("a control message must be a non-empty array")
    tag = fields[0]
    if not isinstance(tag, bytes):
        raise ProtocolError(f"message tag must be bin, got {type(tag).__name__}")
    if tag == READ_READY_BATCH:
        return _decode_read_ready(fields, read_requests)
    if tag == MF_META:
        if len(fields) < 3:
            raise ProtocolError(f"MF_META needs 3 fields, got {len(fields)}")
        session = _str(fields[1], "MF_META session")
        raw = fields[2]
        if isinstance(raw, bytes):
            if decode_nested_metadata is None:
                raise ProtocolError("MF_META carries encoded metadata but no decoder was given")
            raw = decode_nested_metadata(raw)
        compat = compat_at(fields)
        generation = None if compat is None else _seq_field(fields, 4, None, "generation")
        features: tuple[str, ...] = ()
        if generation is not None and len(fields) > 5 and isinstance(fields[5], (list, tuple)):
            features = tuple(
                _str(e, "MF_META feature") for e in _seq(fields[5], "MF_META features"))
        return MfMeta(session, decode_layer_map(raw), compat, generation, features)
    if tag == READ_DONE:
        if len(fields) < 2:
            raise ProtocolError("READ_DONE needs a layer index")
        layer_idx = _int(fields[1], "layer index", minimum=0)
        seq = _seq_field(fields, 2, layer_idx)
        skipped: tuple[str, ...] = ()
        also: tuple[tuple[int, int], ...] = ()
        if seq is not None and len(fields) > 3 and isinstance(fields[3], (list, tuple)):
            skipped = tuple(_str(e, "skipped request id", layer_idx) for e in fields[3])
            also = _answered_also(fields, 4, layer_idx)
        return ReadDone(layer_idx, seq, skipped, also)
    if tag == READ_FAILED:
        if len(fields) < 2:
            raise ProtocolError("READ_FAILED needs a layer index")
        layer_idx = _int(fields[1], "layer index", minimum=0)
        error = "" if len(fields) < 3 else fields[2]
        if isinstance(error, bytes):
            error = error.decode("utf-8", "replace")
        seq = _seq_field(fields, 3, layer_idx)
        return ReadFailed(layer_idx, _str(error, "READ_FAILED error", layer_idx), seq,
                          () if seq is None else _answered_also(fields, 4, layer_idx))
    raise UnknownMessageType(tag)


# ---------------------------------------------------------------- encoding


def fields_of(message: Message, encode_nested_metadata: Any = None) -> list[Any]:
    """The positional tuple of a message, ready for a codec."""
    if isinstance(message, ReadReadyBatch):
        return [
            READ_READY_BATCH,
            message.layer_idx,
            message.layer_name,
            [
                [r.ext_req_id, list(r.p_main_block_ids), list(r.p_indexer_block_ids),
                 r.main_start_block, r.indexer_start_block,
                 *([] if r.digests is None else [[list(d) for d in r.digests]])]
                for r in message.read_reqs
            ],
            list(message.done_ext_ids),
            message.group_member_idx,
            message.tp_ratio,
            *_opt(message.seq),
            *_opt(None if message.seq is None else message.hold_until_ms),
            *_tail(message),
        ]
    if isinstance(message, MfMeta):
        layer_map = {name: meta.to_map() for name, meta in message.layers.items()}
        payload = layer_map if encode_nested_metadata is None else encode_nested_metadata(layer_map)
        stated = message.compat is not None and message.generation is not None
        return [MF_META, message.p_session, payload, *compat_field(message.compat),
                *_opt(None if message.compat is None else message.generation),
                *([list(message.features)] if stated and message.features else [])]
    if isinstance(message, ReadDone):
        if message.seq is not None and message.also:
            return [READ_DONE, message.layer_idx, message.seq, list(message.skipped),
                    [list(pair) for pair in message.also]]
        if message.skipped and message.seq is not None:
            return [READ_DONE, message.layer_idx, message.seq, list(message.skipped)]
        return [READ_DONE, message.layer_idx, *_opt(message.seq)]
    if isinstance(message, ReadFailed):
        also = [[list(pair) for pair in message.also]] if (
            message.also and message.seq is not None) else []
        return [READ_FAILED, message.layer_idx, message.error, *_opt(message.seq), *also]
    raise TypeError(f"not an rd2h message: {message!r}")


def _tail(message: ReadReadyBatch) -> list[Any]:
    """Fields 9 and 10 (both only after a hold): the awaited requests, then the layer
    run's other layers (field 9 is then present, if empty)."""
    if message.seq is None or message.hold_until_ms is None:
        return []
    if message.also:
        return [list(message.awaits), [[lay.layer_idx, lay.layer_name, lay.seq,
                                        list(lay.done_ext_ids)] for lay in message.also]]
    return [list(message.awaits)] if message.awaits else []


def _opt(value: int | None) -> list[int]:
    return [] if value is None else [value]

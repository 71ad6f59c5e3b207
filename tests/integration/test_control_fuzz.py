"""Property-based fuzzing of the Decode receiver through a real ROUTER socket.

One long-running Decode receiver (real ``ZmqControlServer``) per wire variant (plain,
and HMAC-signed) serves a valid Prefill peer (real ``PrefillSender`` over a DEALER)
while hostile DEALERs flood it with hypothesis-generated frames: raw bytes, random
msgpack structures, tagged tuples with garbage fields, hostile READ_READY_BATCH and
MF_META messages with edge-case numbers, and byte-level mutations of valid frames.

Per example: every valid transfer completes and its bytes verify; the receive loop
is alive; every hostile frame that names a layer got exactly one reply, in order,
and every decodable MF_META exactly one ACK (the codec is the oracle of what a frame
names); no guard byte and no destination block outside the allowed ones changed;
no message reached the loop's catch-all. With a secret, nothing from a peer without
it is ever acted on: no metadata stored, no byte written.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import zmq
from fakes.rig import (
    COMPONENTS,
    D_BLOCKS,
    FULL,
    HOST,
    P_BLOCKS,
    WAIT,
    DSide,
    PSide,
    Rig,
    Transfer,
    assert_guarded,
    assert_transfer_landed,
    internal,
    layer_name,
    recv_frames,
    reset_blocks,
    run_transfer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rd2h.adapters.msgpack import AuthenticatedCodec, MsgpackCodec
from rd2h.app.prefill import PrefillSender
from rd2h.domain.errors import ProtocolError, UnknownMessageType
from rd2h.domain.wire.protocol import (
    MF_META,
    READ_DONE,
    READ_FAILED,
    READ_READY_BATCH,
    MetaAck,
    MfMeta,
    ReadReadyBatch,
    ReadRequest,
)
from rd2h.ports.codec import WireCodec

pytestmark = pytest.mark.integration

SECRET = b"fuzz-shared-secret-0123456789"
WRONG_SECRET = b"not-the-shared-secret-987654"
CODEC_MAX = 64 * 1024  # the codec's frame limit (decode error, connection kept)
MAX_FRAME_BYTES = 252 * 1024  # the setting: the container caps the socket 4 KiB above it
ZMQ_MAX = MAX_FRAME_BYTES + 4096  # the socket's limit (ZeroMQ drops the connection)
PLAIN_READER = MsgpackCodec(max_frame_bytes=CODEC_MAX)
LAYERS = (0, 1)
RUN = uuid.uuid4().hex[:8]  # valid request ids no hostile frame can guess
OK_BLOCKS = tuple(range(0, 6))  # Decode blocks of the valid peer's requests
# Requests the hostile peers may name: they may write Prefill bytes into these blocks.
FUZZ_TARGETS = {
    "fz-0": ((6, 7), (6, 7)),
    "fz-1": ((8, 9), (9, 8)),
    "fz-2": ((10, 11), (10, 11)),
}
FUZZ_BLOCKS = tuple(sorted({b for m, i in FUZZ_TARGETS.values() for b in m + i}))
# blocks 12..15 and every guard region are never allocated: they must keep SENTINEL
EXAMPLES = 100
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ====================================================================== the fuzzing state


@dataclass
class Fuzz:
    variant: str
    codec: WireCodec  # what the valid peers speak
    attacker: list[WireCodec]  # what a peer without the secret can produce
    p: PSide
    d: DSide
    sender: PrefillSender
    acct: zmq.Socket  # hostile DEALER whose replies are checked one by one
    chaos: zmq.Socket  # hostile DEALER for multi-frame / oversized sends (replies dropped)
    examples: int = 0
    frames: int = 0
    checked_replies: int = 0
    transfers: int = 0
    marker: Iterator[int] = field(default_factory=lambda: itertools.count(1 << 40))
    # mutation seeds, made once: a signing codec's frames differ on every encode, and
    # Hypothesis needs a strategy that draws the same way when it replays an example
    seeds: list[bytes] = field(default_factory=list)

    def expected(self, frame: bytes) -> str | int | None:
        """What Decode answers to ``frame``: "ACK", a layer index, or nothing (a real
        codec, holding the secret where Decode holds it, is the oracle: a fresh one per
        frame, like Decode facing a connection it accepted no MF_META on)."""
        oracle = self.codec
        if isinstance(oracle, AuthenticatedCodec):
            oracle = AuthenticatedCodec(PLAIN_READER, SECRET)
        try:
            msg = oracle.decode(frame)
        except UnknownMessageType:
            return None
        except ProtocolError as exc:
            return exc.layer_idx
        if isinstance(msg, MfMeta):
            return "ACK"
        return msg.layer_idx if isinstance(msg, ReadReadyBatch) else None

    def reply_of(self, frame: bytes) -> str | int:
        if frame.startswith(b"ACK"):  # plain, or signed (ACK + its envelope)
            return "ACK"
        msg = PLAIN_READER.decode(frame)  # a signed reply reads as the plain message
        assert not isinstance(msg, (MfMeta, ReadReadyBatch)), msg
        return msg.layer_idx


@pytest.fixture(scope="module", params=["plain", "signed"])
def fuzz(request: pytest.FixtureRequest) -> Iterator[Fuzz]:
    plain = MsgpackCodec(max_frame_bytes=CODEC_MAX)
    if request.param == "plain":
        codec: WireCodec = plain
        attacker: list[WireCodec] = [plain]
    else:
        codec = AuthenticatedCodec(plain, SECRET)
        attacker = [plain, AuthenticatedCodec(plain, WRONG_SECRET)]
    # One long-lived rig per variant; both sides speak ``codec`` (it is also the oracle).
    rig = Rig()
    try:
        p = rig.prefill_memory(LAYERS, seed=7, advertise=True)
        d = rig.decode(LAYERS, codec, settings={"max_frame_bytes": MAX_FRAME_BYTES})
        sender = rig.start_sender(p, codec)
        acct, chaos = rig.dealer(d.endpoint), rig.dealer(d.endpoint)
        r = Fuzz(request.param, codec, attacker, p, d, sender, acct, chaos)
        r.seeds = templates(r)
        admit_fuzz_targets(d)
        # the accounted hostile peer starts with Prefill's own metadata (its best disguise)
        for c in attacker:
            send_checked(r, [c.encode(p.meta())])
        yield r
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(
                f"\n[control fuzz, {r.variant}] {r.examples} examples, {r.frames} hostile "
                f"frames, {r.checked_replies} replies checked one by one, {r.transfers} "
                f"valid transfers verified, decode malformed counter "
                f"{d.receiver.stats.malformed}, authentication refusals "
                f"{d.receiver.stats.auth_refused}"
            )
    finally:
        rig.close()


def admit_fuzz_targets(d: DSide) -> None:
    """Admit the targets afresh: an earlier hostile example may have completed or
    failed one (a terminal request is skipped by later announcements until a worker
    step reports it, and this rig runs no steps), so their old state goes first."""
    d.receiver.abandon([internal(ext) for ext in FUZZ_TARGETS])
    for ext, (main, idx) in FUZZ_TARGETS.items():
        d.receiver.admit(internal(ext), main, idx)


def send_checked(r: Fuzz, frames: list[bytes]) -> None:
    for frame in frames:
        r.acct.send(frame)
    check_replies(r, frames)


def check_replies(r: Fuzz, sent: list[bytes]) -> None:
    """After ``sent`` went out on the accounted DEALER, send a marker batch: the replies
    up to the marker's must be exactly the expected ones, in order."""
    marker_layer = next(r.marker)
    marker = r.codec.encode(ReadReadyBatch(marker_layer, layer_name(0), ()))
    expected = [e for e in map(r.expected, sent) if e is not None] + [marker_layer]
    r.acct.send(marker)
    got: list[str | int] = []
    while len(got) < len(expected):
        for frame in recv_frames(r.acct, WAIT):
            got.append(r.reply_of(frame))
    assert got == expected
    r.checked_replies += len(got)


# ====================================================================== strategies

EDGE_INTS = [
    -1, -(2**63), P_BLOCKS - 1, P_BLOCKS, D_BLOCKS, 2**31 - 1, 2**31, 2**32,
    2**63 - 1, 2**63, 2**64 - 1,
]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, 1.5, -1.0]
ids = st.sampled_from([*FUZZ_TARGETS, "unknown-1", "unknown-2", ""]) | st.text(max_size=6)
small_ints = st.integers(0, P_BLOCKS + 1)
ints = small_ints | st.sampled_from(EDGE_INTS) | st.integers(-(2**63), 2**64 - 1)
not_ints = (
    st.sampled_from(EDGE_FLOATS) | st.floats() | st.booleans() | st.none()
    | st.text(max_size=3) | st.binary(max_size=3)
)
leaf_values = ints | not_ints | st.sampled_from([MF_META, READ_READY_BATCH, b"ACK", ""])
values = st.recursive(
    leaf_values,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.binary(max_size=2), inner, max_size=3),
    max_leaves=10,
)
block_lists = (
    st.lists(small_ints | st.sampled_from(EDGE_INTS), max_size=6)
    | st.lists(ints | not_ints, max_size=3)
    | st.integers(500, 3000).map(lambda n: [1] * n)  # long duplicate lists
    | values
)
starts = st.integers(0, 4) | st.sampled_from(EDGE_INTS) | not_ints
entries = (
    st.tuples(ids, block_lists, block_lists, starts, starts).map(list)
    | st.tuples(ids, block_lists).map(list)
    | st.lists(values, max_size=6)
)
layer_indices = st.integers(0, 3) | st.sampled_from(EDGE_INTS) | not_ints
names = st.sampled_from([layer_name(0), layer_name(1), "model.layers.9.mlp"]) | st.text(max_size=8)


@st.composite
def hostile_ready(draw: st.DrawFn) -> bytes:
    fields = [
        READ_READY_BATCH,
        draw(layer_indices),
        draw(names | values),
        draw(st.lists(entries, max_size=4) | values),
    ]
    tail = draw(st.integers(0, 3))
    if tail >= 1:
        fields.append(draw(st.lists(ids, max_size=4) | values))
    if tail >= 2:
        fields.append(draw(st.integers(0, 3) | st.sampled_from(EDGE_INTS) | not_ints))
    if tail >= 3:
        fields.append(draw(st.integers(-1, 4) | st.sampled_from(EDGE_INTS) | not_ints))
    return pack(fields)


@st.composite
def plausible_ready(draw: st.DrawFn) -> bytes:
    """Well-formed up to the numbers: real layers, requests Decode knows, and block ids,
    start offsets and group positions from the edges (beyond the regions, past the end,
    negative, 2**63, floats)."""
    edge = st.sampled_from(EDGE_INTS)
    block = st.one_of(small_ints, small_ints, small_ints, edge)  # mostly in range
    start = st.one_of(st.just(0), st.just(0), st.integers(0, 2), edge)
    # the fuzz targets own two blocks each: at most two, from 0, mostly
    reqs = draw(st.lists(
        st.tuples(st.sampled_from([*FUZZ_TARGETS, "unknown-3"]),
                  st.lists(block, min_size=1, max_size=2),
                  st.lists(block, max_size=3), start, start).map(list),
        min_size=1, max_size=3,
    ))
    member = draw(st.one_of(st.just(0), st.just(0), st.integers(0, 2), edge))
    ratio = draw(st.one_of(st.just(1), st.integers(1, 3), st.integers(1, 3), edge))
    done = draw(st.lists(st.sampled_from([*FUZZ_TARGETS, "unknown-4"]), max_size=2))
    return pack([READ_READY_BATCH, draw(st.sampled_from(LAYERS)),
                 layer_name(draw(st.sampled_from(LAYERS))), reqs, done, member, ratio])


@st.composite
def plausible_meta(draw: st.DrawFn, p: PSide) -> bytes:
    """Prefill's real metadata with region sizes dropped, inflated or zeroed and base
    addresses moved to the edges of the address space (or into other memory)."""
    layers = {}
    for layer, lay in p.layouts.items():
        entry = lay.to_metadata().to_map()
        n = len(entry["base_addrs"])
        i = draw(st.integers(0, n - 1))
        edge = st.sampled_from([0, 2**62, 2**63 - 1, 2**63, 2**64 - 1, entry["base_addrs"][0]])
        entry["base_addrs"][i] = draw(edge | st.integers(0, 2**64 - 1))
        how = draw(st.sampled_from(["drop", "inflate", "zero", "keep"]))
        if how == "drop":
            del entry["num_blocks"]
        elif how == "inflate":
            entry["num_blocks"] = [draw(st.sampled_from([P_BLOCKS + 1, 2**40, 2**63 - 1]))] * n
        elif how == "zero":
            entry["num_blocks"] = [0] * n
        layers[layer_name(layer)] = entry
    session = draw(st.sampled_from([p.session, p.session, "inproc:nope"]))
    return pack([MF_META, session, pack(layers)])


@st.composite
def hostile_meta(draw: st.DrawFn, p: PSide, d: DSide) -> bytes:
    layers = {}
    for name in draw(st.lists(names, max_size=3, unique=True)):
        real = p.layouts[0].to_metadata().to_map()
        n = draw(st.integers(0, 5))
        addr = st.sampled_from(real["base_addrs"] + [0, 1, 2**63 - 1, 2**63, 2**64 - 1]) | ints
        entry: dict[str, Any] = {
            "base_addrs": draw(st.lists(addr, min_size=n, max_size=n) | values),
            "block_len": draw(
                st.lists(st.sampled_from(list(FULL.sizes().values())) | ints, min_size=n,
                         max_size=n) | values
            ),
            "block_size_scale": draw(st.lists(st.just(1) | ints, min_size=n, max_size=n)),
            "tensor_group_idx": draw(st.lists(st.just(0) | ints, min_size=n, max_size=n)),
            "main_tensor_count": draw(st.integers(0, 3) | ints | not_ints),
            "has_indexer": draw(st.booleans() | not_ints),
        }
        if draw(st.booleans()):
            entry["num_blocks"] = draw(
                st.lists(st.sampled_from([P_BLOCKS, P_BLOCKS + 4, 0]) | ints, max_size=5)
                | values
            )
        if draw(st.booleans()):
            entry = real | {k: v for k, v in entry.items() if draw(st.booleans())}
        layers[name] = entry
    session = draw(st.sampled_from([p.session, d.engine.session_id, "inproc:nope"]) | values)
    nested = draw(st.booleans())
    return pack([MF_META, session, pack(layers) if nested else layers])


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def templates(r: Fuzz) -> list[bytes]:
    """Valid-looking frames a peer without the secret can produce (mutation seeds)."""
    fz = [
        ReadRequest(ext, (1, 2), (3, 4), 0, 0) for ext in FUZZ_TARGETS
    ]
    msgs = [
        ReadReadyBatch(0, layer_name(0), tuple(fz), ("fz-0",)),
        ReadReadyBatch(1, layer_name(1), (fz[1],), (), 1, 2),
        r.p.meta(),
    ]
    return [c.encode(m) for c in r.attacker for m in msgs]


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    frame = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete", "append"]))
        at = draw(st.integers(0, max(0, len(frame) - 1)))
        if op == "flip" and frame:
            # xor with a non-zero mask: always a different byte, and always exactly one
            # draw whatever the seed holds (a filter on the old byte made Hypothesis's
            # replays draw differently when a seed changed: FlakyStrategyDefinition)
            frame[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del frame[at:]
        elif op == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del frame[at : at + draw(st.integers(1, 8))]
        else:
            frame += draw(st.binary(min_size=1, max_size=8))
    return bytes(frame)


def hostile_frames(r: Fuzz) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        values.map(pack),
        st.tuples(
            st.sampled_from([MF_META, READ_READY_BATCH, READ_DONE, READ_FAILED, b"x"]),
            st.lists(values, max_size=7),
        ).map(lambda t: pack([t[0], *t[1]])),
        hostile_ready(),
        plausible_ready(),
        plausible_ready(),
        hostile_meta(r.p, r.d),
        plausible_meta(r.p),
        mutated(r.seeds),
        # just above the codec's limit (below the socket's): cheap to draw, one byte repeated
        st.integers(0, 255).map(lambda b: bytes([b]) * (CODEC_MAX + 1)),
    )


CHAOS = [
    [b"\x93\x01", b"\x02"],  # multi-frame, malformed when joined
    [b"", b""],  # only empty frames
    [b"\x00" * (ZMQ_MAX + 1)],  # above the socket limit: ZeroMQ drops this connection
    [b"\xdd\xff\xff\xff\xff"],  # an array header claiming 4G items
    [b"\x91" * 50_000 + b"\xc0"],  # arrays nested 50k deep
]


# ====================================================================== the property


def fuzz_once(r: Fuzz, data: st.DataObject) -> None:
    frames = data.draw(st.lists(hostile_frames(r), min_size=20, max_size=40), label="frames")
    chaos = data.draw(st.lists(st.sampled_from(CHAOS), max_size=2), label="chaos")
    n = data.draw(st.integers(1, 4), label="blocks")
    p_main = tuple(data.draw(st.permutations(range(P_BLOCKS)))[:n])
    p_idx = tuple(data.draw(st.permutations(range(P_BLOCKS)))[:n])
    d_main = tuple(data.draw(st.permutations(OK_BLOCKS))[:n])
    d_idx = tuple(data.draw(st.permutations(OK_BLOCKS))[:n])
    cut = data.draw(st.integers(0, n), label="chunk boundary")
    chunks = [(0, cut), (cut, n)] if 0 < cut < n else [(0, n)]
    t = Transfer(f"ok-{RUN}-{r.examples}", p_main, p_idx, d_main, d_idx)

    # Hostile frames interleave with the valid peer's announcements.
    # each slice starts with Prefill's real metadata, so that hostile ready messages
    # reach the planner even after a hostile MF_META replaced it
    meta = r.attacker[-1].encode(r.p.meta())
    slices = iter([[meta, *frames[i::3]] for i in range(3)] + [[]] * 8)
    sent: list[bytes] = []
    for parts in chaos:
        r.chaos.send_multipart(parts)

    def between() -> None:
        part = next(slices)
        for frame in part:
            r.acct.send(frame)
        sent.extend(part)

    out = run_transfer(r.p, r.d, r.sender, t, chunks, between)
    assert internal(t.ext) not in out.failed, out.reasons
    assert_transfer_landed(r.p, r.d, t)
    r.transfers += 1
    check_replies(r, sent)  # every hostile frame's reply, one by one
    r.frames += len(sent) + len(chaos)
    while r.chaos.poll(0):
        r.chaos.recv_multipart()

    assert r.d.receiver.running
    errors = r.d.log.lines("error")
    unexpected = [e for e in errors if "refusing unauthenticated" not in e]
    assert not unexpected, unexpected[:3]  # nothing reached a catch-all
    writable = OK_BLOCKS + (FUZZ_BLOCKS if r.variant == "plain" else ())
    assert_guarded(r.d, {"main": writable, "indexer": writable})
    if r.variant == "signed":
        assert r.d.receiver.counters()["peers"] == 1  # only the valid peer's metadata
    reset_blocks(r.d, t)
    admit_fuzz_targets(r.d)  # hostile done reports may have finished them
    r.examples += 1


def test_hostile_frames_never_disturb_a_valid_peer(fuzz: Fuzz) -> None:
    @given(data=st.data())
    @FUZZ
    def prop(data: st.DataObject) -> None:
        fuzz_once(fuzz, data)

    prop()
    # the fuzzing was not vacuous
    assert fuzz.examples >= EXAMPLES // 2
    assert fuzz.frames >= 20 * fuzz.examples // 2
    assert fuzz.transfers == fuzz.examples
    stats = fuzz.d.receiver.stats
    if fuzz.variant == "plain":
        assert stats.malformed > fuzz.examples
        assert stats.layers_failed >= 10  # hostile ready batches were answered
    else:  # a peer without the secret never gets as far as being malformed
        assert stats.auth_refused > 10 * fuzz.examples
        assert stats.malformed == 0
    assert stats.layers_done >= 2 * fuzz.transfers
    assert fuzz.checked_replies > fuzz.examples
    assert fuzz.sender.counters()["pending_layers"] == 0


def test_hostile_read_ready_for_known_blocks_lands_only_in_their_request(fuzz: Fuzz) -> None:
    """Without a secret a peer with metadata can pull into a request it names, but only
    into that request's blocks; with one, it cannot pull at all."""
    if fuzz.variant == "signed":
        frame = fuzz.attacker[1].encode(ReadReadyBatch(0, layer_name(0), (), ()))
        send_checked(fuzz, [frame])
        assert_guarded(fuzz.d, {"main": OK_BLOCKS, "indexer": OK_BLOCKS})
        return
    fz = ReadRequest("fz-1", (5, 6), (7, 0), 0, 0)
    admit_fuzz_targets(fuzz.d)
    send_checked(fuzz, [
        fuzz.codec.encode(fuzz.p.meta()),  # hostile metadata may have replaced it
        fuzz.codec.encode(ReadReadyBatch(0, layer_name(0), (fz,), ())),
    ])
    main, idx = FUZZ_TARGETS["fz-1"]
    for comp in COMPONENTS:
        is_main = comp.startswith("main")
        src = fuzz.p.bufs[(0, comp)][[5, 6] if is_main else [7, 0]]
        dst = fuzz.d.rows(0, comp)[list(main if is_main else idx)]
        assert (dst == src).all()
    assert_guarded(fuzz.d, {"main": OK_BLOCKS + FUZZ_BLOCKS, "indexer": OK_BLOCKS + FUZZ_BLOCKS})


def test_port_is_still_served_after_fuzzing(fuzz: Fuzz) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(fuzz.d.endpoint)
        sock.send(fuzz.codec.encode(fuzz.p.meta(), "probe"))
        assert fuzz.codec.decode(recv_frames(sock)[0], "probe") == MetaAck()
    finally:
        sock.close(0)
    assert fuzz.d.endpoint.startswith(f"tcp://{HOST}:")

"""Nothing a peer sends grows a ``DecodeSession`` without bound (sans IO, hypothesis).

A stateful machine drives one Decode session with arbitrary sequences of valid and
hostile input from several peers: MF_META or none, ready messages naming admitted,
unknown and invented request ids, reads and done reports as any member of groups of
any ratio (unequal TP with contributors that never report), read failures, refused
frames, lost connections, engine steps and time passing. Invariants: the orphan
caps and the peer cap hold at every step. At the end, once every deadline passed,
the session holds no request state at all, and after the peers disconnect, nothing.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rd2h.domain.decode.decode_session import (
    Capped,
    DecodeSession,
    Forget,
    Read,
    Rejected,
    SendAck,
)
from rd2h.domain.errors import ProtocolError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import MfMeta, ReadReadyBatch, ReadRequest

X9 = "-abcdefgh"
NAMES = ("model.layers.0.attn", "model.layers.1.attn")
BPB, NB = 16, 8
SRC = {n: SourceLayout(n, (TensorComponent(0x10000 * (i + 1), BPB, num_blocks=NB),))
       for i, n in enumerate(NAMES)}
DST = {n: DestinationLayout(n, (DestTensor(0x900000 + 0x1000 * i, BPB, NB),))
       for i, n in enumerate(NAMES)}
META = MfMeta("p", {n: s.to_metadata() for n, s in SRC.items()})
TIMEOUT = 10.0
PER_PEER, TOTAL, MAX_PEERS = 5, 12, 3
PEERS = [b"p0", b"p1", b"p2", b"p3", b"p4"]
ADMITTABLE = [f"r{n}" for n in range(6)]
ids = st.sampled_from(ADMITTABLE) | st.text("abcxyz", min_size=1, max_size=4)
blocks = st.lists(st.integers(0, NB - 1), min_size=0, max_size=3)


class DecodeBounds(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = DecodeSession(destinations=DST, d_rank=0, d_tp=1, main_shared=False,
                               request_timeout_s=TIMEOUT, max_peers=MAX_PEERS,
                               max_orphans_per_peer=PER_PEER, max_orphans=TOTAL)
        self.now = 0.0
        self.reads: list[int] = []
        self.admitted: set[str] = set()
        self.capped = 0

    def _run(self, outs: list) -> None:
        for out in outs:
            if isinstance(out, Read):
                self.reads.append(out.token)
            elif isinstance(out, Capped):
                self.capped += 1

    @rule(ext=st.sampled_from(ADMITTABLE), main=blocks)
    def admit(self, ext: str, main: list[int]) -> None:
        if ext in self.admitted:
            return  # vLLM admits a request once
        self.admitted.add(ext)
        self.s.admit(ext + X9, main, [], self.now)

    @rule(peer=st.sampled_from(PEERS))
    def meta(self, peer: bytes) -> None:
        self._run(self.s.receive(peer, META, self.now))

    @rule(peer=st.sampled_from(PEERS), layer=st.integers(0, 1),
          reads=st.lists(st.tuples(ids, blocks), max_size=3),
          done=st.lists(ids, max_size=6), group=st.integers(1, 3) | st.just(1),
          member=st.integers(0, 2))
    def ready(self, peer: bytes, layer: int, reads: list, done: list[str], group: int,
              member: int) -> None:
        reqs = tuple(ReadRequest(ext, tuple(b), tuple(b), 0, 0) for ext, b in reads)
        batch = ReadReadyBatch(layer, NAMES[layer], reqs, tuple(done), member % group, group)
        self._run(self.s.receive(peer, batch, self.now))

    @rule(peer=st.sampled_from(PEERS), layer=st.none() | st.integers(0, 3))
    def refused(self, peer: bytes, layer: int | None) -> None:
        self._run(self.s.reject(peer, ProtocolError("garbage", layer)))

    @precondition(lambda self: self.reads)
    @rule(ok=st.booleans(), data=st.data())
    def finish_read(self, ok: bool, data: st.DataObject) -> None:
        token = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        self.s.begin_read(token)
        self._run(self.s.read_done(token, self.now, None if ok else "boom"))

    @rule(peer=st.sampled_from(PEERS))
    def lost(self, peer: bytes) -> None:
        self._run(self.s.peer_lost(peer, self.now))

    @rule(dt=st.floats(0.0, TIMEOUT / 2))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._run(self.s.tick(self.now))

    @rule()
    def engine_step(self) -> None:
        out = self.s.finish_step([self.s.local_report()], (), self.now)
        for internal in out.finished:
            self.admitted.discard(internal[: -len(X9)])  # vLLM frees finished requests
            self.s.drop([internal])

    @invariant()
    def bounded(self) -> None:
        c = self.s.counters()
        assert c["orphans"] <= TOTAL
        assert c["peers"] <= MAX_PEERS
        book = self.s._book
        for peer in PEERS:
            assert book.orphans.held_by(peer) <= PER_PEER
        # Everything keyed by a request id is admitted or a held orphan.
        assert c["contributors"] <= len(self.admitted) + c["orphans"]
        assert c["terminal"] <= len(self.admitted) + c["orphans"]

    def teardown(self) -> None:
        while self.reads:
            self.s.begin_read(self.reads[0])
            self._run(self.s.read_done(self.reads.pop(0), self.now))
        self.now += TIMEOUT + 1
        self._run(self.s.tick(self.now))
        out = self.s.finish_step([self.s.local_report()], (), self.now)
        self.s.drop(out.finished)
        counters = self.s.counters()
        peers = counters.pop("peers")
        assert counters == dict.fromkeys(counters, 0), counters
        assert self.s.reads_in_flight == 0
        for peer in PEERS:
            self.s.peer_lost(peer, self.now)
        assert self.s.counters()["peers"] == 0 and peers <= MAX_PEERS


DecodeBounds.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
TestDecodeBounds = DecodeBounds.TestCase


def test_a_hit_cap_is_reported_once_per_episode() -> None:
    s = DecodeSession(destinations=DST, d_rank=0, d_tp=1, request_timeout_s=TIMEOUT,
                      max_orphans_per_peer=2, max_orphans=100)
    s.receive(b"p", META, 0.0)
    outs = s.receive(b"p", ReadReadyBatch(0, NAMES[0], (), ("a", "b", "c", "d"), 0, 2), 0.0)
    assert [o for o in outs if isinstance(o, Capped)] == [Capped("orphans", "peer 70", 2)]
    outs = s.receive(b"p", ReadReadyBatch(0, NAMES[0], (), ("e",), 0, 2), 1.0)
    assert not [o for o in outs if isinstance(o, Capped)]  # same episode
    s.tick(TIMEOUT)  # a and b expire: under the cap again
    assert s.counters()["orphans"] == 0
    outs = s.receive(b"p", ReadReadyBatch(0, NAMES[0], (), ("f", "g", "h"), 0, 2), 11.0)
    assert [o for o in outs if isinstance(o, Capped)] == [Capped("orphans", "peer 70", 2)]


def test_the_peer_cap_refuses_new_metadata_until_a_peer_leaves() -> None:
    s = DecodeSession(destinations=DST, d_rank=0, d_tp=1, max_peers=1)
    assert s.receive(b"a", META, 0.0)[0].__class__.__name__ == "SendAck"
    s.receive(b"a", ReadReadyBatch(0, NAMES[0], (), ()), 0.0)  # a announced: proven
    outs = s.receive(b"b", META, 0.0)
    assert [type(o).__name__ for o in outs] == ["Rejected", "Forget", "Capped"]
    assert outs[1] == Forget(b"b")  # the refused connection keeps nothing (codec state)
    assert s.receive(b"a", META, 0.0)[0].__class__.__name__ == "SendAck"  # known: fine
    assert [type(o).__name__ for o in s.receive(b"b", META, 0.0)] == ["Rejected", "Forget"]
    s.peer_lost(b"a", 1.0)
    assert s.receive(b"b", META, 1.0)[0].__class__.__name__ == "SendAck"


def test_a_peer_that_announced_nothing_yields_its_slot_to_a_newcomer() -> None:
    """Replayed MF_METAs (each on a new connection) can fill the peer table but never
    announce a layer: a newcomer takes the oldest such slot; a peer that announced, or
    that re-sent its MF_META after announcing, is never evicted."""
    s = DecodeSession(destinations=DST, d_rank=0, d_tp=1, max_peers=3)
    s.receive(b"valid", META, 0.0)
    s.receive(b"valid", ReadReadyBatch(0, NAMES[0], (), ()), 0.0)
    s.receive(b"valid", META, 0.0)  # still proven
    for n in range(10):
        outs = s.receive(b"replay-%d" % n, META, 0.0)
        assert isinstance(outs[-2], SendAck)
        assert outs[:-2] == ([Forget(b"replay-%d" % (n - 2))] if n >= 2 else [])
    assert s.counters()["peers"] == 3
    outs = s.receive(b"new", META, 0.0)
    assert outs[0] == Forget(b"replay-8") and isinstance(outs[1], SendAck)
    s.receive(b"new", ReadReadyBatch(1, NAMES[1], (), ()), 0.0)
    assert s.receive(b"replay-10", META, 0.0)[0] == Forget(b"replay-9")
    assert s.receive(b"last", META, 0.0)[0] == Forget(b"replay-10")
    s.receive(b"last", ReadReadyBatch(0, NAMES[0], (), ()), 0.0)
    outs = s.receive(b"one-more", META, 0.0)  # all 3 proven: refused, nothing evicted
    assert isinstance(outs[0], Rejected) and outs[1] == Forget(b"one-more")
    outs = s.receive(b"valid", ReadReadyBatch(1, NAMES[1], (), (), 0, 1, 3), 0.0)
    assert [type(o).__name__ for o in outs] == ["Reply", "LayerDone"]


def test_a_connection_without_metadata_leaves_no_state_for_unknown_ids() -> None:
    s = DecodeSession(destinations=DST, d_rank=0, d_tp=1)
    s.admit("r" + X9, [1], [], 0.0)
    s.receive(b"x", ReadReadyBatch(0, NAMES[0], (), ("r", "ghost-1", "ghost-2")), 0.0)
    c = s.counters()
    assert c["orphans"] == 0 and c["failed"] == 1  # only the admitted one failed

"""Decode's side of the control protocol as a sans-IO state machine (spec 4-7.2).

The receive loop (``rd2h.app.decode``) decodes frames and feeds them in with
the time; the session validates, plans and keeps the request book, and says
what to do: ``SendAck``, ``Reply`` (exactly one READ_DONE or READ_FAILED per
READ_READY_BATCH, also when this rank owns none of its blocks) or ``Read`` (one
batched read of a plan; the loop performs it and reports ``read_done``). Events
(``MetaStored``, ``LayerDone``, ``LayerFailed``, ``PeerLost``, ``Expired``,
``Rejected``) say what happened, for logs, stats and the worker's wake-up.

The engine side (admission, the per-step TP resolution) goes through the same
object, so one lock in the caller covers every rule.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from rd2h.domain.decode.decode_events import (
    Capped,
    Expired,
    Forget,
    Incomplete,
    LayerDone,
    LayerFailed,
    MetaStored,
    Output,
    Parked,
    Peer,
    PeerLost,
    Read,
    Rejected,
    RejectKind,
    Reply,
    SendAck,
    SendRefusal,
    Skipped,
    Unparked,
)
from rd2h.domain.decode.orphans import (
    ALL_OWNERS,
    DEFAULT_ORPHANS_PER_PEER,
    DEFAULT_ORPHANS_TOTAL,
    CapHit,
)
from rd2h.domain.decode.request_book import DecodeRequestBook, RankReport, StepOutcome
from rd2h.domain.errors import (
    AuthenticationError,
    LayoutMismatch,
    PlanningError,
    ProtocolError,
    UnknownMessageType,
)
from rd2h.domain.planning.kv_groups import NO_BLOCK
from rd2h.domain.planning.layout import DestinationLayout, SourceLayout
from rd2h.domain.planning.planning import (
    Destination,
    PlanMemo,
    ReadPlan,
    merge_plans,
    plan_reads,
    plan_run,
)
from rd2h.domain.wire.compat import Compat, compare
from rd2h.domain.wire.protocol import (
    FEATURE_LAYER_RUNS,
    Message,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    clip,
)

DEFAULT_MAX_PEERS = 1024
ALL_PEERS = ALL_OWNERS
# Parallel dispatch: how long an announcement may wait for its requests' admission here
# (also bounded by its hold), and how many bytes of such announcements are kept.
DEFAULT_PARK_S = 5.0
DEFAULT_PARKED_BYTES_PER_PEER = 16 << 20
DEFAULT_PARKED_BYTES = 64 << 20
# A kept announcement is handled this long before its hold's margin, so its read ends in
# time (a layer's read takes milliseconds).
_PARK_READ_ALLOWANCE_S = 0.05


# ---------------------------------------------------------------- state


@dataclass
class _Peer:
    session: str
    layers: dict[str, SourceLayout | LayoutMismatch]
    proven: bool = False  # a READ_READY_BATCH came since its MF_META
    generation: int | None = None  # MF_META's (None: the peer states none)


@dataclass
class _PendingRead:
    peer: Peer
    batch: ReadReadyBatch
    started: bool = False
    lost: bool = False
    skipped: tuple[str, ...] = ()
    # The layers this read covers, each a single-layer announcement (a layer run's that
    # were planned; one for a plain message).
    layers: tuple[ReadReadyBatch, ...] = ()


@dataclass
class _Parked:
    """An announcement waiting for this rank to admit the requests it ``awaits``."""

    peer: Peer
    batch: ReadReadyBatch
    since: float
    until: float
    size: int
    waiting: set[str]


class DecodeSession:
    def __init__(
        self,
        *,
        destinations: Mapping[str, DestinationLayout],
        d_rank: int,
        d_tp: int,
        main_shared: bool = True,
        request_timeout_s: float = 120.0,
        max_peers: int = DEFAULT_MAX_PEERS,
        max_orphans_per_peer: int = DEFAULT_ORPHANS_PER_PEER,
        max_orphans: int = DEFAULT_ORPHANS_TOTAL,
        compat: Compat | None = None,
        generation: int | None = None,
        park_s: float = DEFAULT_PARK_S,
        hold_margin_s: float = 0.25,
        max_parked_bytes_per_peer: int = DEFAULT_PARKED_BYTES_PER_PEER,
        max_parked_bytes: int = DEFAULT_PARKED_BYTES,
    ) -> None:
        self.generation = generation  # stated in the ACK to peers that state theirs
        if max_peers < 1:
            raise ValueError("max_peers must be >= 1")
        self._destinations = dict(destinations)
        self.d_rank = d_rank
        self.d_tp = d_tp
        # True: one main pool shared by the Decode TP ranks, each reads its share.
        # False: every rank has its own main cache and reads all main blocks.
        self.main_shared = main_shared
        self.request_timeout_s = request_timeout_s
        self.max_peers = max_peers
        self.compat = compat  # what this side states (None: no MF_META is ever refused)
        self._peers: dict[Peer, _Peer] = {}
        # Every layer of a chunk names the same blocks: plan them once per peer.
        self._memo = PlanMemo()
        self._peers_capped = False
        self._book = DecodeRequestBook(max_orphans_per_peer, max_orphans)
        self._reads: dict[int, _PendingRead] = {}
        self._tokens = itertools.count()
        # Parallel dispatch: announcements kept until their requests are admitted here,
        # in arrival order; which of them wait for each id; bytes kept per peer.
        self.park_s = park_s
        self.hold_margin_s = hold_margin_s
        self.max_parked_bytes_per_peer = max_parked_bytes_per_peer
        self.max_parked_bytes = max_parked_bytes
        self._parked: dict[int, _Parked] = {}
        self._parked_for: dict[str, set[int]] = {}
        self._parked_bytes: dict[Peer, int] = {}
        self._parked_total = 0
        self._parked_due = False  # some kept announcement's requests were all admitted
        self._parked_capped: set[Hashable] = set()
        # Admitted request -> peer -> the layers read for it from that peer (spec 7.2's
        # final report is trusted only once every layer it needs was read: ``_missing``).
        self._read: dict[str, dict[Peer, set[str]]] = {}

    # ------------------------------------------------------------ control inputs
    def receive(self, peer: Peer, message: Message, now: float, *,
                wall_ms: int | None = None, size: int = 0) -> list[Output]:
        """``wall_ms`` (Unix milliseconds, this host's clock) and ``size`` (the frame's
        bytes): for an announcement that waits for its requests' admission (``awaits``),
        how long its hold lets it wait and what it costs to keep."""
        if isinstance(message, MfMeta):
            return self._meta(peer, message, now)
        if isinstance(message, ReadReadyBatch):
            if (known := self._peers.get(peer)) is not None:
                known.proven = True  # no longer evictable by a newcomer (``_meta``)
            capped: list[Output] = []
            if (message.awaits or self._parked_for) and (
                    parked := self._park(peer, message, now, wall_ms, size, capped)):
                return parked
            return self._ready(peer, message, now) + self._cap_hits() + capped
        return [Rejected(RejectKind.UNEXPECTED, type(message).__name__)]

    def reject(self, peer: Peer, error: ProtocolError) -> list[Output]:
        """A frame that did not decode. Refused before anything in it is used: no
        metadata stored, no read, no request failed; a READ_FAILED when it names a layer."""
        if isinstance(error, UnknownMessageType):
            return [Rejected(RejectKind.UNKNOWN, clip(repr(error.tag), 80))]
        detail = clip(error.detail)
        if isinstance(error, AuthenticationError):
            out: list[Output] = [Rejected(RejectKind.UNAUTHENTICATED, detail, error.layer_idx)]
            if error.layer_idx is not None:
                out.append(Reply(peer, ReadFailed(error.layer_idx,
                                                  f"authentication failed: {detail}")))
            return out
        out = [Rejected(RejectKind.MALFORMED, detail, error.layer_idx)]
        if error.layer_idx is not None:
            out.append(Reply(peer, ReadFailed(error.layer_idx, f"malformed message: {detail}")))
        return out

    def begin_read(self, token: int) -> bool:
        """About to perform ``Read(token)``: False if its peer is gone (report
        ``read_done`` anyway: the layer fails and is answered)."""
        pending = self._reads.get(token)
        if pending is None or pending.lost:
            return False
        pending.started = True
        return True

    def read_done(self, token: int, now: float, error: str | None = None) -> list[Output]:
        pending = self._reads.pop(token, None)
        if pending is None:
            return []
        if error is not None:
            return self._fail_layers(pending.peer, pending.layers, f"read failed: {error}", now)
        if pending.lost:
            # A peer that vanished (or reset the connection after its acknowledgement
            # deadline) may have reused the source: do not trust what was read.
            when = "during" if pending.started else "before"
            return self._fail_layers(pending.peer, pending.layers,
                                     f"prefill peer disconnected {when} the read", now)
        return self._finish_layers(pending.peer, pending.layers, now, pending.skipped)

    def peer_lost(self, peer: Peer, now: float, how: str = "disconnected") -> list[Output]:
        """The connection closed (or, ``how``, its process restarted): forget its metadata
        and fail the unfinished requests it was contributing to (requests that never
        heard from it end at their deadline)."""
        gone = self._peers.pop(peer, None)
        self._memo.forget(peer)
        session = gone.session if gone is not None else "?"
        for pending in self._reads.values():
            if pending.peer == peer:
                pending.lost = True
        for token in [t for t, p in self._parked.items() if p.peer == peer]:
            self._unpark(token)  # no reply can reach it; Prefill's deadline ends it
        failed = self._book.fail_peer(
            peer, f"prefill peer {session} {how} before announcing the final layer", now
        )
        if len(self._peers) < self.max_peers:
            self._peers_capped = False
        return [PeerLost(session, tuple(failed))]

    def tick(self, now: float) -> list[Output]:
        """Fail admitted requests past the request deadline; drop stale state of requests
        never admitted here."""
        late = self._book.expire(now, self.request_timeout_s)
        return [Expired(tuple(late), self.request_timeout_s)] if late else []

    def next_deadline(self) -> float | None:
        """When ``tick`` next has something to do: an admitted request reaches
        ``request_timeout_s``, or an orphan goes stale (None: nothing is held)."""
        due = self._book.next_deadline(self.request_timeout_s)
        if self._parked_due and self._parked:
            return float("-inf")
        if self._parked:
            first = min(p.until for p in self._parked.values())
            due = first if due is None else min(due, first)
        return due

    # ------------------------------------------------------------ engine inputs
    def admit(self, internal_id: str, main_block_ids: Iterable[int],
              indexer_block_ids: Iterable[int], now: float,
              group_block_ids: Sequence[Sequence[int]] = ()) -> str:
        ext = self._book.admit(internal_id, list(main_block_ids), list(indexer_block_ids), now,
                               group_block_ids)
        self._read.pop(ext, None)  # a new admission (e.g. after preemption) starts over
        for token in self._parked_for.get(ext, ()):
            parked = self._parked[token]
            parked.waiting.discard(ext)
            if not parked.waiting:
                self._parked_due = True  # ``release`` handles it (the loop's thread)
        return ext

    def local_report(self) -> RankReport:
        return self._book.local_report()

    def finish_step(self, reports: Collection[RankReport], finished_by_vllm: Iterable[str],
                    now: float) -> StepOutcome:
        # A request a planned read names may still get bytes written into its blocks.
        busy = {r.ext_req_id for p in self._reads.values() for r in p.batch.read_reqs}
        busy.update(self._parked_for)  # kept announcements still to be read
        outcome = self._book.finish_step(reports, finished_by_vllm, now=now, busy=busy)
        book = self._book
        for ext in [e for e in self._read
                    if book.destination(e) is None or book.is_terminal(e)]:
            del self._read[ext]
        return outcome

    def drop(self, internal_ids: Iterable[str]) -> None:
        self._book.drop(internal_ids)

    def fail_loads(self, internal_ids: Iterable[str], reason: str) -> list[str]:
        """Fail admitted, unfinished requests whose KV the deployment knows will not come
        (reported at the next step); returns their external ids."""
        return self._book.fail_admitted(internal_ids, clip(reason))

    def counters(self) -> dict[str, int]:
        out = self._book.counters()
        out["peers"] = len(self._peers)
        out["parked"] = len(self._parked)
        out["parked_bytes"] = self._parked_total
        return out

    @property
    def admitted_count(self) -> int:
        return self._book.admitted_count

    @property
    def parked_count(self) -> int:
        """Announcements kept for their requests' admission (parallel dispatch)."""
        return len(self._parked)

    @property
    def reads_in_flight(self) -> int:
        return len(self._reads)

    # ------------------------------------------------------------ parallel dispatch
    def release(self, now: float) -> list[Output]:
        """Handle the kept announcements whose requests are all admitted, and those whose
        wait ended (their requests still unknown here are answered skipped), in arrival
        order. The receive loop calls it on its own thread: it may ask for reads."""
        out: list[Output] = []
        self._parked_due = False
        blocked: set[str] = set()  # named by an earlier announcement that still waits
        for token, parked in list(self._parked.items()):
            if token not in self._parked:
                continue
            named = parked.batch.named_ext_ids
            expired = now >= parked.until
            if not expired and (parked.waiting or not blocked.isdisjoint(named)):
                blocked.update(named)
                continue
            self._unpark(token)
            out.append(Unparked(parked.batch.layer_idx, now - parked.since,
                                bool(parked.waiting)))
            if parked.peer in self._peers:
                out += self._ready(parked.peer, parked.batch, now)
            # else: the peer's metadata is gone; its deadline ends the announcement
        return out

    def _park(self, peer: Peer, batch: ReadReadyBatch, now: float, wall_ms: int | None,
              size: int, capped: list[Output]) -> list[Output]:
        """Keep ``batch`` if requests it ``awaits`` are not admitted here yet (or an
        earlier kept announcement names one of its requests: order is kept), within
        its hold and the byte budgets; [] when it is to be handled now (a budget that
        refused it adds its ``Capped`` to ``capped``, once per episode)."""
        book = self._book
        named = batch.named_ext_ids
        waiting = {e for e in batch.awaits if e in named and book.destination(e) is None
                   and not book.is_terminal(e)}
        if not waiting and not any(e in self._parked_for for e in named):
            return []
        if self._peers.get(peer) is None:
            return []  # answered at once (no MF_META on this connection)
        until = now + self.park_s
        if batch.hold_until_ms is not None and wall_ms is not None:
            left = (batch.hold_until_ms - wall_ms) / 1000.0
            until = min(until, now + left - self.hold_margin_s - _PARK_READ_ALLOWANCE_S)
        if until <= now:
            return []
        size = max(size, 1)
        held = self._parked_bytes.get(peer, 0)
        over: Hashable | None = None
        if held + size > self.max_parked_bytes_per_peer:
            over, limit = peer, self.max_parked_bytes_per_peer
        elif self._parked_total + size > self.max_parked_bytes:
            over, limit = ALL_PEERS, self.max_parked_bytes
        if over is not None:
            if over not in self._parked_capped:  # reported once per episode
                self._parked_capped.add(over)
                capped.append(Capped("parked announcements", _label(CapHit(over, limit)),
                                     limit))
            return []
        token = next(self._tokens)
        self._parked[token] = _Parked(peer, batch, now, until, size, waiting)
        for ext in named:
            self._parked_for.setdefault(ext, set()).add(token)
        self._parked_bytes[peer] = held + size
        self._parked_total += size
        return [Parked(batch.layer_idx, tuple(sorted(waiting)), until)]

    def _unpark(self, token: int) -> None:
        parked = self._parked.pop(token)
        for ext in parked.batch.named_ext_ids:
            tokens = self._parked_for.get(ext)
            if tokens is not None:
                tokens.discard(token)
                if not tokens:
                    del self._parked_for[ext]
        left = self._parked_bytes[parked.peer] - parked.size
        if left > 0:
            self._parked_bytes[parked.peer] = left
        else:
            del self._parked_bytes[parked.peer]
        self._parked_total -= parked.size
        if not self._parked:
            self._parked_due = False  # nothing left to release (e.g. its peer was lost)
        if left <= self.max_parked_bytes_per_peer // 2:
            self._parked_capped.discard(parked.peer)
        if self._parked_total <= self.max_parked_bytes // 2:
            self._parked_capped.discard(ALL_PEERS)

    # ------------------------------------------------------------ rules
    def _cap_hits(self) -> list[Output]:
        return [Capped("orphans", _label(hit), hit.limit)
                for hit in self._book.orphans.take_hits()]

    def _restarted(self, peer: Peer, meta: MfMeta, now: float) -> list[Output]:
        """Other connections of the same Prefill session from another generation: that
        process is gone (a new one took its address), so its metadata, signing state,
        reads and the requests it was contributing to end now; a new one's announcements
        are never read as its."""
        out: list[Output] = []
        for old, known in list(self._peers.items()):
            if (old != peer and known.session == meta.p_session and known.generation
                    is not None and known.generation != meta.generation):
                out += [*self.peer_lost(old, now, "restarted (a new generation)"),
                        Forget(old)]
        return out

    def _meta(self, peer: Peer, meta: MfMeta, now: float) -> list[Output]:
        refused = None if meta.compat is None or self.compat is None else compare(
            meta.compat, self.compat)
        if refused is not None:  # an incompatible build: nothing of this peer is kept
            self._peers.pop(peer, None)
            self._memo.forget(peer)
            why = clip(f"prefill {meta.p_session}: {refused.describe()}")
            return [Rejected(RejectKind.INCOMPATIBLE, why), SendRefusal(peer, refused),
                    Forget(peer)]
        out = [] if meta.generation is None else self._restarted(peer, meta, now)
        known = self._peers.get(peer)
        # Full: the oldest peer that announced nothing since its MF_META (a replayed one
        # cannot: that needs the secret) yields its slot; it holds no other state.
        for idle in [p for p, k in self._peers.items() if not k.proven][:1] if (
                known is None and len(self._peers) >= self.max_peers) else ():
            del self._peers[idle]
            out.append(Forget(idle))
        if known is None and len(self._peers) >= self.max_peers:
            # Not acknowledged: that Prefill's handshake deadline reports it.
            out += [Rejected(RejectKind.CAPPED, f"MF_META from a new connection while "
                            f"{self.max_peers} peers are known"), Forget(peer)]
            if not self._peers_capped:
                self._peers_capped = True
                out.append(Capped("peers", "all peers", self.max_peers))
            return out
        layers: dict[str, SourceLayout | LayoutMismatch] = {}
        for name, lm in meta.layers.items():
            if name not in self._destinations:  # never read: not kept (bounds peer state)
                continue
            try:
                layers[name] = SourceLayout.from_metadata(name, lm)
            except LayoutMismatch as exc:
                layers[name] = exc
        self._peers[peer] = _Peer(meta.p_session, layers, known is not None and known.proven,
                                  meta.generation)
        ack = SendAck(peer, None if meta.generation is None else self.generation,
                      meta.generation is not None and FEATURE_LAYER_RUNS in meta.features)
        return [*out, ack, MetaStored(peer, meta.p_session, len(layers))]

    def _ready(self, peer: Peer, batch: ReadReadyBatch, now: float) -> list[Output]:
        known = self._peers.get(peer)
        if known is None:
            return self._fail(peer, batch, "READ_READY_BATCH before MF_META on this connection",
                              now)
        if batch.also:
            return self._ready_run(peer, known, batch, now)
        src = known.layers.get(batch.layer_name)
        dst = self._destinations.get(batch.layer_name)
        if src is None or dst is None:
            side = "decode destinations" if dst is None else "prefill metadata"
            return self._fail(peer, batch, f"layer {batch.layer_name!r} is unknown to {side}",
                              now)
        if isinstance(src, LayoutMismatch):
            return self._fail(peer, batch, str(src), now)
        batch, dests, skipped = self._readable(batch)
        try:
            plan = self._plan(peer, batch, src, dst, dests)
        except (LayoutMismatch, PlanningError) as exc:
            return self._fail(peer, batch, str(exc), now)
        except Exception as exc:  # a planner bug must still answer, or Prefill waits it out
            return self._fail(peer, batch, f"cannot plan the layer: {type(exc).__name__}: "
                              f"{exc}", now, unexpected=True)
        return self._to_read(peer, known, (batch,), plan, now, skipped)

    def _ready_run(self, peer: Peer, known: _Peer, batch: ReadReadyBatch,
                   now: float) -> list[Output]:
        """A layer run (field 10): each layer is checked and planned on its own (one that
        fails is answered alone, and the layers after it skip the requests it failed),
        the rest are read in one batched read and answered by one reply."""
        if any(r.digests is not None for r in batch.read_reqs):
            return self._fail(peer, batch, "a layer run carries no digests (digests are per "
                              "layer: announce one layer per message)", now)
        out: list[Output] = []
        plans: list[ReadPlan] = []
        good: list[ReadReadyBatch] = []
        todo = list(range(1 + len(batch.also)))
        skipped: tuple[str, ...] = ()
        while todo:
            current, dests, skipped = self._readable(batch)
            layers = current.layers()
            known_layers: list[ReadReadyBatch] = []
            layouts: list[tuple[SourceLayout, DestinationLayout]] = []
            for i in todo:
                lay = layers[i]
                src = known.layers.get(lay.layer_name)
                dst = self._destinations.get(lay.layer_name)
                if src is None or dst is None:
                    side = "decode destinations" if dst is None else "prefill metadata"
                    out += self._fail(peer, lay, f"layer {lay.layer_name!r} is unknown to "
                                      f"{side}", now)
                elif isinstance(src, LayoutMismatch):
                    out += self._fail(peer, lay, str(src), now)
                else:
                    known_layers.append(lay)
                    layouts.append((src, dst))
            plan, errors = self._plan_run(peer, known_layers, layouts, dests)
            first_bad = next((n for n, e in enumerate(errors) if e is not None), None)
            todo = []
            if first_bad is None:
                good += known_layers
                plans += [plan] if plan is not None else []
                continue
            # The layers before the first that failed are read (``plan`` also covers good
            # layers after it: plan those before it again); it fails alone; the layers
            # after it are planned again without the requests it failed.
            if first_bad:
                plan, _ = self._plan_run(peer, known_layers[:first_bad],
                                         layouts[:first_bad], dests)
                good += known_layers[:first_bad]
                plans += [plan] if plan is not None else []
            error = errors[first_bad]
            expected = isinstance(error, LayoutMismatch | PlanningError)
            out += self._fail(peer, known_layers[first_bad], str(error) if expected else (
                f"cannot plan the layer: {type(error).__name__}: {error}"), now,
                unexpected=not expected)
            rest = {id(x) for x in known_layers[first_bad + 1:]}
            todo = [i for i, x in enumerate(layers) if id(x) in rest]
        if not good:
            return out
        return out + self._to_read(peer, known, tuple(good), merge_plans(plans), now, skipped)

    def _plan_run(self, peer: Peer, layers: Sequence[ReadReadyBatch],
                  layouts: Sequence[tuple[SourceLayout, DestinationLayout]],
                  dests: Mapping[str, Destination]
                  ) -> tuple[ReadPlan | None, list[Exception | None]]:
        return plan_run(layers, layouts, dests, d_rank=self.d_rank, d_tp=self.d_tp,
                        main_shared=self.main_shared, memo=self._memo, owner=peer)

    def _readable(self, batch: ReadReadyBatch
                  ) -> tuple[ReadReadyBatch, dict[str, Destination], tuple[str, ...]]:
        """The announcement without the requests this rank no longer reads (aborted,
        never admitted, or already ended here, e.g. failed: not read, named in the reply
        as skipped; the rest is read as usual), their destinations, and the skipped."""
        book = self._book
        dests = {
            r.ext_req_id: d
            for r in batch.read_reqs
            if (d := book.destination(r.ext_req_id)) is not None
            and not book.is_terminal(r.ext_req_id)
        }
        skipped: tuple[str, ...] = ()
        if len(dests) < len(batch.read_reqs):
            skipped = tuple(dict.fromkeys(r.ext_req_id for r in batch.read_reqs
                                          if r.ext_req_id not in dests))
            batch = dataclasses.replace(
                batch, read_reqs=tuple(r for r in batch.read_reqs if r.ext_req_id in dests))
        return batch, dests, skipped

    def _plan(self, peer: Peer, batch: ReadReadyBatch, src: SourceLayout,
              dst: DestinationLayout, dests: Mapping[str, Destination]) -> ReadPlan:
        return plan_reads(batch, src, dst, dests, d_rank=self.d_rank, d_tp=self.d_tp,
                          main_shared=self.main_shared, memo=self._memo, owner=peer)

    def _to_read(self, peer: Peer, known: _Peer, layers: tuple[ReadReadyBatch, ...],
                 plan: ReadPlan, now: float, skipped: tuple[str, ...]) -> list[Output]:
        first = layers[0]
        # These requests now depend on this peer until it reports their final layer.
        self._book.note_contribution(peer, (r.ext_req_id for r in first.read_reqs))
        if not plan.num_descriptors:
            return self._finish_layers(peer, layers, now, skipped)
        token = next(self._tokens)
        self._reads[token] = _PendingRead(peer, first, skipped=skipped, layers=layers)
        return [Read(token, peer, known.session, plan, first.hold_until_ms, first.layer_idx)]

    def _finish_layers(self, peer: Peer, layers: Sequence[ReadReadyBatch], now: float,
                       skipped: tuple[str, ...] = ()) -> list[Output]:
        """The layers were read: record each one's done ids, answer them in one reply
        (READ_DONE, the run's other layers in ``also``); a layer whose done ids break
        the rules fails alone."""
        gone = set(skipped)  # no orphan state for a request this rank already forgot
        failed: list[Output] = []
        events: list[Output] = []
        answered: list[ReadReadyBatch] = []
        for lay in layers:
            for r in lay.read_reqs:
                self._read.setdefault(r.ext_req_id, {}).setdefault(peer, set()).add(
                    lay.layer_name)
        for lay in layers:
            done_ids = lay.done_ext_ids
            if gone:
                done_ids = tuple(e for e in done_ids if e not in gone)
            if done_ids:
                done_ids, short = self._complete_only(peer, done_ids, now)
                if short:
                    events.append(Incomplete(lay.layer_idx, tuple(short.items())))
            try:  # most layers of a chunk end no request: nothing to record
                completed = self._book.record_done(
                    done_ids, lay.group_member_idx, lay.tp_ratio, peer=peer, now=now
                ) if done_ids else []
            except ProtocolError as exc:
                failed += self._fail_layers(peer, (lay,), exc.detail, now)
                continue
            answered.append(lay)
            events.append(LayerDone(lay.layer_idx, tuple(completed)))
        if not answered:
            return failed
        first = answered[0]
        also = tuple((lay.layer_idx, lay.seq) for lay in answered[1:] if lay.seq is not None)
        out: list[Output] = [Reply(peer, ReadDone(first.layer_idx, first.seq, skipped, also)),
                             *events]
        if skipped:
            out.append(Skipped(first.layer_idx, skipped))
        return out + failed

    def _complete_only(self, peer: Peer, done_ids: Sequence[str], now: float
                       ) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
        """The final reports ``peer`` may make, and the requests it reports final before
        every layer they need from it was read (each with those layers): these fail here,
        naming the layers, instead of completing with KV missing."""
        keep: list[str] = []
        short: dict[str, tuple[str, ...]] = {}
        for ext in done_ids:
            missing = self._missing(peer, ext)
            if missing:
                short[ext] = missing
                shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more"
                                                  if len(missing) > 4 else "")
                self._book.record_failed(
                    (ext,), clip(f"the prefill peer reported its final layer before "
                                 f"{len(missing)} layer(s) it must send were read: {shown}"),
                    now, peer)
            else:
                keep.append(ext)
        return tuple(keep), short

    def _missing(self, peer: Peer, ext: str) -> tuple[str, ...]:
        """The layers of ``peer``'s metadata that the admitted request ``ext`` needs from
        it (this rank has a destination for the layer and the request a block in the
        layer's group) and that were not read for it yet. Nothing for a request not
        admitted here or already over (its report is kept or dropped as before), nor from
        a peer that named it in no layer: a contributor owning none of its blocks still
        reports it final (spec 8)."""
        dest = self._book.destination(ext)
        known = self._peers.get(peer)
        read = self._read.get(ext, {}).get(peer)
        if not read or dest is None or known is None or self._book.is_terminal(ext):
            return ()
        missing = []
        holds: dict[int | None, bool] = {}  # group -> the request has a block in it
        for name, src in known.layers.items():
            dst = self._destinations.get(name)
            if name in read or dst is None or isinstance(src, LayoutMismatch):
                continue
            if dst.group not in holds:
                try:
                    holds[dst.group] = bool((dest.main_for(dst.group) != NO_BLOCK).any())
                except IndexError:
                    holds[dst.group] = False
            if holds[dst.group]:
                missing.append(name)
        return tuple(missing)

    def _finish(self, peer: Peer, batch: ReadReadyBatch, now: float,
                skipped: tuple[str, ...] = ()) -> list[Output]:
        return self._finish_layers(peer, batch.layers(), now, skipped)

    def _fail(self, peer: Peer, batch: ReadReadyBatch, reason: str, now: float | None,
              *, unexpected: bool = False) -> list[Output]:
        return self._fail_layers(peer, batch.layers(), reason, now, unexpected=unexpected)

    def _fail_layers(self, peer: Peer, layers: Sequence[ReadReadyBatch], reason: str,
                     now: float | None, *, unexpected: bool = False) -> list[Output]:
        """The layers failed: their requests fail, one READ_FAILED answers them all (a
        layer run's other layers in ``also``)."""
        reason = clip(reason)  # names and ids in it come from the peer
        named = dict.fromkeys(e for lay in layers for e in lay.named_ext_ids)
        # A connection that never sent MF_META may fail admitted requests it names (a
        # Prefill that reconnected) but leaves no state for ids unknown here.
        self._book.record_failed(tuple(named), reason, now, peer,
                                 admitted_only=peer not in self._peers)
        first = layers[0]
        also = tuple((lay.layer_idx, lay.seq) for lay in layers[1:] if lay.seq is not None)
        return [Reply(peer, ReadFailed(first.layer_idx, reason, first.seq, also)),
                *(LayerFailed(lay.layer_idx, reason, unexpected) for lay in layers)]


def _label(hit: CapHit) -> str:
    owner = hit.owner
    if isinstance(owner, bytes):
        return "peer " + owner.hex()[:16]
    return str(owner)

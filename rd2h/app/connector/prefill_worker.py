"""Prefill worker role: announce each layer of this step's completed blocks,
gate buffer reuse, tell vLLM when a finished request's blocks may be freed, and
hold a step whose preempted requests Decode may still be reading
(``handle_preemptions``). The request state lives in the sender's session
(``PrefillSender.requests``), under its one lock: this role keeps none of its own.

Layers of a recurrent-state group (Mamba, gated delta net) get no per-layer hook from
vLLM: they are announced after the step's forward (``wait_for_save``), in layer order,
and only with a request's final chunk; so are the layers of a group vLLM writes without
the hook (``hookless_groups``: DeepSeek-V4's caches), with every chunk. A layer vLLM gave
no hook in a step although its group has one (DeepSeek-V3.2's indexer cache: vLLM calls
the hook from attention forwards only) is announced after the forward too, so every
layer is announced in every step. The request's final report rides on the layer
announced last in time, the one that completes the step's layers, never on a layer
announced before another (by id it may come first: V3.2's layer-2 indexer has a higher
id than layer 2's latent, yet is written before it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from rd2h.app.connector.plans import PrefillSend, StepPlan
from rd2h.app.connector.roles import ConnectorRole, TransferResults
from rd2h.app.prefill import LayerTarget, PrefillSender
from rd2h.domain.errors import CompletionError, LayoutMismatch
from rd2h.domain.planning.chunks import layer_index
from rd2h.domain.planning.digests import stated_digests, stated_split_digests
from rd2h.domain.planning.layout import SourceLayout
from rd2h.domain.planning.state_split import StateGeometry, state_slices
from rd2h.domain.planning.topology import compute_mapping, remote_port, tcp_endpoint
from rd2h.domain.prefill.prefill_book import Announced, RequestFailed, RequestWithheld
from rd2h.domain.prefill.prefill_session import RequestNews
from rd2h.domain.wire.protocol import ReadRequest
from rd2h.ports.runtime import (
    NO_TIMELINE,
    Clock,
    DeviceEvents,
    Digest,
    HopName,
    Logger,
    Timeline,
)
from rd2h.ports.transfer import TransferEngine


def _read_request(s: PrefillSend, group: int | None, state: bool = False
                  ) -> ReadRequest | None:
    """What one layer announces of a send: its own KV cache group's blocks when the
    layer's group is known (None: that group holds nothing new of it, e.g. the whole
    range is outside a sliding window, or a state group before the final chunk), else
    the plan's main and indexer lists."""
    if group is not None and group < len(s.groups):
        start, ids = s.groups[group]
        if not ids and (state or not s.indexer_block_ids):
            return None
        return ReadRequest(s.ext_id, ids, s.indexer_block_ids, start, s.indexer_start)
    if s.main_block_ids or s.indexer_block_ids:
        return ReadRequest(s.ext_id, s.main_block_ids, s.indexer_block_ids,
                           s.main_start, s.indexer_start)
    return None


# A layer's announcement targets, the (request id, ext id) pairs per endpoint, and the
# bytes its reads name.
_Targets = tuple[list[LayerTarget], dict[str, list[tuple[str, str]]], int]


def _block_bytes(layout: SourceLayout | None) -> tuple[int, int]:
    """Bytes read of one main block and of one indexer block (with its scale) of a
    layer: the tensors' pages."""
    if layout is None:
        return 0, 0
    index = (layout.indexer, layout.scale)
    return (sum(t.page for t in layout.main),
            sum(t.page for t in index if t is not None))


class PrefillWorker(ConnectorRole):
    def __init__(
        self,
        *,
        sender: PrefillSender,
        events: DeviceEvents,
        p_rank: int,
        p_tp: int,
        layer_names: Mapping[int, str],
        clock: Clock,
        layer_groups: Mapping[int, int] | None = None,
        state_groups: Iterable[int] = (),
        hookless_groups: Iterable[int] = (),
        log: Logger,
        buffer_reuse: bool = False,
        reuse_timeout_s: float | None = None,
        settle_timeout_s: float | None = None,
        stop_timeout_s: float = 5.0,
        transport: TransferEngine | None = None,
        timeline: Timeline = NO_TIMELINE,
        layouts: Mapping[int, SourceLayout] | None = None,
        digest: Digest | None = None,
        main_shared: bool = False,
        min_announce_bytes: int = 0,
        state_geometry: StateGeometry | None = None,
    ) -> None:
        self._timeline = timeline
        # A state layer split across TP sizes states, per block, a digest of each run its
        # reader reads (``stated_split_digests``): the geometry gives the runs.
        self._state_geometry = state_geometry
        # ``verify_kv``: each announced block's digest, from the layer's source bytes;
        # with ``main_shared`` (this rank states a shared main pool, which the handshake
        # holds Decode to), main only for the reading Decode rank's share.
        self._layouts = dict(layouts or {})
        self._digest = digest
        self._main_shared = main_shared
        self._sender = sender
        # The engine exposing this rank's caches: Decode reads through it for as long
        # as this worker runs, so the worker owns it (closed at shutdown).
        self._transport = transport
        self._events = events
        self._p_rank = p_rank
        self._p_tp = p_tp
        self._layers = dict(layer_names)
        self._ids = {name: idx for idx, name in self._layers.items()}
        # Layer -> its KV cache group: a layer announces that group's blocks (absent:
        # the plan's main and indexer lists, as with one group).
        self._layer_groups = dict(layer_groups or {})
        state = frozenset(state_groups)
        late = state | frozenset(hookless_groups)
        self._state_layers = frozenset(i for i in self._layers
                                       if self._layer_groups.get(i) in state)
        # Layers announced after the forward (then any layer vLLM called no hook for).
        self._late_layers = tuple(sorted(i for i in self._layers
                                         if self._layer_groups.get(i) in late))
        self._unhooked_seen: set[int] = set()  # layers found without a hook (logged once)
        self._clock = clock
        self._log = log
        self.buffer_reuse = buffer_reuse
        self._reuse_timeout = reuse_timeout_s
        self._settle_timeout_s = settle_timeout_s
        self._stop_timeout = stop_timeout_s
        self._sends: tuple[PrefillSend, ...] = ()
        self._dispatched: set[int] = set()
        # This step's targets per (KV cache group, state layer, last layer): every layer
        # of a kind announces the same blocks to the same endpoints (without digests).
        self._step_targets: dict[tuple[int | None, bool, bool], _Targets] = {}
        # A step's layers are held back (``submit(hold=True)``) until those held name
        # ``min_announce_bytes`` of reads, or the forward ends (``wait_for_save``): one
        # frame for layers too small for a frame of their own to pay (0: never held).
        self._min_announce_bytes = min_announce_bytes
        self._held_bytes = 0
        self._requests = sender.requests  # the session's request book
        self.layers_announced = 0
        self.requests_settled = 0

    # -- counters
    def kv_connector_stats(self) -> dict[str, Any]:
        held = self._requests.held()  # requests (and their main blocks) held for Decode
        return {"layers_announced": self.layers_announced,
                "requests_failed": self.requests_failed,
                "requests_aborted": self.requests_skipped,
                "refused_incompatible": self._sender.stats.handshakes_refused, **held}

    @property
    def requests_failed(self) -> int:
        return self._requests.failed

    @property
    def requests_skipped(self) -> int:
        """Requests Decode no longer knew (aborted there)."""
        return self._requests.skipped

    @property
    def sender(self) -> PrefillSender:
        return self._sender

    def start(self) -> None:
        self._sender.start()

    # -- the connector role's hooks, per step: handle_preemptions, bind_connector_metadata,
    # then per layer wait_for_layer_load (or wait_for_layer_reuse) and save_kv_layer;
    # get_transfer_results
    def bind_connector_metadata(self, plan: StepPlan) -> None:
        """This step's sends. A request with a failed announcement gets no more: Decode
        failed it, or never read the failed part and must not complete it without that
        (it fails at its own deadline instead)."""
        self._release()  # the last step's forward ended (``wait_for_save`` released them)
        sends = plan.sends
        kept = self._requests.start_step(
            (s.internal_id, s.main_start + len(s.main_block_ids)) for s in sends)
        self._report(self._requests.take_news())
        self._sends = tuple(s for s in sends if s.internal_id in kept)
        self._dispatched.clear()
        self._step_targets.clear()

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s buffer may be written again (spec 11)."""
        self._sender.wait_for_layer_send(layer_idx, self.reuse_timeout_s)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """On Prefill: with shared buffers, the reuse gate."""
        if self.buffer_reuse:
            self.wait_for_layer_reuse(self._layer_id(layer_name))

    def _layer_id(self, layer_name: str) -> int:
        idx = self._ids.get(layer_name)
        return layer_index(layer_name) if idx is None else idx

    def save_kv_layer(self, layer_name: str) -> None:
        """The layer's KV scatter was queued (also Ascend's ``on_kv_cache_written``):
        announce it, once per layer per step (``layers_announced`` counts them)."""
        idx = self._layer_id(layer_name)
        if idx in self._late_layers:
            return  # final only after the forward (``wait_for_save``)
        self._announce(idx)

    def wait_for_save(self) -> None:
        """The step's forward ran every layer: announce the late layers (a state layer's
        block is in this step's sends with a request's final chunk only), then every layer
        vLLM called no hook for in this step (written by now); the last of them carries
        the step's final reports."""
        for idx in self._late_layers:
            self._announce(idx)
        if self._sends:
            for idx in sorted(self._layers):
                if idx not in self._dispatched:
                    if idx not in self._unhooked_seen:
                        self._unhooked_seen.add(idx)
                        self._log.info("vLLM called no save hook for a cache layer; it is "
                                       "announced after each step's forward",
                                       layer=self._layers[idx])
                    self._announce(idx)
        self._release()

    def _release(self) -> None:
        """Announce what this step held back (one frame per Decode that reads runs)."""
        self._held_bytes = 0
        self._sender.release()

    def _announce(self, idx: int) -> None:
        """Announce layer ``idx`` of this step's sends, once per step."""
        if idx in self._dispatched or idx not in self._layers:
            return
        self._dispatched.add(idx)
        if not self._sends:
            return
        # The step's last layer in time: every other one was announced before it.
        last = len(self._dispatched) == len(self._layers)
        group = self._layer_groups.get(idx)
        key = (group, idx in self._state_layers, last)
        known = self._step_targets.get(key)
        if known is None:
            known = self._targets(idx, group, key[1], last)
            if self._digest is None:  # digests differ per layer: built for each
                self._step_targets[key] = known
        targets, names, nbytes = known
        if not targets:
            return
        final = [s.internal_id for s in self._sends if s.final] if last else []
        hold = False
        if self._min_announce_bytes:
            self._held_bytes += nbytes
            hold = self._held_bytes < self._min_announce_bytes
            if not hold:
                self._held_bytes = 0  # this submit sends what was held with it
        try:
            self._sender.submit(idx, self._events.record(), targets, names, final, hold=hold)
        finally:
            self._report(self._requests.take_news())
        self.layers_announced += 1

    def _targets(self, idx: int, group: int | None, state: bool, last: bool) -> _Targets:
        """Layer ``idx``'s announcement of this step's sends, per Decode endpoint, and
        the bytes its reads name in all (``min_announce_bytes``); ``last``: the step's
        last layer, which carries the final reports."""
        targets: list[LayerTarget] = []
        names: dict[str, list[tuple[str, str]]] = {}
        nbytes = 0
        main_bpb, index_bpb = _block_bytes(self._layouts.get(idx))
        for s in self._sends:
            m = compute_mapping(self._p_tp, s.decode.tp_size, self._p_rank)
            req = _read_request(s, group, state)
            done = s.final and last
            if req is None and not done:
                continue
            layout = self._layouts.get(idx) if self._digest is not None else None
            stated: dict[tuple[int, int], ReadRequest] = {}  # per reader's main share
            # One Decode rank, or (Decode TP above Prefill TP) each of the fan-out ranks
            # this rank alone serves: each is announced to and answers separately.
            for d_rank in m.d_ranks:
                endpoint = tcp_endpoint(s.decode.host, remote_port(s.decode.base_port, d_rank))
                ask = req
                if req is not None and layout is not None and self._digest is not None:
                    runs = self._split_runs(layout, d_rank, m.d_tp)
                    if runs is not None:
                        ask = dataclasses.replace(req, digests=stated_split_digests(
                            layout, req, self._digest, runs))
                    else:
                        owner = (d_rank, m.d_tp) if self._main_shared else (0, 1)
                        ask = stated.get(owner)
                        if ask is None:
                            ask = stated[owner] = dataclasses.replace(
                                req, digests=stated_digests(
                                    layout, req, self._digest, member=m.member, ratio=m.ratio,
                                    main_owner=owner))
                targets.append(LayerTarget(endpoint, ask, done, m.member, m.ratio, s.ext_id,
                                           s.awaits))
                names.setdefault(endpoint, []).append((s.internal_id, s.ext_id))
                if req is not None:
                    nbytes += (len(req.p_main_block_ids) * main_bpb
                               + len(req.p_indexer_block_ids) * index_bpb)
        return targets, names, nbytes

    def _split_runs(self, layout: SourceLayout, d_rank: int, d_tp: int) -> Any:
        """The runs Decode rank ``d_rank`` of ``d_tp`` reads of this state layer's pages
        when the TP sizes differ (``state_slices``); None otherwise."""
        geometry = self._state_geometry
        if geometry is None or layout.state is None or d_tp == layout.state[1]:
            return None
        try:
            return state_slices(geometry, layout.state, (d_rank, d_tp), layout.layer_name)
        except LayoutMismatch:
            return None  # Decode refuses the pair itself, naming why

    # -- preemption
    def handle_preemptions(self, plan: StepPlan) -> None:
        """vLLM preempted ``plan.preempted`` and freed their blocks; this step's forward
        may write them. Return once every announcement of them was answered or failed, so
        Decode is no longer reading them (a failed one: Decode failed the request, or
        never read that part and gets no more of it, see ``bind_connector_metadata``).
        Raises ``CompletionError`` if the sender keeps one open past every deadline."""
        if not plan.preempted:
            return
        self._release()  # what it waits for must be on its way
        rids = tuple(dict.fromkeys(plan.preempted))
        timeout = self.settle_timeout_s
        started = self._clock.now()
        waited_on = self._requests.open_requests(rids)
        still = self._requests.wait_settled(rids, timeout) if waited_on else {}
        self._report(self._requests.take_news())
        if still:
            raise CompletionError(
                f"preempted request(s) {sorted(still)}: Decode has not answered "
                f"{sum(still.values())} announcement(s) of their blocks within "
                f"{timeout:g} s; vLLM freed those blocks and would "
                f"overwrite them while Decode may still read them"
            )
        failed = self._requests.errors(rids)
        self.requests_settled += len(rids)
        self._log.info("preempted requests settled before their blocks are reused",
                       requests=list(rids), open_announcements=sum(waited_on.values()),
                       waited_ms=round((self._clock.now() - started) * 1000, 1),
                       failed=failed)

    @property
    def reuse_timeout_s(self) -> float:
        """How long ``wait_for_layer_reuse`` waits: the sender's gate budget (a slow but
        healthy Decode answering inside the session's deadlines never makes it raise)."""
        if self._reuse_timeout is not None:
            return self._reuse_timeout
        return self._sender.timeouts.gate_budget_s

    @property
    def settle_timeout_s(self) -> float:
        """Every announcement ends (answered or failed) within the sender's own deadlines;
        this bound (the gate budget) only catches a sender that stopped keeping them."""
        if self._settle_timeout_s is not None:
            return self._settle_timeout_s
        return self._sender.timeouts.gate_budget_s

    # -- completion
    def get_transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """Finished sending: requests vLLM finished whose announcements have all been
        answered."""
        self._report(self._requests.take_news())
        done = self._requests.release(finished_req_ids)
        for rid in done:
            self._timeline.stamp(rid, HopName.PREFILL_RELEASED)
        return TransferResults(finished_sending=frozenset(done))

    def _report(self, news: Iterable[RequestNews]) -> None:
        """Timeline stamps and logs of what happened to requests, in order."""
        for e in news:
            if isinstance(e, Announced):
                for rid in e.first:
                    self._timeline.stamp(rid, HopName.PREFILL_FIRST_LAYER)
                for rid in e.final:
                    self._timeline.stamp(rid, HopName.PREFILL_ANNOUNCED_ALL)
            elif isinstance(e, RequestFailed):
                self._log.warning("decode did not read a request's layer",
                                  request=e.request, error=e.error)
            elif isinstance(e, RequestWithheld):
                self._log.warning("not announcing more of a request with a failed "
                                  "announcement", request=e.request, error=e.error)
            else:
                self._log.info("decode skipped an aborted request; no more of it is "
                               "announced", request=e.request, endpoint=e.endpoint)

    def counters(self) -> dict[str, int]:
        out = self._requests.counters()
        out.update(self._sender.counters())
        return out

    def shutdown(self) -> None:
        self._sender.stop(self._stop_timeout)
        if self._transport is not None:
            self._transport.close()

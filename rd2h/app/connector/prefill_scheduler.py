"""Prefill scheduler role (spec 3.2): per request, which completed blocks to
announce this step, to which Decode instance; cleanup when a request ends.

Preemption: vLLM frees a preempted request's blocks without ``request_finished``
and may hand them to another request in the same step. The plan names every
preempted request that already announced blocks (``StepPlan.preempted``); the
workers wait, before that step's forward, until Decode answered (or the deadline
failed) every announcement of it. What Decode read is then the request's true KV,
so the request keeps its progress here (``transferred``): when it resumes (with new
blocks, recomputed from the start or from a prefix-cache hit), the blocks after that
point are announced from the new block table as they complete.

Recurrent state (``rd2h.domain.planning.kv_groups``, the N-1 scheme): a request for a remote
Decode is shortened by its last prompt token on arrival (``prompt_backoff``, once per
request, whatever preemption does later), so the state Prefill ends with is the state
after N-1 tokens; each state group's running-state block is announced with the final
chunk only (before it, the state is still changing), as that group's one block."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rd2h.app.connector.plans import DecodeEndpoint, PrefillSend, StepPlan
from rd2h.app.connector.roles import BlockIds, ConnectorRole, RequestFacts, ScheduledRequest
from rd2h.domain.errors import ChunkError, Rd2hError
from rd2h.domain.planning.chunks import chunk_block_range, external_request_id
from rd2h.domain.planning.kv_groups import NO_BLOCK, STATE_BACKOFF, leading_gap, state_slot
from rd2h.domain.planning.topology import MAX_PORT, check_topology
from rd2h.domain.wire.rendezvous import AWAITS_ADMISSION, sampled, traceparent
from rd2h.ports.runtime import NO_TIMELINE, HopName, Logger, Timeline


class TransferParamsError(Rd2hError, ValueError):
    """A request's kv_transfer_params cannot be used by Prefill."""


def _int_param(params: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TransferParamsError(f"kv_transfer_params[{key!r}] must be an int, got {value!r}")
    return value


def resolve_params(ext_id: str, params: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """This request's own params; a prompt-list dispatch carries every child's params
    under ``batch_kv_transfer_params`` keyed by external id. None: not a remote decode."""
    if not params or not params.get("do_remote_decode"):
        return None
    batch = params.get("batch_kv_transfer_params")
    if batch is None:
        return params
    if not isinstance(batch, Mapping):
        raise TransferParamsError("batch_kv_transfer_params must be an object")
    child = batch.get(ext_id)
    if child is None:
        raise TransferParamsError(
            f"batch_kv_transfer_params has no entry for request {ext_id!r} "
            f"(it names {sorted(batch)[:8]})"
        )
    if not isinstance(child, Mapping):
        raise TransferParamsError(f"batch_kv_transfer_params[{ext_id!r}] must be an object")
    if not child.get("do_remote_decode", True):
        return None  # Decode computes this prompt itself (a local notice)
    return child


def decode_endpoint(params: Mapping[str, Any], p_tp: int) -> tuple[DecodeEndpoint, int]:
    """D's contact info from the rendezvous params; also the remote cached tokens."""
    host = params.get("remote_host")
    if not isinstance(host, str) or not host:
        raise TransferParamsError("kv_transfer_params['remote_host'] must be a host name")
    port = _int_param(params, "remote_port")
    if not 1 <= port <= MAX_PORT:
        raise TransferParamsError(f"remote_port {port} is outside 1..{MAX_PORT}")
    d_tp = _int_param(params, "remote_tp_size", 1)
    for key in ("remote_pcp_size", "remote_dcp_size"):
        if _int_param(params, key, 1) != 1:
            raise TransferParamsError(
                f"{key} must be 1: rd2h supports tensor parallel Decode only"
            )
    check_topology(p_tp, d_tp)
    cached = _int_param(params, "remote_cached_tokens", 0)
    if cached < 0:
        raise TransferParamsError(f"remote_cached_tokens must be >= 0, got {cached}")
    engine = params.get("remote_engine_id", "")
    return DecodeEndpoint(host, port, d_tp, str(engine or "")), cached


def awaits_admission(params: Mapping[str, Any]) -> bool:
    """The proxy dispatched this request to Prefill and Decode at once
    (``AWAITS_ADMISSION``): Decode may not have admitted it when its first layer is
    announced, and ``remote_cached_tokens`` is unknown (every block is announced; Decode
    leaves alone what its own prefix cache holds)."""
    return params.get(AWAITS_ADMISSION) is True


def _held_part(ids: list[int], start: int, end: int) -> tuple[int, tuple[int, ...]]:
    """Blocks ``[start, end)`` of one group's table as ``(first position, ids)``, without
    the head a sliding window already dropped (``NO_BLOCK``: Decode holds nothing there
    either, since its window ends at the prompt's end, at or past this chunk's)."""
    part = ids[start:end]
    gap = leading_gap(part)
    if NO_BLOCK in part[gap:]:
        raise ChunkError(f"blocks [{start}, {end}) of a KV cache group have a gap after "
                         f"block {start + gap}: that KV is no longer held")
    return start + gap, tuple(part[gap:])


@dataclass
class _Tracked:
    ext_id: str
    decode: DecodeEndpoint
    total_tokens: int
    remote_cached: int
    blocks: list[list[int]] = field(default_factory=list)
    transferred: int = 0  # tokens announced (the main group's blocks)
    # Tokens announced per group, where groups differ in block size (else empty).
    group_transferred: list[int] = field(default_factory=list)
    final_sent: bool = False
    sent_any: bool = False
    awaits: bool = False  # dispatched before Decode admitted it (``AWAITS_ADMISSION``)


class PrefillScheduler(ConnectorRole):
    def __init__(
        self, *, block_size: int, main_group: int, indexer_group: int, p_tp: int,
        log: Logger, timeline: Timeline = NO_TIMELINE, state_groups: Iterable[int] = (),
        group_block_sizes: Sequence[int] = (), prompt_backoff: bool | None = None,
    ) -> None:
        """``group_block_sizes``: tokens per block of each KV cache group, by index, when
        they differ (DeepSeek-V4); each group's blocks are then counted in its own.
        ``prompt_backoff``: Prefill computes all but the prompt's last token, which
        Decode computes (the N-1 scheme; None: with state groups)."""
        self._timeline = timeline
        sizes = tuple(int(b) for b in group_block_sizes)
        state = frozenset(state_groups)
        # Only where attention groups differ (a state group's block size is one state).
        self._group_bs = sizes if len({b for g, b in enumerate(sizes)
                                       if g not in state}) > 1 else ()
        self._state = state
        self._backoff = bool(state) if prompt_backoff is None else prompt_backoff
        self._shortened: set[str] = set()  # requests whose prompt tail Decode computes
        self._bs = block_size
        self._main = main_group
        self._indexer = indexer_group
        self._p_tp = p_tp
        self._log = log
        self._tracked: dict[str, _Tracked] = {}
        self._preempted: dict[str, None] = {}  # for the next plan, in order
        self.rejected = 0
        self.preempted = 0

    # -- the connector role's hooks
    def prompt_backoff(self, request: RequestFacts) -> int:
        """With state groups (or the N-1 scheme otherwise asked for): 1 for a request
        Prefill will send to a remote Decode (its state must be the state after N-1
        tokens), once per request; else 0. A one-token
        prompt is never shortened (Decode computes such a prompt itself and the proxy
        does not dispatch it here)."""
        rid = request.request_id
        if not self._backoff or rid in self._shortened or request.num_prompt_tokens <= 1:
            return 0
        try:
            own = resolve_params(external_request_id(rid), request.params)
        except TransferParamsError:
            return 0  # refused with its reason at update_state_after_alloc
        if own is None:
            return 0
        self._shortened.add(rid)
        return STATE_BACKOFF

    def update_state_after_alloc(self, request: RequestFacts, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        """Start tracking a request sent with ``do_remote_decode`` (idempotent)."""
        request_id = request.request_id
        if request_id in self._tracked:
            return
        ext = external_request_id(request_id)
        try:
            own = resolve_params(ext, request.params)
            if own is None:
                return
            decode, cached = decode_endpoint(own, self._p_tp)
        except (TransferParamsError, ValueError) as exc:
            self.rejected += 1
            self._log.error("request cannot be transferred to decode", request=request_id,
                            error=str(exc))
            return
        self._tracked[request_id] = _Tracked(ext, decode, request.num_prompt_tokens, cached,
                                             awaits=awaits_admission(own))
        trace = traceparent(request.params)
        self._timeline.stamp(request_id, HopName.PREFILL_TRACKED, trace)
        if trace:
            (self._log.info if sampled(trace) else self._log.debug)(
                "sending KV to decode", request=request_id, traceparent=trace,
                decode=f"{decode.host}:{decode.base_port}")

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        sends = tuple(s for s in map(self._schedule, scheduled) if s is not None)
        preempted, self._preempted = tuple(self._preempted), {}
        return StepPlan(sends=sends, preempted=preempted)

    def request_finished(self, request_id: str) -> bool:
        """Drop the request's state; True if its blocks must wait for the sends."""
        self._shortened.discard(request_id)
        t = self._tracked.pop(request_id, None)
        return t is not None and t.sent_any

    def requests_preempted(self, request_ids: Iterable[str]) -> None:
        """Preempted in the step being built: those with announced blocks go in its
        plan (the others have nothing Decode could be reading)."""
        for rid in request_ids:
            t = self._tracked.get(rid)
            if t is None or not t.sent_any or rid in self._preempted:
                continue
            self._preempted[rid] = None
            self.preempted += 1
            self._log.info("request preempted after announcing blocks: decode's reads "
                           "settle before its blocks are reused", request=rid,
                           announced_tokens=t.transferred, final_sent=t.final_sent)

    # -- the rules
    def _schedule(self, r: ScheduledRequest) -> PrefillSend | None:
        """One scheduled step of a tracked request: its newly completed blocks."""
        request_id = r.request_id
        t = self._tracked.get(request_id)
        if t is None or t.final_sent:
            return None
        if r.new_block_ids is not None:
            if r.replace_blocks or not t.blocks:
                t.blocks = [list(map(int, g)) for g in r.new_block_ids]
            else:
                for group, ids in zip(t.blocks, r.new_block_ids):
                    group.extend(int(b) for b in ids)
        computed = r.num_computed_tokens + r.num_scheduled_tokens
        final = computed >= t.total_tokens
        main_ids = t.blocks[self._main] if t.blocks else []
        tokens = min(computed, t.total_tokens)
        try:
            ranges = self._group_ranges(t, tokens, final)
            if ranges:
                start, end = ranges[self._main]
            else:
                start, end = chunk_block_range(
                    block_size=self._bs, computed_tokens=tokens,
                    transferred_tokens=t.transferred, remote_cached_tokens=t.remote_cached,
                    final=final, allocated_blocks=len(main_ids),
                )
            groups = tuple(self._state_part(g, ids, final) if g in self._state
                           else _held_part(ids, *(ranges[g] if ranges else (start, end)))
                           for g, ids in enumerate(t.blocks))
        except ChunkError as exc:
            self._log.error("cannot announce request blocks", request=request_id,
                            error=str(exc))
            if t.sent_any:  # Decode may still read earlier blocks: keep them until
                t.final_sent = True  # finished_sending (``request_finished`` says wait)
            else:
                self._tracked.pop(request_id, None)
            return None
        # A step with no new block in any group announces nothing before the final one.
        fresh = (any(e > s_ for g, (s_, e) in enumerate(ranges) if g not in self._state)
                 if ranges else end > start)
        if not fresh and not final:
            return None
        if ranges:
            t.group_transferred = [e * b for (_, e), b in zip(ranges, self._group_bs)]
            t.transferred = end * self._group_bs[self._main]
        else:
            t.transferred = end * self._bs
        t.final_sent = final
        t.sent_any = True
        main_start, main = groups[self._main] if groups else (start, ())
        idx_start, idx = groups[self._indexer] if groups else (start, ())
        return PrefillSend(
            request_id, t.ext_id, t.decode, main, idx, main_start, idx_start, final,
            groups=groups, awaits=t.awaits,
        )

    def _group_ranges(self, t: _Tracked, computed: int, final: bool
                      ) -> list[tuple[int, int]]:
        """Each group's blocks ``[start, end)`` completed by this step and not yet
        announced, in its own block size (empty: one block size, the main group's range
        serves every group)."""
        if not self._group_bs:
            return []
        if len(self._group_bs) != len(t.blocks):
            raise ChunkError(f"the request has {len(t.blocks)} block lists for "
                             f"{len(self._group_bs)} KV cache groups")
        done = t.group_transferred or [0] * len(self._group_bs)
        return [chunk_block_range(
            block_size=bs, computed_tokens=computed, transferred_tokens=done[g],
            remote_cached_tokens=t.remote_cached, final=final,
            allocated_blocks=len(t.blocks[g])) if g not in self._state else (0, 0)
            for g, bs in enumerate(self._group_bs)]

    @staticmethod
    def _state_part(group: int, ids: list[int], final: bool) -> tuple[int, tuple[int, ...]]:
        """A state group's part of a step: nothing before the final chunk; with it, the
        running-state block (the state after the prompt this engine computes)."""
        if not final:
            return 0, ()
        slot = state_slot(ids)
        if slot is None:
            raise ChunkError(f"KV cache group {group} (recurrent state) holds no state block "
                             f"for the request (its blocks: {ids[-4:]})")
        return 0, (slot,)

    def counters(self) -> dict[str, int]:
        return {"tracked": len(self._tracked), "rejected": self.rejected}

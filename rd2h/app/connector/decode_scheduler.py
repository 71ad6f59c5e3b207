"""Decode scheduler role (spec 3.1): async external match, destination blocks kept
locally, rendezvous post to the proxy's metaserver once every Decode rank has
admitted the request, cancellation when the request finishes.

Recurrent state (``rd2h.domain.planning.kv_groups``, the N-1 scheme): the match is the prompt
but its last token, which this engine computes from the state after the others; a
request with nothing to pull then (a one-token prompt, or a local prefix hit of all
but the last token) is computed here, and the proxy is told so (a local notice). A
state group's destination is its running-state block alone."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rd2h.app.connector.plans import DecodeLoad, StepPlan
from rd2h.app.connector.roles import BlockIds, ConnectorRole, RequestFacts, ScheduledRequest
from rd2h.domain.planning.chunks import external_request_id
from rd2h.domain.planning.kv_groups import NO_BLOCK, STATE_BACKOFF, state_slot
from rd2h.domain.wire.rendezvous import (
    AWAITS_ADMISSION,
    SENT_CONTACT,
    same_contact,
    sampled,
    traceparent,
)
from rd2h.ports.metaserver import MetaserverPoster
from rd2h.ports.runtime import NO_TIMELINE, HopName, Logger, Timeline


@dataclass
class _Waiting:
    url: str | None
    payload: dict[str, Any]
    admitted: int = 0
    posted: bool = False


class DecodeScheduler(ConnectorRole):
    """Keeps ``(main, indexer)`` destination ids per request; they never leave Decode.

    The post to the metaserver waits until all ``tp_size`` workers reported the
    request admitted (``update_connector_output``): Prefill may announce blocks as soon
    as it learns the contact info, and every Decode rank must know the destinations by
    then.
    """

    def __init__(
        self,
        *,
        metaserver: MetaserverPoster,
        host: str,
        base_port: int,
        tp_size: int,
        engine_id: str,
        log: Logger,
        main_group: int = 0,
        indexer_group: int = 0,
        stop_timeout_s: float = 5.0,
        timeline: Timeline = NO_TIMELINE,
        state_groups: Iterable[int] = (),
        block_size: int = 0,
        group_block_sizes: Sequence[int] = (),
        prompt_backoff: bool | None = None,
    ) -> None:
        """``prompt_backoff``: Decode takes all but the prompt's last token from Prefill
        and computes that token itself (the N-1 scheme; None: with state groups)."""
        self._state = frozenset(state_groups)
        self._backoff = bool(self._state) if prompt_backoff is None else prompt_backoff
        # Tokens per block (per group where vLLM states them): what a prefix-cache hit
        # covers of each destination list (``_own_prefix``).
        self._bs = int(block_size)
        self._group_bs = tuple(int(b) for b in group_block_sizes)
        self._metaserver = metaserver
        self._timeline = timeline
        self._main_group = main_group
        self._indexer_group = indexer_group
        self._stop_timeout = stop_timeout_s
        self._host = host
        self._base_port = base_port
        self._tp = tp_size
        self._engine_id = engine_id
        self._log = log
        # request -> tokens computed locally when matched (vLLM updates the request's
        # num_computed_tokens only after update_state_after_alloc).
        self._remote: dict[str, int] = {}
        # request -> (tokens its prefix cache held, prompt length): computed here, with
        # no pull, because the proxy's local_prefill_tokens covers what is missing.
        self._local: dict[str, tuple[int, int]] = {}
        self.local_prefills = 0
        self._loads: list[DecodeLoad] = []
        self._waiting: dict[str, _Waiting] = {}
        self._received: dict[str, bool] = {}  # KV received, not yet scheduled (timeline)
        self.posts = 0
        self.posts_skipped = 0  # parallel dispatch with the right contact: nothing to post
        self.failed_fast = 0  # requests failed because their Prefill dispatch failed

    # -- the connector role's hooks
    def get_num_new_matched_tokens(self, request: RequestFacts,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """The rest of the prompt, loaded async."""
        params = request.params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        missing = max(0, request.prompt_len - num_computed_tokens)
        backoff = STATE_BACKOFF if self._backoff else 0
        count = max(0, missing - backoff)
        if _computes_locally(params, missing) or (missing and not count):
            self._local[request.request_id] = (num_computed_tokens, request.prompt_len)
            return 0, False
        self._local.pop(request.request_id, None)
        if count:
            self._remote[request.request_id] = num_computed_tokens
            trace = traceparent(params)
            self._timeline.stamp(request.request_id, HopName.DECODE_MATCHED, trace)
            if trace:
                (self._log.info if sampled(trace) else self._log.debug)(
                    "pulling KV from prefill", request=request.request_id,
                    traceparent=trace, tokens=count)
        return count, count > 0

    def update_state_after_alloc(self, request: RequestFacts, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        """Record the destinations and clear ``do_remote_prefill``."""
        request_id, params = request.request_id, request.params
        if params is None or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        local = self._local.pop(request_id, None)
        if local is not None:
            self._post_local(request_id, params, *local)
        if request_id not in self._remote or num_external_tokens <= 0:
            self._remote.pop(request_id, None)
            return
        num_computed_tokens = max(int(request.num_computed_tokens), self._remote[request_id])
        own = self._own_prefix if params.get(AWAITS_ADMISSION) is True else _as_is
        main = own(block_ids[self._main_group], self._main_group, num_computed_tokens)
        indexer = own(block_ids[self._indexer_group], self._indexer_group,
                      num_computed_tokens)
        groups = tuple(self._state_destination(i, g) if i in self._state
                       else own(g, i, num_computed_tokens) for i, g in enumerate(block_ids))
        self._loads.append(DecodeLoad(request_id, main, indexer, groups))
        self._timeline.stamp(request_id, HopName.DECODE_ALLOCATED)
        ext = external_request_id(request_id)
        url = None if params.get("do_virtual") else params.get("metaserver")
        if url is not None and not isinstance(url, str):
            self._log.warning("ignoring a metaserver that is not a URL", request=request_id)
            url = None
        payload = {
            "request_id": ext,
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_engine_id": self._engine_id,
            "remote_host": self._host,
            "remote_port": self._base_port,
            "remote_tp_size": self._tp,
            "remote_pcp_size": 1,
            "remote_dcp_size": 1,
            "remote_cached_tokens": int(num_computed_tokens),
        }
        sent = params.get(SENT_CONTACT)
        if url is not None and isinstance(sent, dict) and same_contact(sent, payload):
            url = None  # parallel dispatch: Prefill has this contact already, no post
            self.posts_skipped += 1
        self._waiting[request_id] = _Waiting(url, payload)

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """This step's new loads (every worker admits them, once) and failed loads."""
        if self._received:
            for r in scheduled:
                if self._received.pop(r.request_id, False):
                    self._timeline.stamp(r.request_id, HopName.DECODE_SCHEDULED)
        loads, self._loads = tuple(self._loads), []
        failed = self._dispatch_failures()
        return StepPlan(loads=loads, failed_loads=failed, idle=not loads and not failed and not any(
            r.num_scheduled_tokens for r in scheduled))

    def update_connector_output(self, admitted: Mapping[str, int],
                                finished_recving: Iterable[str] = ()) -> None:
        """Workers' admission reports (summed over ranks): post the complete ones."""
        for request_id, n in admitted.items():
            w = self._waiting.get(request_id)
            if w is None or w.posted:
                continue
            w.admitted += n
            if w.admitted < self._tp:
                continue
            w.posted = True
            self._timeline.stamp(request_id, HopName.DECODE_ADMITTED_ALL)
            if w.url is None:
                continue
            try:
                self._metaserver.post(w.payload["request_id"], w.url, dict(w.payload))
            except ValueError as exc:  # a URL or payload that can never be posted
                self._log.error("cannot post to the metaserver; the request will time out",
                                request=request_id, error=str(exc))
                continue
            self.posts += 1
        for request_id in finished_recving:
            self._timeline.stamp(request_id, HopName.DECODE_KV_READY)
            if self._timeline is not NO_TIMELINE:
                self._received[request_id] = True  # its first step is stamped too

    def request_finished(self, request_id: str) -> bool:
        """Cancel pending posts and forget the request."""
        self._remote.pop(request_id, None)
        self._local.pop(request_id, None)
        self._received.pop(request_id, None)
        self._loads = [ld for ld in self._loads if ld.internal_id != request_id]
        w = self._waiting.pop(request_id, None)
        if w is not None:
            self._metaserver.cancel(w.payload["request_id"])
        return False

    # -- the rules
    def _own_prefix(self, ids: Sequence[int], group: int, cached: int) -> tuple[int, ...]:
        """A destination list with the blocks this engine's prefix cache already held
        marked ``NO_BLOCK``: nothing is read into them. Under parallel dispatch Prefill
        did not learn ``remote_cached_tokens`` and announces every block; those blocks
        may be shared with other requests and must never be written."""
        bs = self._group_bs[group] if group < len(self._group_bs) else self._bs
        held = cached // bs if bs > 0 and cached > 0 else 0
        return tuple(NO_BLOCK if i < held else int(b) for i, b in enumerate(ids))

    @staticmethod
    def _state_destination(group: int, ids: Sequence[int]) -> tuple[int, ...]:
        """A state group's destination: its running-state block, where the state after
        the loaded tokens must be (``NO_BLOCK`` if vLLM gave none: nothing lands)."""
        slot = state_slot([int(b) for b in ids])
        return (NO_BLOCK if slot is None else slot,)

    def _post_local(self, request_id: str, params: dict[str, Any], cached: int,
                    prompt_len: int) -> None:
        """Tell the proxy that no Prefill is needed: this engine computes the prompt."""
        self.local_prefills += 1
        ext = external_request_id(request_id)
        trace = traceparent(params)
        (self._log.info if sampled(trace) else self._log.debug)(
            "computing the prompt locally (the proxy sends no Prefill)", request=request_id,
            cached_tokens=cached, prompt_tokens=prompt_len, traceparent=trace)
        url = params.get("metaserver")
        if not isinstance(url, str) or params.get("do_virtual"):
            return
        payload = {"request_id": ext, "do_remote_prefill": False, "do_remote_decode": False,
                   "prefill": "local", "remote_engine_id": self._engine_id,
                   "remote_cached_tokens": int(cached), "prompt_tokens": int(prompt_len)}
        try:
            self._metaserver.post(ext, url, payload)
        except ValueError as exc:
            self._log.error("cannot post to the metaserver", request=request_id,
                            error=str(exc))

    def _dispatch_failures(self) -> tuple[tuple[str, str], ...]:
        """Requests the metaserver says will get no KV (its Prefill dispatch failed), as
        ``(request, reason)`` for the workers; each is reported once."""
        failed = self._metaserver.take_failed()
        if not failed:
            return ()
        by_ext = {w.payload["request_id"]: rid for rid, w in self._waiting.items()}
        out = tuple((by_ext[ext], reason) for ext, reason in failed.items() if ext in by_ext)
        for rid, reason in out:
            self.failed_fast += 1
            self._log.warning("request will get no KV; failing it now", request=rid,
                              reason=reason)
        return out

    def shutdown(self, timeout: float | None = None) -> None:
        self._waiting.clear()
        self._loads.clear()
        self._metaserver.shutdown(self._stop_timeout if timeout is None else timeout)

    def counters(self) -> dict[str, int]:
        return {"remote": len(self._remote), "waiting_post": len(self._waiting),
                "queued_loads": len(self._loads)}


def _as_is(ids: Sequence[int], group: int, cached: int) -> tuple[int, ...]:
    return tuple(int(b) for b in ids)


def _computes_locally(params: dict[str, Any], missing: int) -> bool:
    """The proxy allows Decode to compute up to ``local_prefill_tokens`` itself."""
    limit = params.get("local_prefill_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int):
        return False
    return 0 < missing <= limit

"""Rendezvous rules of the ``rd2h proxy`` (spec 3.1 items 3-4, 3.2 prompt lists, 3.4).

The proxy sends a client request to Decode first; Decode's connector posts its
contact information to the proxy's metaserver once per prompt, and the proxy
then sends the same request to Prefill. This module holds everything about that
exchange that does not need a socket: which proxy request a posted id belongs
to, how many posts a request waits for, what the Decode and Prefill bodies look
like, and the table of requests waiting for their posts. The HTTP adapter is a
thin loop around it.

Request ids: the proxy names each client request with ``rid`` (32 lowercase hex
digits) and sends it as the ``X-Request-Id`` header. vLLM 0.32's OpenAI server
builds its ids from that header: completions ``cmpl-<rid>-<i>`` (one per prompt,
``i`` counting from 0, also for a single prompt), chat ``chatcmpl-<rid>``. The
engine appends a 9-character suffix that Decode strips again (spec 3.4), so the
posted ``request_id`` contains ``rid`` as a run of exactly 32 hex digits.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rd2h.domain.errors import Rd2hError

_RID_RUN = re.compile(r"(?<![0-9a-f])([0-9a-f]{32})(?![0-9a-f])")

# Prefill's ``kv_transfer_params`` key under parallel dispatch (``--dispatch parallel``):
# true when the proxy sent the request to Prefill and Decode at once, so Decode may not
# have admitted it yet when Prefill announces its first layer (Prefill names it in each
# READ_READY_BATCH's ``awaits``), and Decode's prefix-cache hit is unknown (no
# ``remote_cached_tokens``: every block is announced, Decode writes none it holds).
AWAITS_ADMISSION = "awaits_admission"
# Decode's ``kv_transfer_params`` key under parallel dispatch: the contact Prefill was
# given for it (``CONTACT_KEYS``). Decode posts only when its own differs (a mismatch the
# proxy then repairs); the same contact needs no post.
SENT_CONTACT = "sent_contact"


class Endpoint(str, Enum):
    """The two OpenAI endpoints the proxy serves."""

    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


class ClientRequestError(Rd2hError, ValueError):
    """A client request the proxy cannot route (answered with HTTP 400)."""


class MetaserverPostError(Rd2hError, ValueError):
    """A metaserver post that is not a JSON object with a string ``request_id`` (HTTP 400)."""


class UnknownRendezvous(Rd2hError, LookupError):
    """A metaserver post whose id names no pending proxy request (HTTP 404)."""


class UnexpectedPost(Rd2hError):
    """A post for a request that has already been sent to Prefill under other ids (HTTP 409)."""


def extract_rid(request_id: str) -> str | None:
    """The proxy's 32-hex request id embedded in a posted ``request_id``, or None.

    A run of hex digits longer than 32 is not a match, so an id that merely
    contains hex is not mistaken for a proxy id.
    """
    found = _RID_RUN.findall(request_id)
    return found[0] if len(found) == 1 else None


def count_prompts(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """How many engine requests (and metaserver posts) one client request becomes.

    Chat requests are one prompt. A completion ``prompt`` is one prompt when it is
    a string or a list of token ids, and N prompts when it is a list of N strings
    or N token-id lists. ``n`` > 1 and beam search fan one prompt out into
    several engine requests that would each post; the proxy rejects them rather
    than dispatching Prefill more than once for one prompt.
    """
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise ClientRequestError(
            f"'n' = {n!r} is not supported through the disaggregated proxy (only n = 1)"
        )
    if body.get("use_beam_search"):
        raise ClientRequestError("beam search is not supported through the disaggregated proxy")
    if endpoint is Endpoint.CHAT:
        return 1
    prompt = body.get("prompt")
    if prompt is None or isinstance(prompt, str):
        return 1  # a missing prompt is the engine's error to report (it may use prompt_embeds)
    if not isinstance(prompt, list):
        raise ClientRequestError(
            f"'prompt' must be a string or a list, not {type(prompt).__name__}"
        )
    if not prompt:
        raise ClientRequestError("'prompt' is an empty list")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return 1
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return len(prompt)
    raise ClientRequestError(
        "'prompt' must be a string, a list of token ids, a list of strings or a list of "
        "token-id lists"
    )


def decode_body(body: Mapping[str, Any], metaserver_url: str, *, local_prefill_tokens: int = 0,
                traceparent: str | None = None,
                sent_contact: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The client's body for Decode: unchanged but for ``kv_transfer_params``.

    ``local_prefill_tokens`` > 0: Decode computes the prompt itself when its prefix
    cache lacks at most that many of its tokens, and posts a local notice instead of
    its contact information (``LOCAL_PREFILL``).
    """
    out = dict(body)
    params: dict[str, Any] = {"do_remote_prefill": True, "metaserver": metaserver_url}
    if local_prefill_tokens:
        params["local_prefill_tokens"] = local_prefill_tokens
    if traceparent:
        params["traceparent"] = traceparent
    if sent_contact is not None:  # Prefill already has it (parallel dispatch)
        params[AWAITS_ADMISSION] = True
        params[SENT_CONTACT] = dict(sent_contact)
    out["kv_transfer_params"] = params
    return out


def traceparent(params: Mapping[str, Any] | None) -> str | None:
    """The W3C ``traceparent`` the proxy put in ``kv_transfer_params`` (bounded), if any."""
    value = params.get("traceparent") if params else None
    return value if isinstance(value, str) and 0 < len(value) <= 64 else None


def sampled(trace: str | None) -> bool:
    """A ``traceparent`` whose flags have the sampled bit: its requests are logged at
    info level on the engines (others at debug)."""
    if not trace:
        return False
    try:
        return bool(int(trace.rsplit("-", 1)[1], 16) & 1)
    except (ValueError, IndexError):
        return False



# A post's ``prefill`` value when Decode computes the prompt itself: no KV is pulled.
LOCAL_PREFILL = "local"


def is_local(post: Mapping[str, Any]) -> bool:
    return post.get("prefill") == LOCAL_PREFILL


def prefill_body(
    body: Mapping[str, Any], endpoint: Endpoint, kv_transfer_params: Mapping[str, Any]
) -> dict[str, Any]:
    """The client's body for Prefill: one output token, no streaming, D's contact info.

    Options that contradict a one-token, non-streaming request (``stream_options``,
    ``min_tokens``) are dropped so the engine does not reject the dispatch.
    """
    out = copy.deepcopy(dict(body))
    out["max_tokens"] = 1
    if endpoint is Endpoint.CHAT:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = copy.deepcopy(dict(kv_transfer_params))
    return out


def posted_request_id(post: Any) -> str:
    """Validate a metaserver post and return its ``request_id``."""
    if not isinstance(post, Mapping):
        raise MetaserverPostError(
            f"metaserver post must be a JSON object, not {type(post).__name__}"
        )
    request_id = post.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise MetaserverPostError("metaserver post needs a non-empty string 'request_id'")
    return request_id


class PostStatus(str, Enum):
    DISPATCH = "dispatched"  # every expected post is in: send to Prefill now
    WAITING = "waiting"  # a prompt list still waits for other children
    DUPLICATE = "duplicate"  # the same id posted again (a retry): nothing to do
    LOCAL = "local"  # every prompt is computed by Decode itself: no Prefill dispatch
    # Parallel dispatch: Prefill already has the request with the contact the proxy
    # predicted. CONFIRMED: the post says the same; MISMATCH: it does not (the early
    # dispatch must be cancelled and the request sent again with the posted params).
    CONFIRMED = "confirmed"
    MISMATCH = "mismatch"


# What identifies a Decode engine's contact in its posts: the same for every request it
# posts, so the proxy can send Prefill the next request of that instance before Decode
# posts it (parallel dispatch).
CONTACT_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size",
                "remote_pcp_size", "remote_dcp_size")


def contact_of(post: Mapping[str, Any]) -> dict[str, Any] | None:
    """A post's engine contact (None: a local notice, or a post without one)."""
    if is_local(post) or not isinstance(post.get("remote_host"), str) or not isinstance(
            post.get("remote_port"), int):
        return None
    return {k: post[k] for k in CONTACT_KEYS if k in post}


def predicted_request_id(endpoint: Endpoint, rid: str) -> str:
    """The external id vLLM's OpenAI server gives the one prompt of a request sent with
    ``X-Request-Id: rid`` (see the module doc): what Decode will post, and what Prefill
    announces."""
    return f"chatcmpl-{rid}" if endpoint is Endpoint.CHAT else f"cmpl-{rid}-0"


def same_contact(sent: Mapping[str, Any], post: Mapping[str, Any]) -> bool:
    """A post (or the payload Decode would post) names the contact Prefill was given."""
    contact = contact_of(post)
    return contact is not None and all(sent.get(k) == v for k, v in contact.items())


def early_params(contact: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """Prefill's ``kv_transfer_params`` for a request sent before Decode posted: the
    instance's known contact, no ``remote_cached_tokens``, ``AWAITS_ADMISSION``."""
    return {**contact, "request_id": request_id, "do_remote_prefill": False,
            "do_remote_decode": True, AWAITS_ADMISSION: True}


@dataclass
class PendingRequest:
    """A client request sent to Decode whose Prefill dispatch is not settled yet."""

    rid: str
    endpoint: Endpoint
    body: dict[str, Any]
    expected: int
    created: float
    posts: dict[str, dict[str, Any]] = field(default_factory=dict)
    dispatched: bool = False
    # Why the Prefill dispatch failed for good (None: it did not), for the client's answer.
    prefill_failure: str | None = None
    # Parallel dispatch: request id -> the params Prefill was sent before Decode posted
    # (empty: Prefill waits for the posts, as usual).
    early: dict[str, dict[str, Any]] = field(default_factory=dict)

    def prefill_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` for the one Prefill dispatch (spec 3.2 prompt lists).

        A prompt Decode computes itself stays in a list's batch with its local notice
        (``do_remote_decode`` false): Prefill computes it and sends nothing."""
        if self.expected == 1:
            return dict(next(iter(self.posts.values())))
        return {"do_remote_decode": True, "batch_kv_transfer_params": dict(self.posts)}

    def missing(self) -> int:
        return max(0, self.expected - len(self.posts))


@dataclass(frozen=True)
class PostOutcome:
    status: PostStatus
    request: PendingRequest
    request_id: str


class RendezvousTable:
    """Pending proxy requests by ``rid``; decides when a request goes to Prefill.

    Not thread-safe: the proxy drives it from its one event loop.
    """

    def __init__(self) -> None:
        self._pending: dict[str, PendingRequest] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, rid: object) -> bool:
        return rid in self._pending

    def open(
        self, rid: str, endpoint: Endpoint, body: Mapping[str, Any], expected: int, now: float
    ) -> PendingRequest:
        if rid in self._pending:
            raise ValueError(f"request {rid!r} is already pending")
        if expected < 1:
            raise ValueError(f"a request expects at least one post, not {expected}")
        entry = PendingRequest(rid, endpoint, dict(body), expected, now)
        self._pending[rid] = entry
        return entry

    def close(self, rid: str) -> PendingRequest | None:
        """Forget a request (its Decode response ended); None if it was not pending."""
        return self._pending.pop(rid, None)

    def post(self, post: Any) -> PostOutcome:
        """Record one metaserver post; DISPATCH exactly once per request."""
        request_id = posted_request_id(post)
        rid = extract_rid(request_id)
        entry = self._pending.get(rid) if rid is not None else None
        if entry is None:
            raise UnknownRendezvous(
                f"no pending proxy request for request_id {request_id!r} (finished, never "
                "sent through this proxy, or not built from the proxy's X-Request-Id)"
            )
        if request_id in entry.posts:
            entry.posts[request_id] = dict(post)
            return PostOutcome(PostStatus.DUPLICATE, entry, request_id)
        if entry.early and not entry.posts:
            entry.posts[request_id] = dict(post)
            if is_local(post):
                return PostOutcome(PostStatus.LOCAL, entry, request_id)
            sent = entry.early.get(request_id)
            same = sent is not None and same_contact(sent, post)
            return PostOutcome(PostStatus.CONFIRMED if same else PostStatus.MISMATCH, entry,
                               request_id)
        if entry.dispatched or len(entry.posts) >= entry.expected:
            raise UnexpectedPost(
                f"request_id {request_id!r}: proxy request {entry.rid} expected "
                f"{entry.expected} post(s) and already has them ({sorted(entry.posts)})"
            )
        entry.posts[request_id] = dict(post)
        if len(entry.posts) < entry.expected:
            return PostOutcome(PostStatus.WAITING, entry, request_id)
        entry.dispatched = True
        if all(is_local(p) for p in entry.posts.values()):
            return PostOutcome(PostStatus.LOCAL, entry, request_id)
        return PostOutcome(PostStatus.DISPATCH, entry, request_id)

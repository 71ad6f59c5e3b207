"""What Prefill announces per layer (spec 4.2): one request's share of a layer for one
Decode endpoint, grouped into one READ_READY_BATCH per endpoint."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest


@dataclass(frozen=True)
class LayerTarget:
    """One request's share of a layer for one Decode endpoint."""

    endpoint: str
    request: ReadRequest | None
    done: bool = False
    member: int = 0
    ratio: int = 1
    ext_req_id: str = ""
    # Prefill got the request before Decode admitted it (the proxy's parallel
    # dispatch): the message names it in ``awaits`` so that Decode waits for it.
    awaits: bool = False


def group_batches(
    layer_idx: int, layer_name: str, targets: Iterable[LayerTarget]
) -> dict[str, ReadReadyBatch]:
    """One READ_READY_BATCH per endpoint, with every request for that endpoint."""
    reqs: dict[str, list[ReadRequest]] = {}
    done: dict[str, list[str]] = {}
    group: dict[str, tuple[int, int]] = {}
    awaits: dict[str, dict[str, None]] = {}
    for t in targets:
        prev = group.setdefault(t.endpoint, (t.member, t.ratio))
        if prev != (t.member, t.ratio):
            raise ValueError(f"endpoint {t.endpoint}: mixed contributor positions {prev}")
        reqs.setdefault(t.endpoint, [])
        done.setdefault(t.endpoint, [])
        if t.request is not None:
            reqs[t.endpoint].append(t.request)
        if t.done:
            ext = t.ext_req_id or (t.request.ext_req_id if t.request else "")
            if not ext:
                raise ValueError("a done target needs its external request id")
            done[t.endpoint].append(ext)
        if t.awaits:
            ext = t.ext_req_id or (t.request.ext_req_id if t.request else "")
            awaits.setdefault(t.endpoint, {})[ext] = None
    return {
        ep: ReadReadyBatch(layer_idx, layer_name, tuple(reqs[ep]), tuple(done[ep]), *group[ep],
                           awaits=tuple(awaits.get(ep, ())))
        for ep in reqs
    }

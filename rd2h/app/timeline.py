"""The per-request timeline: which hop of the serving path a request's time goes to.

Each process on the path (the proxy, every engine's connector scheduler and workers)
stamps hops with the request id when ``timeline_dir`` / ``$RD2H_TIMELINE_DIR`` is set
(``rd2h.adapters.logging.timeline``). vLLM's request ids carry the proxy's request id
(``X-Request-Id``: 32 hex digits), so the stamps of one client request are found by that
id across processes. ``breakdown`` turns them into p50/p99 per hop: the time from the
previous hop on the path to this one, over the requests that passed both.

``PATH`` is the order a request takes, with who owns the interval that ends at each hop
("vLLM" where vLLM's own engine loop, IPC or API server does the work and rd2h cannot
move it; "rd2h" for the connector's own waits; "proxy"; "model" for the forward).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rd2h.ports.runtime import HopName


@dataclass(frozen=True)
class Hop:
    name: HopName
    owner: str
    what: str  # what the interval ending at this hop is made of


PATH: tuple[Hop, ...] = (
    Hop(HopName.PROXY_RECEIVED, "proxy", "client request read and named"),
    Hop(HopName.DECODE_MATCHED, "vLLM", "Decode API server, tokeniser, engine-core queue, "
        "scheduler asks the connector"),
    Hop(HopName.DECODE_ALLOCATED, "vLLM", "Decode scheduler allocates the request's blocks"),
    Hop(HopName.DECODE_WORKER_ADMITTED, "vLLM", "scheduler output to the Decode worker (IPC); "
        "rd2h admits the destinations"),
    Hop(HopName.DECODE_ADMITTED_ALL, "vLLM", "worker output back to the Decode scheduler with "
        "every rank's admission"),
    Hop(HopName.PROXY_POST, "rd2h", "metaserver POST from the Decode scheduler to the proxy"),
    Hop(HopName.PROXY_PREFILL_SENT, "proxy", "the proxy dispatches the Prefill request"),
    Hop(HopName.PREFILL_TRACKED, "vLLM", "Prefill API server, tokeniser, engine-core queue, "
        "scheduler allocates"),
    Hop(HopName.PREFILL_FIRST_LAYER, "vLLM", "scheduler output to the Prefill worker, forward "
        "up to layer 0 written"),
    Hop(HopName.PREFILL_ANNOUNCED_ALL, "model", "the rest of the Prefill forward (every layer "
        "announced as written)"),
    Hop(HopName.DECODE_KV_COMPLETE, "rd2h", "the last announcement, Decode's read of it and the "
        "request's completion on Decode"),
    Hop(HopName.DECODE_REPORTED, "rd2h", "the Decode worker reports it to vLLM (next "
        "get_finished, TP exchange)"),
    Hop(HopName.DECODE_KV_READY, "vLLM", "worker output to the Decode scheduler "
        "(finished_recving)"),
    Hop(HopName.DECODE_SCHEDULED, "vLLM", "the Decode engine's next step schedules the request"),
    Hop(HopName.PROXY_FIRST_BYTE, "vLLM", "Decode computes the last prompt token, samples, "
        "detokenises and streams the first token"),
    Hop(HopName.PROXY_DONE, "vLLM", "the rest of the output"),
)
# Stamped too, off the path: failures and the ends of the Prefill leg.
SIDE_HOPS: tuple[Hop, ...] = (
    Hop(HopName.PROXY_DECODE_HEADERS, "vLLM", "Decode answered the response headers"),
    Hop(HopName.PREFILL_RELEASED, "rd2h", "Prefill: every announcement answered, blocks freed"),
    Hop(HopName.PROXY_PREFILL_ANSWERED, "vLLM", "Prefill's HTTP answer reached the proxy"),
    Hop(HopName.DECODE_FAILED, "rd2h", "Decode failed the request's KV"),
)
KNOWN_HOPS = frozenset(h.name for h in PATH + SIDE_HOPS)
_KEY = re.compile(r"[0-9a-f]{32}")


def request_key(request_id: str) -> str:
    """The proxy's id inside a vLLM request id (``cmpl-<rid>-0-1a2b3c4d``), else the id."""
    m = _KEY.search(request_id)
    return m.group(0) if m else request_id


def load(directory: str | Path) -> dict[str, dict[str, float]]:
    """Every request's first time at each hop, from all ``*.jsonl`` files under
    ``directory``. Lines that are not whole stamps are skipped."""
    requests: dict[str, dict[str, float]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    key, hop, t = request_key(str(rec["id"])), str(rec["hop"]), float(rec["t"])
                except (ValueError, KeyError, TypeError):
                    continue
                hops = requests.setdefault(key, {})
                if t < hops.get(hop, math.inf):
                    hops[hop] = t
    return requests


def select(requests: Mapping[str, Mapping[str, float]], since: float | None = None,
           until: float | None = None) -> dict[str, Mapping[str, float]]:
    """The requests that started (first stamp) within ``[since, until]``."""
    out = {}
    for key, hops in requests.items():
        start = hops.get(HopName.PROXY_RECEIVED, min(hops.values(), default=math.inf))
        if (since is None or start >= since) and (until is None or start <= until):
            out[key] = hops
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (``q`` in 0..100)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class HopFigures:
    hop: str
    after: str
    owner: str
    what: str
    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    at_p50_ms: float  # since proxy.received


@dataclass(frozen=True)
class Breakdown:
    requests: int
    complete: int  # requests that reached proxy.first_byte
    failed: int
    hops: tuple[HopFigures, ...]

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "complete": self.complete, "failed": self.failed,
                "hops": [asdict(h) for h in self.hops]}


def breakdown(requests: Mapping[str, Mapping[str, float]],
              path: Iterable[Hop] = PATH) -> Breakdown:
    """p50/p99 of each path hop's interval (from the previous hop the request passed)."""
    hops = tuple(path)
    figures = []
    for i, hop in enumerate(hops):
        deltas, offsets, afters = [], [], {}
        for stamps in requests.values():
            t = stamps.get(hop.name)
            if t is None:
                continue
            start = stamps.get(hops[0].name)
            if start is not None:
                offsets.append((t - start) * 1e3)
            prev = next((h.name for h in reversed(hops[:i]) if h.name in stamps), None)
            if prev is None:
                continue
            deltas.append((t - stamps[prev]) * 1e3)
            afters[prev] = afters.get(prev, 0) + 1
        if not offsets and not deltas:
            continue
        after = max(afters, key=afters.__getitem__) if afters else "-"
        figures.append(HopFigures(
            hop.name, after, hop.owner, hop.what, len(deltas),
            percentile(deltas, 50), percentile(deltas, 99),
            sum(deltas) / len(deltas) if deltas else math.nan, percentile(offsets, 50)))
    complete = sum(1 for s in requests.values() if HopName.PROXY_FIRST_BYTE in s)
    failed = sum(1 for s in requests.values() if HopName.DECODE_FAILED in s)
    return Breakdown(len(requests), complete, failed, tuple(figures))


def render(b: Breakdown) -> str:
    """The breakdown as a text table (milliseconds)."""
    lines = [f"timeline: {b.requests} requests, {b.complete} reached their first token, "
             f"{b.failed} failed their KV",
             f"{'hop':<24}{'p50 ms':>9}{'p99 ms':>9}{'at p50':>9}  {'owner':<6} interval"]
    for h in b.hops:
        lines.append(f"{h.hop:<24}{_ms(h.p50_ms):>9}{_ms(h.p99_ms):>9}{_ms(h.at_p50_ms):>9}"
                     f"  {h.owner:<6} {h.what}")
    return "\n".join(lines)


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1f}"

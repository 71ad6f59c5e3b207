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

from rd2h.ports.runtime import NO_TIMELINE, HopName


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
    Hop(HopName.DECODE_LAYER_READ, "rd2h", "Decode read one layer of the request (stamped "
        "at each read's end, with the request's bytes in it)"),
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


# ---- how much of each request's pull was done before Prefill's last layer was ready


def load_reads(directory: str | Path) -> dict[str, list[tuple[float, int]]]:
    """Every request's reads on Decode, ``(end time, bytes)``, from the stamps with bytes
    (``decode.layer_read``) under ``directory``."""
    reads: dict[str, list[tuple[float, int]]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if '"bytes"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                    if rec["hop"] != HopName.DECODE_LAYER_READ:
                        continue
                    t, n = float(rec["t"]), int(rec["bytes"])
                    key = request_key(str(rec["id"]))
                except (ValueError, KeyError, TypeError):
                    continue
                reads.setdefault(key, []).append((t, n))
    return reads


@dataclass(frozen=True)
class PullOverlap:
    """Over the requests that have both Decode reads and Prefill's last-layer stamp
    (``prefill.announced_all``: the prompt's last layer written and announced): the share
    of each request's bytes whose read had ended by then, and how long the pull went on
    after it."""

    requests: int
    bytes_p50: float  # bytes pulled per request
    before_last_p50: float  # fraction of a request's bytes read before its last layer
    before_last_min: float
    before_last_all: float  # over all bytes of all requests
    after_last_p50_ms: float  # last layer ready -> last read ended
    after_last_p99_ms: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def pull_overlap(requests: Mapping[str, Mapping[str, float]],
                 reads: Mapping[str, Sequence[tuple[float, int]]]) -> PullOverlap | None:
    """``None`` when no request has both (another connector, or no timeline)."""
    shares, sizes, tails = [], [], []
    before_all = total_all = 0
    for key, hops in requests.items():
        last = hops.get(HopName.PREFILL_ANNOUNCED_ALL)
        got = reads.get(key)
        if last is None or not got:
            continue
        total = sum(n for _, n in got)
        if total <= 0:
            continue
        before = sum(n for t, n in got if t <= last)
        shares.append(before / total)
        sizes.append(float(total))
        tails.append(max(0.0, (max(t for t, _ in got) - last) * 1e3))
        before_all += before
        total_all += total
    if not shares:
        return None
    return PullOverlap(len(shares), percentile(sizes, 50), percentile(shares, 50),
                       min(shares), before_all / total_all, percentile(tails, 50),
                       percentile(tails, 99))


def render_overlap(o: PullOverlap | None) -> str:
    if o is None:
        return "pull overlap: no request with both Decode reads and Prefill's last layer"
    return (f"pull overlap: {o.requests} requests, {o.bytes_p50 / 2**20:.1f} MiB each (p50); "
            f"read before Prefill's last layer was ready: p50 {o.before_last_p50:.1%}, "
            f"min {o.before_last_min:.1%}, all bytes {o.before_last_all:.1%}; "
            f"pull went on {o.after_last_p50_ms:.1f} ms (p50) / {o.after_last_p99_ms:.1f} ms "
            "(p99) after it")


def read_stamper(timeline: Any) -> Any:
    """``DecodeReceiver``'s ``on_read`` that stamps each read's bytes per request on
    ``timeline`` (``None`` when there is no timeline). A read's bytes are apportioned to
    its requests by their blocks (exact when every block of the read is the same size,
    as in a vLLM cache without an indexer)."""
    if timeline is None or timeline is NO_TIMELINE:
        return None

    def on_read(p_session: str, plan: Any) -> None:
        blocks = (plan.main_blocks + plan.indexer_blocks).tolist()
        count = sum(blocks)
        if count <= 0:
            return
        total = plan.total_bytes
        for rid, b in zip(plan.ext_req_ids, blocks):
            if b:
                timeline.stamp_bytes(rid, HopName.DECODE_LAYER_READ, total * b // count)

    return on_read

"""What the drivers count and log from their sessions' events: the app decides what to
log and whom to tell; the sessions only say what happened."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rd2h.domain.decode import decode_session as d
from rd2h.domain.prefill import prefill_events as p
from rd2h.domain.wire.wire_values import clip, few
from rd2h.ports.runtime import Logger

# Latency samples kept between reads of the stats: beyond this the oldest half goes,
# so a long-running rank nobody reads the stats of stays bounded.
MAX_SAMPLES = 65536


def add_sample(samples: list[float], value: float) -> None:
    if len(samples) >= MAX_SAMPLES:
        del samples[: MAX_SAMPLES // 2]
    samples.append(value)


@dataclass
class SenderStats:
    layers_sent: int = 0
    frames_sent: int = 0  # READ_READY_BATCH frames (a layer run carries several layers)
    layers_failed: int = 0
    handshakes_refused: int = 0  # Decode refused our MF_META (incompatible builds)
    ack_latencies_ms: list[float] = field(default_factory=list)


def report_prefill(outs: Iterable[p.Output], stats: SenderStats,
                   log: Logger) -> list[p.HandshakeDone]:
    """Count and log the Prefill session's events; returns the finished handshakes."""
    handshakes = []
    for out in outs:
        if isinstance(out, p.LayerAnswered):
            if out.error is None:
                if out.latency_s is not None:
                    add_sample(stats.ack_latencies_ms, out.latency_s * 1e3)
                continue
            stats.layers_failed += 1
            log.warning("layer not read by decode", layer=out.layer_idx, endpoint=out.endpoint,
                        error=out.error)
        elif isinstance(out, p.EndpointReset):
            level = log.warning if out.layers else log.info  # idle: e.g. Decode shut down
            level("decode endpoint reset", endpoint=out.endpoint,
                  failed_layers=list(out.layers), reason=out.reason)
        elif isinstance(out, p.HandshakeDone):
            if out.error is None:
                log.info("decode endpoint acknowledged metadata", endpoint=out.endpoint)
            handshakes.append(out)
    return handshakes


@dataclass
class DecodeStats:
    layers_done: int = 0
    layers_failed: int = 0
    reads_failed: int = 0
    bytes_read: int = 0
    descriptors: int = 0
    read_seconds: float = 0.0
    handle_seconds: float = 0.0
    malformed: int = 0
    auth_refused: int = 0
    capped: int = 0  # times a bound on peer-driven state was reached
    skipped: int = 0  # announced requests not read: no longer known here (aborted)
    failed_fast: int = 0  # requests failed because the proxy could not dispatch them
    peer_lost_failed: int = 0  # requests failed because their Prefill peer disconnected
    expired: int = 0  # requests failed because no KV arrived by the request deadline
    refused_unauthenticated: int = 0  # MF_META refused: authentication failed
    refused_capped: int = 0  # MF_META refused: the peer cap was full
    refused_incompatible: int = 0  # MF_META refused: the builds do not match
    reads_past_hold: int = 0  # layers failed: the read would end after Prefill's hold
    blocks_verified: int = 0  # verify_kv: block digests checked after reads
    digest_mismatches: int = 0  # verify_kv: blocks whose bytes differed from Prefill's
    parked: int = 0  # announcements kept until their requests' admission (parallel dispatch)
    parked_expired: int = 0  # of those, handled when their wait ended, not admitted
    parked_wait_s: float = 0.0  # time they waited, in all
    incomplete: int = 0  # requests reported final before all their layers were read
    shed: int = 0  # messages dropped unread: their peer sent past its receive budget
    shed_bytes: int = 0
    first_ready_at: float | None = None
    last_read_end_at: float | None = None
    read_latencies_ms: list[float] = field(default_factory=list)


def report_decode(outs: Iterable[d.Output], stats: DecodeStats, log: Logger) -> bool:
    """Count and log the Decode session's events; True when a request reached a
    terminal state on this rank (the worker has news to step on)."""
    progress = False
    for out in outs:
        if isinstance(out, d.LayerDone):
            stats.layers_done += 1
            if out.completed:
                progress = True
                log.debug("requests complete on this rank", layer=out.layer_idx,
                          **few(out.completed))
        elif isinstance(out, d.LayerFailed):
            stats.layers_failed += 1
            progress = True
            if out.unexpected:
                log.error("read planning failed unexpectedly", layer=out.layer_idx,
                          error=out.reason)
            log.warning("layer read failed", layer=out.layer_idx, error=out.reason)
        elif isinstance(out, d.Incomplete):
            progress = True
            stats.incomplete += len(out.requests)
            first = out.requests[0][1] if out.requests else ()
            log.warning("final layer reported before every layer was read; failing the "
                        "requests", layer=out.layer_idx,
                        not_read=[clip(str(n), 128) for n in first[:4]],
                        not_read_count=len(first), **few([e for e, _ in out.requests]))
        elif isinstance(out, d.Skipped):
            stats.skipped += len(out.requests)
            log.info("announced requests not read: no longer known here (aborted)",
                     layer=out.layer_idx, **few(out.requests))
        elif isinstance(out, d.Parked):
            stats.parked += 1
            log.debug("announcement kept until its requests are admitted",
                      layer=out.layer_idx, **few(out.awaiting))
        elif isinstance(out, d.Unparked):
            stats.parked_wait_s += out.waited_s
            if out.expired:
                stats.parked_expired += 1
                log.info("announcement waited its limit for requests never admitted here; "
                         "they are answered skipped", layer=out.layer_idx,
                         waited_ms=round(out.waited_s * 1000, 1))
        elif isinstance(out, d.PeerLost):
            if out.failed:
                progress = True
                stats.peer_lost_failed += len(out.failed)
                log.warning("prefill peer lost; failing its requests",
                            session=clip(str(out.p_session), 128), **few(out.failed))
            else:
                log.info("prefill peer disconnected", session=clip(str(out.p_session), 128))
        elif isinstance(out, d.Expired):
            progress = True
            stats.expired += len(out.requests)
            log.warning("requests timed out waiting for KV", **few(out.requests))
        elif isinstance(out, d.MetaStored):
            log.info("peer metadata stored", session=clip(str(out.p_session), 128),
                     layers=out.layers)
        elif isinstance(out, d.Rejected):
            _rejected(out, stats, log)
        elif isinstance(out, d.Capped):
            stats.capped += 1
            log.warning("peer state limit reached; refusing more until some expires",
                        what=out.what, owner=out.owner, limit=out.limit)
    return progress


def _rejected(out: d.Rejected, stats: DecodeStats, log: Logger) -> None:
    if out.kind == d.RejectKind.UNKNOWN:
        log.warning("ignoring unknown message type", tag=out.detail)
    elif out.kind == d.RejectKind.UNAUTHENTICATED:
        stats.auth_refused += 1
        stats.refused_unauthenticated += out.layer_idx is None  # an MF_META
        log.error("refusing unauthenticated control message", layer=out.layer_idx,
                  error=out.detail)
    elif out.kind == d.RejectKind.CAPPED:
        stats.refused_capped += 1
        log.info("refusing control message", reason=out.detail)
    elif out.kind == d.RejectKind.INCOMPATIBLE:
        stats.refused_incompatible += 1
        log.error("refusing MF_META from an incompatible prefill build", error=out.detail)
    elif out.kind == d.RejectKind.MALFORMED:
        stats.malformed += 1
        what = "dropping malformed message" if out.layer_idx is None else "malformed ready message"
        log.warning(what, layer=out.layer_idx, error=out.detail)
    else:
        log.warning("ignoring unexpected message", kind=out.detail)

"""``rd2h demo``'s configuration and the facts every demo process shares: names,
chunk bounds, the layout of the shared main pool, and byte verification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rd2h.app.settings import MIN_SECRET_CHARS, Deadlines, Rd2hSettings
from rd2h.demo.faults import Fault, check_faults
from rd2h.demo.synthetic import Allocation, Shapes, block_pattern
from rd2h.domain.planning.chunks import chunk_block_range
from rd2h.domain.planning.topology import check_topology
from rd2h.domain.wire.compat import Compat, compat_of

ENGINE_SUFFIX = "-e0000001"  # vLLM appends 9 characters to request ids
SENTINEL = 0xEE  # destination bytes before any pull
STEP_INTERVAL_S = 0.25  # longest pause between Decode worker steps without news

# DemoConfig field -> Deadlines field it overrides (None keeps the library default)
DEADLINE_FLAGS = {
    "request_timeout_s": ("request_s", "--request-timeout"),
    "layer_ack_timeout_s": ("layer_ack_s", "--layer-ack-timeout"),
    "meta_ack_timeout_s": ("meta_ack_s", "--meta-ack-timeout"),
    "exchange_timeout_s": ("tp_exchange_s", "--exchange-timeout"),
}


# Rd2hSettings field -> the demo flag that sets it (for errors that name the flag)
SETTINGS_FLAGS = {
    "kv_port": "--kv-port", "cma_threads": "--cma-threads", "transport": "--transport",
    "mooncake_protocol": "--mooncake-protocol", "log_level": "--log-level",
    "auth_secret": "--auth-secret", "host": "--host", "prefill_host": "--prefill-host",
    "limits": "--layers-per-frame", "deadlines": "a deadline flag",
}


@dataclass(frozen=True)
class DemoConfig:
    prefill_tp: int = 4
    decode_tp: int = 2
    layers: int = 8
    requests: int = 8
    prompt_tokens: int = 8000
    block_size: int = 128
    chunks: int = 2
    shared_buffers: int = 0
    via_provider: bool = False  # Prefill drives rd2h's connector worker (rd2h.demo.provider)
    indexer: bool = True
    scale: bool = True
    transport: str = "cma"
    cma_threads: int = 1
    mooncake_protocol: str = "tcp"
    host: str = "127.0.0.1"  # Decode's address
    prefill_host: str = "127.0.0.1"
    netns: bool = False  # Prefill and Decode in two network namespaces (veth pair)
    prefill_netns: str = ""  # set by run_demo when namespaces are in use
    decode_netns: str = ""
    kv_port: int = 0
    seed: int = 0
    timeout_s: float = 300.0
    replay: bool = True
    log_level: str = "WARNING"
    # Shared secret: every control message is HMAC-signed and checked (None: off).
    auth_secret: str | None = None
    faults: tuple[Fault, ...] = ()
    # Prefill states a digest of every announced block; Decode checks them (verify_kv).
    verify_kv: bool = False
    request_timeout_s: float | None = None
    layer_ack_timeout_s: float | None = None
    meta_ack_timeout_s: float | None = None
    exchange_timeout_s: float | None = None
    # Pipeline / bare-transport A/B rounds in the same processes (rd2h.demo.run).
    rounds: int = 1
    # Each Prefill rank spends this long per layer (host idle, like a device computing)
    # before the layer is ready and announced.
    layer_compute_ms: float = 0.0
    # Layer runs: at most this many layers in one READ_READY_BATCH (1: one per frame).
    max_layers_per_frame: int = 64

    def validate(self) -> None:
        check_topology(self.prefill_tp, self.decode_tp)
        if self.decode_tp > self.prefill_tp:  # the demo's shared pool splits main by TP
            raise ValueError(f"the demo needs --prefill-tp ({self.prefill_tp}) to be a "
                             f"multiple of --decode-tp ({self.decode_tp})")
        if self.auth_secret is not None and len(self.auth_secret) < MIN_SECRET_CHARS:
            raise ValueError(f"--auth-secret must have at least {MIN_SECRET_CHARS} characters")
        for name in ("layers", "requests", "prompt_tokens", "block_size", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.block_size % 2:
            raise ValueError("--block-size must be even (the LIC8 scale block is 4 B/token)")
        if self.shared_buffers < 0 or self.shared_buffers > self.layers:
            raise ValueError("--shared-buffers must be between 0 (off) and --layers")
        if self.scale and not self.indexer:
            raise ValueError("the LIC8 scale needs the indexer (add --no-scale)")
        if self.transport not in ("cma", "mooncake"):
            raise ValueError(
                f"--transport {self.transport!r}: the multi-process demo runs on 'cma' or "
                "'mooncake' ('inproc' only connects peers inside one process)"
            )
        if self.chunks > -(-self.prompt_tokens // self.block_size):
            raise ValueError("--chunks must not exceed the number of blocks of a prompt")
        if self.timeout_s <= 0:
            raise ValueError("--timeout must be > 0")
        if not 1 <= self.rounds <= 100:
            raise ValueError("--rounds must be between 1 and 100")
        if self.verify_kv and self.via_provider:
            raise ValueError("--verify-kv states digests on the direct path; with "
                             "--via-provider set verify_kv in the connector's settings")
        if self.rounds > 1 and (self.faults or self.via_provider):
            raise ValueError("--rounds > 1 times the healthy direct path: it does not combine "
                             "with --fault or --via-provider")
        if not 1 <= self.max_layers_per_frame <= 256:
            raise ValueError("--layers-per-frame must be between 1 and 256")
        if not 0 <= self.layer_compute_ms <= 10_000:
            raise ValueError("--layer-compute-ms must be between 0 and 10000")
        for name, (_, flag) in DEADLINE_FLAGS.items():
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value:g}")
        self._check_rank_settings()

    def _check_rank_settings(self) -> None:
        """Each rank's settings as the rank processes will build them, checked here, so
        that a value rd2h's settings refuse (a port past 65535, no CMA thread) is a
        configuration error naming its flag, not a failed rank process."""
        from pydantic import ValidationError

        try:
            rank_settings(self, "prefill", self.prefill_tp - 1, tp_size=self.prefill_tp,
                          host=self.prefill_host)
            rank_settings(self, "decode", self.decode_tp - 1, host=self.host,
                          kv_port=self.kv_port or 30000, tp_size=self.decode_tp)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                key = str(err["loc"][0]) if err["loc"] else ""
                flag = SETTINGS_FLAGS.get(key, key)
                if not key:
                    problems.append(err["msg"].removeprefix("Value error, "))
                elif "secret" in key:  # never echo a secret
                    problems.append(f"{flag}: {err['msg'].lower()}")
                else:
                    value = getattr(self, key, err["input"])
                    problems.append(f"{flag} {value}: {err['msg'].lower()}")
            raise ValueError("; ".join(problems)) from None
        check_faults(self.faults, layers=self.layers, prefill_tp=self.prefill_tp,
                     decode_tp=self.decode_tp)

    def deadlines(self) -> Deadlines:
        """The library defaults with this run's overrides."""
        values = Deadlines().model_dump()
        for name, (field, _) in DEADLINE_FLAGS.items():
            if getattr(self, name) is not None:
                values[field] = getattr(self, name)
        return Deadlines(**values)

    @property
    def shapes(self) -> Shapes:
        return Shapes(block_size=self.block_size, indexer=self.indexer, scale=self.scale)


def demo_compat(cfg: DemoConfig) -> Compat:
    """What every demo rank states in MF_META's compatibility map: the synthetic
    DeepSeek-V3.2-like MLA cache (main K 512 + V 64 bf16 values per token: a 576-wide
    latent, one KV head), this run's block size and layers, the TP-shared main pool."""
    shapes = cfg.shapes
    return compat_of(block_size=cfg.block_size, kv_dtype="bfloat16", num_layers=cfg.layers,
                     head_size=(shapes.main_k_per_token + shapes.main_v_per_token) // 2,
                     kv_heads=1, mla=True, main_sharing="shared_pool")


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def internal_id(request: int, round_: int = 0) -> str:
    """Request ``request``'s vLLM-style id in round ``round_`` (same blocks, new id)."""
    tag = f"-r{round_}" if round_ else ""
    return f"req-{request:05d}{tag}{ENGINE_SUFFIX}"


def round_order(round_: int) -> tuple[str, str]:
    """The A/B order of one round: round 0 pulls first (its reads are what the bare
    transport replays), then the order alternates so neither side always goes first."""
    return ("pipeline", "bare") if round_ % 2 == 0 else ("bare", "pipeline")


def chunk_bounds(cfg: DemoConfig) -> list[int]:
    """Computed-token counts after each chunk (the last is the whole prompt)."""
    step = -(-cfg.prompt_tokens // cfg.chunks)
    return [min(cfg.prompt_tokens, step * (i + 1)) for i in range(cfg.chunks)]


def chunk_ranges(cfg: DemoConfig, alloc: Allocation) -> list[tuple[int, int, bool]]:
    """Per chunk: the block range ``[start, end)`` it makes ready, and whether it is the
    final chunk."""
    ranges = []
    transferred = 0
    bounds = chunk_bounds(cfg)
    for i, computed in enumerate(bounds):
        final = i == len(bounds) - 1
        s, e = chunk_block_range(
            block_size=cfg.block_size, computed_tokens=computed, transferred_tokens=transferred,
            remote_cached_tokens=0, final=final, allocated_blocks=alloc.blocks_per_request,
        )
        ranges.append((s, e, final))
        transferred = e * cfg.block_size
    return ranges


def main_pool_offsets(cfg: DemoConfig, alloc: Allocation, layer: int) -> tuple[int, int]:
    """Byte offsets of layer ``layer``'s K and V regions inside the shared main pool."""
    shapes = cfg.shapes
    k, v = shapes.bytes_per_block("main_k"), shapes.bytes_per_block("main_v")
    per_layer = alloc.d_pool_blocks * (k + v)
    return layer * per_layer, layer * per_layer + alloc.d_pool_blocks * k


def main_pool_bytes(cfg: DemoConfig, alloc: Allocation) -> int:
    shapes = cfg.shapes
    per = shapes.bytes_per_block("main_k") + shapes.bytes_per_block("main_v")
    return cfg.layers * alloc.d_pool_blocks * per


def main_pool_mismatches(
    cfg: DemoConfig, alloc: Allocation, pool: np.ndarray, requests: list[int] | None = None
) -> dict[int, int]:
    """Per request: main K/V blocks in the shared pool that differ from what Prefill
    computed (all requests, or ``requests``)."""
    shapes = cfg.shapes
    which = range(cfg.requests) if requests is None else requests
    bad = dict.fromkeys(which, 0)
    blocks = np.arange(alloc.blocks_per_request)
    for layer in range(cfg.layers):
        k_off, v_off = main_pool_offsets(cfg, alloc, layer)
        for c, off in (("main_k", k_off), ("main_v", v_off)):
            bpb = shapes.bytes_per_block(c)
            view = pool[off : off + alloc.d_pool_blocks * bpb].reshape(alloc.d_pool_blocks, bpb)
            for r in bad:
                got = view[np.asarray(alloc.d_main_blocks[r], dtype=np.int64)]
                want = block_pattern(r, layer, c, blocks, bpb)
                bad[r] += int((got != want).any(axis=1).sum())
    return bad


def verify_main_pool(cfg: DemoConfig, alloc: Allocation, pool: np.ndarray) -> int:
    """Count main K/V blocks in the shared pool that differ from what Prefill computed."""
    return sum(main_pool_mismatches(cfg, alloc, pool).values())


def rank_settings(cfg: DemoConfig, role: str, rank: int, **place: Any) -> Rd2hSettings:
    """One demo rank's settings: the run's transport, deadlines and secret."""
    return Rd2hSettings(
        role=role, tp_rank=rank, transport=cfg.transport, mooncake_protocol=cfg.mooncake_protocol,
        cma_threads=cfg.cma_threads, log_level=cfg.log_level, deadlines=cfg.deadlines(),
        auth_secret=cfg.auth_secret,
        limits={"max_layers_per_frame": cfg.max_layers_per_frame}, **place,
    )

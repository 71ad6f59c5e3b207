"""What a connector scheduler hands its workers each step (plain, picklable)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeLoad:
    """Decode: a request whose KV will be pulled into these destination blocks."""

    internal_id: str
    main_block_ids: tuple[int, ...]
    indexer_block_ids: tuple[int, ...]
    # Every KV cache group's block ids (``NO_BLOCK`` where the group holds nothing, e.g.
    # outside a sliding window); a layer's reads land in its own group's blocks.
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class DecodeEndpoint:
    """Where a Prefill rank finds a request's Decode instance (spec 3.1, 9)."""

    host: str
    base_port: int
    tp_size: int
    engine_id: str = ""


@dataclass(frozen=True)
class PrefillSend:
    """Prefill: this step completed blocks ``[start, start + len)`` of a request."""

    internal_id: str
    ext_id: str
    decode: DecodeEndpoint
    main_block_ids: tuple[int, ...]
    indexer_block_ids: tuple[int, ...]
    main_start: int
    indexer_start: int
    final: bool
    # Per KV cache group: (start, block ids) of the same token range in that group's
    # block table, positions a sliding window dropped left out (the start moves past
    # them); a layer announces its own group's part.
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # Dispatched before Decode admitted it: its announcements name it in ``awaits``.
    awaits: bool = False


@dataclass(frozen=True)
class StepPlan:
    """One step's connector metadata (scheduler -> every worker of the engine)."""

    loads: tuple[DecodeLoad, ...] = ()
    sends: tuple[PrefillSend, ...] = ()
    # Prefill requests vLLM preempted in this step after some of their blocks were
    # announced: vLLM freed those blocks and this step's forward may overwrite them.
    preempted: tuple[str, ...] = ()
    # Decode: the step computes nothing and admits nothing (every request waits for its
    # KV), so a worker may wait a little for a completion rather than return at once.
    idle: bool = False
    # Decode: (request, reason) whose KV will not come (the proxy could not dispatch it
    # to Prefill): every worker fails it now, so vLLM applies kv_load_failure_policy.
    failed_loads: tuple[tuple[str, str], ...] = ()

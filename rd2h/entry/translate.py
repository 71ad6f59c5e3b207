"""vLLM's objects as the plain values rd2h's connector roles take: the one module
that reads vLLM's request, scheduler-output, cache-config and parallel-config types
(duck-typed, so it imports nothing from vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rd2h.app.connector.facts import EngineFacts
from rd2h.app.connector.roles import BlockIds, RequestFacts, ScheduledRequest
from rd2h.app.settings import ConnectorConfigError, Rd2hOptions
from rd2h.domain.planning.kv_groups import (
    FULL,
    NO_BLOCK,
    SLIDING,
    STATE,
    KvGroup,
    UnsupportedKvGroup,
    check_groups,
    groups_summary,
)
from rd2h.domain.wire.compat import Compat, compat_of

# vLLM's KV cache spec types by the kind rd2h gives them (exact type names: a subclass
# vLLM adds later, e.g. a full-attention variant with sink tokens or a gap in its
# window, is unknown here until it is proven, and refused). ``MLAAttentionSpec`` is
# judged by its fields, not its name (``_single_kind``).
SPEC_KINDS = {
    "FullAttentionSpec": FULL,
    "SlidingWindowSpec": SLIDING,
    # Mamba1/Mamba2, gated delta net, short convolutions: one running state per request
    # (its conv and SSM tensors in one page), moved by the N-1 scheme (kv_groups).
    "MambaSpec": STATE,
}
# KV cache dtypes whose blocks are the whole KV: plain types, and fp8 with one scale per
# layer (a weight of the checkpoint, the same on both sides). Any other (per-token
# scales, packed 4-bit formats with their own scale layout) is refused at start.
# ``fp8_ds_mla`` (DeepSeek-V3.2/V4's own latent format) packs each token's scales and
# its rotary part into the token's bytes (V4: 448 fp8 + 64 bf16 + 8 scale bytes in 584),
# so a block is the whole KV: moved as the bytes it is.
MOVABLE_CACHE_DTYPES = frozenset({"auto", "float16", "bfloat16", "float32", "fp8",
                                  "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"})
# vLLM's null block: the first block of its block pool, never allocated to a request,
# handed out for positions a sliding window no longer holds.
VLLM_NULL_BLOCK = 0


def side_of(kv_role: str | None) -> str:
    if kv_role == "kv_producer":
        return "prefill"
    if kv_role == "kv_consumer":
        return "decode"
    raise ConnectorConfigError(
        f"SfaRemoteD2HConnector needs kv_role 'kv_producer' (Prefill) or 'kv_consumer' "
        f"(Decode), got {kv_role!r}"
    )


def engine(vllm_config: Any, kv_cache_config: Any) -> tuple[Rd2hOptions, EngineFacts]:
    """The validated options and the engine's facts; unsupported set-ups are refused."""
    ktc = vllm_config.kv_transfer_config
    options = Rd2hOptions.parse(ktc.kv_connector_extra_config)
    side = side_of(ktc.kv_role)
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ConnectorConfigError("rd2h supports pipeline_parallel_size 1 only")
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, attr, 1) not in (1, None):
            raise ConnectorConfigError(f"rd2h does not support {attr} > 1")
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    # The layout first: a model that sets its own cache dtype is refused for its layout.
    moved = check_groups(kv_groups(groups)) if groups else ()
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    if str(cache_dtype) not in MOVABLE_CACHE_DTYPES:
        raise UnsupportedKvGroup(
            f"rd2h does not transfer a KV cache of dtype {cache_dtype!r} (the engine's cache "
            f"dtype: --kv-cache-dtype, or the model's own choice): its scales or packing "
            f"are not proven to live inside the blocks rd2h moves; supported: "
            f"{', '.join(sorted(MOVABLE_CACHE_DTYPES))}")
    attention = [g for g in moved if not g.is_state]
    state = tuple(g.index for g in moved if g.is_state)
    hookless = tuple(g.index for g in moved if not g.hooked)
    block_size = (attention[0].block_size if attention
                  else vllm_config.cache_config.block_size)
    geometry, why = _state_geometry(vllm_config, groups, state, hookless)
    facts = EngineFacts(
        side=side,  # type: ignore[arg-type]
        kv_port=int(ktc.kv_port),
        global_dp_rank=int(pc.data_parallel_rank or 0),
        tp_size=int(pc.tensor_parallel_size),
        tp_rank=0,
        engine_id=str(ktc.engine_id or ""),
        block_size=int(block_size),
        group_layer_names=tuple(tuple(g.layer_names) for g in groups),
        num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else 0,
        compat=compat(vllm_config, _first_spec(groups[attention[0].index]) if attention
                      else None, options, side, int(block_size)).with_values(
            kv_groups=_compat_text(groups_summary(moved)) if moved else None,
            spec_decode=spec_decode(vllm_config),
            # State is split over TP ranks by its own layout (conv channels, SSM heads):
            # with its geometry stated, a Decode rank of another TP size reads its parts
            # (both sides must state the same geometry); without one (a layout rd2h cannot
            # describe), and for DeepSeek-V4's caches, proven between equal TP sizes only,
            # the TP size itself is stated, so unequal TP is refused at the handshake.
            state_layout=geometry.text() if geometry is not None else None,
            state_tp=int(pc.tensor_parallel_size)
            if (state and geometry is None) or hookless else None),
        moved_groups=tuple(g.index for g in moved),
        state_groups=state,
        group_block_sizes=tuple(int(g.kv_cache_spec.block_size) for g in groups),
        hookless_groups=hookless,
        groups_text="; ".join(g.describe() for g in moved) + (
            f"; state across TP sizes: {why}" if why else ""),
        state_geometry=geometry,
        state_note=why,
        total_kv_heads=split_kv_heads(vllm_config),
    )
    return options, facts


def _state_geometry(vllm_config: Any, groups: Any, state: tuple[int, ...],
                    hookless: tuple[int, ...]) -> tuple[Any, str]:
    """The state groups' geometry (``rd2h.adapters.vllm.state_geometry``) and "", or None
    and why not ("" without state)."""
    if not state:
        return None, ""
    if hookless:
        return None, "not with caches vLLM gives no per-layer hook (equal TP only)"
    from rd2h.adapters.vllm.state_geometry import state_geometry

    geometry, why = state_geometry(vllm_config, [groups[i].kv_cache_spec for i in state])
    return geometry, (f"equal TP only: {why}" if geometry is None else "")


# Model layouts whose caches rd2h moves (``model_version`` of vLLM's spec): every group
# by vLLM's own manager's rule (full or sliding window), announced after the forward.
MOVED_MODEL_LAYOUTS = frozenset({"deepseek_v4"})
# vLLM's ``model_version`` of a cache spec -> the layout it stands for, in refusals.
MODEL_LAYOUTS = {
    "deepseek_v4": "DeepSeek-V4's compressed sparse attention: per-layer window caches, "
                   "compressed latent caches and compressor states",
}


@dataclass(frozen=True)
class _SpecKind:
    kind: str | None  # rd2h's kind (None: not movable)
    spec_type: str  # vLLM's type, as named in refusals
    layout: str | None = None  # what the layout is, when the type alone does not say
    model: str | None = None  # the model family's own layout, when the spec names one
    hooked: bool = True  # vLLM calls the per-layer save hook for its layers


def _tokens_per_state(spec: Any) -> Any:
    return getattr(spec, "tokens_per_state", 1)


def _single_kind(spec: Any, layers: tuple[str, ...], engine_model: str | None = None
                 ) -> _SpecKind:
    """rd2h's kind of one vLLM KV cache spec. ``MLAAttentionSpec`` is full attention in
    its plain latent layout (one state per token and no model-specific layout: the
    latent of DeepSeek-V2/V3, or V3.2's indexer with ``cache_role`` indexer). vLLM files
    DeepSeek-V4's compressed caches under the same type: those are full attention too as
    vLLM manages them (a block holds ``block_size`` tokens of the prompt as
    ``block_size / tokens_per_state`` states), and V4's window caches and compressor
    states are sliding windows; all of V4's caches are written by its own kernels, with
    no per-layer hook (``hooked`` False). Not every V4 cache names the model (its indexer
    cache and compressor states do not): ``engine_model`` is the model version any of
    the engine's specs names. Any other variant is refused, naming it."""
    name = type(spec).__name__
    version = getattr(spec, "model_version", None) or engine_model
    model = MODEL_LAYOUTS.get(str(version), f"model layout {version!r}") if version else None
    if name in ("MLAAttentionSpec", "SlidingWindowMLASpec"):
        per_state = _tokens_per_state(spec)
        plain = per_state == 1 and version is None
        if name == "MLAAttentionSpec" and plain:
            return _SpecKind(FULL, name)
        if version in MOVED_MODEL_LAYOUTS and isinstance(per_state, int) and per_state >= 1:
            kind = FULL if name == "MLAAttentionSpec" else SLIDING
            return _SpecKind(kind, name, None, model, hooked=False)
        role = getattr(getattr(spec, "cache_role", None), "value", None)
        dtype = getattr(spec, "cache_dtype_str", None) or str(
            getattr(spec, "dtype", "")).removeprefix("torch.")
        if name == "SlidingWindowMLASpec":
            what = ("a compressor state" if any("compressor" in n for n in layers)
                    else "a sliding-window latent cache")
            layout = (f"{what} ({spec.sliding_window}-token window, blocks of "
                      f"{spec.block_size}, {dtype})")
        else:
            what = ("a compressed indexer cache" if role == "indexer"
                    or any("indexer" in n.lower() for n in layers)
                    else "a compressed latent cache")
            layout = f"{what} (one state per {per_state} tokens, {dtype})"
        return _SpecKind(None, name, layout, model)
    return _SpecKind(SPEC_KINDS.get(name), name, None, model)


def _inner_specs(spec: Any) -> list[Any]:
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) and inner else [spec]


def engine_model(groups: Any) -> str | None:
    """The model-specific cache layout any of the engine's specs names (vLLM's
    ``model_version``, e.g. "deepseek_v4"), or None."""
    for g in groups:
        for spec in _inner_specs(g.kv_cache_spec):
            version = getattr(spec, "model_version", None)
            if version:
                return str(version)
    return None


def _spec_kind(spec: Any, layers: tuple[str, ...] = (), model: str | None = None
               ) -> _SpecKind:
    """rd2h's kind of a group's vLLM KV cache spec (``UniformTypeKVCacheSpecs``: one
    block table for several specs, a kind only if all share it)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        parts = [_single_kind(s, (n,), model) for n, s in inner.items()]
        kinds = {p.kind for p in parts}
        kind = kinds.pop() if len(kinds) == 1 else None
        names = sorted({p.spec_type for p in parts})
        layouts = sorted({p.layout for p in parts if p.layout})
        model = next((p.model for p in parts if p.model), None)
        return _SpecKind(kind, f"{type(spec).__name__}({', '.join(names)})",
                         "; ".join(layouts) or None, model, all(p.hooked for p in parts))
    return _single_kind(spec, layers, model)


def _first_spec(group: Any) -> Any:
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)
    return next(iter(inner.values())) if isinstance(inner, dict) and inner else spec


def kv_groups(groups: Any) -> tuple[KvGroup, ...]:
    """vLLM's ``KVCacheGroupSpec`` list as rd2h's ``KvGroup`` values."""
    out = []
    model = engine_model(groups)
    for i, g in enumerate(groups):
        found = _spec_kind(g.kv_cache_spec, tuple(g.layer_names), model)
        kind = found.kind
        window = getattr(_first_spec(g), "sliding_window", None) if kind == SLIDING else None
        out.append(KvGroup(
            index=i, kind=kind, spec_type=found.spec_type, layout=found.layout,
            model=found.model, hooked=found.hooked,
            block_size=int(g.kv_cache_spec.block_size), layers=tuple(g.layer_names),
            sliding_window=None if window is None else int(window),
            transferable=bool(getattr(g, "enable_kv_transfer", True)),
            speculative_blocks=int(getattr(_first_spec(g), "num_speculative_blocks", 0) or 0)
            if kind == STATE else 0,
        ))
    return tuple(out)


def _compat_text(text: str) -> str:
    """A compatibility value within the map's length limit (a digest past it)."""
    if len(text) <= 128:
        return text
    import hashlib

    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def spec_decode(vllm_config: Any) -> str:
    """The speculative-decoding set-up both sides must share (its draft layers own KV):
    method, draft model and tokens per step; "none" without one."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return "none"
    draft = getattr(getattr(spec, "draft_model_config", None), "model", None) or getattr(
        spec, "model", None)
    text = (f"{getattr(spec, 'method', None)}:{draft}:"
            f"{getattr(spec, 'num_speculative_tokens', None)}")
    return _compat_text(text)


def split_kv_heads(vllm_config: Any) -> int | None:
    """The model's total KV heads when TP splits them over its ranks (GQA, MHA); None
    for MLA (one latent, the same on every rank) or without a model config."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or bool(getattr(model, "use_mla", False)):
        return None
    return int(model.get_total_num_kv_heads())


def compat(vllm_config: Any, spec: Any, options: Rd2hOptions, side: str,
           block_size: int) -> Compat:
    """What this engine states in MF_META's compatibility map: facts that do not depend
    on TP (the KV cache spec's head size, MLA and dtype; the model's layers and total KV
    heads when there is a model config). Main-KV sharing: Decode's mode, and Prefill's
    only when configured explicitly (Prefill itself does not depend on it)."""
    model = getattr(vllm_config, "model_config", None)
    head_size = getattr(spec, "head_size", None)
    mla = type(spec).__name__.startswith("MLA") if spec is not None else None
    if model is not None:
        head_size = head_size if head_size is not None else int(model.get_head_size())
        mla = bool(model.use_mla) if mla is None else mla
    sharing = options.main_sharing if side == "prefill" else (
        "shared_pool" if options.main_shared else "rank_local")
    return compat_of(
        block_size=block_size, kv_dtype=kv_dtype(vllm_config, spec), mla=mla,
        head_size=None if head_size is None else int(head_size), main_sharing=sharing,
        num_layers=None if model is None else int(model.get_total_num_hidden_layers()),
        kv_heads=None if model is None else int(model.get_total_num_kv_heads()),
    )


def kv_dtype(vllm_config: Any, spec: Any) -> str | None:
    """The KV cache's element type: vLLM's ``cache_dtype`` when set ("fp8" is
    "fp8_e4m3"), else the cache spec's torch dtype (e.g. "bfloat16")."""
    configured = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if configured not in (None, "auto"):
        return "fp8_e4m3" if configured == "fp8" else str(configured)
    dtype = getattr(spec, "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def drop_prompt_tail(req: Any, count: int) -> None:
    """Make vLLM compute ``count`` fewer prompt tokens of ``req`` (Prefill, the N-1
    scheme: the last tokens are Decode's to compute) and stop after one output token."""
    if req.prompt_token_ids is not None:
        del req.prompt_token_ids[-count:]
    elif getattr(req, "prompt_embeds", None) is not None:
        req.prompt_embeds = req.prompt_embeds[:-count]
    else:
        raise ValueError(f"request {req.request_id!r} has neither prompt token ids nor "
                         "prompt embeddings to shorten")
    del req._all_token_ids[-count:]
    req.num_prompt_tokens -= count
    req.max_tokens = 1


def on_worker(facts: EngineFacts, tp_group: Any, world_group: Any) -> EngineFacts:
    """This worker's TP rank and size (vLLM's TP group) and its accelerator (local rank)."""
    return facts.on_rank(int(tp_group.rank_in_group), int(tp_group.world_size),
                         int(world_group.local_rank))


def request(req: Any) -> RequestFacts:
    return RequestFacts(
        request_id=req.request_id,
        prompt_len=len(req.prompt_token_ids or ()),
        num_prompt_tokens=int(req.num_prompt_tokens),
        num_computed_tokens=int(req.num_computed_tokens),
        params=req.kv_transfer_params,
    )


def _ids(group: Any) -> tuple[int, ...]:
    """One group's block ids, vLLM's null block as ``NO_BLOCK``."""
    return tuple(NO_BLOCK if (b := int(x)) == VLLM_NULL_BLOCK else b for x in group)


def block_ids(blocks: Any) -> BlockIds:
    """``KVCacheBlocks`` -> one tuple of block ids per cache group (null: ``NO_BLOCK``)."""
    return tuple(map(_ids, blocks.get_block_ids()))


def _new_ids(ids: Any) -> BlockIds | None:
    return None if ids is None else tuple(map(_ids, ids))


def scheduled(output: Any) -> tuple[ScheduledRequest, ...]:
    """The requests of a ``SchedulerOutput``: new ones get their whole block table,
    running ones the blocks added this step; resumed ones replace theirs."""
    counts = output.num_scheduled_tokens
    out = [
        ScheduledRequest(new.req_id, _new_ids(new.block_ids), new.num_computed_tokens,
                         counts.get(new.req_id, 0), replace_blocks=True)
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    out += [
        ScheduledRequest(rid, _new_ids(cached.new_block_ids[i]), cached.num_computed_tokens[i],
                         counts.get(rid, 0), replace_blocks=rid in resumed)
        for i, rid in enumerate(cached.req_ids)
    ]
    return tuple(out)

"""Each layer's own page, exactly, in every layout vLLM allocates (issue #58): caches from
vLLM's own allocation, blocks from vLLM's own ``KVCacheManager``, real bytes through the
real ``SfaRemoteD2HConnector`` pair over the ``inproc`` transport.

The caches are what a vLLM 0.32 worker registers: the layers' specs from vLLM's own cache
layers (with the widths a real engine has: DeepSeek-V4's indexer cache 132 bytes a token
with its scales, its compressor states 512 / 2048 / 1024 floats wide), grouped by
``get_kv_cache_groups``, sized by ``get_kv_cache_config_from_groups`` and laid out by
``allocate_kv_cache`` in the layout under test: layer-compact (``LBNHC``: each layer its
own region) or block-outermost (``BLHNC``: one block holds every layer of a group side by
side, a layer's page at its own offset in it; DeepSeek-V4's only layout, 47,808-byte
blocks with pages at 0, 8,640 and 46,080). Models: DeepSeek-V4, DeepSeek-V3.2 (latent and
indexer), a plain GQA model, and a hybrid (Mamba2 state pages, which vLLM pads to the
attention page: only the state moves, never the padding). Prefill's memory is random
bytes, Decode's zeros.

Prefill computes a prompt (in one step or in chunks) with the hooks vLLM calls: the
per-layer save hook for attention layers only (never for DeepSeek-V3.2's indexer cache,
DeepSeek-V4's caches, which its kernels write, nor a Mamba mixer's state), then
``wait_for_save``.

What is proven, for each model and layout: Decode's whole cache memory afterwards is
exactly its memory before with, for every block Decode holds, each layer's page (vLLM's
own page size for that layer's spec, at the layer's own offset) replaced by Prefill's
page at the same position of the same group; no other byte of Decode's memory changed.
The bytes Decode counts as pulled are exactly those pages.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm")
import test_vllm_connector as base
import torch
from test_mla_variants import _cache_config, dsv4_specs
from test_vllm_connector import (  # noqa: F401 (fixtures)
    SUFFIX_D,
    SUFFIX_P,
    URL,
    cached_reqs,
    memory_control,
    metaserver,
    request,
    scheduler_output,
    tp_group,
    vllm_config,
)
from vllm.config import set_current_vllm_config
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.utils import allocate_kv_cache

NB = 192  # blocks of the pool, each side (a 520-token V4 prompt takes 150 on Prefill)


@dataclass(frozen=True)
class Model:
    name: str
    specs: Any  # (vllm_config) -> {layer name: spec}
    cache_dtype: str
    block_size: int  # the engine's --block-size
    hooked: Any  # (layer name) -> whether vLLM calls the per-layer save hook for it
    backoff: int = 0  # prompt tokens Decode computes itself (the N-1 scheme: V4)


def _dsv32_specs(cfg) -> dict[str, Any]:
    """DeepSeek-V3.2, 3 layers: the 576-wide bf16 latent and the indexer cache (128 fp8
    values and a 4-byte scale a token: ``head_dim`` 132, as ``DeepseekV32IndexerCache``
    is built by the model)."""
    out: dict[str, Any] = {}
    for i in range(3):
        out[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        out[f"model.layers.{i}.self_attn.indexer.k_cache"] = DeepseekV32IndexerCache(
            head_dim=132, dtype=torch.uint8, prefix=f"model.layers.{i}.self_attn.indexer.k_cache",
            cache_config=cfg.cache_config).get_kv_cache_spec(cfg)
    return out


def _plain_specs(cfg) -> dict[str, Any]:
    """A plain GQA model, 3 layers of 2 KV heads of 32, fp16, 16 tokens a block."""
    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16) for i in range(3)}


def _hybrid_specs(cfg) -> dict[str, Any]:
    """A hybrid (Nemotron-H / Granite-4.0-H style), 4 layers: Mamba2 mixers at 0 and 2 (a
    conv and an SSM state per request, one page a block, padded by vLLM's rule to the
    attention page) and full attention at 1 and 3 (2 KV heads of 32, float32, 16 tokens
    a block)."""
    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    state = MambaSpec(block_size=1024, shapes=((3, 96), (4, 8, 32)),
                      dtypes=(torch.float32, torch.float32),
                      page_size_padded=attn.page_size_bytes)
    return {**{f"model.layers.{i}.mixer": state for i in (0, 2)},
            **{f"model.layers.{i}.self_attn.attn": attn for i in (1, 3)}}


MODELS = {
    "dsv4": Model("dsv4", dsv4_specs, "fp8_ds_mla", 256, lambda name: False, backoff=1),
    "dsv32": Model("dsv32", _dsv32_specs, "auto", 64, lambda name: "indexer" not in name),
    "plain": Model("plain", _plain_specs, "auto", 16, lambda name: True),
    # vLLM calls no per-layer hook for a Mamba mixer's state; the N-1 scheme.
    "hybrid": Model("hybrid", _hybrid_specs, "auto", 16, lambda name: "mixer" not in name,
                    backoff=1),
}


@dataclass
class Side:
    conn_sched: Any
    conn_work: Any
    caches: dict[str, torch.Tensor]
    raw: torch.Tensor  # the one backing allocation, as bytes


class Engine:
    """One model in one layout: vLLM's configs, both connector pairs and their caches."""

    def __init__(self, model: Model, layout: str, sockets: dict[str, Any]) -> None:
        self.model = model
        cfg = _cache_config(model.cache_dtype)  # the engine's, as vLLM's worker sizes it
        cfg.cache_config.kv_cache_layout = layout
        cfg.cache_config.block_size = model.block_size
        with set_current_vllm_config(cfg):
            self.specs = model.specs(cfg)
            groups = get_kv_cache_groups(cfg, self.specs)
            probe = get_kv_cache_config_from_groups(cfg, groups, 1 << 30)
            per_block = (1 << 30) // probe.num_blocks
            self.config: KVCacheConfig = get_kv_cache_config_from_groups(
                cfg, groups, per_block * NB)
        assert self.config.num_blocks == NB
        self.layout = KVCacheLayout[layout]
        self.group_of = {n: i for i, g in enumerate(self.config.kv_cache_groups)
                         for n in g.layer_names}
        self.sched_config = generate_scheduler_kv_cache_config([self.config])
        extra = {"transport": "inproc", "deadlines": {"layer_ack_s": 10.0, "meta_ack_s": 10.0}}
        self.sides: dict[str, Side] = {}
        for role, seed in (("kv_consumer", None), ("kv_producer", 7)):
            ecfg = vllm_config(role, extra)
            object.__setattr__(ecfg.cache_config, "cache_dtype", model.cache_dtype)
            sched = base.connector(ecfg, base.KVConnectorRole.SCHEDULER, self.sched_config,
                                   **sockets)
            work = base.connector(ecfg, base.KVConnectorRole.WORKER, self.config, **sockets)
            caches = allocate_kv_cache(self.config, torch.device("cpu"), self.layout)
            storage = next(iter(caches.values())).untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            if seed is not None:
                gen = torch.Generator().manual_seed(seed)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
            self.sides[role] = Side(sched, work, caches, raw)
        self.sides["kv_consumer"].conn_work.register_kv_caches(self.sides["kv_consumer"].caches)
        self.sides["kv_producer"].conn_work.register_kv_caches(self.sides["kv_producer"].caches)
        gc.collect()

    def manager(self) -> KVCacheManager:
        register_all_kvcache_specs(None)
        size = max(g.kv_cache_spec.block_size for g in self.sched_config.kv_cache_groups)
        return KVCacheManager(self.sched_config, max_model_len=1024, scheduler_block_size=size,
                              hash_block_size=size, enable_caching=False)

    def page(self, name: str) -> tuple[int, int, int]:
        """vLLM's own numbers for a layer: its offset in the backing allocation, the
        distance between its blocks, and its page (the spec's unpadded page size)."""
        view, raw = self.sides["kv_consumer"].caches[name], self.sides["kv_consumer"].raw
        return (view.data_ptr() - raw.data_ptr(), view.stride(0) * view.element_size(),
                self.specs[name].real_page_size_bytes)

    def shutdown(self) -> None:
        for side in self.sides.values():
            side.conn_work.shutdown()
            side.conn_sched.shutdown()


@pytest.fixture(params=[("dsv4", "BLHNC"), ("dsv32", "LBNHC"), ("dsv32", "BLHNC"),
                        ("plain", "LBNHC"), ("plain", "BLHNC"), ("hybrid", "LBNHC")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def engine(request, tp_group, memory_control, metaserver):  # noqa: F811
    eng = Engine(MODELS[request.param[0]], request.param[1], memory_control[1])
    yield eng
    eng.shutdown()


def _ids(blocks) -> tuple[list[int], ...]:
    return tuple(list(g) for g in blocks.get_block_ids())


def transfer(eng: Engine, rid: str, prompt: int, chunks: list[int]) -> tuple:
    """Decode admits the request (its blocks from its manager), Prefill computes it in
    ``chunks`` (its blocks from its own manager), with the hooks vLLM calls; returns both
    sides' final block tables and Prefill's sends."""
    d, p = eng.sides["kv_consumer"], eng.sides["kv_producer"]
    assert sum(chunks) == prompt
    d_mgr, p_mgr = eng.manager(), eng.manager()
    loaded = prompt - eng.model.backoff  # Decode computes the rest itself
    chunks = [*chunks[:-1], chunks[-1] - eng.model.backoff]
    dreq = request(rid + SUFFIX_D, prompt, {"do_remote_prefill": True, "metaserver": URL})
    assert d.conn_sched.get_num_new_matched_tokens(dreq, 0) == (loaded, True)
    assert d_mgr.allocate_slots(dreq, 0, num_external_computed_tokens=loaded,
                                delay_cache_blocks=True) is not None
    d.conn_sched.update_state_after_alloc(dreq, d_mgr.get_blocks(dreq.request_id), loaded)
    d.conn_work.bind_connector_metadata(d.conn_sched.build_connector_meta(scheduler_output()))
    d.conn_sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=d.conn_work.build_connector_worker_meta()))
    post = base.RecordingMetaserver.made[0].posts[-1][2]

    preq = request(rid + SUFFIX_P, prompt, post)
    p.conn_sched.on_new_request(preq)
    assert preq.num_prompt_tokens == loaded  # Prefill computes the first N-1 (V4) or N
    sends = []
    hooked = [n for g in eng.config.kv_cache_groups for n in g.layer_names
              if eng.model.hooked(n)]
    for step, count in enumerate(chunks):
        new = p_mgr.allocate_slots(preq, count)
        assert new is not None
        ids = _ids(new)
        if step == 0:
            p.conn_sched.update_state_after_alloc(preq, p_mgr.get_blocks(preq.request_id), 0)
            out = scheduler_output([NewRequestData.from_request(preq, ids)],
                                   counts={preq.request_id: count})
        else:
            out = scheduler_output(cached=cached_reqs(
                [(preq.request_id, ids, preq.num_computed_tokens)]),
                counts={preq.request_id: count})
        plan = p.conn_sched.build_connector_meta(out)
        sends.extend(plan.plan.sends)
        p.conn_work.bind_connector_metadata(plan)
        for name in sorted(hooked, key=lambda n: int(n.split(".")[2])):  # forward order
            p.conn_work.save_kv_layer(name, None, None)
        p.conn_work.wait_for_save()
        preq.num_computed_tokens += count
    for i in range(len(eng.specs)):
        p.conn_work.wait_for_layer_reuse(i)
    assert d.conn_work.get_transfer_results(set()).finished_recving == {dreq.request_id}
    return d_mgr.get_block_ids(dreq.request_id), p_mgr.get_block_ids(preq.request_id), sends


def expected_decode(eng: Engine, before: torch.Tensor, d_ids, p_ids) -> tuple[torch.Tensor, int]:
    """Decode's memory as it must be: ``before`` with each page of each block Decode holds
    replaced by Prefill's page at the same position of the same group (vLLM's null block 0
    excluded); and the bytes of those pages."""
    want = before.clone()
    p_raw = eng.sides["kv_producer"].raw
    moved = 0
    for name in eng.specs:
        g = eng.group_of[name]
        off, block, page = eng.page(name)
        pairs = [(d, p) for d, p in zip(d_ids[g], p_ids[g]) if d != 0]
        assert pairs, f"decode holds no block of {name}"
        assert all(p != 0 for _, p in pairs), f"{name}: prefill dropped a block decode holds"
        for d, p in pairs:
            want[off + d * block: off + d * block + page] = \
                p_raw[off + p * block: off + p * block + page]
            moved += page
    return want, moved


PROMPTS = [(300, [300]), (256, [256]), (77, [77]), (300, [128, 128, 44]), (520, [200, 320])]


@pytest.mark.parametrize(("prompt", "chunks"), PROMPTS,
                         ids=[f"{p}-in-{len(c)}" for p, c in PROMPTS])
def test_decode_holds_prefills_pages_and_nothing_else_changed(engine, prompt, chunks) -> None:
    d_raw = engine.sides["kv_consumer"].raw
    before = d_raw.clone()
    d_ids, p_ids, sends = transfer(engine, f"{engine.model.name}-{prompt}-{len(chunks)}",
                                   prompt, chunks)
    assert sends[-1].final and not any(s.final for s in sends[:-1])
    want, moved = expected_decode(engine, before, d_ids, p_ids)
    diff = torch.nonzero(d_raw != want).flatten()
    assert diff.numel() == 0, (
        f"{diff.numel()} bytes of Decode's memory differ from the pages it must hold, "
        f"first at byte {int(diff[0])}: {_where(engine, int(diff[0]))}")
    stats = engine.sides["kv_consumer"].conn_work.get_kv_connector_stats().data
    assert stats["bytes_pulled"] == moved


def _where(eng: Engine, at: int) -> str:
    """Which layer's page or which gap a byte of the backing allocation is in."""
    for name in eng.specs:
        off, block, page = eng.page(name)
        if at >= off and (at - off) % block < page:
            return f"block {(at - off) // block} of {name}'s page"
    return "no layer's page (another layer's, padding or a gap)"


def test_the_packed_v4_layout_is_vllms(tp_group, memory_control, metaserver) -> None:  # noqa: F811
    """DeepSeek-V4 in vLLM's packed layout, as a real engine allocates it: 47,808-byte
    blocks, the compressed group's pages at 0, 8,640 and 46,080; each layer's page is
    smaller than its block, and rd2h states exactly that page for it."""
    eng = Engine(MODELS["dsv4"], "BLHNC", memory_control[1])
    try:
        offsets = {n: eng.page(n) for n in eng.specs}
        assert {b for _, b, _ in offsets.values()} == {47808}
        assert offsets["model.layers.1.attn.indexer.k_cache"][::2] == (0, 8448)
        assert offsets["model.layers.1.attn"][::2] == (8640, 37376)
        assert offsets["model.layers.2.attn"][::2] == (46080, 1168)
        worker = eng.sides["kv_producer"].conn_work._role
        layouts = {lay.layer_name: lay for lay in worker._layouts.values()}
        for name, (_, block, page) in offsets.items():
            (t,) = layouts[name].main
            assert (t.bytes_per_block, t.page) == (block, page), name
    finally:
        eng.shutdown()


def test_each_v4_group_is_announced_in_its_own_block_size(
        tp_group, memory_control, metaserver) -> None:  # noqa: F811
    """A 300-token prompt in chunks of 128, 128 and 44: each step announces each group's
    blocks completed in it, counted in that group's tokens per block."""
    eng = Engine(MODELS["dsv4"], "BLHNC", memory_control[1])
    try:
        *_, sends = transfer(eng, "v4-sizes", 300, [128, 128, 44])
    finally:
        eng.shutdown()
    spans = [[(start, start + len(ids)) for start, ids in s.groups] for s in sends]
    # Step 1 (tokens 0-127): window blocks 0-1, no compressed block, state blocks 0-31
    # and 0-15; step 2 (128-255): 2-3, block 0, 32-63, 16-31; step 3: the rest.
    assert spans[0] == [(0, 2)] * 4 + [(0, 0), (0, 32), (0, 16)]
    assert spans[1] == [(2, 4)] * 4 + [(0, 1), (32, 64), (16, 32)]
    assert spans[2] == [(4, 5)] * 4 + [(1, 2), (64, 75), (32, 38)]

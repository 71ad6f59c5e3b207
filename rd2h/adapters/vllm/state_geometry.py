"""A hybrid model's recurrent-state geometry as vLLM computes it, for moving state across
TP sizes (``rd2h.domain.planning.state_split``).

vLLM sizes a model's state pages from ``MambaStateShapeCalculator``, called by the
model class's ``get_mamba_state_shape_from_config`` with the model's own numbers (heads,
groups, head and state sizes, kernel). rd2h asks the model class the same question with
the calculator's methods wrapped for the call, so it learns exactly the inputs vLLM used,
whatever the model's config names them; then it checks that the geometry it builds from
them gives, at this engine's TP size, the shapes vLLM's cache spec states. Anything it
cannot describe this way (another calculator, several state layouts in one model, extra
state tensors) gets no geometry: such a model's state moves between equal TP sizes only.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rd2h.domain.planning.state_split import (
    StateGeometry,
    StateSplitError,
    gated_delta_net,
    mamba1,
    mamba2,
    short_conv,
)

# vLLM's calculator method -> (rd2h's geometry builder, the arguments it takes)
_BUILDERS: dict[str, tuple[Callable[..., StateGeometry], tuple[str, ...]]] = {
    "mamba2_state_shape": (mamba2, ("intermediate_size", "n_groups", "num_heads", "head_dim",
                                    "state_size", "conv_kernel", "num_spec")),
    "mamba1_state_shape": (mamba1, ("intermediate_size", "state_size", "conv_kernel")),
    "gated_delta_net_state_shape": (gated_delta_net, (
        "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size",
        "num_spec")),
    "short_conv_state_shape": (short_conv, ("intermediate_size", "conv_kernel", "num_spec")),
}
_LOCK = threading.Lock()


def _captured_calls(model_cls: Any, vllm_config: Any) -> list[tuple[str, dict[str, Any]]]:
    """The calculator calls (method, arguments by name) the model class makes to size its
    state for this engine."""
    from vllm.model_executor.layers.mamba import mamba_utils

    calc = mamba_utils.MambaStateShapeCalculator
    calls: list[tuple[str, dict[str, Any]]] = []
    saved = {name: calc.__dict__[name] for name in _BUILDERS if name in calc.__dict__}

    def wrap(name: str, method: Any) -> classmethod:
        func = method.__func__
        signature = inspect.signature(func)

        def recording(klass: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(klass, *args, **kwargs)
            bound.apply_defaults()
            calls.append((name, dict(bound.arguments)))
            return func(klass, *args, **kwargs)

        return classmethod(recording)

    with _LOCK:
        try:
            for name, method in saved.items():
                setattr(calc, name, wrap(name, method))
            model_cls.get_mamba_state_shape_from_config(vllm_config)
        finally:
            for name, method in saved.items():
                setattr(calc, name, method)
    return calls


def _elem(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if not isinstance(size, int) or size < 1:
        raise StateSplitError(f"state dtype {dtype!r} has no element size")
    return size


def state_geometry(vllm_config: Any, specs: Sequence[Any]) -> tuple[StateGeometry | None, str]:
    """The engine's state geometry and "" when rd2h can split its state across TP sizes;
    else None and why not (in words, for the log)."""
    if not specs:
        return None, "no state"
    first = specs[0]
    if any(tuple(s.shapes) != tuple(first.shapes) or tuple(s.dtypes) != tuple(first.dtypes)
           for s in specs):
        return None, "its state groups have different layouts"
    try:
        from vllm.model_executor.layers.mamba import mamba_utils
        from vllm.model_executor.models import ModelRegistry

        mc = vllm_config.model_config
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        if hasattr(model_cls, "get_mamba_specs_from_config"):
            return None, "the model has several state layouts"
        calls = _captured_calls(model_cls, vllm_config)
        layout = mamba_utils.get_conv_state_layout()
    except Exception as exc:  # vLLM's own question failed: no split, equal TP as before
        return None, f"vLLM's state sizes could not be read ({type(exc).__name__}: {exc})"
    if len({(name, tuple(sorted(args.items()))) for name, args in calls}) != 1:
        return None, (f"the model sizes its state by {len(calls)} calculator calls"
                      if calls else "the model sizes its state without vLLM's calculator")
    name, args = calls[0]
    build, names = _BUILDERS[name]
    dtypes = tuple(first.dtypes)
    elems: dict[str, int] = {"conv_elem": _elem(dtypes[0])}
    if build is not short_conv:
        if len(dtypes) < 2:
            return None, f"{name} with {len(dtypes)} dtypes"
        elems["ssm_elem"] = _elem(dtypes[1])
    try:
        geometry = build(**{k: int(args[k]) for k in names}, **elems, layout=layout)
        tp = int(args["tp_world_size"] if "tp_world_size" in args else args["tp_size"])
        numels = geometry.numels(tp)
    except (StateSplitError, KeyError, TypeError, ValueError) as exc:
        return None, f"{name}: {exc}"
    want = tuple(math.prod(int(d) for d in shape) for shape in first.shapes)
    if numels != want:
        return None, (f"{name}'s geometry gives {numels} elements a tensor at TP {tp}, "
                      f"vLLM's cache spec {want}")
    return geometry, ""

"""TEST-ONLY PyTorch reference of vLLM 0.32's ``selective_scan_fwd`` (the Mamba-1
selective scan), which vLLM's CPU libraries lack: Jamba, Mamba and FalconMamba fail in
vLLM's first forward on the CPU backend (``torch.ops._C`` has no
``selective_scan_fwd``). vLLM has CPU versions of the rest of a Mamba-1 mixer (the
causal convolution and the one-token ``selective_state_update``). With this op a Jamba
gets through its prefill; vLLM 0.32's CPU ``selective_state_update`` then fails on
Mamba1's 3-D state (it takes Mamba2's 4-D one), a second gap the model sweep names.

``register()`` defines the op under ``torch.ops._C`` with the real schema and this body
where the loaded library has none; ``serve_patch_dir()`` writes a ``sitecustomize`` that
calls it after vLLM loads its library, for an engine's PYTHONPATH. Nothing here is part
of rd2h.

What the op computes (packed sequences, the layout ``selective_scan_fn`` passes): for
each sequence i (tokens ``query_start_loc[i]:query_start_loc[i+1]``, state slot
``cache_indices[i]``, skipped when it is ``null_block_id``), starting from
``ssm_states[slot]`` when ``has_initial_state[i]`` and from zeros otherwise, per token t
and channel d:

    dt  = softplus(delta[d, t] + delta_bias[d])       (softplus when delta_softplus)
    h   = exp(dt * A[d]) * h + dt * B[:, t] * u[d, t]  (h: one row of dstate)
    y   = <h, C[:, t]> + D[d] * u[d, t]
    out = y * silu(z[d, t])                            (y when there is no z)

written over ``z`` (or over ``delta`` when there is no z), and the last h into
``ssm_states[slot]``. In float32, as the CUDA kernel computes, one token after another
(row-invariant: a sequence's result does not depend on the others in the batch).
Prefix caching's per-block states (``block_idx_*``) are not implemented: the tests run
these families with prefix caching off, and the op raises if asked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SCHEMA = ("(Tensor! u, Tensor! delta, Tensor! A, Tensor! B, Tensor! C, Tensor? D_, "
          "Tensor!? z_, Tensor? delta_bias_, bool delta_softplus, Tensor? query_start_loc, "
          "Tensor? cache_indices, Tensor? has_initial_state, Tensor! ssm_states, "
          "int null_block_id, int block_size, Tensor? block_idx_first_scheduled_token, "
          "Tensor? block_idx_last_scheduled_token, Tensor? initial_state_idx, "
          "Tensor? cu_chunk_seqlen, Tensor? last_chunk_indices) -> ()")
_LIBRARY: torch.library.Library | None = None


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                       query_start_loc, cache_indices, has_initial_state, ssm_states,
                       null_block_id, block_size, block_idx_first_scheduled_token,
                       block_idx_last_scheduled_token, initial_state_idx, cu_chunk_seqlen,
                       last_chunk_indices) -> None:
    if block_idx_first_scheduled_token is not None or initial_state_idx is not None:
        raise NotImplementedError(
            "test-only selective_scan_fwd: prefix caching's per-block states are not "
            "implemented (serve with --no-enable-prefix-caching)")
    if query_start_loc is None:
        raise NotImplementedError("test-only selective_scan_fwd: packed sequences only")
    A32 = A.float()
    Bm = B.reshape(-1, B.shape[-2], B.shape[-1])[0].float()  # (dstate, total): 1 group
    Cm = C.reshape(-1, C.shape[-2], C.shape[-1])[0].float()
    # Every elementwise function is applied one token (one column) at a time, so that a
    # token's result never depends on how many others share the call (vectorized and
    # scalar paths of exp/softplus may differ in the last bit).
    dts = delta.float()
    bias = delta_bias.float() if delta_bias is not None else None
    uf = u.float()
    zf = z.float() if z is not None else None
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist() if cache_indices is not None else list(range(len(starts) - 1))
    initial = has_initial_state.tolist() if has_initial_state is not None else None
    out = torch.zeros_like(uf)
    for i, slot in enumerate(slots):
        lo, hi = starts[i], starts[i + 1]
        if slot == null_block_id or hi <= lo:
            continue
        if initial is not None and initial[i]:
            h = ssm_states[slot].float().clone()
        else:
            h = torch.zeros(A32.shape, dtype=torch.float32)
        for t in range(lo, hi):
            dt = dts[:, t] if bias is None else dts[:, t] + bias  # (dim,)
            if delta_softplus:
                dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
            dt = dt[:, None]
            h = torch.exp(dt * A32) * h + (dt * Bm[:, t][None, :]) * uf[:, t:t + 1]
            y = (h * Cm[:, t][None, :]).sum(-1)
            if D is not None:
                y = y + D.float() * uf[:, t]
            out[:, t] = y if zf is None else y * F.silu(zf[:, t])
        ssm_states[slot] = h.to(ssm_states.dtype)
    if z is not None:
        z.copy_(out.to(z.dtype))
    else:
        delta.copy_(out.to(delta.dtype))


def register(verbose: bool = True) -> bool:
    """Define ``_C::selective_scan_fwd`` with this body where vLLM's loaded library has
    none; True when it did. Call it after ``CpuPlatform.import_kernels``."""
    global _LIBRARY
    if hasattr(torch.ops._C, "selective_scan_fwd"):
        return False
    _LIBRARY = torch.library.Library("_C", "FRAGMENT")
    _LIBRARY.define("selective_scan_fwd" + SCHEMA)
    _LIBRARY.impl("selective_scan_fwd", selective_scan_fwd, "CPU")
    torch.library.register_fake("_C::selective_scan_fwd", lambda *args: None, lib=_LIBRARY)
    if verbose:
        print("rd2h test-only reference kernel registered: selective_scan_fwd (Mamba-1)",
              file=sys.stderr, flush=True)
    return True


SITECUSTOMIZE = '''"""TEST-ONLY (rd2h): after vLLM loads its CPU library, define the
Mamba-1 selective scan it lacks with the PyTorch reference in mamba1_reference.py."""
import importlib.abc
import importlib.machinery
import sys


def _install(mod):
    cls = mod.CpuPlatform
    orig = cls.import_kernels.__func__

    def import_kernels(cls_):
        orig(cls_)
        import mamba1_reference
        mamba1_reference.register()

    cls.import_kernels = classmethod(import_kernels)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _install(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.platforms.cpu":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
'''


def serve_patch_dir(path: str | os.PathLike[str]) -> Path:
    """Write the ``sitecustomize`` and this module into ``path``; return it (put it on
    the engine's PYTHONPATH)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (out / "mamba1_reference.py").write_text(Path(__file__).read_text())
    return out

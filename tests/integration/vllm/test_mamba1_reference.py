"""The test-only Mamba-1 selective scan (``mamba1_reference``) that lets vLLM's CPU
backend serve Jamba for the model sweep: a hand-computed case, continuation from a saved
state equal to one pass (what chunked prefill and the N-1 scheme rely on), packed
sequences independent of each other, the null slot skipped, and the op reachable under
``torch.ops._C`` with the real schema. vLLM's CPU library has no such kernel to compare
with. With it, a served Jamba gets past its prefill and fails at the first decode step in
vLLM's own CPU ``selective_state_update`` (which takes Mamba2's 4-D state, not Mamba1's
3-D one), so the model sweep lists Jamba as not runnable, naming that.
"""

from __future__ import annotations

import math

import mamba1_reference as ref
import pytest
import torch

pytestmark = pytest.mark.integration

NULL = -1


def _inputs(dim=8, dstate=4, total=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"u": r(dim, total), "delta": r(dim, total) * 0.5, "A": -torch.rand(dim, dstate,
                                                                                 generator=g),
            "B": r(1, dstate, total), "C": r(1, dstate, total), "D": r(dim), "z": r(dim, total),
            "delta_bias": r(dim) * 0.1}


def _scan(x, starts, slots, initial, states):
    u, delta, z = x["u"].clone(), x["delta"].clone(), x["z"].clone()
    ref.selective_scan_fwd(u, delta, x["A"], x["B"], x["C"], x["D"], z, x["delta_bias"], True,
                           torch.tensor(starts, dtype=torch.int32),
                           torch.tensor(slots, dtype=torch.int32),
                           torch.tensor(initial, dtype=torch.bool), states, NULL, 1024,
                           None, None, None, None, None)
    return z


def test_hand_case() -> None:
    """dim 1, dstate 1, two tokens, no softplus, no z: y_t = C_t h_t + D u_t."""
    u = torch.tensor([[1.0, 2.0]])
    delta = torch.tensor([[0.5, 0.25]])
    A, B, C, D = torch.tensor([[-1.0]]), torch.tensor([[[2.0, 1.0]]]), torch.tensor(
        [[[1.0, 3.0]]]), torch.tensor([0.5])
    states = torch.zeros(1, 1, 1)
    ref.selective_scan_fwd(u, delta, A, B, C, D, None, None, False, torch.tensor([0, 2]),
                           torch.tensor([0]), torch.tensor([False]), states, NULL, 1024,
                           None, None, None, None, None)
    h1 = 0.5 * 2.0 * 1.0
    h2 = math.exp(-0.25) * h1 + 0.25 * 1.0 * 2.0
    assert delta[0].tolist() == pytest.approx([h1 + 0.5, 3.0 * h2 + 1.0])
    assert states.item() == pytest.approx(h2)


def test_continuing_from_the_saved_state_equals_one_pass() -> None:
    x = _inputs()
    whole = torch.zeros(3, 8, 4)
    out = _scan(x, [0, 11], [2], [False], whole)
    parts = torch.zeros(3, 8, 4)
    first = {k: (v[..., :7] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    rest = {k: (v[..., 7:] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    a = _scan(first, [0, 7], [2], [False], parts)
    b = _scan(rest, [0, 4], [2], [True], parts)
    assert torch.equal(torch.cat([a, b], dim=1), out)
    assert torch.equal(parts, whole)


def test_packed_sequences_are_independent_and_the_null_slot_is_skipped() -> None:
    x = _inputs(total=11)
    states = torch.zeros(4, 8, 4)
    packed = _scan(x, [0, 5, 5, 11], [1, NULL, 3], [False, False, False], states)
    alone = torch.zeros(4, 8, 4)
    head = {k: (v[..., :5] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    tail = {k: (v[..., 5:] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    assert torch.equal(packed[:, :5], _scan(head, [0, 5], [1], [False], alone))
    assert torch.equal(packed[:, 5:], _scan(tail, [0, 6], [3], [False], alone))
    assert torch.equal(states, alone)
    assert not states[0].any() and not states[2].any()


def test_prefix_cachings_block_states_are_refused() -> None:
    x = _inputs()
    with pytest.raises(NotImplementedError, match="prefix caching"):
        ref.selective_scan_fwd(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                               None, True, torch.tensor([0, 11]), torch.tensor([0]), None,
                               torch.zeros(1, 8, 4), NULL, 16, torch.tensor([0]),
                               torch.tensor([0]), torch.tensor([0]), None, None)


def test_registered_under_torch_ops_with_the_real_schema() -> None:
    ref.register(verbose=False)  # False when already there (an earlier call)
    assert hasattr(torch.ops._C, "selective_scan_fwd")
    x = _inputs()
    z = x["z"].clone()
    states = torch.zeros(1, 8, 4)
    torch.ops._C.selective_scan_fwd(x["u"], x["delta"].clone(), x["A"], x["B"], x["C"], x["D"],
                                    z, x["delta_bias"], True, torch.tensor([0, 11]),
                                    torch.tensor([0]), torch.tensor([False]), states, NULL,
                                    1024, None, None, None, None, None)
    assert torch.equal(z, _scan(x, [0, 11], [0], [False], torch.zeros(1, 8, 4)))

"""An engine's KV cache groups as rd2h sees them, and which ones it can move.

vLLM splits a model's cache layers into KV cache groups, each with its own block
table: one group for a plain model, a full-attention and a sliding-window group for a
Gemma-3 or gpt-oss style model, recurrent-state groups for a Mamba hybrid, a draft
model's layers in a group of their own. A request has one list of block ids per group,
and a layer's blocks are addressed by its own group's ids, never another group's.

rd2h moves full attention (MLA included) and sliding-window attention, each group into
that group's own Decode blocks. In a sliding-window group vLLM gives a request its
shared null block for the positions outside the window (``NO_BLOCK`` here): Decode
reads nothing into them, and Prefill announces nothing of them. Groups may differ in
block size (DeepSeek-V4: window caches of 64 tokens a block, compressed caches of 256,
compressor states of 4 and 8): each group's blocks are counted in its own tokens per
block, a block position always meaning the same tokens on both sides.

A group whose layers vLLM gives no per-layer hook (``hooked`` False: DeepSeek-V4's
caches, written by the model's own kernels) is announced after the step's forward,
like state.

A state group (vLLM's ``MambaSpec``: Mamba1/Mamba2 SSM and conv state, gated delta net,
short convolutions) holds no KV per token but one running state per request, which a
token updates in place: computing a token twice gives a wrong state. So with state
groups Prefill computes the prompt's first N-1 tokens only, the state after them moves
with the attention KV of those tokens, and Decode computes the last token itself (the
N-1 scheme, ``STATE_BACKOFF``). A request's state lives in one block of its group's list,
the last one (``state_slot``); that block moves, on the final chunk only, into Decode's
own state block.

Every other kind of group is refused when the engine starts, naming the group, its vLLM
spec type and its layers: cross-attention, encoder caches and any kind not known here,
and state groups rd2h does not move correctly (with speculative scratch blocks, or a
model with no attention group at all).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rd2h.domain.errors import Rd2hError

# A position of a request's block list with no block behind it (vLLM's null block: the
# positions a sliding window no longer holds). Never read from, never written into.
NO_BLOCK = -1

FULL = "full"
SLIDING = "sliding"
STATE = "state"
# The kinds rd2h transfers; a vLLM spec type maps to one of them or to none.
MOVABLE = frozenset({FULL, SLIDING, STATE})
MAX_NAMED_LAYERS = 4
# Prompt tokens Prefill leaves for Decode to compute when the model carries state.
STATE_BACKOFF = 1


class UnsupportedKvGroup(Rd2hError):
    """An engine has a KV cache group rd2h cannot move correctly (refused at start)."""


@dataclass(frozen=True)
class KvGroup:
    """One KV cache group: its index, what rd2h calls its kind (None: not movable),
    vLLM's spec type, tokens per block, sliding window (tokens), layer names, and
    whether vLLM transfers it at all (an ephemeral replica rebuilt after a load is not).
    ``speculative_blocks``: a state group's scratch blocks for speculative decoding."""

    index: int
    kind: str | None
    spec_type: str
    block_size: int
    layers: tuple[str, ...]
    sliding_window: int | None = None
    transferable: bool = True
    speculative_blocks: int = 0
    # The model family whose own cache layout the group is, when vLLM's spec names one
    # (e.g. "DeepSeek-V4's compressed sparse attention").
    model: str | None = None
    # What the layout is, when the spec type alone does not say (e.g. a compressed latent
    # cache under vLLM's MLA spec type): named in a refusal.
    layout: str | None = None
    # Whether vLLM calls the connector's per-layer save hook for the group's layers
    # (False: announced after the step's forward instead).
    hooked: bool = True

    @property
    def is_state(self) -> bool:
        return self.kind == STATE

    def describe(self) -> str:
        shown = ", ".join(self.layers[:MAX_NAMED_LAYERS])
        more = len(self.layers) - MAX_NAMED_LAYERS
        if more > 0:
            shown += f" and {more} more"
        window = f", window {self.sliding_window}" if self.sliding_window else ""
        return (f"group {self.index} ({self.spec_type}{window}, {len(self.layers)} layers: "
                f"{shown or 'none'})")

    def summary(self) -> str:
        """Short and stable, for the compatibility map: kind, window, block size, layers."""
        window = f"w{self.sliding_window}" if self.sliding_window else ""
        return f"{self.kind or self.spec_type}{window}/{self.block_size}x{len(self.layers)}"


def check_groups(groups: Sequence[KvGroup]) -> tuple[KvGroup, ...]:
    """The groups rd2h transfers (every transferable group), in index order; raises
    ``UnsupportedKvGroup`` naming each group it cannot move."""
    moved = tuple(g for g in groups if g.transferable)
    bad = [g for g in moved if g.kind not in MOVABLE
           or (g.is_state and g.speculative_blocks)]
    if bad:
        model = next((g.model for g in groups if g.model), None)
        raise UnsupportedKvGroup(
            "rd2h cannot transfer this model's KV cache"
            + (f" ({model})" if model else "") + ": "
            + "; ".join(f"{g.describe()} is {_why(g)}" for g in bad)
            + ". rd2h moves full-attention (MLA included), sliding-window and recurrent-"
              "state KV cache groups only; serve this model without disaggregation"
        )
    if not moved:
        raise UnsupportedKvGroup("the engine has no KV cache group to transfer")
    attention = [g for g in moved if not g.is_state]
    if not attention:
        raise UnsupportedKvGroup(
            "rd2h cannot transfer this model's KV cache: every group is recurrent state ("
            + "; ".join(g.describe() for g in moved) + "); rd2h moves state beside "
            "attention (hybrid models) only; serve this model without disaggregation")
    return moved


def _why(group: KvGroup) -> str:
    spec = group.spec_type.lower()
    if group.layout is not None:
        return f"{group.layout}, which rd2h does not transfer"
    if group.is_state:
        return (f"recurrent state with {group.speculative_blocks} speculative scratch "
                "block(s) (speculative decoding), which rd2h does not transfer")
    if "mamba" in spec or "linear" in spec or "recurrent" in spec:
        return "recurrent state of a kind rd2h does not know"
    if "cross" in spec:
        return "cross-attention, which rd2h does not transfer"
    if "encoder" in spec:
        return "an encoder cache, which rd2h does not transfer"
    return "a KV cache spec type rd2h does not know"


def state_groups(groups: Sequence[KvGroup]) -> frozenset[int]:
    """The indices of the state groups among ``groups``."""
    return frozenset(g.index for g in groups if g.is_state)


def state_slot(ids: Sequence[int]) -> int | None:
    """A state group's running-state block in a request's list: the last entry (vLLM
    keeps earlier positions as its null block, or as earlier states it no longer
    needs); None when the list is empty or ends in ``NO_BLOCK``."""
    if not ids or ids[-1] == NO_BLOCK:
        return None
    return int(ids[-1])


def late_groups(groups: Sequence[KvGroup]) -> frozenset[int]:
    """The groups announced after the step's forward: state, and groups vLLM gives no
    per-layer hook."""
    return frozenset(g.index for g in groups if g.is_state or not g.hooked)


def layer_groups(groups: Sequence[KvGroup]) -> dict[str, int]:
    """Layer name -> the index of the group whose block ids address it."""
    return {name: g.index for g in groups for name in g.layers}


def groups_summary(groups: Sequence[KvGroup]) -> str:
    """The transferred groups in one line (``full/32x4,slidingw32/32x4``)."""
    return ",".join(g.summary() for g in groups)


def leading_gap(ids: Sequence[int]) -> int:
    """How many ``NO_BLOCK`` entries open ``ids`` (a sliding window's dropped head)."""
    n = 0
    for b in ids:
        if b != NO_BLOCK:
            break
        n += 1
    return n

"""What vLLM tells the connector about its engine and rank, in plain values
(``rd2h.entry.translate`` reads them from vLLM's objects)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from rd2h.app.settings import Rd2hOptions, Rd2hSettings
from rd2h.domain.planning.layout import HeadRange
from rd2h.domain.planning.state_split import StateGeometry
from rd2h.domain.wire.compat import Compat


@dataclass(frozen=True)
class EngineFacts:
    """What vLLM tells the connector about this engine and rank."""

    side: Literal["prefill", "decode"]
    kv_port: int
    global_dp_rank: int
    tp_size: int
    tp_rank: int
    engine_id: str
    block_size: int
    group_layer_names: tuple[tuple[str, ...], ...]
    local_rank: int = 0  # the rank's accelerator on its host, as vLLM assigned it
    num_blocks: int = 0
    # What this engine states in MF_META's compatibility map (None: nothing, as before).
    compat: Compat | None = None
    # The model's KV heads over all TP ranks when they are split over the ranks (a GQA
    # or MHA model; None for MLA's one latent "head" or when unknown).
    total_kv_heads: int | None = None
    # The KV cache groups rd2h transfers (``rd2h.domain.planning.kv_groups.check_groups``): every
    # transferable group of the engine; an engine with one rd2h cannot move never starts.
    moved_groups: tuple[int, ...] = (0,)
    groups_text: str = ""  # the moved groups in words, for the log line at start
    # The moved groups that hold recurrent state (``rd2h.domain.planning.kv_groups``, N-1 scheme).
    state_groups: tuple[int, ...] = ()
    # Tokens per block of every group, by index (empty: ``block_size`` for each).
    group_block_sizes: tuple[int, ...] = ()
    # The moved groups whose layers vLLM gives no per-layer save hook (announced after
    # the step's forward, like state).
    hookless_groups: tuple[int, ...] = ()
    # The state groups' geometry (``rd2h.domain.planning.state_split.StateGeometry``):
    # a Decode rank of another TP size reads its parts of each state page (None: the
    # state moves between equal TP sizes only).
    state_geometry: StateGeometry | None = None
    state_note: str = ""  # why the state moves between equal TP sizes only

    def state_position(self) -> tuple[int, int] | None:
        """This rank's ``(rank, tp)`` for its state layers, when they split by TP."""
        return None if self.state_geometry is None else (self.tp_rank, self.tp_size)

    def layer_groups(self) -> dict[str, int] | None:
        """Cache layer name -> the group whose block ids address it (moved groups only);
        None when vLLM stated no groups (every layer, one block table)."""
        out = {name: g for g in self.moved_groups if g < len(self.group_layer_names)
               for name in self.group_layer_names[g]}
        return out or None

    def on_rank(self, tp_rank: int, tp_size: int, local_rank: int) -> EngineFacts:
        return replace(self, tp_rank=tp_rank, tp_size=tp_size, local_rank=local_rank)

    def kv_heads(self) -> HeadRange | None:
        """The KV heads this TP rank holds, as vLLM splits them: ``total / tp`` each when
        they divide, one head shared by ``tp / total`` ranks when there are fewer heads
        than ranks; None when unknown (MLA) or split some other way."""
        total, tp, rank = self.total_kv_heads, self.tp_size, self.tp_rank
        if not total or tp < 1:
            return None
        if total % tp == 0:
            count = total // tp
            return HeadRange(rank * count, count, total)
        if tp % total == 0:
            return HeadRange(rank * total // tp, 1, total)
        return None

    def settings(self, options: Rd2hOptions) -> Rd2hSettings:
        return Rd2hSettings.for_rank(
            options, role=self.side, kv_port=self.kv_port, global_dp_rank=self.global_dp_rank,
            tp_size=self.tp_size, tp_rank=self.tp_rank, local_rank=self.local_rank,
        )

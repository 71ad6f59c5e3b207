"""What vLLM tells the connector about its engine and rank, in plain values
(``rd2h.entry.translate`` reads them from vLLM's objects)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from rd2h.app.settings import Rd2hOptions, Rd2hSettings
from rd2h.domain.compat import Compat


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

    def on_rank(self, tp_rank: int, tp_size: int, local_rank: int) -> EngineFacts:
        return replace(self, tp_rank=tp_rank, tp_size=tp_size, local_rank=local_rank)

    def settings(self, options: Rd2hOptions) -> Rd2hSettings:
        return Rd2hSettings.for_rank(
            options, role=self.side, kv_port=self.kv_port, global_dp_rank=self.global_dp_rank,
            tp_size=self.tp_size, tp_rank=self.tp_rank, local_rank=self.local_rank,
        )

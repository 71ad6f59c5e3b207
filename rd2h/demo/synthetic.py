"""Synthetic KV for the demo: deterministic block contents and block allocations.

Every block's bytes are a pure function of (request, layer, component, block
index within the request), so Decode can verify each destination byte against
exactly what Prefill "computed".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COMPONENTS = ("main_k", "main_v", "indexer", "scale")
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)


@dataclass(frozen=True)
class Shapes:
    """Bytes per token of each component (spec 13 defaults: DeepSeek-V3.2-like)."""

    block_size: int = 128
    main_k_per_token: int = 1024  # 512 x bf16
    main_v_per_token: int = 128  # 64 x bf16 (rope part)
    indexer_per_token: int = 128  # 128 x int8
    scale_per_token: int = 4  # 1 x fp32
    indexer: bool = True
    scale: bool = True

    def bytes_per_block(self, component: str) -> int:
        per_token = {
            "main_k": self.main_k_per_token,
            "main_v": self.main_v_per_token,
            "indexer": self.indexer_per_token,
            "scale": self.scale_per_token,
        }[component]
        return per_token * self.block_size

    @property
    def components(self) -> tuple[str, ...]:
        out = ["main_k", "main_v"]
        if self.indexer:
            out.append("indexer")
            if self.scale:
                out.append("scale")
        return tuple(out)


def block_pattern(
    request: int, layer: int, component: str, block_indices: np.ndarray, nbytes: int
) -> np.ndarray:
    """``(len(block_indices), nbytes)`` uint8 contents of those blocks of a request."""
    comp = COMPONENTS.index(component)
    keys = (
        ((np.uint64(request) * np.uint64(4096) + np.uint64(layer)) * np.uint64(8) + np.uint64(comp))
        * np.uint64(1 << 20)
        + block_indices.astype(np.uint64)
        + np.uint64(1)
    )
    words = -(-nbytes // 8)
    with np.errstate(over="ignore"):
        grid = keys[:, None] * _C1 + np.arange(words, dtype=np.uint64)[None, :] * _C2
        grid ^= grid >> np.uint64(29)
    return grid.view(np.uint8).reshape(len(block_indices), words * 8)[:, :nbytes]


@dataclass(frozen=True)
class Allocation:
    """Block ids of every request on both sides (drawn from a seeded shuffle)."""

    blocks_per_request: int
    p_pool_blocks: int
    d_pool_blocks: int
    p_blocks: tuple[tuple[int, ...], ...]
    d_main_blocks: tuple[tuple[int, ...], ...]
    d_indexer_blocks: tuple[tuple[int, ...], ...]


def allocate(requests: int, prompt_tokens: int, block_size: int, seed: int) -> Allocation:
    per_req = -(-prompt_tokens // block_size)
    need = requests * per_req
    pool = need + max(8, need // 8)
    rng = np.random.default_rng(seed)

    def split(perm: np.ndarray) -> tuple[tuple[int, ...], ...]:
        return tuple(
            tuple(int(x) for x in perm[i * per_req : (i + 1) * per_req]) for i in range(requests)
        )

    return Allocation(
        blocks_per_request=per_req,
        p_pool_blocks=pool,
        d_pool_blocks=pool,
        p_blocks=split(rng.permutation(pool)),
        d_main_blocks=split(rng.permutation(pool)),
        d_indexer_blocks=split(rng.permutation(pool)),
    )

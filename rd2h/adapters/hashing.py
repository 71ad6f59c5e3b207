"""Block digests for ``verify_kv`` (``rd2h.domain.wire.digests``): XXH3-64 (the ``xxhash``
library) of bytes at addresses of this process, read in place (no copy)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import xxhash

from rd2h.domain.wire.digests import DIGEST_MASK


def digest_blocks(addrs: Iterable[int], sizes: Iterable[int]) -> list[int]:
    """The masked XXH3-64 digest of ``sizes[i]`` bytes at ``addrs[i]`` (host memory of
    this process: a CPU KV cache, a pinned pool)."""
    return [xxhash.xxh3_64_intdigest((ctypes.c_char * size).from_address(addr)) & DIGEST_MASK
            for addr, size in zip(addrs, sizes)]

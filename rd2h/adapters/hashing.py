"""Block digests for ``verify_kv`` (``rd2h.domain.planning.digests``): XXH3-64 (the ``xxhash``
library) of bytes at addresses of this process, read in place (no copy)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from rd2h.domain.planning.digests import DIGEST_MASK

_hash = xxhash.xxh3_64_intdigest


def digest_blocks(addrs: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray
                  ) -> np.ndarray:
    """The masked XXH3-64 digest (int64) of ``sizes[i]`` bytes at ``addrs[i]`` (host
    memory of this process: a CPU KV cache, a pinned pool). One ctypes view type per
    block size; the hashing runs in C over the bytes in place."""
    addrs = np.asarray(addrs, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    out = np.empty(addrs.size, dtype=np.uint64)
    if not addrs.size:
        return out.astype(np.int64)
    views: dict[int, Any] = {}  # block size -> the ctypes array type of that many bytes
    for i, (addr, size) in enumerate(zip(addrs.tolist(), sizes.tolist())):
        view = views.get(size)
        if view is None:
            view = views[size] = ctypes.c_char * size
        out[i] = _hash(view.from_address(addr))
    return (out & np.uint64(DIGEST_MASK)).astype(np.int64)

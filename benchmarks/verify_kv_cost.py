"""What ``verify_kv`` costs per byte: the block digests (XXH3-64, ``rd2h.adapters.hashing``)
against the copy they guard, measured in the same run on the same buffers.

A pull copies each KV byte once (Decode's read); ``verify_kv`` adds one digest pass over
the source on Prefill and one over the destination on Decode. For each block size the
script times, over ``--mib`` MiB split in blocks: the copy (numpy, one memcpy per block,
as a transport lands them), and the digest of every block (as both sides compute them),
each the median of ``--repeat`` rounds, and prints digest time / copy time. Figures
only; nothing here passes or fails on a clock.

Run:  .venv/bin/python benchmarks/verify_kv_cost.py [--mib N] [--repeat N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np

from rd2h.adapters.hashing import digest_blocks

BLOCK_SIZES = (4 * 1024, 16 * 1024, 64 * 1024, 128 * 1024)  # bytes per block of a tensor


def _median(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(src.shape[0]):  # one memcpy per block, as a transport lands them
        dst[i] = src[i]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per round, MiB")
    ap.add_argument("--repeat", type=int, default=7, help="rounds per figure (median)")
    args = ap.parse_args()
    total = args.mib * 1024 * 1024
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.empty_like(src)
    print(f"verify_kv cost: {args.mib} MiB per round, median of {args.repeat} rounds")
    print(f"{'block':>8} {'copy GB/s':>10} {'digest GB/s':>12} {'digest/copy':>12} "
          f"{'both sides/copy':>16}")
    for size in BLOCK_SIZES:
        n = total // size
        s_blocks, d_blocks = src[: n * size].reshape(n, size), dst[: n * size].reshape(n, size)
        addrs = (s_blocks.ctypes.data + np.arange(n, dtype=np.int64) * size).tolist()
        sizes = [size] * n

        copy = functools.partial(_copy, s_blocks, d_blocks)
        digest = functools.partial(digest_blocks, addrs, sizes)
        t_copy, t_digest = _median(copy, args.repeat), _median(digest, args.repeat)
        gb = n * size / 1e9
        print(f"{size // 1024:>6} K {gb / t_copy:>10.2f} {gb / t_digest:>12.2f} "
              f"{t_digest / t_copy:>12.2f} {2 * t_digest / t_copy:>16.2f}")


if __name__ == "__main__":
    main()

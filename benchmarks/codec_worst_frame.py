"""Worst frames for ``MsgpackCodec``'s decode budget: what they cost to decode.

For each hostile shape (the values that cost the most memory per budget unit or per
wire byte), builds the frame that spends the whole budget at the given limits, decodes
it, and prints its size, the outcome (refused frames show the ``ProtocolError``), the
decode time, the peak memory (tracemalloc, and the RSS high-water mark's rise) and the
bound ``worst_case_decode_bytes`` promises. A legitimate large READ_READY_BATCH and
an MF_META of 61 layers are measured too. Each shape runs in a fresh interpreter
(``--in-process`` to not), so the RSS figures do not mix.

Run:  .venv/bin/python benchmarks/codec_worst_frame.py [--max-frame-bytes N]
      [--max-objects N] [--max-items N] [--max-depth N] [--shape NAME ...] [--json]
Timings and memory are only reported: the exit status is 1 only when a peak
exceeds the bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack

from rd2h.adapters.msgpack import codec as codec_module
from rd2h.adapters.msgpack.codec import MsgpackCodec
from rd2h.domain.errors import ProtocolError
from rd2h.domain.wire.protocol import (
    LayerMetadata,
    MfMeta,
    ReadReadyBatch,
    ReadRequest,
)

MiB = 1024 * 1024


class Limits(NamedTuple):
    max_frame_bytes: int
    max_objects: int
    max_items: int
    max_depth: int
    max_metadata_objects: int

    def codec(self) -> MsgpackCodec:
        return MsgpackCodec(
            self.max_frame_bytes, self.max_items, max_objects=self.max_objects,
            max_depth=self.max_depth, max_metadata_objects=self.max_metadata_objects,
        )


def array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def chunked(items: list[bytes], per: int) -> bytes:
    """``items`` as an array of arrays of at most ``per`` items each."""
    chunks = [items[i:i + per] for i in range(0, len(items), per)]
    return array_header(len(chunks)) + b"".join(array_header(len(c)) + b"".join(c)
                                                 for c in chunks)


def spend(item: bytes, units: int, lim: Limits) -> bytes:
    """Enough copies of ``item`` (costing ``units`` each) to overrun the budget by one."""
    return chunked([item] * (lim.max_objects // units + 1), min(lim.max_items, lim.max_objects))


def open_containers(lim: Limits, scalar: bytes = b"\xa4\xf0\x9f\x98\x80") -> bytes:
    """The budget spent but for one array, then ``max_depth - 1`` nested arrays full of
    scalars: everything is built before the innermost completes and overruns it."""
    per = min(lim.max_items, lim.max_objects)
    target = max(lim.max_objects - per, 0)  # a string costs 1 unit, a chunk 1 more
    strings = target - -(-target // (per + 1))
    filler = [scalar] * strings
    chunks = [filler[i:i + per] for i in range(0, len(filler), per)]
    chain = array_header(per) + scalar * per  # the innermost level
    for _ in range(lim.max_depth - 2):
        chain = array_header(per) + scalar * (per - 1) + chain
    body = b"".join(array_header(len(c)) + b"".join(c) for c in chunks)
    return array_header(len(chunks) + 1) + body + chain


def long_strings(lim: Limits) -> bytes:
    """Strings as long as allowed, each decoding to UCS-4 (one astral character)."""
    size = min(codec_module.MAX_STR_BYTES, lim.max_frame_bytes // 8)
    text = ("a" * (size - 4) + "\U0001f600").encode()
    count = min(lim.max_items, (lim.max_frame_bytes - 16) // (size + 5))
    return array_header(count) + b"".join(msgpack.packb(text.decode()) for _ in range(count))


def layer_map(layers: int, tensors: int = 1) -> dict[str, LayerMetadata]:
    meta = LayerMetadata(
        base_addrs=tuple(0x7F00_0000_0000 + i * (1 << 30) for i in range(tensors)),
        block_len=(65536,) * tensors, block_size_scale=(1,) * tensors,
        tensor_group_idx=tuple(range(tensors)), main_tensor_count=tensors,
        has_indexer=False, num_blocks=(4096,) * tensors,
    )
    return {f"model.layers.{i}.self_attn.attn": meta for i in range(layers)}


def mf_meta(layers: int, tensors: int = 1) -> bytes:
    return MsgpackCodec(1 << 40).encode(MfMeta("session-0", layer_map(layers, tensors)))


def metadata_at_cap(lim: Limits) -> bytes:
    # A 1-tensor layer costs 28 units: its name, its map (2 + 2 per key and value) and
    # five lists (1 + 1 per tensor each), 23 + 5 per tensor.
    return mf_meta(min(lim.max_metadata_objects, lim.max_objects) // 28 + 1)


def legit_batch(requests: int = 256, blocks: int = 4096) -> bytes:
    rng = random.Random(7)
    reqs = tuple(
        ReadRequest(f"cmpl-{i:08d}-0", tuple(rng.randrange(200_000) for _ in range(blocks)),
                    tuple(rng.randrange(200_000) for _ in range(blocks)), 0, 0)
        for i in range(requests)
    )
    msg = ReadReadyBatch(3, "model.layers.3.self_attn.attn", reqs, (), 0, 1)
    return MsgpackCodec(1 << 40).encode(msg)


def _nested(lim: Limits) -> bytes:
    return spend(b"\x91" * (lim.max_depth - 3) + b"\x90", 2 * (lim.max_depth - 2), lim)


SHAPES: dict[str, Callable[[Limits], bytes]] = {
    "empty arrays, flat": lambda lim: spend(b"\x90", 2, lim),
    "empty arrays, nested": _nested,
    "empty maps": lambda lim: spend(b"\x80", 3, lim),
    "maps {'ab': {}}": lambda lim: spend(b"\x81\xa2ab\x80", 7, lim),
    "2-char strings": lambda lim: spend(b"\xa2ab", 1, lim),
    "1-char astral strings": lambda lim: spend(b"\xa4\xf0\x9f\x98\x80", 1, lim),
    "2-byte bins": lambda lim: spend(b"\xc4\x02ab", 1, lim),
    "negative fixints": lambda lim: spend(b"\xe0", 1, lim),
    "uint64s": lambda lim: spend(b"\xcf\x80" + bytes(7), 1, lim),
    "float64s": lambda lim: spend(b"\xcb\x40\x09\x21\xfb\x54\x44\x2d\x18", 1, lim),
    "open containers": open_containers,
    "long UCS-4 strings": long_strings,
    "MF_META layer map at its cap": metadata_at_cap,
    "MF_META of 100,000 layers": lambda lim: mf_meta(100_000),
    "deep nesting (100,000)": lambda lim: b"\x91" * 100_000 + b"\xc0",
    "legit READ_READY_BATCH 256x2x4096": lambda lim: legit_batch(),
    "legit MF_META of 61 layers": lambda lim: mf_meta(61, 4),
}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak_rss() -> bool:
    try:  # Linux >= 4.0: "5" resets the VmHWM high-water mark
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _decode(codec: MsgpackCodec, frame: bytes) -> str:
    try:
        codec.decode(frame)
    except ProtocolError as exc:
        return f"refused: {exc}"
    return "decoded"


def measure(name: str, lim: Limits) -> dict[str, Any]:
    frame = SHAPES[name](lim)
    codec = lim.codec()
    out: dict[str, Any] = {"shape": name, "frame_bytes": len(frame)}
    gc.collect()
    base, exact = _rss_now(), _reset_peak_rss()
    if not exact:
        base = _peak_rss()
    start = time.perf_counter()
    out["outcome"] = _decode(codec, frame)
    out["seconds"] = time.perf_counter() - start
    out["rss_delta"] = max(_peak_rss() - base, 0)
    gc.collect()
    tracemalloc.start()
    _decode(codec, frame)
    out["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out["bound"] = codec.worst_case_decode_bytes()
    return out


def _child_args(lim: Limits, name: str) -> list[str]:
    return [sys.executable, __file__, "--child", name,
            "--max-frame-bytes", str(lim.max_frame_bytes), "--max-objects", str(lim.max_objects),
            "--max-items", str(lim.max_items), "--max-depth", str(lim.max_depth),
            "--max-metadata-objects", str(lim.max_metadata_objects)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-frame-bytes", type=int, default=codec_module.DEFAULT_MAX_FRAME_BYTES,
                    help="longest frame (default %(default)s)")
    ap.add_argument("--max-objects", type=int, default=codec_module.DEFAULT_MAX_OBJECTS,
                    help="decode budget per frame, in units (default %(default)s)")
    ap.add_argument("--max-items", type=int, default=codec_module.DEFAULT_MAX_ITEMS,
                    help="longest array (default %(default)s)")
    ap.add_argument("--max-depth", type=int, default=codec_module.DEFAULT_MAX_DEPTH,
                    help="deepest nesting of long frames (default %(default)s)")
    ap.add_argument("--max-metadata-objects", type=int,
                    default=codec_module.DEFAULT_MAX_METADATA_OBJECTS,
                    help="units the MF_META layer map may use (default %(default)s)")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), metavar="NAME",
                    help=f"only this shape (repeatable; default: all): {', '.join(SHAPES)}")
    ap.add_argument("--in-process", action="store_true",
                    help="measure every shape in this interpreter (RSS figures then mix)")
    ap.add_argument("--json", action="store_true", help="one JSON object per shape")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lim = Limits(args.max_frame_bytes, args.max_objects, args.max_items, args.max_depth,
                 args.max_metadata_objects)
    if args.child:
        print(json.dumps(measure(args.child, lim)))
        return 0
    bound = lim.codec().worst_case_decode_bytes()
    if not args.json:
        print(f"limits: {lim._asdict()}\nbound (worst_case_decode_bytes): {bound / MiB:.1f} MiB")
        print(f"{'shape':36} {'frame':>10} {'time':>9} {'peak':>10} {'rss+':>10}  outcome")
    worst = 0
    for name in args.shape or list(SHAPES):
        if args.in_process:
            row = measure(name, lim)
        else:
            done = subprocess.run(_child_args(lim, name), capture_output=True, text=True,
                                  check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
        worst = max(worst, row["tracemalloc_peak"])
        if args.json:
            print(json.dumps(row))
            continue
        print(f"{name:36} {row['frame_bytes'] / MiB:8.2f}Mi {row['seconds'] * 1e3:7.0f}ms "
              f"{row['tracemalloc_peak'] / MiB:8.1f}Mi {row['rss_delta'] / MiB:8.1f}Mi  "
              f"{row['outcome'][:70]}")
    if not args.json:
        print(f"worst tracemalloc peak {worst / MiB:.1f} MiB = {100 * worst / bound:.0f}% "
              f"of the bound")
    return 0 if worst <= bound else 1


if __name__ == "__main__":
    sys.exit(main())

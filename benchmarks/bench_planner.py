"""Benchmark of the vectorised read planner ``rd2h.domain.planning.planning.plan_reads``.

Plans one DeepSeek-V3.2-like layer (spec 13: 128-token blocks; main K 128 KiB,
main V 16 KiB, indexer 16 KiB and LIC8 scale 512 B per block; the Ascend layout
with two main tensors, an indexer and a scale) for ``--requests`` requests of
``--blocks`` blocks each, for several P/D tensor-parallel topologies (spec 8).

"Planning one layer" for a topology means: for every Prefill rank ``p`` build
the READ_READY_BATCH it sends (``ratio = p_tp // d_tp``, ``member = p % ratio``,
``d_rank = p // ratio``) and plan it on Decode rank ``d_rank``: the total
planning work of all Decode ranks for that layer.

The same inputs are also planned by a plain Python loop written straight from
spec section 5 (per request, per block, per tensor; coalescing in a loop). Both
must produce identical coalesced descriptor arrays, and the byte/block totals
must match what the topology has to move; a mismatch exits with status 1.
Timings are only reported (with the >= 20x vectorised/loop target stated):
they never change the exit status.

Run:  .venv/bin/python benchmarks/bench_planner.py [--requests N] [--blocks N]
      [--repeat N] [--ids random|contiguous|both] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import Destination, ReadPlan, plan_reads
from rd2h.domain.planning.topology import compute_mapping
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest

# Spec 13 reference shapes (DeepSeek-V3.2-like), bytes per 128-token block.
BLOCK_TOKENS = 128
MAIN_K_BYTES = 512 * 2 * BLOCK_TOKENS  # 512 x bf16 per token = 128 KiB
MAIN_V_BYTES = 64 * 2 * BLOCK_TOKENS  # 64 x bf16 per token = 16 KiB
INDEXER_BYTES = 128 * 1 * BLOCK_TOKENS  # 128 x int8 per token = 16 KiB
SCALE_BYTES = 1 * 4 * BLOCK_TOKENS  # 1 x fp32 per token = 512 B
MAIN_BYTES = MAIN_K_BYTES + MAIN_V_BYTES
INDEXER_TOTAL_BYTES = INDEXER_BYTES + SCALE_BYTES

TARGET_RATIO = 20.0
DEFAULT_TOPOLOGIES = ((1, 1), (4, 2), (8, 1))
LAYER_IDX = 5
LAYER_NAME = f"model.layers.{LAYER_IDX}.self_attn"

# Address map: every tensor gets its own 1 TiB window, far larger than any pool.
_WINDOW = 1 << 40
_P_BASE = 1 << 44
_D_BASE = 1 << 46
_D_RANK_STRIDE = 1 << 38  # rank-local indexer/scale tensors of different Decode ranks


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Workload:
    """Block ids of one layer's requests: P sources and D destinations."""

    name: str
    p_main: list[tuple[int, ...]]
    p_idx: list[tuple[int, ...]]
    starts: list[int]  # chunk offset into D's lists (main and indexer alike)
    destinations: dict[str, Destination]
    pool_blocks: int

    @property
    def ext_ids(self) -> list[str]:
        return list(self.destinations)


def make_workload(kind: str, requests: int, blocks: int, seed: int, max_start: int) -> Workload:
    """``random``: ids from seeded permutations of a pool twice the needed size (P and D,
    main and indexer each drawn independently); ``contiguous``: consecutive ids."""
    rng = np.random.default_rng(seed)
    starts = [int(s) for s in rng.integers(0, max_start + 1, size=requests)]
    d_len = [blocks + s for s in starts]
    need = max(requests * blocks, sum(d_len))
    pool = 2 * need
    if kind == "random":
        p_main_pool = rng.permutation(pool)
        p_idx_pool = rng.permutation(pool)
        d_main_pool = rng.permutation(pool)
        d_idx_pool = rng.permutation(pool)
    elif kind == "contiguous":
        p_main_pool = p_idx_pool = d_main_pool = d_idx_pool = np.arange(pool)
    else:
        raise ValueError(f"unknown id layout {kind!r}")
    p_main, p_idx, destinations = [], [], {}
    d_off = 0
    for i in range(requests):
        lo, hi = i * blocks, (i + 1) * blocks
        p_main.append(tuple(p_main_pool[lo:hi].tolist()))
        p_idx.append(tuple(p_idx_pool[lo:hi].tolist()))
        dm = tuple(d_main_pool[d_off : d_off + d_len[i]].tolist())
        di = tuple(d_idx_pool[d_off : d_off + d_len[i]].tolist())
        d_off += d_len[i]
        destinations[f"req-{i:05d}"] = Destination(dm, di)
    return Workload(kind, p_main, p_idx, starts, destinations, pool)


def source_layout() -> SourceLayout:
    return SourceLayout(
        LAYER_NAME,
        main=(
            TensorComponent(_P_BASE + 0 * _WINDOW, MAIN_K_BYTES, 1, 0),
            TensorComponent(_P_BASE + 1 * _WINDOW, MAIN_V_BYTES, 1, 0),
        ),
        indexer=TensorComponent(_P_BASE + 2 * _WINDOW, INDEXER_BYTES, 1, 1),
        scale=TensorComponent(_P_BASE + 3 * _WINDOW, SCALE_BYTES, 1, 1),
    )


def destination_layout(pool_blocks: int, d_rank: int) -> DestinationLayout:
    """Main pool shared by all Decode ranks; indexer and scale rank-local (spec 2)."""
    local = d_rank * _D_RANK_STRIDE
    return DestinationLayout(
        LAYER_NAME,
        main=(
            DestTensor(_D_BASE + 0 * _WINDOW, MAIN_K_BYTES, pool_blocks),
            DestTensor(_D_BASE + 1 * _WINDOW, MAIN_V_BYTES, pool_blocks),
        ),
        indexer=DestTensor(_D_BASE + 2 * _WINDOW + local, INDEXER_BYTES, pool_blocks),
        scale=DestTensor(_D_BASE + 3 * _WINDOW + local, SCALE_BYTES, pool_blocks),
    )


@dataclass(frozen=True)
class Call:
    """One READ_READY_BATCH from Prefill rank ``p_rank``, planned on ``d_rank``."""

    p_rank: int
    d_rank: int
    d_tp: int
    batch: ReadReadyBatch
    dst: DestinationLayout


def make_calls(wl: Workload, p_tp: int, d_tp: int) -> list[Call]:
    ext_ids = wl.ext_ids
    calls = []
    for p in range(p_tp):
        m = compute_mapping(p_tp, d_tp, p)
        reqs = tuple(
            ReadRequest(ext, wl.p_main[i], wl.p_idx[i], wl.starts[i], wl.starts[i])
            for i, ext in enumerate(ext_ids)
        )
        batch = ReadReadyBatch(LAYER_IDX, LAYER_NAME, reqs, (), m.member, m.ratio)
        calls.append(Call(p, m.d_rank, d_tp, batch, destination_layout(wl.pool_blocks, m.d_rank)))
    return calls


# ------------------------------------------------------------------ reference loop


class LoopPlanningError(Exception):
    pass


def _loop_owned_range(n: int, k: int, r: int, s: int) -> tuple[int, int]:
    """Spec 5, verbatim: owner ``r`` of ``k`` gets ``[start, start + count)``."""
    logical = (r - s % k) % k
    q, rem = divmod(n, k)
    start = logical * q + min(logical, rem)
    count = q + (1 if logical < rem else 0)
    return start, start + count


def loop_plan(
    batch: ReadReadyBatch,
    src: SourceLayout,
    dst: DestinationLayout,
    destinations: Mapping[str, Destination],
    *,
    d_rank: int,
    d_tp: int,
) -> tuple[list[tuple[int, int, int]], int, int]:
    """Plain-Python spec-5 planner: (coalesced descriptors, descriptors before, blocks).

    Per request, per owned block, per tensor it builds one ``(local, remote, length)``
    tuple. Descriptor order is a planner choice the spec leaves open, and coalescing
    depends on it; this loop keeps each tensor's descriptors in its own list and
    joins them in tensor order (main K, main V, indexer, scale), the order
    ``plan_reads`` uses, then merges neighbours contiguous on both sides.
    """
    member, ratio = batch.group_member_idx, max(1, batch.tp_ratio)
    main_pairs = list(zip(src.main, dst.main))
    idx_pairs = []
    if src.indexer is not None:
        idx_pairs.append((src.indexer, dst.indexer))
        if src.scale is not None:
            idx_pairs.append((src.scale, dst.scale))
    per_tensor: list[list[tuple[int, int, int]]] = [[] for _ in main_pairs + idx_pairs]
    idx_bucket0 = len(main_pairs)
    blocks = 0

    for req in batch.read_reqs:
        dest = destinations.get(req.ext_req_id)
        if dest is None:
            raise LoopPlanningError(f"{req.ext_req_id}: no destination")
        p_main, p_idx = req.p_main_block_ids, req.p_indexer_block_ids
        if not p_main and not p_idx:
            raise LoopPlanningError(f"{req.ext_req_id}: no blocks")
        owned = built = 0
        if member == 0 and main_pairs and p_main:
            n, s = len(p_main), req.main_start_block
            d_list = dest.main_block_ids[s : s + n]
            if len(d_list) != n:
                raise LoopPlanningError(f"{req.ext_req_id}: main does not fit")
            lo, hi = _loop_owned_range(n, d_tp, d_rank, s)
            for j in range(lo, hi):
                p_block, d_block = p_main[j], d_list[j]
                for t, (st, dt) in enumerate(main_pairs):
                    if d_block >= dt.num_blocks:
                        raise LoopPlanningError(f"{req.ext_req_id}: main block out of pool")
                    size = st.block_len * st.block_size_scale
                    per_tensor[t].append(
                        (dt.base_addr + d_block * size, st.base_addr + p_block * size, size)
                    )
                    built += 1
            owned += hi - lo
        if idx_pairs and p_idx:
            n, s = len(p_idx), req.indexer_start_block
            d_list = dest.indexer_block_ids[s : s + n]
            if len(d_list) != n:
                raise LoopPlanningError(f"{req.ext_req_id}: indexer does not fit")
            lo, hi = _loop_owned_range(n, ratio, member, s)
            for j in range(lo, hi):
                p_block, d_block = p_idx[j], d_list[j]
                for t, (st, dt) in enumerate(idx_pairs, start=idx_bucket0):
                    if d_block >= dt.num_blocks:
                        raise LoopPlanningError(f"{req.ext_req_id}: indexer block out of pool")
                    size = st.block_len * st.block_size_scale
                    per_tensor[t].append(
                        (dt.base_addr + d_block * size, st.base_addr + p_block * size, size)
                    )
                    built += 1
            owned += hi - lo
        if owned and not built:
            raise LoopPlanningError(f"{req.ext_req_id}: owns blocks but built nothing")
        blocks += owned

    coalesced: list[tuple[int, int, int]] = []
    before = 0
    for bucket in per_tensor:
        for local, remote, length in bucket:
            before += 1
            if coalesced:
                c_local, c_remote, c_len = coalesced[-1]
                if c_local + c_len == local and c_remote + c_len == remote:
                    coalesced[-1] = (c_local, c_remote, c_len + length)
                    continue
            coalesced.append((local, remote, length))
    return coalesced, before, blocks


# ------------------------------------------------------------------ running


def _timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """Wall times of ``repeat`` calls, garbage collection off while timing (as timeit)."""
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return times


def _same_descriptors(plan: ReadPlan, loop: list[tuple[int, int, int]]) -> bool:
    ref = np.array(loop, dtype=np.int64).reshape(-1, 3)
    return (
        np.array_equal(plan.local_addrs, ref[:, 0])
        and np.array_equal(plan.remote_addrs, ref[:, 1])
        and np.array_equal(plan.lengths, ref[:, 2])
    )


def run_topology(
    wl: Workload, p_tp: int, d_tp: int, repeat: int
) -> tuple[dict[str, object], list[str]]:
    src = source_layout()
    calls = make_calls(wl, p_tp, d_tp)
    dests = wl.destinations

    def vectorised() -> list[ReadPlan]:
        return [plan_reads(c.batch, src, c.dst, dests, d_rank=c.d_rank, d_tp=c.d_tp) for c in calls]

    def loop() -> list[tuple[list[tuple[int, int, int]], int, int]]:
        return [loop_plan(c.batch, src, c.dst, dests, d_rank=c.d_rank, d_tp=c.d_tp) for c in calls]

    # Untimed first run of each: its results are the ones checked.
    plans = vectorised()
    refs = loop()
    errors: list[str] = []
    for c, plan, (ref, ref_before, ref_blocks) in zip(calls, plans, refs):
        where = f"{wl.name} {p_tp}x{d_tp} p{c.p_rank}->d{c.d_rank}"
        if not _same_descriptors(plan, ref):
            errors.append(
                f"{where}: coalesced descriptors differ "
                f"({plan.num_descriptors} vectorised vs {len(ref)} loop)"
            )
        before = sum(r.descriptors for r in plan.requests)
        if before != ref_before or plan.blocks != ref_blocks:
            errors.append(
                f"{where}: counts differ (descriptors {before} vs {ref_before}, "
                f"blocks {plan.blocks} vs {ref_blocks})"
            )

    total_blocks = sum(p.blocks for p in plans)
    desc_before = sum(r.descriptors for p in plans for r in p.requests)
    desc_after = sum(p.num_descriptors for p in plans)
    total_bytes = sum(p.total_bytes for p in plans)
    # Main is read once over all D ranks; every D rank gets the full indexer + scale.
    chunk_blocks = sum(len(b) for b in wl.p_main)
    want_bytes = chunk_blocks * MAIN_BYTES + d_tp * chunk_blocks * INDEXER_TOTAL_BYTES
    want_blocks = chunk_blocks + d_tp * chunk_blocks
    if total_bytes != want_bytes or total_blocks != want_blocks:
        errors.append(
            f"{wl.name} {p_tp}x{d_tp}: covers {total_bytes} B / {total_blocks} blocks, "
            f"expected {want_bytes} B / {want_blocks} blocks"
        )

    vec_times = _timed(vectorised, repeat)
    loop_times = _timed(loop, repeat)
    vec_best, vec_med = min(vec_times), statistics.median(vec_times)
    loop_best, loop_med = min(loop_times), statistics.median(loop_times)
    ratio_best = loop_best / vec_best
    figures: dict[str, object] = {
        "ids": wl.name,
        "p_tp": p_tp,
        "d_tp": d_tp,
        "plan_calls": len(calls),
        "blocks": total_blocks,
        "descriptors_before": desc_before,
        "descriptors_after": desc_after,
        "bytes": total_bytes,
        "vectorised_best_s": vec_best,
        "vectorised_median_s": vec_med,
        "vectorised_blocks_per_s_best": total_blocks / vec_best,
        "vectorised_blocks_per_s_median": total_blocks / vec_med,
        "loop_best_s": loop_best,
        "loop_median_s": loop_med,
        "loop_blocks_per_s_best": total_blocks / loop_best,
        "ratio_best": ratio_best,
        "ratio_median": loop_med / vec_med,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio_best >= TARGET_RATIO,
        "descriptors_match": not errors,
    }
    return figures, errors


def _parse_topologies(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        p, _, d = item.strip().lower().partition("x")
        try:
            out.append((int(p), int(d)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"topology {item!r} is not PxD") from None
    return out


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(
            "Time rd2h's vectorised read planner (plan_reads) on one DeepSeek-V3.2-like "
            "layer against a plain-Python spec-5 loop, checking both give identical "
            "descriptors. Exit status reflects correctness only, never speed."
        ),
    )
    ap.add_argument("--requests", type=_positive, default=256, help="requests (default 256)")
    ap.add_argument(
        "--blocks", type=_positive, default=256, help="blocks per request (default 256)"
    )
    ap.add_argument(
        "--repeat", type=_positive, default=5, help="timed repetitions of each (default 5)"
    )
    ap.add_argument(
        "--ids",
        choices=("random", "contiguous", "both"),
        default="random",
        help="block ids: seeded random permutations of a pool (default), consecutive, or both",
    )
    ap.add_argument(
        "--topologies",
        type=_parse_topologies,
        default=list(DEFAULT_TOPOLOGIES),
        help="comma-separated PxD list (default 1x1,4x2,8x1)",
    )
    ap.add_argument(
        "--max-start",
        type=int,
        default=3,
        help="chunk start offsets drawn from [0, N] per request (default 3; 0 = all at 0)",
    )
    ap.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return ap.parse_args(argv)


def _print_text(args: argparse.Namespace, results: list[dict[str, object]]) -> None:
    print(
        f"plan_reads benchmark: {args.requests} requests x {args.blocks} blocks, "
        f"DeepSeek-V3.2-like layer (K {MAIN_K_BYTES} B, V {MAIN_V_BYTES} B, "
        f"indexer {INDEXER_BYTES} B, scale {SCALE_BYTES} B per block), "
        f"repeat {args.repeat}, seed {args.seed}, chunk starts in [0, {args.max_start}]"
    )
    print(f"target: vectorised >= {TARGET_RATIO:.0f}x the plain loop (best time vs best time)")
    for r in results:
        print()
        print(
            f"[{r['ids']} ids] p_tp={r['p_tp']} d_tp={r['d_tp']}: "
            f"{r['plan_calls']} plan_reads calls per layer"
        )
        print(
            f"  blocks {r['blocks']:,}  descriptors {r['descriptors_before']:,} -> "
            f"{r['descriptors_after']:,} after coalescing  bytes {r['bytes']:,} "
            f"({r['bytes'] / 2**20:.1f} MiB)"
        )
        print(
            f"  vectorised: best {r['vectorised_best_s'] * 1e3:9.3f} ms  "
            f"median {r['vectorised_median_s'] * 1e3:9.3f} ms  "
            f"{r['vectorised_blocks_per_s_best'] / 1e6:7.2f} M blocks/s (best), "
            f"{r['vectorised_blocks_per_s_median'] / 1e6:7.2f} M blocks/s (median)"
        )
        print(
            f"  loop:       best {r['loop_best_s'] * 1e3:9.3f} ms  "
            f"median {r['loop_median_s'] * 1e3:9.3f} ms  "
            f"{r['loop_blocks_per_s_best'] / 1e6:7.2f} M blocks/s (best)"
        )
        verdict = "met" if r["target_met"] else "NOT met"
        print(
            f"  speed ratio vectorised/loop: {r['ratio_best']:.1f}x best, "
            f"{r['ratio_median']:.1f}x median; target {TARGET_RATIO:.0f}x {verdict}; "
            f"descriptors identical: {'yes' if r['descriptors_match'] else 'NO'}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = ("random", "contiguous") if args.ids == "both" else (args.ids,)
    results: list[dict[str, object]] = []
    errors: list[str] = []
    for kind in kinds:
        wl = make_workload(kind, args.requests, args.blocks, args.seed, max(0, args.max_start))
        for p_tp, d_tp in args.topologies:
            figures, errs = run_topology(wl, p_tp, d_tp, args.repeat)
            results.append(figures)
            errors.extend(errs)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "rd2h.domain.planning.planning.plan_reads",
                    "requests": args.requests,
                    "blocks_per_request": args.blocks,
                    "repeat": args.repeat,
                    "seed": args.seed,
                    "max_start": args.max_start,
                    "bytes_per_block": {
                        "main_k": MAIN_K_BYTES,
                        "main_v": MAIN_V_BYTES,
                        "indexer": INDEXER_BYTES,
                        "scale": SCALE_BYTES,
                    },
                    "python": platform.python_version(),
                    "numpy": np.__version__,
                    "target_ratio": TARGET_RATIO,
                    "all_targets_met": all(r["target_met"] for r in results),
                    "correct": not errors,
                    "errors": errors,
                    "topologies": results,
                }
            )
        )
    else:
        _print_text(args, results)
        print()
        met = all(r["target_met"] for r in results)
        print(f"target {TARGET_RATIO:.0f}x met on every topology: {'yes' if met else 'no'}")
        print(f"correctness: {'OK' if not errors else 'FAILED'}")
    for e in errors:
        print(f"MISMATCH: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

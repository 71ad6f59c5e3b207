"""Recurrent state across TP sizes: which bytes of a Prefill rank's state page fill which
bytes of a Decode rank's (docs/guide/vllm.md "Recurrent state").

vLLM splits a state layer's tensors over the TP ranks by the model's own sharding, and
packs a rank's tensors one after another into its page:

- Mamba2: the conv state holds the channels of x (the heads' ``intermediate`` ones),
  then B's and C's (``n_groups x state_size`` each), each part split over the ranks in
  order; with a single group every rank holds it (vLLM replicates ``n_groups == 1``);
  the SSM state holds ``heads / tp`` heads of ``head_dim x state_size``.
- Mamba1: the conv state's ``intermediate / tp`` channels; the SSM state's
  ``intermediate / tp`` channels of ``state_size``.
- Gated delta net: the conv state's q, k (``key heads x key dim``) and v (``value heads
  x value dim``) channels, each split; the recurrent state's ``value heads / tp``.
- Short convolutions: the conv state's ``intermediate / tp`` channels.

The conv state is ``(state_len, channels)`` per block (vLLM's "SD" layout: a rank's
channels of one step are contiguous, ``state_len`` rows of them) or ``(channels,
state_len)`` ("DS": a channel's steps contiguous). A ``StateGeometry`` states the model's
parts before any split (the same for every TP size: what MF_META's compatibility map
compares), ``local`` gives one rank's parts, and ``state_slices`` the byte runs one
Decode rank reads from one Prefill rank: for each part, the units both hold, per row.
A unit several Prefill contributors hold (a replicated group) is read from the first
of them (contributor member 0). Everything here is arithmetic on ints.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.planning.layout import MainSlice

SD = "SD"  # conv state (state_len, channels) per block: vLLM's default
DS = "DS"  # conv state (channels, state_len) per block
MAX_TEXT = 128  # the compatibility map's longest value


class StateSplitError(ValueError):
    """A state geometry that does not split over a TP size (the reason in words)."""


@dataclass(frozen=True)
class Segment:
    """A run of one tensor's split dimension: ``total`` units of ``unit`` elements each
    over all ranks. ``single_replicated``: a Mamba2 group, which vLLM replicates on every
    rank when there is one (``n_groups == 1``) and TP is larger."""

    name: str
    total: int
    unit: int
    single_replicated: bool = False


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a state layer: its split dimension's segments in order, the
    elements each unit repeats over (``rows``: the steps of an SD conv state, whose
    split dimension is the inner one) and the element size."""

    name: str
    segments: tuple[Segment, ...]
    rows: int
    elem: int
    # The split dimension is the inner one (SD conv state): ``rows`` rows of a rank's
    # units. Else it is the outer one and each unit holds ``rows`` x ``unit`` elements.
    inner: bool = False


@dataclass(frozen=True)
class Part:
    """One segment on one rank: units ``[first, first + count)`` of ``total``; byte
    ``offset`` of its first unit in row 0 of the page, ``row_stride`` between rows."""

    offset: int
    rows: int
    row_stride: int
    unit_bytes: int
    first: int
    count: int
    total: int
    replicated: bool


@dataclass(frozen=True)
class StateGeometry:
    """A state layer's tensors before any TP split (see the module docstring)."""

    kind: str
    tensors: tuple[StateTensor, ...]

    def text(self) -> str:
        """The geometry in a short line (MF_META's ``state_layout``): two builds agree on
        how a state page splits when their texts are equal."""
        parts = []
        for t in self.tensors:
            segs = ",".join(f"{s.total}x{s.unit}{'r' if s.single_replicated else ''}"
                            for s in t.segments)
            parts.append(f"{t.name}:{'i' if t.inner else 'o'}{t.rows}:{t.elem}:{segs}")
        out = f"{self.kind};" + ";".join(parts)
        if len(out) > MAX_TEXT:  # long geometries: a stable digest of the same text
            digest = hashlib.sha256(out.encode()).hexdigest()[:24]
            out = f"{self.kind};sha256:{digest}"
        return out

    def check(self, tp: int) -> None:
        """Raise ``StateSplitError`` naming the part that does not split over ``tp``."""
        for t in self.tensors:
            for s in t.segments:
                if s.total % tp and not (s.single_replicated and s.total == 1):
                    raise StateSplitError(
                        f"{self.kind} state: {t.name}'s {s.name} ({s.total} units) does not "
                        f"split over TP {tp}" + (
                            " (vLLM replicates a group over the ranks only when there is "
                            "one)" if s.single_replicated else ""))

    def local(self, tp: int, rank: int) -> tuple[tuple[Part, ...], int]:
        """Rank ``rank`` of ``tp``: its parts (tensor by tensor, segment by segment) and
        its page's state bytes."""
        self.check(tp)
        if not 0 <= rank < tp:
            raise StateSplitError(f"rank {rank} of TP {tp}")
        parts: list[Part] = []
        at = 0
        for t in self.tensors:
            counts = []
            for s in t.segments:
                if s.total % tp == 0:
                    counts.append((s.total // tp, rank * (s.total // tp), False))
                else:  # a single group (``check``): every rank holds it
                    counts.append((1, 0, True))
            if t.inner:
                unit_bytes = [s.unit * t.elem for s in t.segments]
                row = sum(c * u for (c, _, _), u in zip(counts, unit_bytes))
                rows, size = t.rows, t.rows * row
            else:
                unit_bytes = [s.unit * t.rows * t.elem for s in t.segments]
                row = sum(c * u for (c, _, _), u in zip(counts, unit_bytes))
                rows, size = 1, row
            off = at
            for s, (count, first, rep), ub in zip(t.segments, counts, unit_bytes):
                parts.append(Part(off, rows, row, ub, first, count, s.total, rep))
                off += count * ub
            at += size
        return tuple(parts), at

    def numels(self, tp: int) -> tuple[int, ...]:
        """Each tensor's elements on a rank of ``tp`` (to compare with vLLM's
        ``MambaSpec.shapes``)."""
        self.check(tp)
        return tuple(t.rows * sum((s.total // tp if s.total % tp == 0 else 1) * s.unit
                                  for s in t.segments) for t in self.tensors)


    def tensor_bytes(self, tp: int) -> tuple[int, ...]:
        """Each tensor's bytes on a rank of ``tp``, in page order."""
        return tuple(n * t.elem for n, t in zip(self.numels(tp), self.tensors))


def member_zero(src_rank: int, src_tp: int, dst_tp: int) -> bool:
    """Whether Prefill rank ``src_rank`` is the first contributor of its Decode rank
    (always, when Decode TP is not smaller)."""
    return src_tp <= dst_tp or src_rank % (src_tp // dst_tp) == 0


def state_slices(geometry: StateGeometry, src: tuple[int, int], dst: tuple[int, int],
                 layer: str = "") -> tuple[MainSlice, ...]:
    """The byte runs Decode rank ``dst = (rank, tp)`` reads from Prefill rank ``src =
    (rank, tp)``'s state page into its own: for each part, the units both hold (a unit
    every Prefill rank holds: from member 0 only), row by row; runs contiguous on both
    sides merged. Raises ``LayoutMismatch`` when the TP sizes do not pair (neither a
    multiple of the other, or this Prefill rank does not serve this Decode rank) or a
    part does not split."""
    (sr, stp), (dr, dtp) = src, dst
    if stp % dtp and dtp % stp:
        raise LayoutMismatch(layer, "main", f"state of prefill TP {stp} cannot fill decode "
                             f"TP {dtp}: neither divides the other")
    if (stp >= dtp and sr // (stp // dtp) != dr) or (stp < dtp and dr // (dtp // stp) != sr):
        raise LayoutMismatch(layer, "main", f"prefill rank {sr} of TP {stp} does not serve "
                             f"decode rank {dr} of TP {dtp}")
    try:
        sparts, _ = geometry.local(stp, sr)
        dparts, _ = geometry.local(dtp, dr)
    except StateSplitError as exc:
        raise LayoutMismatch(layer, "main", str(exc)) from None
    first = member_zero(sr, stp, dtp)
    runs: list[list[int]] = []
    for s, d in zip(sparts, dparts):
        if s.replicated and not first:
            continue
        lo, hi = max(s.first, d.first), min(s.first + s.count, d.first + d.count)
        if lo >= hi:
            continue
        n = (hi - lo) * s.unit_bytes
        for row in range(s.rows):
            so = s.offset + row * s.row_stride + (lo - s.first) * s.unit_bytes
            do = d.offset + row * d.row_stride + (lo - d.first) * d.unit_bytes
            if runs and runs[-1][0] + runs[-1][2] == so and runs[-1][1] + runs[-1][2] == do:
                runs[-1][2] += n
            else:
                runs.append([so, do, n])
    return tuple(MainSlice(so, do, n) for so, do, n in sorted(runs, key=lambda r: r[1]))


# ---------------------------------------------------------------- vLLM's models


def _conv(tp_parts: tuple[Segment, ...], state_len: int, elem: int, layout: str) -> StateTensor:
    if layout not in (SD, DS):
        raise StateSplitError(f"conv state layout {layout!r} (SD or DS)")
    return StateTensor("conv", tp_parts, state_len, elem, inner=layout == SD)


def mamba2(*, intermediate_size: int, n_groups: int, num_heads: int, head_dim: int,
           state_size: int, conv_kernel: int, num_spec: int = 0, conv_elem: int,
           ssm_elem: int, layout: str = SD) -> StateGeometry:
    """vLLM's ``mamba2_state_shape`` inputs (before any split) as a geometry."""
    conv = _conv((Segment("x", intermediate_size, 1),
                  Segment("B", n_groups, state_size, single_replicated=True),
                  Segment("C", n_groups, state_size, single_replicated=True)),
                 conv_kernel - 1 + num_spec, conv_elem, layout)
    ssm = StateTensor("ssm", (Segment("heads", num_heads, head_dim * state_size),), 1,
                      ssm_elem)
    return StateGeometry("mamba2", (conv, ssm))


def mamba1(*, intermediate_size: int, state_size: int, conv_kernel: int, conv_elem: int,
           ssm_elem: int, layout: str = SD) -> StateGeometry:
    conv = _conv((Segment("x", intermediate_size, 1),), conv_kernel - 1, conv_elem, layout)
    ssm = StateTensor("ssm", (Segment("channels", intermediate_size, state_size),), 1,
                      ssm_elem)
    return StateGeometry("mamba1", (conv, ssm))


def gated_delta_net(*, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                    conv_kernel_size: int, num_spec: int = 0, conv_elem: int,
                    ssm_elem: int, layout: str = SD) -> StateGeometry:
    # vLLM splits q, k and v by heads (``num_k_heads // tp`` key heads a rank)
    conv = _conv((Segment("q", num_k_heads, head_k_dim), Segment("k", num_k_heads, head_k_dim),
                  Segment("v", num_v_heads, head_v_dim)),
                 conv_kernel_size - 1 + num_spec, conv_elem, layout)
    rec = StateTensor("recurrent", (Segment("heads", num_v_heads, head_v_dim * head_k_dim),),
                      1, ssm_elem)
    return StateGeometry("gdn", (conv, rec))


def short_conv(*, intermediate_size: int, conv_kernel: int, num_spec: int = 0,
               conv_elem: int, layout: str = SD) -> StateGeometry:
    conv = _conv((Segment("x", intermediate_size, 1),), conv_kernel - 1 + num_spec,
                 conv_elem, layout)
    return StateGeometry("short_conv", (conv,))

"""Recurrent state across TP sizes (``rd2h.domain.planning.state_split``).

Two proofs. The geometry's per-rank sizes equal vLLM's own ``MambaStateShapeCalculator``
for each family and TP size. And byte for byte: every rank's state page is built here by
vLLM's sharding rules directly (which channels and heads a rank holds, in the loader's
order: x, then B, then C, a single group on every rank), with every element naming its
global position; Decode ranks' pages assembled by the runs ``state_slices`` gives, from
each Prefill rank that serves them, must equal the pages built directly at Decode's TP.
"""

from __future__ import annotations

import numpy as np
import pytest

from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.planning.layer_pair import LayerPair
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.state_split import (
    DS,
    SD,
    StateSplitError,
    gated_delta_net,
    mamba1,
    mamba2,
    short_conv,
    state_slices,
)

calc = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
Calc = calc.MambaStateShapeCalculator

# ---------------------------------------------------------------- an oracle page


def _ids(n: int, base: int) -> np.ndarray:
    return np.arange(base, base + n, dtype=np.int64)


def _conv_page(parts: list[tuple[int, int, bool]], total_units: list[int], state_len: int,
               layout: str, tp: int, rank: int, elem: int) -> bytes:
    """A conv state of channel parts ``(total channels, channels per unit, replicated one
    unit)``; each element's value: its global channel and step."""
    chans = []
    base = 0
    for total, per_unit, single in parts:
        units = total // per_unit
        if units % tp == 0:
            n = total // tp
            chans.append(_ids(n, base + rank * n))
        else:
            assert single and units == 1
            chans.append(_ids(total, base))
        base += total
    ch = np.concatenate(chans)
    steps = np.arange(state_len, dtype=np.int64)
    grid = (ch[None, :] * 1000 + steps[:, None])  # (state_len, channels)
    if layout == DS:
        grid = grid.T
    dtype = {2: np.uint16, 4: np.uint32}[elem]
    return np.ascontiguousarray(grid % (1 << (8 * elem) - 1)).astype(dtype).tobytes()


def _heads_page(total: int, per_head: int, tp: int, rank: int, elem: int, tag: int) -> bytes:
    n = total // tp
    heads = _ids(n, rank * n)
    grid = heads[:, None] * 100000 + np.arange(per_head)[None, :] + tag
    dtype = {2: np.uint16, 4: np.uint32}[elem]
    return (grid % (1 << (8 * elem) - 1)).astype(dtype).tobytes()


def _page(kind: str, p: dict, tp: int, rank: int, layout: str) -> bytes:
    ce, se = p["conv_elem"], p.get("ssm_elem", 4)
    if kind == "mamba2":
        g, ds = p["n_groups"], p["state_size"]
        conv = _conv_page([(p["intermediate_size"], 1, False), (g * ds, ds, g == 1),
                           (g * ds, ds, g == 1)], [], p["conv_kernel"] - 1, layout, tp, rank, ce)
        return conv + _heads_page(p["num_heads"], p["head_dim"] * ds, tp, rank, se, 7)
    if kind == "gdn":
        k, v = p["num_k_heads"] * p["head_k_dim"], p["num_v_heads"] * p["head_v_dim"]
        conv = _conv_page([(k, 1, False), (k, 1, False), (v, 1, False)], [],
                          p["conv_kernel_size"] - 1, layout, tp, rank, ce)
        return conv + _heads_page(p["num_v_heads"], p["head_v_dim"] * p["head_k_dim"], tp,
                                  rank, se, 3)
    if kind == "mamba1":
        conv = _conv_page([(p["intermediate_size"], 1, False)], [], p["conv_kernel"] - 1,
                          layout, tp, rank, ce)
        return conv + _heads_page(p["intermediate_size"], p["state_size"], tp, rank, se, 5)
    return _conv_page([(p["intermediate_size"], 1, False)], [], p["conv_kernel"] - 1,
                      layout, tp, rank, ce)


def _geometry(kind: str, p: dict, layout: str):
    make = {"mamba2": mamba2, "gdn": gated_delta_net, "mamba1": mamba1,
            "short_conv": short_conv}[kind]
    return make(**p, layout=layout)


MAMBA2_G1 = dict(intermediate_size=32, n_groups=1, num_heads=8, head_dim=4, state_size=4,
                 conv_kernel=4, conv_elem=2, ssm_elem=4)
MAMBA2_G2 = dict(MAMBA2_G1, n_groups=2)
MAMBA2_G4 = dict(MAMBA2_G1, n_groups=4)
GDN = dict(num_k_heads=2, num_v_heads=4, head_k_dim=4, head_v_dim=6, conv_kernel_size=4,
           conv_elem=2, ssm_elem=4)
MAMBA1 = dict(intermediate_size=16, state_size=4, conv_kernel=4, conv_elem=2, ssm_elem=4)
SHORT = dict(intermediate_size=16, conv_kernel=3, conv_elem=2)

CASES = [("mamba2", MAMBA2_G1), ("mamba2", MAMBA2_G2), ("mamba2", MAMBA2_G4), ("gdn", GDN),
         ("mamba1", MAMBA1), ("short_conv", SHORT)]
PAIRS = [(2, 1), (4, 1), (4, 2), (1, 2), (1, 4), (2, 4), (2, 2)]


def _splits(kind: str, p: dict, tp: int) -> bool:
    if kind == "mamba2":
        return p["num_heads"] % tp == 0 and (p["n_groups"] % tp == 0 or p["n_groups"] == 1)
    if kind == "gdn":
        return p["num_k_heads"] % tp == 0 and p["num_v_heads"] % tp == 0
    return p["intermediate_size"] % tp == 0


@pytest.mark.parametrize("layout", [SD, DS])
@pytest.mark.parametrize("kind,params", CASES, ids=lambda c: c if isinstance(c, str) else "")
@pytest.mark.parametrize("p_tp,d_tp", PAIRS)
def test_pages_assembled_from_prefill_ranks_equal_decode_pages(kind, params, p_tp, d_tp,
                                                               layout):
    geo = _geometry(kind, params, layout)
    if not (_splits(kind, params, p_tp) and _splits(kind, params, d_tp)):
        with pytest.raises(StateSplitError):
            geo.local(max(p_tp, d_tp), 0)
        return
    src_pages = [_page(kind, params, p_tp, r, layout) for r in range(p_tp)]
    for r, page in enumerate(src_pages):
        assert geo.local(p_tp, r)[1] == len(page)
    for dr in range(d_tp):
        want = _page(kind, params, d_tp, dr, layout)
        got = bytearray(len(want))
        written = np.zeros(len(want), dtype=np.int64)
        if p_tp >= d_tp:
            ratio = p_tp // d_tp
            srcs = range(dr * ratio, (dr + 1) * ratio)
        else:
            srcs = [dr // (d_tp // p_tp)]
        for sr in srcs:
            for cut in state_slices(geo, (sr, p_tp), (dr, d_tp)):
                got[cut.dst_offset:cut.dst_offset + cut.nbytes] = \
                    src_pages[sr][cut.src_offset:cut.src_offset + cut.nbytes]
                written[cut.dst_offset:cut.dst_offset + cut.nbytes] += 1
        assert bytes(got) == want, (kind, p_tp, d_tp, dr)
        # every byte written exactly once: nothing read twice, nothing left out
        assert (written == 1).all(), (kind, p_tp, d_tp, dr)


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sizes_equal_vllms_shape_calculator(tp, layout, monkeypatch):
    monkeypatch.setattr(calc, "is_conv_state_dim_first", lambda: layout == "DS")

    def elems(shapes):
        return tuple(int(np.prod(s)) for s in shapes)

    p = MAMBA2_G1
    for g in (1, 2, 4):
        if g % tp and g != 1:
            continue
        want = Calc.mamba2_state_shape(tp, p["intermediate_size"], g, p["num_heads"],
                                       p["head_dim"], p["state_size"], p["conv_kernel"])
        geo = _geometry("mamba2", dict(p, n_groups=g), layout)
        assert geo.numels(tp) == elems(want), (g, tp)
        conv = want[0]
        assert (conv[1] if layout == "SD" else conv[0]) * conv[0 if layout == "SD" else 1] \
            == geo.numels(tp)[0]
    gdn = dict(GDN, num_k_heads=4, num_v_heads=8)  # vLLM splits key heads: 4 over TP 4
    want = Calc.gated_delta_net_state_shape(tp, gdn["num_k_heads"], gdn["num_v_heads"],
                                            gdn["head_k_dim"], gdn["head_v_dim"],
                                            gdn["conv_kernel_size"])
    assert _geometry("gdn", gdn, layout).numels(tp) == elems(want)
    want = Calc.mamba1_state_shape(tp, MAMBA1["intermediate_size"], MAMBA1["state_size"],
                                   MAMBA1["conv_kernel"])
    assert _geometry("mamba1", MAMBA1, layout).numels(tp) == elems(want)
    want = Calc.short_conv_state_shape(tp, SHORT["intermediate_size"], SHORT["conv_kernel"])
    assert _geometry("short_conv", SHORT, layout).numels(tp) == elems(want)


def test_splits_that_do_not_divide_are_refused_naming_the_part():
    with pytest.raises(StateSplitError, match=r"B .*over TP 4.*only when there is one"):
        _geometry("mamba2", MAMBA2_G2, SD).local(4, 0)
    with pytest.raises(StateSplitError, match=r"heads .*over TP 4"):
        _geometry("mamba2", dict(MAMBA2_G1, intermediate_size=24, num_heads=6), SD).local(4, 0)
    geo = _geometry("gdn", GDN, SD)
    with pytest.raises(StateSplitError, match=r"q .*over TP 4"):
        _geometry("gdn", dict(GDN, num_k_heads=2, head_k_dim=1), SD).local(4, 0)
    with pytest.raises(LayoutMismatch, match="neither divides"):
        state_slices(geo, (0, 2), (0, 3))
    with pytest.raises(LayoutMismatch, match="does not serve"):
        state_slices(geo, (2, 4), (0, 2))


def test_replicated_group_is_read_from_the_first_member_only():
    geo = _geometry("mamba2", MAMBA2_G1, SD)
    first = state_slices(geo, (0, 2), (0, 1))
    second = state_slices(geo, (1, 2), (0, 1))
    # SD: 3 rows of x, B, C from member 0 (B and C runs merge), of x from member 1
    assert sum(c.nbytes for c in first) > sum(c.nbytes for c in second)
    assert sum(c.nbytes for c in first) + sum(c.nbytes for c in second) == geo.local(1, 0)[1]


def test_equal_geometry_text_whatever_the_tp_and_different_for_other_models():
    a = _geometry("mamba2", MAMBA2_G1, SD)
    assert a.text() == _geometry("mamba2", dict(MAMBA2_G1), SD).text()
    assert a.text() != _geometry("mamba2", MAMBA2_G2, SD).text()
    assert a.text() != _geometry("mamba2", MAMBA2_G1, DS).text()
    assert len(a.text()) <= 128


def _layouts(geo, src, dst, src_page=None):
    _, sbytes = geo.local(src[1], src[0])
    _, dbytes = geo.local(dst[1], dst[0])
    s = SourceLayout("layers.0.mixer", (TensorComponent(1 << 20, 4096, num_blocks=8,
                                                        page_bytes=src_page or sbytes),),
                     state=src)
    d = DestinationLayout("layers.0.mixer", (DestTensor(1 << 30, 4096, 8, dbytes),),
                          state=dst, geometry=geo)
    return s, d


def test_layer_pair_reads_each_run_and_checks_the_pages():
    geo = _geometry("mamba2", MAMBA2_G1, SD)
    s, d = _layouts(geo, (1, 2), (0, 1))
    pair = LayerPair.of(s, d)
    assert pair.slices == state_slices(geo, (1, 2), (0, 1))
    assert len(pair.main_pairs) == len(pair.slices) > 1
    # equal TP: the page moves whole, as before
    s, d = _layouts(geo, (0, 2), (0, 2))
    assert LayerPair.of(s, d).slices is None
    # a page that is not the rank's state bytes is refused, naming the sizes
    s, d = _layouts(geo, (1, 2), (0, 1), src_page=4000)
    with pytest.raises(LayoutMismatch, match="4000-byte state page"):
        LayerPair.of(s, d)
    # a peer that does not state its position: the pages must match whole (refused)
    s, d = _layouts(geo, (1, 2), (0, 1))
    s = SourceLayout(s.layer_name, s.main)
    with pytest.raises(LayoutMismatch):
        LayerPair.of(s, d)


def test_state_shard_survives_the_wire():
    from rd2h.domain.wire.layer_meta import decode_layer_metadata

    geo = _geometry("mamba2", MAMBA2_G1, SD)
    s, _ = _layouts(geo, (1, 2), (0, 1))
    meta = s.to_metadata()
    back = decode_layer_metadata(s.layer_name, meta.to_map())
    assert back.state_shard == (1, 2)
    assert SourceLayout.from_metadata(s.layer_name, back).state == (1, 2)
    from rd2h.domain.errors import ProtocolError

    bad = dict(meta.to_map(), state_shard=[2, 2])
    with pytest.raises(ProtocolError, match="state_shard rank"):
        decode_layer_metadata(s.layer_name, bad)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_split_state_digests_check_every_run_and_catch_a_wrong_byte(p_tp, d_tp):
    """``verify_kv`` on a state page split across TP sizes: each Prefill rank states one
    digest per run its reader reads (``stated_split_digests``); Decode checks each run at
    its destination after the copy (``split_checks``): all equal, and one changed byte
    in Decode's copy is caught, naming the request and the block."""
    from rd2h.adapters.hashing import digest_blocks
    from rd2h.domain.planning.digests import split_checks, stated_split_digests
    from rd2h.domain.wire.protocol import ReadRequest

    geo = _geometry("mamba2", MAMBA2_G1, SD)
    nb, blocks = 4, (2, 3)  # the request's state blocks on both sides (the same ids)
    src_pages = {}
    for r in range(p_tp):
        page = np.frombuffer(_page("mamba2", MAMBA2_G1, p_tp, r, SD), dtype=np.uint8)
        buf = np.zeros((nb, 8192), dtype=np.uint8)
        buf[:, :page.size] = page
        buf[3, :page.size] = page[::-1]  # another block holds other bytes
        src_pages[r] = buf
    req = ReadRequest("req-1", blocks, ())
    for dr in range(d_tp):
        srcs = range(dr * (p_tp // d_tp), (dr + 1) * (p_tp // d_tp)) if p_tp >= d_tp \
            else [dr // (d_tp // p_tp)]
        dst = np.zeros((nb, 8192), dtype=np.uint8)
        dtensor = DestTensor(dst.ctypes.data, 8192, nb, geo.local(d_tp, dr)[1])
        checks = []
        for sr in srcs:
            runs = state_slices(geo, (sr, p_tp), (dr, d_tp))
            src = SourceLayout("l", (TensorComponent(src_pages[sr].ctypes.data, 8192,
                                                     num_blocks=nb),))
            stated = ReadRequest("req-1", blocks, (),
                                 digests=stated_split_digests(src, req, digest_blocks, runs))
            assert len(stated.digests[0]) == len(blocks) * len(runs)
            ids = np.asarray(blocks, dtype=np.int64)
            for b in blocks:
                for cut in runs:
                    dst[b, cut.dst_offset:cut.dst_offset + cut.nbytes] = \
                        src_pages[sr][b, cut.src_offset:cut.src_offset + cut.nbytes]
            checks.append(split_checks("l", [stated], [(ids, ids)], runs, dtensor))
        for c in checks:
            assert (digest_blocks(c.addrs, c.sizes) == c.expected).all()
        dst[3, 5] ^= 0xFF  # one byte of Decode's copy of block 3
        bad = [c.describe(np.flatnonzero(digest_blocks(c.addrs, c.sizes) != c.expected))
               for c in checks]
        assert [("req-1", "main", 3)] in bad, bad

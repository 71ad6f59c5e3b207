"""Chunk block ranges, request ids, layer names and cache groups (spec 2, 3.2, 3.4)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.errors import ChunkError, Rd2hError
from rd2h.domain.planning.chunks import (
    ENGINE_SUFFIX_LEN,
    CacheGroups,
    LayerNameError,
    chunk_block_range,
    discover_cache_groups,
    external_request_id,
    is_final_chunk,
    is_indexer_layer,
    layer_index,
    wire_layer_ids,
)

PROPS = settings(max_examples=300, deadline=None)


def _range(*, computed, transferred=0, cached=0, final=False, allocated=1000, block_size=128):
    return chunk_block_range(
        block_size=block_size,
        computed_tokens=computed,
        transferred_tokens=transferred,
        remote_cached_tokens=cached,
        final=final,
        allocated_blocks=allocated,
    )


# ------------------------------------------------------------------ chunk_block_range


@pytest.mark.parametrize(
    ("computed", "transferred", "cached", "final", "allocated", "expected"),
    [
        # non-final chunks announce only completed blocks
        (256, 0, 0, False, 4, (0, 2)),
        (300, 0, 0, False, 4, (0, 2)),  # partial block 2 held back
        (100, 0, 0, False, 4, (0, 0)),  # nothing complete yet
        (512, 256, 0, False, 4, (2, 4)),
        (400, 256, 0, False, 4, (2, 3)),
        # the final chunk carries its partial last block
        (300, 0, 0, True, 3, (0, 3)),
        (300, 256, 0, True, 3, (2, 3)),
        (256, 256, 0, True, 2, (2, 2)),  # exact multiple: nothing left
        (257, 256, 0, True, 3, (2, 3)),
        (1, 0, 0, True, 1, (0, 1)),
        (0, 0, 0, True, 0, (0, 0)),
        (128, 0, 0, True, 1, (0, 1)),
        # remote_cached_tokens: D already has those tokens
        (512, 0, 256, False, 4, (2, 4)),
        (512, 128, 256, False, 4, (2, 4)),  # max(cached, transferred)
        (512, 384, 256, False, 4, (3, 4)),
        (500, 0, 300, True, 4, (2, 4)),  # cached 300 -> block 2 (partially cached) resent
        (300, 0, 300, True, 3, (2, 3)),
        # start past end (transferred ahead of completed) gives an empty range
        (256, 384, 0, False, 4, (3, 3)),
    ],
)
def test_chunk_block_range_table(computed, transferred, cached, final, allocated, expected):
    got = _range(
        computed=computed, transferred=transferred, cached=cached, final=final, allocated=allocated
    )
    assert got == expected


def test_partial_last_block_only_on_final_chunk():
    assert _range(computed=300, final=False, allocated=3) == (0, 2)
    assert _range(computed=300, final=True, allocated=3) == (0, 3)


@pytest.mark.parametrize(
    ("computed", "final", "allocated"),
    [
        (300, True, 2),  # ceil(300/128) = 3 > 2
        (513, False, 3),  # 4 > 3
        (129, True, 1),
        (128, False, 0),
    ],
)
def test_end_beyond_allocation_is_a_chunk_error(computed, final, allocated):
    with pytest.raises(ChunkError, match="allocated"):
        _range(computed=computed, final=final, allocated=allocated)


def test_end_exactly_at_allocation_is_fine():
    assert _range(computed=384, final=True, allocated=3) == (0, 3)
    assert _range(computed=384, final=False, allocated=3) == (0, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": -128},
        {"computed": -1},
        {"transferred": -1},
        {"cached": -1},
        {"allocated": -1},
    ],
)
def test_negative_or_zero_inputs_are_chunk_errors(kwargs):
    base = {"computed": 128, "transferred": 0, "cached": 0, "allocated": 4, "block_size": 128}
    base.update(kwargs)
    with pytest.raises(ChunkError):
        _range(**base)


def test_chunk_error_is_value_error_and_rd2h_error():
    with pytest.raises(ValueError):
        _range(computed=1000, allocated=1)
    with pytest.raises(Rd2hError):
        _range(computed=1000, allocated=1)


@given(
    block_size=st.integers(1, 256),
    total=st.integers(1, 5000),
    cached_frac=st.floats(0, 1),
    steps=st.lists(st.integers(1, 700), min_size=1, max_size=30),
)
@PROPS
def test_chunk_sequence_announces_every_block_once(block_size, total, cached_frac, steps):
    """Walking a request through chunks announces each uncached block exactly once."""
    allocated = -(-total // block_size)
    cached = int(total * cached_frac) // block_size * block_size  # whole cached blocks
    computed = cached
    transferred = 0
    announced: list[int] = []
    final = False
    i = 0
    while not final:
        computed = min(total, computed + steps[i % len(steps)])
        i += 1
        final = is_final_chunk(computed, total)
        start, end = chunk_block_range(
            block_size=block_size,
            computed_tokens=computed,
            transferred_tokens=transferred,
            remote_cached_tokens=cached,
            final=final,
            allocated_blocks=allocated,
        )
        assert start <= end <= allocated
        announced.extend(range(start, end))
        transferred = end * block_size
    assert announced == list(range(cached // block_size, allocated))


# ------------------------------------------------------------------ final chunk


@pytest.mark.parametrize(
    ("computed", "total", "final"),
    [(0, 1, False), (99, 100, False), (100, 100, True), (101, 100, True), (0, 0, True)],
)
def test_is_final_chunk(computed, total, final):
    assert is_final_chunk(computed, total) is final


# ------------------------------------------------------------------ request ids (3.4)


@pytest.mark.parametrize(
    ("internal", "external"),
    [
        ("cmpl-abc123-0-1a2b3c4d", "cmpl-abc123-0"),
        ("req-42-0123abcd", "req-42"),  # exactly 9 trailing chars dropped
        ("0123456789", "0"),  # 10 chars
        ("012345678", "012345678"),  # 9 chars: unchanged
        ("short", "short"),
        ("", ""),
        ("x" * 9, "x" * 9),
        ("y" * 10, "y"),
    ],
)
def test_external_request_id_table(internal, external):
    assert external_request_id(internal) == external


@given(st.text(max_size=60))
@PROPS
def test_external_request_id_property(internal):
    ext = external_request_id(internal)
    if len(internal) > ENGINE_SUFFIX_LEN:
        assert ext == internal[: len(internal) - 9]
        assert len(ext) == len(internal) - 9
    else:
        assert ext == internal
    assert internal.startswith(ext)


# ------------------------------------------------------------------ layer names


@pytest.mark.parametrize(
    ("name", "idx"),
    [
        ("model.layers.5.self_attn.indexer", 5),
        ("model.layers.0.self_attn.attn", 0),
        ("model.layers.60.self_attn", 60),
        ("layers.7", 7),
        ("layers.12.mlp", 12),
        ("language_model.model.layers.123.self_attn.mla_attn", 123),
        ("model.layers.007.attn", 7),
        # No 'layers.N': vLLM's own rule, the one integer among the dotted parts.
        ("model.4.mixer", 4),  # Falcon-H1's Mamba mixers, offset past the decoder layers
        ("model.layer.5.attn", 5),
        ("model.sublayers.5.attn", 5),
    ],
)
def test_layer_index(name, idx):
    assert layer_index(name) == idx


@pytest.mark.parametrize(
    "name",
    [
        "",
        "model.embed_tokens",
        "model.layers.x.attn",
        "model.layers.",
        "model.layers5.attn",
        "model.layers.-1.attn",
        "encoder.3.sub.1",  # two integers, no 'layers.N': vLLM cannot place it either
    ],
)
def test_layer_index_error(name):
    with pytest.raises(LayerNameError, match="cannot place the KV cache layer"):
        layer_index(name)


def test_falcon_h1_caches_get_their_own_wire_ids():
    """Falcon-H1: an attention cache per decoder layer and a Mamba mixer per layer named
    past them (vLLM's ``model.<i>.mixer``): every cache is placed, none collides."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)] + [
        f"model.{2 + i}.mixer" for i in range(2)]
    assert wire_layer_ids(names) == {names[0]: 0, names[1]: 1, names[2]: 2, names[3]: 3}


@given(st.integers(0, 10**6), st.sampled_from(["", "model.", "a.b."]), st.sampled_from(["", ".x"]))
@PROPS
def test_layer_index_round_trip(idx, prefix, suffix):
    assert layer_index(f"{prefix}layers.{idx}{suffix}") == idx


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.1.self_attn.indexer", True),
        ("model.layers.1.self_attn.Indexer", True),
        ("model.layers.1.INDEXER.k_cache", True),
        ("model.layers.1.self_attn.attn", False),
        ("model.layers.1.index", False),
    ],
)
def test_is_indexer_layer(name, expected):
    assert is_indexer_layer(name) is expected


# ------------------------------------------------------------------ cache groups (spec 2)

MAIN = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
IDX = ["model.layers.0.self_attn.indexer", "model.layers.1.self_attn.indexer"]


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ([MAIN, IDX], CacheGroups(main=0, indexer=1, has_indexer_group=True)),
        ([IDX, MAIN], CacheGroups(main=1, indexer=0, has_indexer_group=True)),
        (
            [MAIN, ["model.layers.0.attn.INDEXER"]],
            CacheGroups(main=0, indexer=1, has_indexer_group=True),
        ),
        (
            [["model.layers.0.attn.InDeXeR_cache"], MAIN],
            CacheGroups(main=1, indexer=0, has_indexer_group=True),
        ),
        # no indexer group: the indexer uses the main group's ids
        ([MAIN], CacheGroups(main=0, indexer=0, has_indexer_group=False)),
        ([[], MAIN], CacheGroups(main=1, indexer=1, has_indexer_group=False)),
        # first non-indexer group is main
        ([MAIN, ["model.layers.0.mlp"]], CacheGroups(main=0, indexer=0, has_indexer_group=False)),
        (
            [IDX, ["model.layers.9.a"], ["model.layers.8.b"]],
            CacheGroups(main=1, indexer=0, has_indexer_group=True),
        ),
        # a uniform config may put main and indexer layers in one group
        ([MAIN + IDX], CacheGroups(main=0, indexer=0, has_indexer_group=True)),
        # first indexer group wins
        ([IDX, MAIN, IDX], CacheGroups(main=1, indexer=0, has_indexer_group=True)),
    ],
)
def test_discover_cache_groups(groups, expected):
    assert discover_cache_groups(groups) == expected


@pytest.mark.parametrize("groups", [[], [IDX], [[]], [IDX, IDX, []]])
def test_discover_cache_groups_without_main_is_an_error(groups):
    with pytest.raises(ValueError):
        discover_cache_groups(groups)


@given(
    n_main=st.integers(1, 4),
    with_indexer=st.booleans(),
    data=st.data(),
)
@PROPS
def test_discover_cache_groups_does_not_rely_on_order(n_main, with_indexer, data):
    groups = [[f"model.layers.{i}.attn.g{g}" for i in range(2)] for g in range(n_main)]
    if with_indexer:
        case = data.draw(st.sampled_from(["indexer", "Indexer", "INDEXER"]))
        groups.append([f"model.layers.{i}.attn.{case}" for i in range(2)])
    order = data.draw(st.permutations(range(len(groups))))
    shuffled = [groups[i] for i in order]
    got = discover_cache_groups(shuffled)
    main_pos = min(pos for pos, i in enumerate(order) if i < n_main)
    assert got.main == main_pos
    assert got.has_indexer_group is with_indexer
    if with_indexer:
        assert got.indexer == list(order).index(n_main)
    else:
        assert got.indexer == got.main

"""Models with recurrent state on real vLLM engines (issue #39): Mamba2 hybrids and a
gated-delta-net hybrid served by rd2h, their state moved with the prompt's KV.

Families (``rd2h.demo.tiny_families``, tiny random weights, 4 layers):

| name | model | state | dtype | prefix caching |
|---|---|---|---|---|
| nemotron_h | Nemotron-H ("M-M*": Mamba2, MLP, Mamba2, attention) | Mamba2 | float32 | off |
| granite_hybrid | Granite-4.0-H style (Mamba2 / attention alternating) | Mamba2 | float32 | off |
| falcon_h1 | Falcon-H1 (attention and a Mamba2 mixer in every layer) | Mamba2 | float32 | off |
| qwen3_next | Qwen3-Next (gated delta net / attention, MoE) | GDN | bfloat16 | on |
| qwen3_next_no_pc | the same | GDN | bfloat16 | off |

Mamba2 runs with prefix caching off (on, vLLM 0.32's CPU backend fails on prompts over
256 tokens); Qwen3-Next's CPU kernels need bfloat16. vLLM picks each engine's
attention block size to fit a state page (128 or 256 tokens here).

Each family: a Prefill and a Decode engine with rd2h over cma behind ``rd2h proxy``,
``verify_kv`` on (every block, state pages included, digested by Prefill and checked by
Decode after its read) and Decode's ``kv_load_failure_policy`` recompute; the reference
is the Prefill engine's own API under a ``cache_salt`` (a plain request: rd2h does
nothing for it). Prompts of 1 to 300 tokens (one token, the N-1 of a block boundary, a
block plus one token, several chunks of 64), eight concurrent prompts, a prompt list
with a one-token child, and a second turn. Decode must report all but the last prompt
token supplied (``cached_tokens`` = N-1: the N-1 scheme), the bytes it pulled for a
fresh prompt must equal what it holds for it, group by group (ceil((N-1)/block)
attention blocks per attention layer, per state layer the state's own bytes, not its
padded page), and no digest may differ.

Tokens: equal to the reference's, exactly, for every family. The float32 families'
reference is the Prefill engine's own API under a ``cache_salt`` (a plain request: rd2h
does nothing for it). vLLM's bfloat16 CPU kernels (Qwen3-Next) are not split-invariant:
a prompt computed in chunks [64, 64, 3] and one computed in [64, 64, 2, 1] differ in the
last bits, and this tiny random model turns that into other tokens within a few
positions. So the bfloat16 reference is a third, plain engine computing the P/D split
(``pd_split_scheduler``: the first N-1 tokens in the 64-token chunks Prefill computes,
then the last token alone, as Decode does; one request at a time, prefix caching off),
and the bfloat16 Prefill runs one request at a time (``--max-num-seqs 1``), so that a
prompt computed beside others (concurrent prompts, a list) is still split as it is
alone. ``verify_kv`` holds every family's bytes to Prefill's, state pages included.

Unequal TP with state (Nemotron-H and Qwen3-Next, Prefill TP 2 -> Decode TP 1 and Prefill
TP 1 -> Decode TP 2): each Decode rank reads its parts of each Prefill rank's state page
(``rd2h.domain.planning.state_split``); tokens equal, bytes pulled as computed.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import stall
from fakes.net import free_port, quiet_ports
from servers import (
    bytes_pulled,
    metric,
    proxy_server,
    rd2h_kv,
    running,
    settled_bytes_pulled,
    vllm_server,
)

from rd2h.demo.tiny_families import make_tiny_family
from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

MAX_TOKENS = 8
MAX_PROMPT = 512 - MAX_TOKENS  # --max-model-len 512
KV_HEADS, HEAD_DIM = 2, 64  # every family here
CHUNK = 64  # --max-num-batched-tokens: prefill chunks of 64 tokens
SALT = "rd2h-plain-reference"
HERE = os.path.dirname(os.path.abspath(__file__))
# The bfloat16 reference: a plain engine computing the P/D split (module text).
PD_SPLIT = ["--scheduler-cls", "pd_split_scheduler.PdSplitScheduler", "--max-num-seqs", "1",
            "--no-enable-prefix-caching"]

# name -> (checkpoint, dtype, bytes per KV element, prefix caching)
FAMILIES = {
    "nemotron_h": ("nemotron_h", "float32", 4, False),
    "granite_hybrid": ("granite_hybrid", "float32", 4, False),
    "falcon_h1": ("falcon_h1", "float32", 4, False),
    "qwen3_next": ("qwen3_next", "bfloat16", 2, True),
    "qwen3_next_no_pc": ("qwen3_next", "bfloat16", 2, False),
}


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % (VOCAB - 3) for i in range(n)]


def _post(url: str, model: str, prompt, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}
    resp = stall.post(url + "/v1/completions", body, 180.0)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _choices(out: dict) -> list[dict]:
    return sorted(out["choices"], key=lambda c: c["index"])


def _reference(cluster, prompt) -> list[dict]:
    """The plain reference's choices (see the module's text)."""
    return _choices(_post(cluster["reference"].url, cluster["model"], prompt, cache_salt=SALT))


def _agrees(cluster, got: list[int], ref: dict, prompt_len: int, batched: bool = False
            ) -> str | None:
    """None when ``got`` is the reference's answer, token for token; else why not.
    ``prompt_len`` and ``batched`` only describe the case in the message."""
    want = list(ref["token_ids"])
    if got == want:
        return None
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got),
                                                                           len(want)))
    where = "computed beside others" if batched else "alone"
    return (f"tokens {got} != reference {want} (a {prompt_len}-token prompt {where}; "
            f"first difference at position {i})")


def _groups(log_text: str) -> dict[str, list[tuple[int, int]]]:
    """The moved groups rd2h states at start: kind -> [(block size, layers)]."""
    found = re.search(r"'kv_groups': '([^']+)'", log_text)
    assert found, "no 'rd2h moves KV cache groups' line with kv_groups"
    out: dict[str, list[tuple[int, int]]] = {}
    for part in found.group(1).split(","):
        kind, rest = part.split("/")
        size, layers = rest.split("x")
        out.setdefault(kind, []).append((int(size), int(layers)))
    return out


# The Mamba2 families' state, by vLLM's MambaStateShapeCalculator for their configs
# (an inner width of 256: hidden 256 x expand 1, Falcon-H1's mamba_d_ssm; 1 group, 8
# heads of 32, state 64, conv kernel 4; float32): the conv state (4 - 1) x (256 + 2 x 1 x
# 64) and the SSM state 8 x 32 x 64, 4 bytes each.
MAMBA2_STATE_BYTES = (3 * (256 + 2 * 64) + 8 * 32 * 64) * 4  # 70,144


def _state_page(log_text: str) -> tuple[int, int]:
    """The bytes Decode moves of each state block and the block's size, from the pages
    line rd2h logs at start (``pages={'group i': 'page/block'}``, i the group's index; the
    state groups' indices from the ``kv_groups`` order)."""
    kinds = re.search(r"'kv_groups': '([^']+)'", log_text).group(1).split(",")
    found = re.search(r"pages=\{([^}]*)\}", log_text)
    assert found, "no 'KV cache pages' line"
    pages = dict(re.findall(r"'group (\d+)': '([\d/,]+)'", found.group(1)))
    state = {pages[str(i)] for i, kind in enumerate(kinds) if kind.startswith("state/")}
    ((text,),) = [state]
    page, block = (int(x) for x in text.split("/"))
    return page, block


def _expected_bytes(cluster, prompt_len: int, hit: int = 0) -> int:
    """What Decode holds of a prompt, pulled past a local prefix hit of ``hit`` tokens:
    the attention blocks of its first N-1 tokens after the hit (each layer), and the
    state after them (per state layer the state's own bytes, not the padding vLLM adds
    to make its page the attention page); nothing for a one-token prompt."""
    loaded = prompt_len - 1
    if loaded <= 0:
        return 0
    groups = cluster["groups"]
    ((block, _),) = set(groups["full"])
    page = 2 * block * KV_HEADS * HEAD_DIM * cluster["elem"]
    attention_layers = sum(n for _, n in groups["full"])
    state_layers = sum(n for _, n in groups["state"])
    blocks = math.ceil(loaded / block) - hit // block
    return attention_layers * blocks * page + state_layers * cluster["state_page"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def cluster(request, tmp_path_factory):
    name = request.param
    checkpoint, dtype, elem, prefix_caching = FAMILIES[name]
    root = tmp_path_factory.mktemp(f"hybrid-{name}")
    model = make_tiny_family(checkpoint, root / "model")
    kv_port = quiet_ports(4)
    extra = {"transport": "cma", "log_level": "INFO", "verify_kv": True,
             "deadlines": {"request_s": 60.0, "layer_ack_s": 20.0, "meta_ack_s": 10.0}}
    args = ["--dtype", dtype, *([] if prefix_caching else ["--no-enable-prefix-caching"])]
    exact_split = dtype == "bfloat16"
    servers = {
        "prefill": vllm_server(f"{name} prefill engine", model, free_port(),
                               root / "prefill.log", block_size=None, tokenizer=True,
                               args=[*args, *(["--max-num-seqs", "1"] if exact_split else [])],
                               kv=rd2h_kv("kv_producer", kv_port, extra)),
        "decode": vllm_server(f"{name} decode engine", model, free_port(),
                              root / "decode.log", log_stats=True, block_size=None,
                              tokenizer=True, args=[*args, "--enable-prompt-tokens-details"],
                              kv={**rd2h_kv("kv_consumer", kv_port, extra),
                                  "kv_load_failure_policy": "recompute"}),
    }
    if exact_split:
        path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
        servers["reference"] = vllm_server(
            f"{name} plain reference (P/D split)", model, free_port(), root / "reference.log",
            block_size=None, tokenizer=True, args=[*args, *PD_SPLIT],
            env={"PYTHONPATH": path})
    else:
        servers["reference"] = servers["prefill"]
    servers["proxy"] = proxy_server(
        free_port(), [servers["prefill"].url], [servers["decode"].url], root / "proxy.log")
    servers["parallel"] = proxy_server(
        free_port(), [servers["prefill"].url], [servers["decode"].url],
        root / "parallel-proxy.log", args=["--dispatch", "parallel"])
    with running(*{id(s): s for s in servers.values()}.values()):
        text = servers["decode"].log.read_text(errors="replace")
        groups = _groups(text)
        state_page, state_block = _state_page(text)
        yield {"name": name, "model": str(model), "dtype": dtype, "elem": elem,
               "prefix_caching": prefix_caching, "groups": groups, "root": root,
               "state_page": state_page, "state_block": state_block,
               "kv_port": kv_port, **servers}


def _logs(cluster) -> str:
    return "\n".join(f"--- {k}\n{cluster[k].tail(30)}" for k in ("prefill", "decode", "proxy"))


def test_state_groups_are_moved_not_refused(cluster):
    """Both engines start and state which groups rd2h moves, state groups among them."""
    assert "state" in cluster["groups"] and "full" in cluster["groups"], cluster["groups"]
    for side in ("prefill", "decode"):
        text = cluster[side].log.read_text(errors="replace")
        assert "rd2h moves KV cache groups" in text and "MambaSpec" in text, \
            cluster[side].tail(40)


def test_only_the_states_own_bytes_move(cluster):
    """vLLM pads a state page to the attention page; rd2h moves the state's bytes (its
    conv and SSM tensors), not the padding: for the Mamba2 families exactly vLLM's state
    size, 70,144 of each 131,072-byte block."""
    page, block = cluster["state_page"], cluster["state_block"]
    assert 0 < page <= block
    if cluster["dtype"] == "float32":
        assert page == MAMBA2_STATE_BYTES and page < block, (page, block)


def test_prompts_of_one_token_to_several_chunks(cluster):
    """Tokens equal the plain engine's; Decode supplied N-1 tokens from the connector
    (a one-token prompt it computes itself); the bytes it pulled are what it holds."""
    model, proxy, decode = cluster["model"], cluster["proxy"], cluster["decode"]
    ((block, _),) = set(cluster["groups"]["full"])
    lengths = sorted(n for n in {1, 2, 5, CHUNK, CHUNK + 1, block - 1, block, block + 1,
                                 2 * block + 1, 300} if n <= MAX_PROMPT)
    for n in lengths:
        prompt = _prompt(n, seed=n)
        (ref,) = _reference(cluster, prompt)
        before = bytes_pulled(decode)
        out = _post(proxy.url, model, prompt)
        expected = _expected_bytes(cluster, n)
        pulled = settled_bytes_pulled(decode, before, expected) - before
        why = _agrees(cluster, _choices(out)[0]["token_ids"], ref, n)
        assert why is None, f"{cluster['name']}: prompt of {n} tokens: {why}\n{_logs(cluster)}"
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1, out["usage"]
        assert pulled == expected, (f"{cluster['name']}: prompt of {n} tokens: pulled "
                                    f"{pulled:.0f} bytes, Decode holds {expected}")
    assert metric(decode, "vllm:rd2h_kv_digest_mismatches_total") == 0
    assert metric(decode, "vllm:rd2h_kv_blocks_verified_total") > 0


def test_eight_concurrent_prompts(cluster):
    model, proxy = cluster["model"], cluster["proxy"]
    prompts = [_prompt(n, seed=100 + i)
               for i, n in enumerate((1, 7, 33, 61, 96, 130, 257, 297))]
    refs = [_reference(cluster, p)[0] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _choices(_post(proxy.url, model, p))[0]["token_ids"],
                            prompts))
    bad = [(len(p), why) for p, g, r in zip(prompts, got, refs)
           if (why := _agrees(cluster, g, r, len(p), batched=True)) is not None]
    assert not bad, f"{cluster['name']}: {bad}\n{_logs(cluster)}"


def test_prompt_list_with_a_child_decode_computes_itself(cluster):
    """One list: Decode computes its one-token child itself (a local notice) and pulls
    the others; Prefill gets the list once and shortens only the pulled children."""
    model, proxy = cluster["model"], cluster["proxy"]
    prompts = [_prompt(1, 201), _prompt(40, 202), _prompt(129, 203)]
    refs = _reference(cluster, prompts)
    got = [c["token_ids"] for c in _choices(_post(proxy.url, model, prompts))]
    bad = [(len(p), why) for p, g, r in zip(prompts, got, refs)
           if (why := _agrees(cluster, g, r, len(p), batched=True)) is not None]
    assert not bad, f"{cluster['name']}: {bad}\n{_logs(cluster)}"


def test_second_turn(cluster):
    """A chat's second turn (the first turn, its answer and more): tokens equal. The
    first turn is a block and a token long, so the state Decode received (after N-1
    tokens) is the state at a block's end: with prefix caching (Qwen3-Next, vLLM's
    ``align`` mode) Decode caches it with that block's attention KV, and the second
    turn pulls only the rest. Without, it pulls the whole N-1 again."""
    model, proxy, decode = cluster["model"], cluster["proxy"], cluster["decode"]
    ((block, _),) = set(cluster["groups"]["full"])
    first = _prompt(block + 1, 301)
    out = _post(proxy.url, model, first)
    (ref,) = _reference(cluster, first)
    assert _agrees(cluster, _choices(out)[0]["token_ids"], ref, len(first)) is None
    # Continue from the engine's own answer (so both paths see the same text).
    second = first + list(_choices(out)[0]["token_ids"]) + _prompt(60, 302)
    (ref,) = _reference(cluster, second)
    before = bytes_pulled(decode)
    out = _post(proxy.url, model, second)
    why = _agrees(cluster, _choices(out)[0]["token_ids"], ref, len(second))
    assert why is None, f"{cluster['name']}: {why}\n{_logs(cluster)}"
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(second) - 1
    hit = block if cluster["prefix_caching"] else 0
    expected = _expected_bytes(cluster, len(second), hit=hit)
    pulled = settled_bytes_pulled(decode, before, expected) - before
    assert pulled == expected, (f"{cluster['name']}: second turn of {len(second)} tokens: "
                                f"pulled {pulled:.0f}, expected {expected} (hit {hit})")


def test_parallel_dispatch_moves_the_state(cluster):
    """``--dispatch parallel`` with state groups: fresh prompts pull exactly what Decode
    holds (N-1 tokens, the state after them), a one-token prompt is computed by Decode
    (its local notice cancels the early Prefill dispatch), a second turn leaves Decode's
    prefix hit alone; tokens agree with the reference and no digest differs."""
    model, proxy, decode = cluster["model"], cluster["parallel"], cluster["decode"]
    ((block, _),) = set(cluster["groups"]["full"])
    first = _prompt(block + 1, 501)
    for prompt in [_prompt(40, 500), first, _prompt(1, 502), _prompt(130, 503)]:
        (ref,) = _reference(cluster, prompt)
        before = bytes_pulled(decode)
        out = _post(proxy.url, model, prompt)
        expected = _expected_bytes(cluster, len(prompt))
        pulled = settled_bytes_pulled(decode, before, expected) - before
        why = _agrees(cluster, _choices(out)[0]["token_ids"], ref, len(prompt))
        assert why is None, f"{cluster['name']}: {len(prompt)} tokens: {why}\n{_logs(cluster)}"
        assert pulled == expected, (cluster["name"], len(prompt), pulled, expected)
    second = first + _prompt(60, 504)
    (ref,) = _reference(cluster, second)
    before = bytes_pulled(decode)
    out = _post(proxy.url, model, second)
    why = _agrees(cluster, _choices(out)[0]["token_ids"], ref, len(second))
    assert why is None, f"{cluster['name']}: second turn: {why}\n{_logs(cluster)}"
    hit = block if cluster["prefix_caching"] else 0
    expected = _expected_bytes(cluster, len(second), hit=hit)
    pulled = settled_bytes_pulled(decode, before, expected) - before
    assert pulled == expected, (cluster["name"], "second turn", pulled, expected, hit)
    counters = httpx.get(proxy.url + "/healthcheck", timeout=10).json()["counters"]
    assert counters["prefill_parallel"] == 4, counters  # all but the first
    assert counters["parallel_mismatch"] == 0 and counters["prefill_failed"] == 0, counters
    assert metric(decode, "vllm:rd2h_kv_digest_mismatches_total") == 0


def _state_bytes_at(cluster, tp: int) -> int:
    """The state bytes of one request on all ``tp`` Decode ranks together, by rd2h's
    geometry of the family's vLLM shapes (a Mamba2 group is held by every rank)."""
    from rd2h.domain.planning.state_split import gated_delta_net, mamba2

    if cluster["dtype"] == "float32":  # the Mamba2 families (MAMBA2_STATE_BYTES)
        geo = mamba2(intermediate_size=256, n_groups=1, num_heads=8, head_dim=32,
                     state_size=64, conv_kernel=4, conv_elem=4, ssm_elem=4)
    else:  # tiny Qwen3-Next: 2 key and 2 value heads of 128, kernel 4; a bfloat16 conv
        # state, a float32 recurrent one
        geo = gated_delta_net(num_k_heads=2, num_v_heads=2, head_k_dim=128, head_v_dim=128,
                              conv_kernel_size=4, conv_elem=2, ssm_elem=4)
    assert geo.local(1, 0)[1] == cluster["state_page"]  # what a TP 1 engine moves
    return sum(geo.local(tp, r)[1] for r in range(tp))


# Prefill TP 2 -> Decode TP 1 and Prefill TP 1 -> Decode TP 2 (Decode's attention heads
# then a part of Prefill's): one float32 Mamba2 family and the gated-delta-net one.
@pytest.mark.parametrize("cluster", ["nemotron_h", "qwen3_next_no_pc"], indirect=True)
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["p2-d1", "p1-d2"])
def test_state_moves_across_tp_sizes(cluster, p_tp, d_tp):
    """Each Decode rank reads, from each Prefill rank it overlaps, exactly its channels
    and heads of each state page (conv x / B / C or q / k / v, SSM or recurrent heads)
    and its attention heads: tokens equal to the plain reference's for prompts of 2 to
    300 tokens, Decode supplied N-1 tokens, the bytes pulled are exactly what Decode's
    ranks hold (attention pages and each rank's state bytes), every state run read was
    checked against the digest its Prefill rank stated and none differs, and both
    sides stated the state's geometry instead of refusing (``state_layout``)."""
    root, name, model = cluster["root"], cluster["name"], cluster["model"]
    extra = {"transport": "cma", "log_level": "INFO", "verify_kv": True,
             "deadlines": {"request_s": 60.0, "layer_ack_s": 20.0, "meta_ack_s": 10.0}}
    args = ["--dtype", cluster["dtype"], "--no-enable-prefix-caching"]
    tp = ["--tensor-parallel-size", "2"]
    one_at_a_time = ["--max-num-seqs", "1"] if cluster["dtype"] == "bfloat16" else []
    started = []
    if p_tp == 2:
        prefill = vllm_server(f"{name} prefill TP 2", model, free_port(),
                              root / "prefill_tp2.log", block_size=None, tokenizer=True,
                              kv=rd2h_kv("kv_producer", cluster["kv_port"], extra),
                              args=[*args, *tp, *one_at_a_time])
        decode = cluster["decode"]
        started.append(prefill)
    else:
        prefill = cluster["prefill"]
        decode = vllm_server(f"{name} decode TP 2", model, free_port(), root / "decode_tp2.log",
                             log_stats=True, block_size=None, tokenizer=True,
                             args=[*args, *tp, "--enable-prompt-tokens-details"],
                             kv={**rd2h_kv("kv_consumer", quiet_ports(4), extra),
                                 "kv_load_failure_policy": "recompute"})
        started.append(decode)
    proxy = proxy_server(free_port(), [prefill.url], [decode.url],
                         root / f"proxy_p{p_tp}_d{d_tp}.log")
    with running(*started, proxy):
        ((block, _),) = set(cluster["groups"]["full"])
        groups = cluster["groups"]
        page = 2 * block * KV_HEADS * HEAD_DIM * cluster["elem"]  # over all Decode ranks
        attention_layers = sum(n for _, n in groups["full"])
        state_layers = sum(n for _, n in groups["state"])
        state_bytes = _state_bytes_at(cluster, d_tp)
        digest_before = metric(decode, "vllm:rd2h_kv_digest_mismatches_total")
        verified_before = metric(decode, "vllm:rd2h_kv_blocks_verified_total")
        for n in (2, CHUNK + 1, block + 1, 300):
            prompt = _prompt(n, seed=700 + n)
            (ref,) = _reference(cluster, prompt)
            before = bytes_pulled(decode)
            out = _post(proxy.url, model, prompt)
            expected = (attention_layers * math.ceil((n - 1) / block) * page
                        + state_layers * state_bytes)
            pulled = settled_bytes_pulled(decode, before, expected) - before
            why = _agrees(cluster, _choices(out)[0]["token_ids"], ref, n)
            assert why is None, (f"{name} P TP {p_tp} -> D TP {d_tp}: {n} tokens: {why}\n"
                                 f"{prefill.tail(30)}\n{decode.tail(30)}")
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1, out["usage"]
            assert pulled == expected, (name, p_tp, d_tp, n, pulled, expected)
        assert metric(decode, "vllm:rd2h_kv_digest_mismatches_total") == digest_before
        # the state runs were checked (attention heads split across TP sizes are not)
        assert metric(decode, "vllm:rd2h_kv_blocks_verified_total") > verified_before
        for side in (prefill, decode):
            text = side.log.read_text(errors="replace")
            assert "'state_layout'" in text and "'state_tp'" not in text, side.tail(40)
            # no handshake refusal, no layer refused or failed (the stats line's
            # ``refused_incompatible=0`` counters are not refusals)
            for what in ("incompatible builds", "layout mismatch", "layer read failed"):
                assert what not in text, (what, side.tail(40))

"""``benchmarks/model_sweep.py`` and ``sweep_models.py`` without engines: the registry it
covers, the tiny configs (each kind of layer kept when layers are cut), the prompt
lengths around a block, the root cause read from an engine's log, rd2h's refusal, and
the committed results against the registry."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _modules():
    saved = list(sys.path)  # the scripts put their own folders on the path
    sys.path.insert(0, str(BENCH))
    try:
        import model_sweep
        import sweep_models
    finally:
        sys.path[:] = saved
    return model_sweep, sweep_models


SWEEP, MODELS = _modules()


def test_cut_keeps_every_kind_of_layer() -> None:
    cut = MODELS._cut
    assert cut(["a"] * 10, 4) == ["a"] * 4
    # Gemma-3's 5 sliding : 1 full becomes alternating, never all sliding.
    assert cut(["s"] * 5 + ["f"] + ["s"] * 5 + ["f"], 4) == ["s", "f", "s", "f"]
    assert sorted(set(cut(["m", "m", "a", "m", "e", "m"], 4))) == ["a", "e", "m"]
    assert cut([{"k": 1}, {"k": 2}] * 3, 4) == [{"k": 1}, {"k": 2}] * 2
    # A leading dense layer stays the only leading one (vLLM's first_k_dense_replace).
    assert cut(["dense"] + ["sparse"] * 40, 4) == ["dense", "sparse", "sparse", "sparse"]


def test_derived_fields_fill_only_what_the_config_lacks() -> None:
    derived = MODELS._derived
    assert derived({"hidden_size": 256, "num_attention_heads": 4}) == {"head_dim": 64}
    assert derived({"hidden_size": 256, "num_attention_heads": 4, "head_dim": 128}) == {}
    assert derived({"mlp_layer_types": ["dense", "dense", "sparse"]}) == {
        "first_k_dense_replace": 2}
    assert derived({"mlp_layer_types": ["sparse"], "first_k_dense_replace": 0}) == {}


def test_tiny_config_is_small_and_keeps_the_family_features() -> None:
    cfg = MODELS.tiny_config("Gemma2ForCausalLM", "gemma2")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (256, 4, 4, 2, MODELS.VOCAB)
    assert cfg.sliding_window == MODELS.WINDOW
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    moe = MODELS.tiny_config("MixtralForCausalLM", "mixtral")
    assert (moe.num_local_experts, moe.num_experts_per_tok) == (4, 2)
    mla = MODELS.tiny_config("DeepseekV3ForCausalLM", "deepseek_v3")
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.n_routed_experts) == (512, 64, 4)
    nested = MODELS.tiny_config("DbrxForCausalLM", "dbrx")  # a dotted override
    assert nested.attn_config.kv_n_heads == 2 and nested.ffn_config.moe_num_experts == 4


def test_lengths_cross_the_block_boundaries() -> None:
    lengths = SWEEP._lengths(128)
    for n in (1, 2, 127, 128, 129, 256, 257, 300):
        assert n in lengths
    assert max(SWEEP._lengths(512)) <= SWEEP.MAX_MODEL_LEN - SWEEP.MAX_TOKENS
    assert SWEEP._block("full/128x2,sliding/64x2,state/512x2") == 64
    assert SWEEP._block("") == 32


def test_root_error_skips_the_wrappers(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "(APIServer pid=1) WARNING 12-07 16:23:25 [x.py:1] fd limit errors like `OSError: "
        "[Errno 24] Too many open files`\n"
        "(EngineCore pid=2) ERROR 12-07 16:23:56 [core.py:1510]     raise ValueError(\n"
        "(EngineCore pid=2) ERROR 12-07 16:23:56 [core.py:1510] ValueError: Following "
        "weights were not initialized from checkpoint: {'w'}\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert SWEEP._root_error(log) == ("ValueError: Following weights were not initialized "
                                      "from checkpoint: {'w'}")
    only_wrapper = tmp_path / "wrapper.log"
    only_wrapper.write_text("RuntimeError: Engine core initialization failed.\n")
    assert SWEEP._root_error(only_wrapper).startswith("RuntimeError: Engine core")
    assert SWEEP._root_error(tmp_path / "missing.log") == "(no log)"


def test_refusal_pattern_names_rd2hs_errors() -> None:
    line = ("rd2h.domain.planning.kv_groups.UnsupportedKvGroup: rd2h cannot transfer this "
            "model's KV cache: every group is recurrent state")
    found = SWEEP.REFUSAL.search(line)
    assert found and found.group(1) == "UnsupportedKvGroup"
    assert SWEEP.REFUSAL.search("ValueError: something else") is None


@pytest.mark.parametrize("verdict", ["CRASH", "WRONG", "HANG"])
def test_exit_status_fails_on_a_failing_verdict(tmp_path: Path, verdict: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"architectures": {"X": {"verdict": verdict}}}))
    monkeypatch.setattr(SWEEP.sm, "registry", lambda: ([("X", "x")], []))
    assert SWEEP.main(["--only", "", "--skip-done", "--results", str(results)]) == 1
    results.write_text(json.dumps({"architectures": {"X": {"verdict": "REFUSED"}}}))
    assert SWEEP.main(["--only", "", "--skip-done", "--results", str(results)]) == 0


def test_committed_results_cover_the_registry() -> None:
    """Every architecture the installed vLLM and transformers give the sweep has a
    committed verdict, with a reason wherever it is not EQUAL+PULLED."""
    swept, not_swept = MODELS.registry()
    doc = json.loads((BENCH / "results" / "model_sweep.json").read_text())
    archs = doc["architectures"]
    assert sorted(archs) == sorted(a for a, _ in swept)
    assert doc["not_swept"] == not_swept
    for arch, res in archs.items():
        if res["verdict"] == "EQUAL+PULLED":
            assert res["bytes_pulled"] > 0 and res["lengths"], arch
        else:
            assert res["reason"], arch


class _Engine:
    def __init__(self, url: str) -> None:
        self.url = url


def _answers(monkeypatch: pytest.MonkeyPatch, pd_alone: list[int], plain_alone: list[int],
             plain_at_once: list[list[int]]) -> list[str]:
    """Fakes the requests ``_batch_variant`` sends: P/D alone, Decode plain alone, then
    Decode plain at once (one answer list per round, cycled); returns what was asked."""
    asked: list[str] = []
    rounds = iter(plain_at_once)
    state = {"round": None, "served": 0}

    def ask(url: str, model: str, prompt: list[int], what: str) -> dict:
        asked.append(what)
        if url == "proxy":
            ids = pd_alone
        elif what.endswith("at once"):
            if state["served"] % 2 == 0:
                state["round"] = next(rounds)
            ids = state["round"][state["served"] % 2]
            state["served"] += 1
        else:
            ids = plain_alone
        return {"choices": [{"token_ids": ids}]}

    monkeypatch.setattr(SWEEP, "_ask", ask)
    return asked


def test_an_answer_at_once_is_vllms_when_its_own_answers_move_with_the_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    together = [[1, 2], [3, 4]]
    asked = _answers(monkeypatch, pd_alone=[7, 8], plain_alone=[7, 8],
                     plain_at_once=[[[7, 8], [7, 8]], [[7, 9], [7, 8]]])
    note = SWEEP._batch_variant({"decode": _Engine("decode")}, _Engine("proxy"), "m",
                                together, [([1, 2], [7, 8], [7, 9])])
    assert "round 2" in note and "alone through P/D it equals" in note
    assert asked[0] == "P/D, 2 tokens, alone again"


def test_an_answer_alone_that_differs_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    _answers(monkeypatch, pd_alone=[7, 9], plain_alone=[7, 8],
             plain_at_once=[[[7, 9], [7, 8]]])
    with pytest.raises(SWEEP.Verdict) as got:
        SWEEP._batch_variant({"decode": _Engine("decode")}, _Engine("proxy"), "m",
                             [[1, 2], [3, 4]], [([1, 2], [7, 8], [7, 9])])
    assert got.value.verdict == "WRONG" and "alone" in got.value.reason


def test_a_difference_vllm_does_not_show_itself_is_wrong(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _answers(monkeypatch, pd_alone=[7, 8], plain_alone=[7, 8],
             plain_at_once=[[[7, 8], [7, 8]]] * SWEEP.BATCH_ROUNDS)
    with pytest.raises(SWEEP.Verdict) as got:
        SWEEP._batch_variant({"decode": _Engine("decode")}, _Engine("proxy"), "m",
                             [[1, 2], [3, 4]], [([1, 2], [7, 8], [7, 9])])
    assert got.value.verdict == "WRONG"
    assert f"did not move with the batch in {SWEEP.BATCH_ROUNDS} rounds" in got.value.reason

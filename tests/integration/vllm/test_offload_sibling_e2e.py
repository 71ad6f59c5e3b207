"""rd2h beside a real layer-wise sibling on a real Prefill engine.

Prefill runs ``Rd2hMultiConnector`` over rd2h (producer, ``buffer_reuse`` on: each
layer's next write waits for Decode to have read it) and vLLM 0.32's own
``ExampleConnector``, the CPU stand-in for a layer-wise Prefill offload (it saves
every layer of a new prompt from ``save_kv_layer`` to safetensors files, and loads
a stored prefix back from ``start_load_kv``). vLLM's ``OffloadingConnector`` and
``SimpleCPUOffloadConnector`` cannot be the sibling here: both refuse a non-GPU
platform (``CPUOffloadingSpec.get_worker``: "only supported on CUDA-alike and XPU
GPUs"; the simple one creates ``torch.cuda.Stream``s).

Checked: greedy tokens through the proxy equal the plain engine's; the sibling's own
work happened (one file per layer per prompt, holding the prompt's aligned tokens);
and a second pass over the same prompts, where the sibling supplies Prefill's prefix
from its files instead of Prefill computing it, still gives Decode the right KV.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import stall
from fakes.net import free_port, quiet_ports
from servers import proxy_server, rd2h_kv, running, vllm_server

from rd2h.demo.tiny_model import NUM_LAYERS, VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

MAX_TOKENS = 8
BLOCK = 32


def _prompt(n: int, seed: int) -> list[int]:
    return [2 + (seed * 137 + i * 29) % (VOCAB - 2) for i in range(n)]


# The sibling stores a prompt's first (n - 1) // 32 * 32 tokens; all longer than a
# block so there is something to store. Prefill runs unchunked here (the sibling, a
# debug connector, stores a prompt from the step that first schedules it).
PROMPTS = [_prompt(40, 21), _prompt(64, 22), _prompt(150, 23), _prompt(97, 24)]


def _aligned(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


def _complete(url: str, model: str, prompt) -> list[list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    resp = stall.post(url + "/v1/completions", body, 180)
    assert resp.status_code == 200, resp.text
    return [list(c["token_ids"]) for c in sorted(resp.json()["choices"],
                                                  key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, llama_model, llama_reference):
    root = tmp_path_factory.mktemp("vllm-sibling")
    store = root / "offload"
    store.mkdir()
    kv_port = quiet_ports(4)
    extra = {"transport": "cma", "log_level": "INFO",
             "deadlines": {"request_s": 40.0, "layer_ack_s": 15.0, "meta_ack_s": 10.0}}
    sibling = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    multi = {"kv_connector": "Rd2hMultiConnector",
             "kv_connector_module_path": "rd2h.adapters.vllm.multi",
             "kv_role": "kv_producer",
             "kv_connector_extra_config": {"connectors": [
                 rd2h_kv("kv_producer", kv_port, {**extra, "buffer_reuse": True}),
                 sibling,
             ]}}
    servers = {
        "prefill": vllm_server("prefill engine (rd2h + ExampleConnector)", llama_model,
                               free_port(), root / "prefill.log", kv=multi,
                               max_num_batched_tokens=512,
                               # ExampleConnector does not declare HMA support
                               args=["--disable-hybrid-kv-cache-manager"]),
        "decode": vllm_server("decode engine", llama_model, free_port(), root / "decode.log",
                              kv=rd2h_kv("kv_consumer", kv_port, extra)),
    }
    servers["proxy"] = proxy_server(
        free_port(), [servers["prefill"].url], [servers["decode"].url], root / "proxy.log"
    )
    with running(*servers.values()):
        yield {"model": str(llama_model), "base": llama_reference, "store": store, **servers}


def _logs(cluster) -> str:
    return "\n".join(f"--- {k}\n{cluster[k].tail(40)}" for k in ("prefill", "decode", "proxy"))


def _stored(store: Path) -> dict[str, dict[str, tuple[int, ...]]]:
    """Per stored prompt folder: layer file name -> the saved tensor's shape."""
    from safetensors import safe_open

    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for folder in sorted(p for p in store.iterdir() if p.is_dir()):
        out[folder.name] = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                out[folder.name][f.name] = tuple(fh.get_slice("kv_cache").get_shape())
    return out


def test_tokens_equal_the_reference_and_the_sibling_stored_every_layer(cluster):
    model, proxy, base = cluster["model"], cluster["proxy"], cluster["base"]
    for prompt in PROMPTS:
        want = _complete(base.url, model, prompt)
        got = _complete(proxy.url, model, prompt)
        assert got == want, f"prompt of {len(prompt)} tokens\n{_logs(cluster)}"

    stored = _stored(cluster["store"])
    assert len(stored) == len(PROMPTS), (stored, _logs(cluster))
    lengths = sorted(_aligned(len(p)) for p in PROMPTS)
    seen = []
    for folder, layers in stored.items():
        assert len(layers) == NUM_LAYERS, (folder, layers)
        shapes = set(layers.values())
        assert len(shapes) == 1, layers  # every layer holds the same tokens
        shape = shapes.pop()
        # the Llama's CPU cache: (2 [K, V], tokens, kv heads, head dim) or similar;
        # the token count is the one dimension equal to an aligned prompt length
        seen.append(next(d for d in shape if d in lengths))
    assert sorted(seen) == lengths, stored


def test_second_pass_prefill_prefix_from_the_sibling_still_delivers_right_kv(cluster):
    """The sibling now holds every prompt's prefix: Prefill loads it from files
    instead of computing it, and rd2h must still hand Decode the right KV."""
    model, proxy, base = cluster["model"], cluster["proxy"], cluster["base"]
    before = cluster["prefill"].log.read_text(errors="replace").count("External Cache Hit")
    for prompt in PROMPTS:
        want = _complete(base.url, model, prompt)
        got = _complete(proxy.url, model, prompt)
        assert got == want, f"prompt of {len(prompt)} tokens (second pass)\n{_logs(cluster)}"
    health = httpx.get(cluster["proxy"].url + "/healthcheck", timeout=10).json()
    assert health["pending"] == 0, health
    after = cluster["prefill"].log.read_text(errors="replace").count("External Cache Hit")
    assert after > before, "the sibling loaded nothing on the second pass\n" + _logs(cluster)

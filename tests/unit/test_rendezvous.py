"""Rendezvous rules of the proxy (pure): ids, prompt counting, bodies, the pending table."""

from __future__ import annotations

import uuid

import pytest

from rd2h.domain.wire.rendezvous import (
    ClientRequestError,
    Endpoint,
    MetaserverPostError,
    PostStatus,
    RendezvousTable,
    UnexpectedPost,
    UnknownRendezvous,
    count_prompts,
    decode_body,
    extract_rid,
    prefill_body,
)

RID = uuid.UUID(int=0xABCDEF0123456789ABCDEF0123456789).hex


def _contact(request_id: str, port: int = 30000) -> dict:
    return {
        "request_id": request_id, "do_remote_prefill": False, "do_remote_decode": True,
        "remote_engine_id": "d0", "remote_host": "10.0.0.2", "remote_port": port,
        "remote_tp_size": 2, "remote_pcp_size": 1, "remote_dcp_size": 1,
        "remote_cached_tokens": 0,
    }


@pytest.mark.parametrize("request_id", [
    f"cmpl-{RID}-0",  # completions, external id (vLLM 0.32)
    f"cmpl-{RID}-12",
    f"chatcmpl-{RID}",
    f"cmpl-{RID}-0-1a2b3c4d",  # internal id (suffix not stripped) still matches
    RID,
])
def test_extract_rid_finds_the_proxy_id(request_id: str) -> None:
    assert extract_rid(request_id) == RID


@pytest.mark.parametrize("request_id", [
    "cmpl-abc-0", f"cmpl-{RID}0-0", f"{RID}-{RID}", f"cmpl-{RID.upper()}-0", "",
])
def test_extract_rid_rejects_ids_without_exactly_one_32_hex_run(request_id: str) -> None:
    assert extract_rid(request_id) is None


@pytest.mark.parametrize(("prompt", "n"), [
    ("hello", 1), ([1, 2, 3], 1), (["a", "b", "c"], 3), ([[1, 2], [3]], 2), (["solo"], 1),
    (None, 1),
])
def test_count_prompts(prompt: object, n: int) -> None:
    body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
    assert count_prompts(body, Endpoint.COMPLETIONS) == n


def test_chat_is_one_prompt() -> None:
    assert count_prompts({"messages": [{"role": "user", "content": "x"}]}, Endpoint.CHAT) == 1


@pytest.mark.parametrize(("body", "needle"), [
    ({"prompt": []}, "empty"),
    ({"prompt": 7}, "must be a string or a list"),
    ({"prompt": ["a", [1]]}, "token-id lists"),
    ({"prompt": [1, True]}, "token-id lists"),
    ({"prompt": "x", "n": 2}, "'n'"),
    ({"prompt": "x", "use_beam_search": True}, "beam search"),
])
def test_count_prompts_rejects_unroutable_bodies(body: dict, needle: str) -> None:
    with pytest.raises(ClientRequestError, match=needle):
        count_prompts(body, Endpoint.COMPLETIONS)


def test_decode_body_adds_only_kv_transfer_params() -> None:
    body = {"model": "m", "prompt": "hi", "stream": True, "kv_transfer_params": {"x": 1}}
    out = decode_body(body, "http://proxy:8000/v1/metaserver")
    assert out == {"model": "m", "prompt": "hi", "stream": True, "kv_transfer_params": {
        "do_remote_prefill": True, "metaserver": "http://proxy:8000/v1/metaserver"}}
    assert body["kv_transfer_params"] == {"x": 1}  # the caller's dict is untouched


def test_prefill_body_is_one_token_not_streamed() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 50, "min_tokens": 5}
    params = _contact(f"chatcmpl-{RID}")
    out = prefill_body(body, Endpoint.CHAT, params)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"] == params
    assert out["messages"] == body["messages"] and body["max_tokens"] == 50
    completion = prefill_body({"prompt": "x"}, Endpoint.COMPLETIONS, params)
    assert "max_completion_tokens" not in completion


def test_single_prompt_dispatches_on_its_post_once() -> None:
    table = RendezvousTable()
    table.open(RID, Endpoint.COMPLETIONS, {"prompt": "x"}, 1, now=0.0)
    post = _contact(f"cmpl-{RID}-0")
    outcome = table.post(post)
    assert outcome.status is PostStatus.DISPATCH
    assert outcome.request.prefill_params() == post
    assert table.post(post).status is PostStatus.DUPLICATE  # a retried post
    with pytest.raises(UnexpectedPost, match="expected 1"):
        table.post(_contact(f"cmpl-{RID}-1"))
    assert table.close(RID) is not None and len(table) == 0
    with pytest.raises(UnknownRendezvous, match="no pending"):
        table.post(post)


def test_prompt_list_waits_for_every_child_then_batches() -> None:
    table = RendezvousTable()
    table.open(RID, Endpoint.COMPLETIONS, {"prompt": ["a", "b", "c"]}, 3, now=0.0)
    ids = [f"cmpl-{RID}-{i}" for i in (2, 0, 1)]
    assert table.post(_contact(ids[0], 1)).status is PostStatus.WAITING
    assert table.post(_contact(ids[0], 1)).status is PostStatus.DUPLICATE
    assert table.post(_contact(ids[1], 2)).status is PostStatus.WAITING
    outcome = table.post(_contact(ids[2], 3))
    assert outcome.status is PostStatus.DISPATCH
    params = outcome.request.prefill_params()
    assert params["do_remote_decode"] is True
    assert params["batch_kv_transfer_params"] == {
        ids[0]: _contact(ids[0], 1), ids[1]: _contact(ids[1], 2), ids[2]: _contact(ids[2], 3)}


@pytest.mark.parametrize(("post", "needle"), [
    ([1, 2], "JSON object"),
    ({"remote_host": "h"}, "request_id"),
    ({"request_id": 5}, "request_id"),
])
def test_malformed_posts_are_rejected(post: object, needle: str) -> None:
    with pytest.raises(MetaserverPostError, match=needle):
        RendezvousTable().post(post)


def test_unknown_and_foreign_ids_are_unknown() -> None:
    table = RendezvousTable()
    table.open(RID, Endpoint.CHAT, {}, 1, now=0.0)
    for request_id in ("cmpl-nohex-0", f"cmpl-{uuid.uuid4().hex}-0"):
        with pytest.raises(UnknownRendezvous, match=request_id):
            table.post(_contact(request_id))
    with pytest.raises(ValueError, match="already pending"):
        table.open(RID, Endpoint.CHAT, {}, 1, now=0.0)

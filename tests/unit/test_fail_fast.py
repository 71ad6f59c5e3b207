"""Fail fast (issue 21, part 1), one level down: the proxy's table of failed dispatches
and its watch, the Decode scheduler turning the metaserver's failures into the step's
``failed_loads``, the worker failing them at once, and a failure held back while a read
may still write into the request's blocks."""

from __future__ import annotations

import asyncio

import pytest
from fakes.logs import RecordingLogger
from fakes.metaserver import RecordingMetaserver

from rd2h.app.connector.roles import RequestFacts
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.decode.decode_session import DecodeSession, Read, SendAck
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import MfMeta, ReadReadyBatch, ReadRequest
from rd2h.proxy.outcomes import DispatchFailures, WatchError

X9 = "-abcdefgh"


def post(rid: str, engine: str) -> dict:
    return {"request_id": rid, "remote_engine_id": engine}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_watch_returns_failures_of_its_engine_only_and_moves_the_cursor() -> None:
    async def main() -> None:
        f = DispatchFailures()
        assert f.record({"a": post("a", "d1"), "b": post("b", "d2")}, "refused") == 2
        first = await f.watch({"engine_id": "d1", "cursor": 0, "wait_s": 0})
        assert first["failed"] == [["a", "refused"]]
        again = await f.watch({"engine_id": "d1", "cursor": first["cursor"], "wait_s": 0})
        assert again["failed"] == []
        assert (await f.watch({"engine_id": "d2", "cursor": 0, "wait_s": 0}))["failed"] == [
            ["b", "refused"]]
    run(main())


def test_a_waiting_watch_is_answered_as_soon_as_a_failure_is_recorded() -> None:
    async def main() -> float:
        f = DispatchFailures()
        loop = asyncio.get_running_loop()
        started = loop.time()
        loop.call_later(0.05, f.record, {"x": post("x", "d1")}, "HTTP 500")
        out = await f.watch({"engine_id": "d1", "cursor": 0, "wait_s": 5})
        assert out["failed"] == [["x", "HTTP 500"]]
        return loop.time() - started
    assert run(main()) < 1.0


def test_an_empty_watch_ends_at_its_wait() -> None:
    async def main() -> None:
        f = DispatchFailures()
        assert await f.watch({"engine_id": "d1", "cursor": 0, "wait_s": 0.05}) == {
            "cursor": 0, "failed": []}
    run(main())


def test_failures_are_bounded_per_engine_and_in_engines() -> None:
    async def main() -> None:
        f = DispatchFailures(per_engine=3, engines=2)
        f.record({f"r{i}": post(f"r{i}", "d1") for i in range(10)}, "x")
        out = await f.watch({"engine_id": "d1", "cursor": 0, "wait_s": 0})
        assert [r for r, _ in out["failed"]] == ["r7", "r8", "r9"]
        f.record({"a": post("a", "d2")}, "x")
        f.record({"b": post("b", "d3")}, "x")  # d1, the oldest engine, is dropped
        assert (await f.watch({"engine_id": "d1", "cursor": 0, "wait_s": 0}))["failed"] == []
        f.record({"c": post("c", None)}, "x")  # a post without an engine: nobody to tell
    run(main())


@pytest.mark.parametrize("body", [[], {"cursor": 0}, {"engine_id": ""},
                                  {"engine_id": "d", "cursor": -1},
                                  {"engine_id": "d", "cursor": True},
                                  {"engine_id": "d", "wait_s": "soon"}])
def test_bad_watch_requests_are_refused(body) -> None:
    with pytest.raises(WatchError):
        run(DispatchFailures().watch(body))


def test_the_scheduler_hands_failed_dispatches_to_the_workers_once() -> None:
    ms = RecordingMetaserver()
    log = RecordingLogger()
    container = bootstrap(Rd2hSettings(role="decode", host="10.1.2.3"), metaserver=ms,
                          logger=log)
    sched = container.decode_scheduler(base_port=31004, engine_id="decode-engine")
    rid = "cmpl-" + "ab" * 16 + "-0" + X9
    params = {"do_remote_prefill": True, "metaserver": "http://proxy:8000/v1/metaserver"}
    request = RequestFacts(rid, 64, 64, 0, params)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, [[1, 2]], 64)
    sched.build_connector_meta([])
    sched.update_connector_output({rid: 1})
    ext = ms.posts[0][0]
    ms.failed = {ext: "prefill dispatch failed: refused", "unknown-id": "x"}
    plan = sched.build_connector_meta([])
    assert plan.failed_loads == ((rid, "prefill dispatch failed: refused"),)
    assert not plan.idle  # the workers have something to do at once
    assert sched.build_connector_meta([]).failed_loads == ()
    assert sched.failed_fast == 1
    assert [kw["request"] for e, kw in log.at("warning") if "no KV" in e] == [rid]


NAME = "model.layers.0.attn"
SRC = SourceLayout(NAME, (TensorComponent(0x10000, 64, num_blocks=8),))
DST = DestinationLayout(NAME, (DestTensor(0x90000, 64, 8),))


def test_a_failed_load_is_reported_failed_at_the_next_step_with_its_blocks() -> None:
    s = DecodeSession(destinations={NAME: DST}, d_rank=0, d_tp=1, main_shared=False)
    s.admit("a" + X9, [3, 4], [], 0.0)
    assert s.fail_loads(["a" + X9, "never-admitted" + X9], "prefill dispatch failed") == ["a"]
    out = s.finish_step([s.local_report()], (), 0.1)
    assert out.failed == out.finished == {"a" + X9}
    assert out.invalid_block_ids == {3, 4}
    assert out.reasons["a" + X9] == "prefill dispatch failed"
    assert s.fail_loads(["a" + X9], "again") == []  # gone: nothing more to report


def test_a_failure_is_held_back_while_a_read_may_still_write_its_blocks() -> None:
    s = DecodeSession(destinations={NAME: DST}, d_rank=0, d_tp=1, main_shared=False)
    assert s.receive(b"p", MfMeta("p", {NAME: SRC.to_metadata()}), 0.0)[0] == SendAck(b"p")
    s.admit("a" + X9, [3, 4], [], 0.0)
    (read,) = s.receive(b"p", ReadReadyBatch(0, NAME, (ReadRequest("a", (1,), (), 0, 0),),
                                             (), seq=1), 0.1)
    assert isinstance(read, Read) and s.begin_read(read.token)
    s.fail_loads(["a" + X9], "prefill dispatch failed")
    held = s.finish_step([s.local_report()], (), 0.2)
    assert not held.finished and not held.failed  # vLLM would recompute into those blocks
    assert s.counters()["deferred"] == 1
    s.read_done(read.token, 0.3)
    out = s.finish_step([s.local_report()], (), 0.4)
    assert out.failed == {"a" + X9} and out.invalid_block_ids == {3, 4}
    assert s.counters()["deferred"] == 0 and s.counters()["admitted"] == 0


def test_closing_answers_every_waiting_watch_at_once() -> None:
    async def main() -> float:
        f = DispatchFailures()
        loop = asyncio.get_running_loop()
        started = loop.time()
        loop.call_later(0.05, f.close)
        assert await f.watch({"engine_id": "d1", "cursor": 0, "wait_s": 30}) == {
            "cursor": 0, "failed": []}
        return loop.time() - started
    assert run(main()) < 1.0

"""``rd2h proxy`` as a router, against the in-memory fake engines of ``test_proxy``:
health probes and ejection, pair-aware /health, the admin API and drain, honest
failures, local prefill, sidecar mode, traceparent, two proxies."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from test_proxy import PROXY, Setup, run

from rd2h.proxy.options import ProxyConfig
from rd2h.proxy.service import create_app

TOKEN = "t0ken-t0ken-t0ken-t0ken"
FAST = {"probe_interval_s": 0.05, "probe_timeout_s": 0.5, "eject_base_s": 0.2,
        "eject_max_s": 0.4}


async def until(cond: Any, what: str, deadline_s: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + deadline_s
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        await asyncio.sleep(0.02)


def completion(prompt: str = "x", **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, **kw}


def test_dead_decode_is_ejected_by_probes_and_readmitted_when_back() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2, config_kw=FAST)
        await s.client.get("/health")  # starts the probes
        d1 = s.router.apps.pop("d1:8200")  # the engine dies: connections refused
        router = s.proxy.router
        await until(lambda: not router.pools["decode"].get("http://d1:8200").healthy,
                    "the dead decode ejected")
        for i in range(4):
            r = await s.client.post("/v1/completions", json=completion(f"p{i}"))
            assert r.status_code == 200
        assert [len(d.received) for d in s.decodes] == [4, 0]
        status = (await s.client.get("/status")).json()
        [dead] = [i for i in status["instances"]["decode"] if i["url"] == "http://d1:8200"]
        assert dead["state"] == "ejected" and "probe" in dead["last_error"]
        s.router.apps["d1:8200"] = d1  # back
        await until(lambda: router.pools["decode"].get("http://d1:8200").healthy,
                    "readmitted")
        for i in range(4):
            assert (await s.client.post("/v1/completions",
                                        json=completion(f"q{i}"))).status_code == 200
        assert len(s.decodes[1].received) >= 1
        text = (await s.client.get("/metrics")).text
        assert 'rd2h_proxy_ejections_total{cause="probe",role="decode"}' in text
        assert 'rd2h_proxy_readmissions_total{role="decode"}' in text
        await s.proxy.aclose()

    run(scenario())


def test_refused_decode_is_ejected_at_once_and_the_request_fails_over() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2, config_kw={"probe_interval_s": 60})
        s.router.apps.pop("d0:8200")
        r = await s.client.post("/v1/completions", json=completion())
        assert r.status_code == 200 and len(s.decodes[1].received) == 1
        assert not s.proxy.router.pools["decode"].get("http://d0:8200").healthy
        await s.proxy.aclose()

    run(scenario())


def test_health_is_pair_aware() -> None:
    async def scenario() -> None:
        s = Setup(config_kw=FAST)
        r = await s.client.get("/health")
        assert r.status_code == 200 and r.json()["admitted"] == {"prefill": 1, "decode": 1}
        prefill = s.router.apps.pop("p0:8100")
        await until(lambda: not s.proxy.router.ready(), "prefill ejected")
        r = await s.client.get("/health")
        assert r.status_code == 503 and r.json()["admitted"]["prefill"] == 0
        # No Prefill: a request is refused at once, not sent to Decode to wait.
        r = await s.client.post("/v1/completions", json=completion())
        assert r.status_code == 503 and "no Prefill instance" in r.json()["error"]["message"]
        assert s.decodes[0].received == []
        s.router.apps["p0:8100"] = prefill
        await until(lambda: s.proxy.router.ready(), "prefill readmitted")
        assert (await s.client.get("/health")).status_code == 200
        await s.proxy.aclose()

    run(scenario())


def test_admin_api_needs_the_token_and_changes_membership() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=1, config_kw={"admin_token": TOKEN, "probe_interval_s": 60})
        body = {"role": "decode", "url": "http://d9:8200"}
        assert (await s.client.post("/admin/instances", json=body)).status_code == 401
        bad = {"Authorization": "Bearer wrong-token-wrong-token"}
        assert (await s.client.post("/admin/instances", json=body,
                                    headers=bad)).status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = await s.client.post("/admin/instances", json=body, headers=auth)
        assert r.status_code == 200 and r.json()["state"] == "admitted"
        listed = (await s.client.get("/admin/instances", headers=auth)).json()
        assert [i["url"] for i in listed["instances"]["decode"]] == [
            "http://d0:8200", "http://d9:8200"]
        r = await s.client.post("/admin/instances/remove", json=body, headers=auth)
        assert r.status_code == 200
        r = await s.client.post("/admin/instances/remove", json=body, headers=auth)
        assert r.status_code == 404
        r = await s.client.post("/admin/instances", json={"role": "x", "url": "http://a:1"},
                                headers=auth)
        assert r.status_code == 404
        r = await s.client.post("/admin/instances", json={"role": "decode", "url": "nope"},
                                headers=auth)
        assert r.status_code == 400
        await s.proxy.aclose()
        off = Setup()
        r = await off.client.get("/admin/instances", headers=auth)
        assert r.status_code == 404 and "admin API is off" in r.json()["error"]["message"]

    run(scenario())


def test_drain_lets_running_requests_finish_and_reports_drained() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2, config_kw={"admin_token": TOKEN, "probe_interval_s": 60,
                                         "decode_policy": "round_robin"})
        s.prefills[0].hang = True  # requests stay in flight until released
        auth = {"Authorization": f"Bearer {TOKEN}"}
        running = [asyncio.ensure_future(s.client.post("/v1/completions",
                                                       json=completion(f"r{i}")))
                   for i in range(4)]
        await until(lambda: sum(len(d.received) for d in s.decodes) == 4, "4 in flight")
        target = {"role": "decode", "url": "http://d0:8200"}
        r = await s.client.post("/admin/instances/drain", json=target, headers=auth)
        assert r.json() == {"role": "decode", "url": "http://d0:8200", "state": "draining",
                            "in_flight": 2}
        s.prefills[0].hang = False
        later = [asyncio.ensure_future(s.client.post("/v1/completions",
                                                     json=completion(f"n{i}")))
                 for i in range(3)]
        # Release the hung dispatches: the fake Prefill's sleep is cut short.
        for task in list(s.proxy._tasks):
            task.cancel()
        results = await asyncio.gather(*running, *later)
        state = (await s.client.get("/admin/instances/drain", params=target,
                                    headers=auth)).json()
        assert state["drained"] and state["in_flight"] == 0
        assert len(s.decodes[0].received) == 2  # nothing new went to the drained one
        assert [r.status_code for r in results[4:]] == [200, 200, 200]
        await s.proxy.aclose()

    run(scenario())


def test_prefill_error_reaches_the_client_with_its_status_and_body() -> None:
    async def scenario() -> None:
        s = Setup(n_prefill=2, prefill_status=500, config_kw={"probe_interval_s": 60})
        r = await s.client.post("/v1/completions", json=completion(stream=True))
        await s.settle()
        assert r.status_code == 500
        assert r.json() == {"id": "p", "choices": [{"text": "x"}]}  # Prefill's own body
        assert s.decodes[0].cancelled  # Decode's leg was closed
        assert [len(p.received) for p in s.prefills] == [1, 0]  # not retried: KV may be out
        assert (await s.health())["counters"]["prefill_failed"] == 1
        await s.proxy.aclose()

    run(scenario())


def test_every_prefill_unreachable_fails_the_request_at_once() -> None:
    async def scenario() -> None:
        s = Setup(n_prefill=2, config_kw={"probe_interval_s": 60})
        s.router.apps.pop("p0:8100")
        s.router.apps.pop("p1:8100")
        r = await s.client.post("/v1/completions", json=completion())
        # 502 when the dispatch met the refusals, 503 when the probes had already
        # ejected both; either way at once, naming Prefill.
        assert r.status_code in (502, 503)
        assert "Prefill" in r.json()["error"]["message"] or "prefill" in r.json()[
            "error"]["message"]
        await s.proxy.aclose()

    run(scenario())


def test_decode_client_error_is_relayed_with_its_body() -> None:
    async def scenario() -> None:
        s = Setup(config_kw={"probe_interval_s": 60})
        r = await s.client.post("/v1/completions", json=completion("reject me"))
        assert r.status_code == 400 and r.json() == {"error": {"message": "bad prompt"}}
        # A client error is not the instance's failure.
        assert s.proxy.router.pools["decode"].get("http://d0:8200").healthy
        await s.proxy.aclose()

    run(scenario())


def test_decode_holding_the_prompt_gets_no_prefill_dispatch() -> None:
    async def scenario() -> None:
        s = Setup(config_kw={"local_prefill_tokens": 16, "probe_interval_s": 60})
        r = await s.client.post("/v1/completions", json=completion("local: second turn"))
        await s.settle()
        assert r.status_code == 200
        [(_, _, body)] = s.decodes[0].received
        assert body["kv_transfer_params"]["local_prefill_tokens"] == 16
        [(_, reply)] = s.decodes[0].posts
        assert reply.json()["status"] == "local"
        assert s.prefills[0].received == []
        health = await s.health()
        assert health["counters"]["prefill_skipped"] == 1
        assert health["counters"]["incomplete_rendezvous"] == 0
        text = (await s.client.get("/metrics")).text
        assert 'rd2h_proxy_prefill_skipped_total{reason="decode_holds_prompt"} 1.0' in text
        await s.proxy.aclose()

    run(scenario())


def test_sidecar_mode_honours_the_prefiller_header_within_the_allowlist() -> None:
    async def scenario() -> None:
        s = Setup(n_prefill=2, config_kw={"prefiller_header": True, "probe_interval_s": 60})
        for _ in range(3):
            r = await s.client.post("/v1/completions", json=completion(),
                                    headers={"x-prefiller-host-port": "p1:8100"})
            assert r.status_code == 200
        await s.settle()
        assert [len(p.received) for p in s.prefills] == [0, 3]
        r = await s.client.post("/v1/completions", json=completion(),
                                headers={"x-prefiller-host-port": "evil:8100"})
        assert r.status_code == 403 and "not one of" in r.json()["error"]["message"]
        assert len(s.decodes[0].received) == 3  # refused before Decode
        await s.proxy.aclose()

    run(scenario())


def test_client_traceparent_is_relayed_on_both_legs() -> None:
    async def scenario() -> None:
        s = Setup(config_kw={"probe_interval_s": 60})
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        r = await s.client.post("/v1/completions", json=completion(),
                                headers={"traceparent": trace})
        await s.settle()
        assert r.status_code == 200
        [(_, d_headers, d_body)] = s.decodes[0].received
        [(_, p_headers, p_body)] = s.prefills[0].received
        assert d_headers["traceparent"] == p_headers["traceparent"] == trace
        assert d_body["kv_transfer_params"]["traceparent"] == trace
        assert p_body["kv_transfer_params"]["traceparent"] == trace
        await s.proxy.aclose()

    run(scenario())


def test_two_proxies_share_engines_each_owning_its_rendezvous() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2, n_prefill=2, config_kw={"probe_interval_s": 60})
        second_url = "http://proxy2:8000"
        config = ProxyConfig(prefill=("http://p0:8100", "http://p1:8100"),
                             decode=("http://d0:8200", "http://d1:8200"),
                             public_url=second_url, probe_interval_s=60)
        app2 = create_app(config, transport=s.router)
        s.router.add(second_url, app2)
        clients = [s.client, httpx.AsyncClient(transport=httpx.ASGITransport(app=app2),
                                               base_url=second_url)]
        answers = await asyncio.gather(*(
            clients[i % 2].post("/v1/completions", json=completion(f"c{i}"))
            for i in range(8)))
        await s.settle()
        assert [a.status_code for a in answers] == [200] * 8
        # Each request's rendezvous named the proxy it came through: 4 each.
        owners = [body["kv_transfer_params"]["metaserver"] for d in s.decodes
                  for (_, _, body) in d.received]
        assert sorted(owners) == sorted([f"{PROXY}/v1/metaserver"] * 4
                                        + [f"{second_url}/v1/metaserver"] * 4)
        assert sum(len(p.received) for p in s.prefills) == 8
        assert len(s.proxy.table) == 0 and len(app2.state.proxy.table) == 0
        await s.proxy.aclose()
        await app2.state.proxy.aclose()

    run(scenario())


def test_routing_config_is_validated() -> None:
    base = {"prefill": ("http://p:1",), "decode": ("http://d:1",), "public_url": PROXY}
    for kw, needle in [({"decode_policy": "random"}, "decode_policy"),
                       ({"admin_token": "short"}, "16 characters"),
                       ({"eject_after": 0}, "eject_after"),
                       ({"eject_after_probe_timeouts": 0}, "probe_timeouts"),
                       ({"local_prefill_tokens": -1}, "local_prefill_tokens"),
                       ({"probe_interval_s": 0}, "probe_interval_s")]:
        try:
            ProxyConfig(**base, **kw)
        except ValueError as exc:
            assert needle in str(exc)
        else:
            raise AssertionError(f"{kw} accepted")




def test_prefill_failure_can_be_left_to_decode() -> None:
    async def scenario() -> None:
        # Decode told at once applies its kv_load_failure_policy (here: it answers).
        s = Setup(prefill_status=500, wait_for_kv=False,
                  config_kw={"on_prefill_failure": "decode", "probe_interval_s": 60})
        r = await s.client.post("/v1/completions", json=completion())
        await s.settle()
        assert r.status_code == 200 and not s.decodes[0].cancelled
        assert s.proxy.failures.recorded == 1  # Decode was told (the watch)
        await s.proxy.aclose()

    run(scenario())


def test_decode_failing_a_request_whose_prefill_failed_says_why() -> None:
    """``--on-prefill-failure decode`` with no Prefill answering: Decode fails the request
    (its policy ``fail``: vLLM answers a bare 500); the client's error names the Prefill
    failure and quotes Decode."""
    async def scenario() -> None:
        s = Setup(prefill_status=503, wait_for_kv=False,
                  fails_when=lambda: s.proxy.failures.recorded >= 1,
                  config_kw={"on_prefill_failure": "decode", "probe_interval_s": 60})
        r = await s.client.post("/v1/completions", json=completion())
        await s.settle()
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("decode failed the request after its prefill failed ("), \
            message
        assert "HTTP 503" in message and message.endswith(
            "decode said: Internal server error"), message
        await s.proxy.aclose()

    run(scenario())


def test_cli_routing_flags_reach_the_config(monkeypatch) -> None:
    import rd2h.bootstrap.gateways as gateways
    from rd2h.cli.main import main

    seen: dict[str, Any] = {}
    monkeypatch.setattr(gateways, "serve_proxy",
                        lambda config, host, port, level, timeline_dir: seen.update(
                            config=config))
    monkeypatch.setenv("RD2H_PROXY_ADMIN_TOKEN", TOKEN)
    assert main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2",
                 "--decode-policy", "power_of_two", "--prefill-policy", "round_robin",
                 "--probe-interval", "0.5", "--probe-timeout", "0.25", "--eject-after", "2",
                 "--eject-after-probe-timeouts", "3",
                 "--eject-backoff", "0.5", "--eject-backoff-max", "8",
                 "--engine-metrics", "3", "--affinity-chunk", "0", "--affinity-slack", "1",
                 "--local-prefill-tokens", "32", "--prefiller-header",
                 "--on-prefill-failure", "decode"]) == 0
    c = seen["config"]
    assert (c.decode_policy, c.prefill_policy, c.probe_interval_s, c.probe_timeout_s,
            c.eject_after, c.eject_base_s, c.eject_max_s, c.engine_metrics_s,
            c.affinity_chunk_chars, c.affinity_slack, c.local_prefill_tokens,
            c.prefiller_header, c.on_prefill_failure, c.admin_token,
            c.eject_after_probe_timeouts) == (
        "power_of_two", "round_robin", 0.5, 0.25, 2, 0.5, 8.0, 3.0, 0, 1.0, 32, True,
        "decode", TOKEN, 3)


def test_proxy_admin_cli_against_a_running_proxy(capsys) -> None:
    import threading

    import uvicorn
    from fakes.net import free_port

    from rd2h.cli.main import main

    port = free_port()
    config = ProxyConfig(prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:9",),
                         public_url=f"http://127.0.0.1:{port}", admin_token=TOKEN,
                         probe_interval_s=60)
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            threading.Event().wait(0.05)
        proxy = ["proxy-admin", "--proxy", f"http://127.0.0.1:{port}", "--token", TOKEN]
        assert main([*proxy, "add", "decode", "http://127.0.0.1:8201"]) == 0
        assert main([*proxy, "drain", "decode", "http://127.0.0.1:8201", "--wait", "5"]) == 0
        assert "drained: decode http://127.0.0.1:8201" in capsys.readouterr().out
        assert main([*proxy, "status"]) == 0
        out = capsys.readouterr().out
        assert '"url": "http://127.0.0.1:8201"' in out and '"state": "drained"' in out
        assert main(["proxy-admin", "--proxy", f"http://127.0.0.1:{port}", "--token",
                     "wrong-token-wrong-token", "status"]) == 1
        assert "HTTP 401" in capsys.readouterr().err
        assert main([*proxy, "remove", "decode", "http://127.0.0.1:1"]) == 1
        assert main([*proxy, "drain"]) == 2  # needs ROLE and URL
    finally:
        server.should_exit = True
        thread.join(10)


def test_engine_metrics_steer_picking_away_from_a_waiting_queue() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2, config_kw={"probe_interval_s": 0.05, "engine_metrics_s": 0.05})
        waiting = {"http://d0:8200": 7.0, "http://d1:8200": 0.0}
        for url, fake in zip(waiting, s.decodes):
            async def metrics(url: str = url) -> Any:
                from fastapi.responses import PlainTextResponse

                return PlainTextResponse(
                    f'vllm:num_requests_waiting{{engine="0"}} {waiting[url]}\n'
                    f'vllm:kv_cache_usage_perc{{engine="0"}} 0.5\n')
            fake.app.get("/metrics")(metrics)
        await s.client.get("/health")  # starts the probes and scrapes
        pool = s.proxy.router.pools["decode"]
        await until(lambda: pool.get("http://d0:8200").engine_waiting == 7.0, "scraped")
        for i in range(4):
            assert (await s.client.post("/v1/completions",
                                        json=completion(f"w{i}"))).status_code == 200
        assert [len(d.received) for d in s.decodes] == [0, 4]
        status = (await s.client.get("/status")).json()["instances"]["decode"]
        assert status[0]["engine_waiting"] == 7.0 and status[0]["engine_kv_usage"] == 0.5
        await s.proxy.aclose()

    run(scenario())


def test_an_engine_that_just_came_up_is_probed_at_once_when_none_is_admitted() -> None:
    async def scenario() -> None:
        # Probes every minute: only the on-demand probe can readmit in time.
        s = Setup(config_kw={"probe_interval_s": 60, "eject_base_s": 0.05,
                             "eject_max_s": 0.05})
        d0 = s.router.apps.pop("d0:8200")  # still starting
        await s.client.get("/health")  # the first probe round ejects it
        pool = s.proxy.router.pools["decode"]
        await until(lambda: not pool.get("http://d0:8200").healthy, "ejected at start")
        s.router.apps["d0:8200"] = d0  # up now
        await asyncio.sleep(0.1)  # its back-off is over
        r = await s.client.post("/v1/completions", json=completion())
        assert r.status_code == 200 and pool.get("http://d0:8200").healthy
        await s.proxy.aclose()

    run(scenario())


def test_a_restarted_only_decode_serves_at_once_whatever_its_back_off() -> None:
    async def scenario() -> None:
        # Probes every minute and a back-off of a minute: only the rule "nothing else
        # to route to" can readmit the only Decode in time.
        s = Setup(config_kw={"probe_interval_s": 60, "eject_base_s": 60,
                             "eject_max_s": 60})
        d0 = s.router.apps.pop("d0:8200")  # killed
        await s.client.get("/health")  # the first probe round ejects it
        pool = s.proxy.router.pools["decode"]
        inst = pool.get("http://d0:8200")
        await until(lambda: not inst.healthy, "ejected")
        down = await asyncio.gather(*(s.client.post("/v1/completions", json=completion())
                                      for _ in range(4)))
        assert [r.status_code for r in down] == [503] * 4
        assert inst.ejected_until > asyncio.get_running_loop().time()
        s.router.apps["d0:8200"] = d0  # restarted
        ups = await asyncio.gather(*(s.client.post("/v1/completions", json=completion())
                                     for _ in range(8)))
        assert [r.status_code for r in ups] == [200] * 8 and inst.healthy
        await s.proxy.aclose()

    run(scenario())


def test_rescue_probes_once_for_many_requests_and_keeps_a_hung_engine_out() -> None:
    async def scenario() -> None:
        s = Setup(config_kw={"probe_interval_s": 60, "probe_timeout_s": 0.3,
                             "eject_base_s": 60, "eject_max_s": 60})
        d0 = s.router.apps.pop("d0:8200")
        await s.client.get("/health")
        router = s.proxy.router
        inst = router.pools["decode"].get("http://d0:8200")
        await until(lambda: not inst.healthy, "ejected")
        probes = 0
        real = router._probe

        async def counted(i, scrape):
            nonlocal probes
            probes += 1
            await asyncio.sleep(0.1)  # a slow answer: requests pile up behind it
            await real(i, scrape)

        router._probe = counted
        down = await asyncio.gather(*(s.client.post("/v1/completions", json=completion())
                                      for _ in range(6)))
        assert [r.status_code for r in down] == [503] * 6
        assert probes < 6, probes  # one rescue at a time, not one per request
        # A hung engine (its /health connects but never answers) stays out.
        router._probe = real

        async def hang(request: httpx.Request) -> None:  # as httpx's deadline ends it
            await asyncio.sleep(0.3)
            raise httpx.ReadTimeout("timed out", request=request)

        s.router.faults[("d0:8200", "/health")] = [hang] * 4
        s.router.apps["d0:8200"] = d0
        r = await s.client.post("/v1/completions", json=completion())
        assert r.status_code == 503 and not inst.healthy
        s.router.faults.clear()
        await s.proxy.aclose()

    run(scenario())


def test_failover_leaves_no_request_counted_in_flight_on_either_instance() -> None:
    async def scenario() -> None:
        # p0 refuses: the dispatch moves to p1; in-flight counts must end at 0 on both
        # (a count left on p0 would keep least-outstanding off it for good).
        s = Setup(n_prefill=2, config_kw={"probe_interval_s": 60})

        async def refuse(request: httpx.Request) -> None:
            raise httpx.ConnectError("connection refused", request=request)

        # p0 answers its probes but refuses the dispatch (it died in between).
        s.router.faults[("p0:8100", "/v1/completions")] = [refuse]
        r = await s.client.post("/v1/completions", json=completion())
        await s.settle()
        assert r.status_code == 200 and len(s.prefills[1].received) == 1
        pool = s.proxy.router.pools["prefill"]
        assert [i.in_flight for i in pool] == [0, 0]
        assert [i.in_flight for i in s.proxy.router.pools["decode"]] == [0]
        await s.proxy.aclose()

    run(scenario())

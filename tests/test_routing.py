"""Routing through a real gateway: by load, by what engines report, by conversation, in turn."""

import collections
import concurrent.futures
import json
import socket

from tests.conftest import make_key, post, wait_until
from tests.test_blame import read_again


def fingerprint(raw: bytes) -> str:
    return json.loads(raw)["system_fingerprint"]


def chat(content, max_tokens=4):
    return {"model": "sim", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}


SYSTEM = {"role": "system", "content": "You are a careful assistant for the accounts team. " * 20}


def conversation(gw, key, turns: int, asked=lambda turn: f"question {turn}") -> list[str]:
    """TURNS turns of one conversation (SYSTEM, then ASKED(turn), each answer sent back): who served each."""
    messages, served = [SYSTEM], []
    for turn in range(turns):
        messages.append({"role": "user", "content": asked(turn)})
        status, _, raw = post(gw.url + "/v1/chat/completions", {"model": "sim", "max_tokens": 4,
                                                                "messages": messages}, key)
        assert status == 200, raw
        served.append(fingerprint(raw))
        messages.append(json.loads(raw)["choices"][0]["message"])
    return served


def start(tmp_path, make_gateway, sims, workers=2, **settings):
    url = f"sqlite:///{tmp_path}/routing.db"
    key = make_key(url)
    endpoints = [{"id": s.replica, "url": s.url, "models": ["sim"]} for s in sims]
    return make_gateway(store_url=url, endpoints=endpoints, workers=workers, **settings), key


def test_a_slow_replica_gets_less_than_round_robin_would_give_it(tmp_path, make_gateway, make_sim):
    slow = make_sim(replica="slow", ttft_ms=300, tokens_per_s=20)
    fast = make_sim(replica="fast", ttft_ms=5, tokens_per_s=0)
    gw, key = start(tmp_path, make_gateway, [slow, fast], routing__affinity_prefix_bytes=0)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: post(gw.url + "/v1/chat/completions", chat(f"q{i}"), key), range(60)))
    served = collections.Counter(fingerprint(raw) for status, _, raw in results if status == 200)
    assert sum(served.values()) == 60
    # Round-robin would send 30 to each; going by outstanding requests, the slow one keeps few.
    assert served["sim-slow"] <= 15, served


def test_load_reported_by_the_engine_steers_requests_away(tmp_path, make_gateway, make_sim):
    busy = make_sim(replica="busy", ttft_ms=1, tokens_per_s=2)
    idle = make_sim(replica="idle", ttft_ms=1, tokens_per_s=0)
    gw, key = start(tmp_path, make_gateway, [busy, idle], workers=1, routing__affinity_prefix_bytes=0,
                    routing__metrics_interval=0.2)
    # A worker reads the engines of the models it routes to: one request first.
    assert post(gw.url + "/v1/chat/completions", chat("first"), key)[0] == 200
    # Eight long requests straight to the busy engine: another gateway's traffic, unseen by this one.
    others = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", busy.port))
        payload = json.dumps({**chat("elsewhere", 60), "stream": True}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                  str(len(payload)).encode() + b"\r\n\r\n" + payload)
        others.append(s)
    wait_until("the busy engine to be busy", 30, lambda: busy.metrics()["vllm:num_requests_running"] == 8)
    # The worker has read the busy engine since: twice (the second began after the first had set what it read).
    read_again(busy, 2, "the worker reading the busy engine")
    served = collections.Counter(fingerprint(post(gw.url + "/v1/chat/completions", chat(f"q{i}"), key)[2])
                                 for i in range(30))
    for s in others:
        s.close()
    # One at a time, this gateway's own counts are equal; only the engine's figures tell them apart.
    assert served == {"sim-idle": 30}, served


def test_a_conversation_sticks_to_the_replica_that_has_its_history(tmp_path, make_gateway, make_sim):
    sims = [make_sim(replica=f"r{i}", ttft_ms=1, tokens_per_s=0) for i in range(3)]
    gw, key = start(tmp_path, make_gateway, sims, workers=2)
    homes = {}
    for c in range(6):
        served = conversation(gw, key, 3, lambda turn, c=c: f"conversation {c} asks question {turn}")
        # Both workers, every later turn: one replica, which had the turns before cached. (A first turn goes
        # to the least loaded, which is the same one unless a worker's figures showed another's request there.)
        assert len(set(served[1:])) == 1, served
        homes[c] = served[-1]
    # Conversations sharing only their system prompt are spread, and every replica caches that prompt once:
    # of about 3,500 prompt tokens, the misses are its 180 on each replica, a turn's new words, and at worst
    # each conversation's first turn again: at most 1,300.
    assert len(set(homes.values())) > 1, homes
    queried = sum(s.metrics()["vllm:prefix_cache_queries_total"] for s in sims)
    hits = sum(s.metrics()["vllm:prefix_cache_hits_total"] for s in sims)
    assert hits / queried > 0.6, (hits, queried)
    spread = {fingerprint(post(gw.url + "/v1/chat/completions", chat(f"unrelated prompt {i}" * 3), key)[2])
              for i in range(30)}
    assert len(spread) == 3, spread


def test_round_robin_is_a_policy_an_operator_can_pick(tmp_path, make_gateway, make_sim):
    sims = [make_sim(replica=f"r{i}", ttft_ms=1, tokens_per_s=0) for i in range(3)]
    gw, key = start(tmp_path, make_gateway, sims, workers=1, routing__policy="round-robin")
    served = [fingerprint(post(gw.url + "/v1/chat/completions", chat("the same question"), key)[2])
              for _ in range(6)]
    assert sorted(served) == ["sim-r0", "sim-r0", "sim-r1", "sim-r1", "sim-r2", "sim-r2"], served
    assert served[:3] == served[3:]  # each in turn, in the same order


def test_weights_share_the_traffic(tmp_path, make_gateway, make_sim):
    heavy = make_sim(replica="heavy", ttft_ms=50, tokens_per_s=0)
    light = make_sim(replica="light", ttft_ms=50, tokens_per_s=0)
    url = f"sqlite:///{tmp_path}/weights.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, workers=1, routing__affinity_prefix_bytes=0,
                      endpoints=[{"id": "heavy", "url": heavy.url, "models": ["sim"], "weight": 4.0},
                                 {"id": "light", "url": light.url, "models": ["sim"], "weight": 1.0}])
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: post(gw.url + "/v1/chat/completions", chat(f"w{i}"), key), range(100)))
    served = collections.Counter(fingerprint(raw) for _, _, raw in results)
    assert served["sim-heavy"] >= 65, served


def test_a_keys_routing_profile_routes_it_otherwise_than_the_gateways_default(tmp_path, make_gateway, make_sim):
    # A batch job's key goes round in turn; everyone else's conversations keep to the replica with their
    # history (the gateway's default policy, `prefix`).
    sims = [make_sim(replica=f"r{i}", ttft_ms=1, tokens_per_s=0) for i in range(3)]
    url = f"sqlite:///{tmp_path}/routing.db"
    chatty, batch = make_key(url, "chatty"), make_key(url, "batch", profile="batch")
    gw = make_gateway(store_url=url, workers=1, endpoints=[{"id": s.replica, "url": s.url, "models": ["sim"]}
                                                            for s in sims],
                      routing_profiles=[{"name": "batch", "policy": "round-robin", "total": 600.0}])
    assert len(set(conversation(gw, chatty, 6)[1:])) == 1
    assert sorted(conversation(gw, batch, 6)) == ["sim-r0", "sim-r0", "sim-r1", "sim-r1", "sim-r2", "sim-r2"]


def test_a_models_routing_profile_gives_way_to_its_keys_and_an_unknown_name_to_the_model(tmp_path, make_gateway,
                                                                                          make_sim):
    slow = make_sim(replica="slow", ttft_ms=1500, tokens_per_s=0)
    url = f"sqlite:///{tmp_path}/profiles.db"
    plain, patient, ghost = make_key(url, "plain"), make_key(url, "patient", profile="patient"), \
        make_key(url, "ghost", profile="ghost")
    gw = make_gateway(store_url=url, workers=1, endpoints=[{"id": "slow", "url": slow.url, "models": ["sim"]}],
                      models=[{"name": "sim", "routing_profile": "hasty"}],
                      routing_profiles=[{"name": "hasty", "total": 0.3, "attempts": 1},
                                        {"name": "patient", "total": 60.0}])
    status, _, raw = post(gw.url + "/v1/chat/completions", chat("hello"), plain)
    assert status == 504 and "timeouts.total (or its routing profile's total)" in json.loads(raw)["error"]["message"]
    assert post(gw.url + "/v1/chat/completions", chat("hello"), patient)[0] == 200  # the key's profile first
    assert post(gw.url + "/v1/chat/completions", chat("hello"), ghost)[0] == 504  # no such profile: the model's
    assert post(gw.url + "/v1/chat/completions", chat("hello"), ghost)[0] == 504
    assert gw.log().count("routing profile 'ghost' is named by a key or a model but not defined here") == 1


def test_a_models_routing_profile_travels_from_the_catalog_to_gateways():
    import pytest

    from llmgw.control import catalog, publisher
    from llmgw.gateway.follower import from_controller
    from llmgw.gateway.snapshot import Snapshot
    from llmgw.wire import gateways

    profiles = [{"engine": "sim"}]
    batch = catalog.parse_model({"name": "b", "source": "/m", "routing_profile": "batch", "profiles": profiles})
    plain = catalog.parse_model({"name": "p", "source": "/m", "profiles": profiles})
    body = publisher.snapshot_body({"b": batch, "p": plain}, [])
    assert "routing_profile" not in next(m for m in body["models"] if m["name"] == "p")  # absent: none
    message = gateways.decode(gateways.encode("snapshot", epoch="e", version=1, **body))
    snapshot = from_controller(message, Snapshot(version=0, models={}, replicas={}))
    assert snapshot.models["b"].routing_profile == "batch" and snapshot.models["p"].routing_profile is None
    with pytest.raises(catalog.CatalogError, match="routing_profile names"):
        catalog.parse_model({"name": "x", "source": "/m", "profiles": profiles, "routing_profile": "a/b"})

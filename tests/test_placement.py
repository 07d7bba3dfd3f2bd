import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control import catalog, placement
from llmgw.control.fleet import Fleet, NodeView, node_facts
from llmgw.control.reconciler import Replicas, Start, Stop, plan

GiB = 1024 ** 3


def node(node_id, state="ready", engines=("sim", "llamacpp"), gpus=(), memory_gb=64, labels=None,
         engines_probed=True, status=None, **registration):
    """A node as the fleet describes it, from the registration (and heartbeat STATUS) it would send."""
    registration = {"engines": {e: "1" for e in engines}, "engines_probed": engines_probed, "labels": labels or {},
                    "memory": {"total_bytes": memory_gb * GiB},
                    "gpus": [{"index": i, "class": c, "health": "ok"} for i, c in enumerate(gpus)], **registration}
    return NodeView(node_id, state, 0.0, 0.0, node_facts(registration, status or {}))


def model(name="m", low=1, high=1, **profile):
    return catalog.parse_model({"name": name, "source": "/m.gguf", "scaling": {"min": low, "max": high},
                                "profiles": [{"engine": "sim", **profile}]})


def test_every_refusal_has_a_reason():
    nodes = [node("down", state="unreachable"), node("old", engines=(), engines_probed=False), node("cpu"),
             node("r2", gpus=["h100-80g"], labels={"rack": "r2"}), node("small", gpus=["l40s-45g"] * 2, memory_gb=8)]
    m = model(gpu_class="h100-80g", gpus=1, node_selector={"rack": "r1"}, min_memory_gb=16)
    decision, reasons = placement.place(m, nodes, [])
    assert decision is None
    assert reasons == {"down": "node is unreachable",
                       "old": "the node has not said which engines it runs (an old agent?)",
                       "cpu": "label rack=r1 wanted, node has rack=(unset)",
                       "r2": "label rack=r1 wanted, node has rack=r2",
                       "small": "label rack=r1 wanted, node has rack=(unset)"}


def test_memory_is_never_double_booked():
    m = model(min_memory_gb=40)
    claims = [placement.Claim("a", "other", 40 * GiB, ())]
    decision, reasons = placement.place(m, [node("a", memory_gb=64)], claims)
    assert decision is None and reasons["a"] == "needs 40.0 GiB of memory, 24.0 GiB unclaimed of 64.0 GiB"


def test_free_gpu_indices_and_spread():
    m = model(gpu_class="h100-80g", gpus=2)
    nodes = [node("a", gpus=["h100-80g"] * 4), node("b", gpus=["h100-80g"] * 4)]
    claims = [placement.Claim("a", "m", 0, (0, 1))]
    decision, _ = placement.place(m, nodes, claims)
    assert decision.node_id == "b" and decision.gpus == (0, 1)  # fewer replicas of this model there
    decision, _ = placement.place(m, nodes[:1], claims)
    assert decision.gpus == (2, 3)


def test_profiles_are_tried_by_priority():
    m = catalog.parse_model({"name": "m", "source": "/m", "profiles": [
        {"name": "cpu", "engine": "llamacpp", "priority": 100},
        {"name": "gpu", "engine": "vllm", "gpu_class": "h100-80g", "gpus": 1, "priority": 200}]})
    decision, _ = placement.place(m, [node("a", engines=("vllm", "llamacpp"), gpus=["h100-80g"])], [])
    assert decision.profile.name == "gpu"
    decision, reasons = placement.place(m, [node("b")], [])
    assert decision.profile.name == "cpu" and "b (gpu)" in reasons


def test_plan_starts_stops_and_backs_off():
    replicas = Replicas(base_backoff=10)
    models = {"m": model(low=2, high=3)}
    nodes = [node("a"), node("b")]
    actions, _ = plan(models, nodes, replicas, now=0.0)
    assert [type(a) for a in actions] == [Start, Start]
    assert {a.decision.node_id for a in actions} == {"a", "b"}
    # Planned replicas count at once: a second pass starts nothing more.
    assert plan(models, nodes, replicas, now=1.0)[0] == []
    shard = actions[0].shard_id
    replicas.report("a", {"shard_id": shard, "state": "failed", "model": "m", "detail": "boom",
                          "last_output": ["x"]}, now=2.0)
    assert plan(models, nodes, replicas, now=3.0)[0] == []  # backing off until 12
    assert replicas.failures["m"].last_output == ["x"]
    assert [type(a) for a in plan(models, nodes, replicas, now=12.5)[0]] == [Start]
    # Scaled down: the extra replica is stopped, a not-yet-ready one first.
    actions = plan({"m": model(low=1, high=1)}, nodes, replicas, now=13.0)[0]
    assert [type(a) for a in actions] == [Stop]


def test_plan_replaces_replicas_of_a_lost_node_and_stops_removed_models():
    replicas = Replicas()
    replicas.report("a", {"shard_id": "m-1", "state": "ready", "model": "m"}, now=0.0)
    replicas.report("b", {"shard_id": "gone-1", "state": "ready", "model": "gone"}, now=0.0)
    nodes = [node("a", state="lost"), node("b")]
    actions, _ = plan({"m": model()}, nodes, replicas, now=1.0)
    kinds = sorted((type(a).__name__, getattr(a, "shard_id", "")) for a in actions)
    assert kinds[0] == ("Start", kinds[0][1]) and ("Stop", "gone-1") in kinds
    # Its engine may still answer: it stays served until its replacement is ready, then it is retired.
    assert replicas.items["m-1"].state == "ready"
    assert plan({"m": model()}, nodes, replicas, now=2.0)[0] == [] and "m-1" in replicas.items
    replicas.report("b", {"shard_id": kinds[0][1], "state": "ready", "model": "m"}, now=3.0)
    assert plan({"m": model()}, nodes, replicas, now=4.0)[0] == []
    assert "m-1" not in replicas.items
    # Its node comes back, still running it: it is stopped, and never served again meanwhile.
    replicas.registered("a", [{"shard_id": "m-1", "state": "ready", "model": "m", "url": "http://a:1"}], now=5.0)
    assert replicas.items["m-1"].state == "stopping"
    actions, _ = plan({"m": model()}, [node("a"), node("b")], replicas, now=6.0)
    assert [(type(a), a.shard_id) for a in actions] == [(Stop, "m-1")]
    replicas.report("a", {"shard_id": "m-1", "state": "stopped", "model": "m"}, now=7.0)
    assert "m-1" not in replicas.items and replicas.retired == {}


def test_a_late_agents_replica_and_its_duplicate_keep_the_one_serving_longest():
    replicas = Replicas()
    actions, _ = plan({"m": model()}, [node("b")], replicas, now=100.0)  # a's agent is not back yet
    duplicate = actions[0].shard_id
    replicas.report("b", {"shard_id": duplicate, "state": "ready", "model": "m", "ready_s": 0.0}, now=101.0)
    # a's agent registers late, listing the replica it has served for an hour.
    replicas.registered("a", [{"shard_id": "m-old", "state": "ready", "model": "m", "ready_s": 3600.0}], now=102.0)
    actions, _ = plan({"m": model()}, [node("a"), node("b")], replicas, now=103.0)
    assert [(type(a), a.shard_id) for a in actions] == [(Stop, duplicate)]
    assert replicas.items["m-old"].state == "ready"


def test_a_registration_lists_everything_the_node_runs():
    replicas = Replicas()
    replicas.report("a", {"shard_id": "died", "state": "ready", "model": "m"}, now=0.0)
    replicas.report("a", {"shard_id": "kept", "state": "ready", "model": "m"}, now=0.0)
    plan({"m": model(low=3, high=3)}, [node("a")], replicas, now=1.0)  # one more placed: pending
    pending = [r.shard_id for r in replicas.items.values() if r.state == "pending"]
    replicas.registered("a", [{"shard_id": "kept", "state": "ready", "model": "m"}], now=2.0)
    # The engine that died while the agent was away is forgotten (and will be replaced); the one
    # just placed is kept: its start may still be on its way.
    assert sorted(replicas.items) == sorted(["kept", *pending])


@pytest.mark.parametrize("table, words", [
    ({"name": "m"}, "source is required"),
    ({"name": "m", "source": "/x"}, "at least one profile"),
    ({"name": "m", "source": "/x", "profiles": [{"engine": "tgi"}]}, "engine must be one of"),
    ({"name": "m", "source": "/x", "profiles": [{"engine": "sim", "gpus": "2"}]}, "gpus has the wrong type"),
    ({"name": "m", "source": "/x", "scaling": {"min": 3, "max": 1}, "profiles": [{"engine": "sim"}]}, "0 <= min <= max"),
    ({"name": "m", "source": "/x", "scaling": {"idle_timeout": "soon"}, "profiles": [{"engine": "sim"}]}, "30d"),
    ({"name": "m", "source": "/x", "profiles": [{"engine": "sim", "colour": 1}]}, "unknown key 'colour'"),
    ({"name": "m", "source": "/x", "profiles": [{"engine": "sim", "min_memory_gb": float("nan")}]},
     "min_memory_gb is a number, 0 or more, not nan"),
    ({"name": "m", "source": "/x", "profiles": [{"engine": "sim", "min_memory_gb": float("inf")}]}, "not inf"),
    ({"name": "m", "source": "/x", "profiles": [{"engine": "sim", "weight": -1}]}, "weight is a number, 0 or more"),
    ({"name": "m", "source": "/x", "max_output": "abc", "profiles": [{"engine": "sim"}]}, "max_output is a number"),
    ({"name": "m", "source": "/x", "max_context": 0, "profiles": [{"engine": "sim"}]}, "max_context is a number"),
    ({"name": "m", "source": "/x", "max_output": 2**64, "profiles": [{"engine": "sim"}]}, "from 1 to 2147483647"),
    ({"name": "m", "source": "/x", "max_output": True, "profiles": [{"engine": "sim"}]}, "max_output is a number"),
])
def test_bad_models_are_refused_naming_the_field(table, words):
    with pytest.raises(catalog.CatalogError, match=words):
        catalog.parse_model(table)


def test_fingerprint_follows_what_changes_the_engine():
    a = model(args=["--ctx-size", "4096"])
    b = model(args=["--ctx-size", "8192"])
    assert a.fingerprint(a.profiles[0]) != b.fingerprint(b.profiles[0])
    assert a.fingerprint(a.profiles[0]) == model(args=["--ctx-size", "4096"]).fingerprint(a.profiles[0])
    assert model(low=1).fingerprint(a.profiles[0]) == model(low=3, high=3).fingerprint(a.profiles[0])


def test_a_node_without_disk_for_the_download_is_skipped():
    m = catalog.parse_model({"name": "m", "source": "http://mirror/m.gguf", "size_bytes": 50 * GiB,
                             "profiles": [{"engine": "sim"}]})
    small = node("small", disk={"free_bytes": 20 * GiB})
    # The latest heartbeat wins over registration.
    big = node("big", disk={"free_bytes": 20 * GiB}, status={"disk": {"free_bytes": 200 * GiB}})
    decision, reasons = placement.place(m, [small, big], [])
    assert decision.node_id == "big"
    assert reasons["small"] == "needs 50.0 GiB of disk for the weights, 20.0 GiB free in its weights directory"


def test_a_gpu_that_fails_after_registration_is_no_longer_offered():
    fleet = Fleet(15, 60)
    fleet.register("a", {"node_id": "a", "engines": {"sim": "1"}, "engines_probed": True,
                         "memory": {"total_bytes": 64 * GiB},
                         "gpus": [{"index": i, "class": "h100-80g", "health": "ok"} for i in (0, 1)]}, b"a", 0.0)
    two = model(gpu_class="h100-80g", gpus=2)
    assert placement.place(two, fleet.describe(1.0), [])[0].gpus == (0, 1)
    # A heartbeat speaks for the cards it names: GPU 0 keeps its health, GPU 1 has failed since.
    fleet.heartbeat("a", {"seq": 1, "gpus": [{"index": 1, "memory_used_bytes": 0, "health": "failed"}]}, b"a", 5.0)
    nodes = fleet.describe(5.0)
    assert [(g.index, g.health, g.gpu_class) for g in nodes[0].facts.gpus] == [(0, "ok", "h100-80g"),
                                                                              (1, "failed", "h100-80g")]
    decision, _ = placement.place(model(gpu_class="h100-80g", gpus=1), nodes, [])
    assert decision.gpus == (0,)
    decision, reasons = placement.place(two, nodes, [])
    assert decision is None and reasons == {"a": "needs 2 x h100-80g, 1 free of 2; GPU 1 is unhealthy (failed)"}
    # Held by a replica, GPU 0 is not free either; a card whose health was never said is not offered.
    held = [placement.Claim("a", "other", 0, (0,))]
    assert placement.place(model(gpus=1), nodes, held)[1] == {"a": "needs 1 x any GPU, 0 free of 2; "
                                                                     "GPU 1 is unhealthy (failed)"}
    quiet = NodeView("q", "ready", 0.0, 0.0, node_facts({"engines": {"sim": "1"}, "engines_probed": True,
                                                         "gpus": [{"index": 0, "class": "h100-80g"}]}, {}))
    assert placement.place(model(gpus=1), [quiet], [])[1] == {"q": "needs 1 x any GPU, 0 free of 1; "
                                                                   "GPU 0's health is not known"}


def test_a_model_whose_planning_raises_leaves_the_others_placed_and_is_logged_once(caplog):
    # A fact no agent of this version can send (the wire refuses it), but one already held from an older
    # agent: comparing it raises, for the one model that reads it.
    odd = node("odd", disk={"free_bytes": "q"})
    download = catalog.parse_model({"name": "b", "source": "http://mirror/b.gguf", "size_bytes": GiB,
                                    "profiles": [{"engine": "sim"}]})
    models = {"a": model("a"), "b": download, "c": model("c")}
    replicas = Replicas()
    with caplog.at_level("ERROR", logger="llmgw.controller"):
        actions, _ = plan(models, [odd], replicas, now=0.0)
        assert sorted(a.model for a in actions) == ["a", "c"]
        plan(models, [odd], replicas, now=1.0)  # the same error again: not logged again
    said = [r for r in caplog.records if "could not plan b" in r.getMessage()]
    assert len(said) == 1 and "TypeError" in said[0].getMessage() and "Traceback" in said[0].getMessage()
    assert replicas.plan_errors == {"b": "TypeError: '<' not supported between instances of 'str' and 'int'"}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_placing_many_in_one_pass_decides_as_placing_each_alone(data):
    """The pass's Placer (each node weighed once, again only where a replica lands, cards chosen on the winner
    alone) decides every replica as `place` did, given the claims of those placed before it."""
    classes = ("h100-80g", "l40s-45g")
    nodes = [node(f"n{i}", state=data.draw(st.sampled_from(("ready", "ready", "ready", "cordoned"))),
                  gpus=data.draw(st.lists(st.sampled_from(classes), max_size=8)),
                  memory_gb=data.draw(st.integers(0, 256)), labels={"rack": data.draw(st.sampled_from("ab"))})
             for i in range(data.draw(st.integers(0, 12)))]
    models = [catalog.parse_model({
        "name": f"m{j}", "source": "/m.gguf", "scaling": {"min": 1, "max": 20},
        "profiles": [{"name": f"p{k}", "engine": "sim", "gpu_class": data.draw(st.sampled_from(classes)),
                      "gpus": data.draw(st.integers(0, 3)), "min_memory_gb": data.draw(st.integers(0, 64)),
                      **({"node_selector": {"rack": "a"}} if data.draw(st.booleans()) else {})}
                     for k in range(data.draw(st.integers(1, 2)))]})
        for j in range(data.draw(st.integers(1, 3)))]
    models = [m for m in models if all(p.gpus or not p.gpu_class for p in m.profiles)] or [model()]
    claims = [placement.Claim(n.node_id, "other", 8 * GiB, (0,)) for n in nodes[:3]]
    placer, alone = placement.Placer(nodes, list(claims), None), list(claims)
    for m in models:
        for _ in range(data.draw(st.integers(0, 12))):
            expected, why = placement.place(m, nodes, alone)
            assert expected == _best(m, nodes, alone)
            got, reasons = placer.place(m)
            assert got == expected
            if expected is None:
                assert reasons == why
                break
            memory = placement.memory_claim(expected.profile)
            alone.append(placement.Claim(expected.node_id, m.name, memory, expected.gpus))
            placer.taken([placement.Claim(expected.node_id, m.name, memory, expected.gpus)])


def _best(m, nodes, claims):
    """The placement rule as the module's docstring states it, weighed afresh for every node: the first profile
    (by priority) with any node that can take it, and of those the node with the fewest replicas of the model,
    then the most unclaimed memory, then the first by id; its cards as gpusets chooses them there."""
    for profile in m.profiles:
        fits = []
        for n in nodes:
            mine = [c for c in claims if c.node_id == n.node_id]
            reason, gpus = placement._refusal(n, profile, mine, m)
            if reason is None:
                unclaimed = n.facts.memory_total_bytes - sum(c.memory_bytes for c in mine)
                fits.append((sum(c.model == m.name for c in mine), -unclaimed, n.node_id, gpus))
        if fits:
            _, _, node_id, gpus = min(fits)
            return placement.Decision(node_id, profile, gpus)
    return None

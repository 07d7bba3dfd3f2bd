"""Load scaling's decisions (llmgw/control/autoscale.py), pass by pass, on a clock the test turns.

The whole loop, with a real controller, agents, simulated engines and a gateway under a load ramp, is
in tests/test_load_scaling.py.
"""

from llmgw.control.autoscale import Scaler
from llmgw.control.catalog import parse_model
from llmgw.control.reconciler import Replica

MODEL = parse_model({"name": "m", "source": "/dev/null", "scaling": {"min": 1, "max": 3},
                     "profiles": [{"engine": "sim"}]})
FP = MODEL.fingerprint(MODEL.profiles[0])


def replicas(*states):
    return [Replica(f"r{i}", "m", "n1", state, profile_fp=FP) for i, state in enumerate(states)]


def busy(*ids, waiting=2.0, running=4.0):
    return {rid: {"shard_id": rid, "waiting": waiting, "running": running} for rid in ids}


def idle(*ids, running=0.0):
    return {rid: {"shard_id": rid, "waiting": 0.0, "running": running} for rid in ids}


def passes(scaler, start, end, step, rs, loads, limits=None, base=None):
    """Run passes every STEP seconds from START to END; the last pass's answer."""
    wanted, t = None, start
    while t <= end:
        wanted = scaler.wanted({"m": MODEL}, rs, loads, limits or {}, base or {"m": 1}, t)
        t += step
    return wanted


def test_a_replica_more_only_after_the_window_and_one_at_a_time():
    scaler = Scaler(up_after=30, down_after=300)
    rs = replicas("ready")
    assert passes(scaler, 0, 29, 1, rs, busy("r0")) == {}  # busy, but not for long enough
    assert passes(scaler, 30, 30, 1, rs, busy("r0")) == {"m": 2}
    [decision] = scaler.explain("m")["decisions"]
    assert decision["step"] == 1 and "all 1 ready replicas are busy (2 requests waiting, 4 running)" in decision["reason"]
    assert "controller.scale_up_after" in decision["reason"]
    # The new one is starting: no second step, however long the first stays busy.
    rs = replicas("ready", "starting")
    assert passes(scaler, 31, 200, 1, rs, busy("r0")) == {"m": 2}
    assert "a replica added before is not ready yet" in scaler.explain("m")["now"]
    # Both ready and both busy: the window starts again, and the third comes after it.
    rs = replicas("ready", "ready")
    assert passes(scaler, 201, 230, 1, rs, busy("r0", "r1")) == {"m": 2}
    assert passes(scaler, 231, 231, 1, rs, busy("r0", "r1")) == {"m": 3}
    # At scaling.max: it says so, and asks for nothing more.
    rs = replicas("ready", "ready", "ready")
    assert passes(scaler, 232, 400, 1, rs, busy("r0", "r1", "r2")) == {"m": 3}
    assert "it is at scaling.max (3)" in scaler.explain("m")["now"]


def test_one_busy_replica_of_two_is_not_saturation_and_a_flicker_restarts_the_window():
    scaler = Scaler(up_after=30, down_after=300)
    rs = replicas("ready", "ready")
    two = {"m": 2}  # its minimum
    assert passes(scaler, 0, 100, 1, rs, {**busy("r0"), **idle("r1", running=3)}, base=two) == {}
    # Busy for 29 s, one pass not, busy for 29 s more: still nothing.
    passes(scaler, 101, 129, 1, rs, busy("r0", "r1"), base=two)
    passes(scaler, 130, 130, 1, rs, {**busy("r0"), **idle("r1")}, base=two)
    assert passes(scaler, 131, 159, 1, rs, busy("r0", "r1"), base=two) == {}
    assert passes(scaler, 160, 161, 1, rs, busy("r0", "r1"), base=two) == {"m": 3}


def test_a_measured_replica_is_busy_at_its_limit_and_quiet_below_half_of_one_fewer():
    scaler = Scaler(up_after=10, down_after=60)
    limits = {("m", FP): 4}
    rs = replicas("ready")
    # Nothing waits in the engine (the gateways hold the rest in their queue), but it holds its limit.
    assert passes(scaler, 0, 10, 1, rs, idle("r0", running=4), limits) == {"m": 2}
    rs = replicas("ready", "ready")
    # 3 running: more than half of one replica's 4. Not quiet: it stays at 2.
    assert passes(scaler, 11, 200, 1, rs, {**idle("r0", running=2), **idle("r1", running=1)}, limits) == {"m": 2}
    assert scaler.explain("m")["state"] == "steady"
    # 2 running would fit in one replica at half: quiet, and after the window one fewer.
    assert passes(scaler, 201, 260, 1, rs, {**idle("r0", running=1), **idle("r1", running=1)}, limits) == {"m": 2}
    assert passes(scaler, 261, 261, 1, rs, {**idle("r0", running=1), **idle("r1", running=1)}, limits) == {}
    decision = scaler.explain("m")["decisions"][-1]
    assert decision["step"] == -1 and "would fit in 1 replicas at half their capacity" in decision["reason"]


def test_an_unmeasured_replica_learns_its_capacity_from_what_ran_while_others_waited():
    scaler = Scaler(up_after=5, down_after=20)
    rs = replicas("ready")
    # It ran 4 at most while requests waited: its capacity is 4.
    assert passes(scaler, 0, 5, 1, rs, busy("r0", running=4)) == {"m": 2}
    rs = replicas("ready", "ready")
    # r1 has never been full: it is taken to hold what r0 held. 2 running, half of one replica's 4: quiet.
    assert passes(scaler, 6, 25, 1, rs, idle("r0", "r1", running=1)) == {"m": 2}
    assert passes(scaler, 26, 27, 1, rs, idle("r0", "r1", running=1)) == {}


def test_without_a_capacity_only_nothing_running_is_quiet():
    scaler = Scaler(up_after=5, down_after=20)
    scaler.models.clear()
    rs = replicas("ready", "ready")
    # First seen with two where its base is one: the second was added for load before (a controller restart).
    assert passes(scaler, 0, 100, 1, rs, idle("r0", "r1", running=1)) == {"m": 2}
    assert passes(scaler, 101, 121, 1, rs, idle("r0", "r1")) == {}


def test_an_on_demand_model_gone_idle_drops_what_was_added_and_a_restarted_controller_keeps_it():
    model = parse_model({"name": "m", "source": "/dev/null", "scaling": {"min": 0, "max": 3},
                         "profiles": [{"engine": "sim"}]})
    scaler = Scaler(up_after=5, down_after=20)
    rs = replicas("ready")
    for t in range(7):
        wanted = scaler.wanted({"m": model}, rs, busy("r0"), {}, {"m": 1}, t)
    assert wanted == {"m": 2}
    assert scaler.wanted({"m": model}, rs, busy("r0"), {}, {"m": 0}, 8) == {}
    assert scaler.explain("m")["decisions"][-1]["reason"].startswith("back to its base: it is idle")
    # A controller that comes to lead finds three running where the base is one: it keeps them.
    scaler.clear()
    rs = replicas("ready", "ready", "ready")
    assert scaler.wanted({"m": model}, rs, idle("r0", "r1", "r2", running=1), {}, {"m": 1}, 100) == {"m": 3}


def test_a_replica_whose_load_is_not_measured_yet_holds_every_decision():
    scaler = Scaler(up_after=5, down_after=20)
    rs = replicas("ready", "ready")
    assert passes(scaler, 0, 100, 1, rs, busy("r0"), base={"m": 2}) == {}
    assert "waiting for every ready replica's load" in scaler.explain("m")["now"]
    # Measured by its node, but without the engine's figures (its /metrics did not answer): no measure either.
    unread = {"r1": {"shard_id": "r1", "memory_rss_bytes": 1 << 30}}
    assert passes(scaler, 101, 200, 1, rs, {**busy("r0"), **unread}, base={"m": 2}) == {}
    assert "waiting for every ready replica's load" in scaler.explain("m")["now"]

import pytest

from llmgw.control.fleet import CORDONED, LOST, READY, UNREACHABLE, Fleet, FleetError, node_facts


def test_states_age_with_silence():
    fleet = Fleet(unreachable_after=15, lost_after=60)
    fleet.register("n1", {"node_id": "n1"}, b"id1", now=100.0)
    state = lambda now: fleet.describe(now)[0].state  # noqa: E731
    assert state(115.0) == READY
    assert state(115.1) == UNREACHABLE
    assert state(160.1) == LOST
    # Back from lost, it must say again what it runs: its replicas may have been replaced meanwhile.
    assert not fleet.heartbeat("n1", {"seq": 1}, b"id1", now=161.0)
    fleet.register("n1", {"node_id": "n1"}, b"id1", now=161.5)
    assert state(161.5) == READY
    assert fleet.heartbeat("n1", {"seq": 2}, b"id1", now=162.0)


def test_a_restarted_controller_settles_once_its_nodes_are_back_or_after_unreachable_after():
    fleet = Fleet(15, 60, started=100.0, expected={"n1", "n2"})
    fleet.register("n1", {}, b"i", 101.0)
    assert fleet.settling(101.0)
    fleet.register("n2", {}, b"j", 102.0)
    assert not fleet.settling(102.0)
    late = Fleet(15, 60, started=100.0, expected={"n1", "gone"})
    assert late.settling(114.9) and not late.settling(115.0)
    plaintext = Fleet(15, 60, started=100.0, expected=None)  # any node may come: wait the whole time
    plaintext.register("n1", {}, b"i", 101.0)
    assert plaintext.settling(114.9) and not plaintext.settling(115.0)
    assert not Fleet(15, 60, started=100.0, expected=set()).settling(100.0)


def test_a_heartbeat_from_an_unknown_connection_asks_for_registration():
    fleet = Fleet(15, 60)
    assert not fleet.heartbeat("n1", {"seq": 1}, b"id1", 0.0)
    fleet.register("n1", {}, b"id1", 0.0)
    assert not fleet.heartbeat("n1", {"seq": 2}, b"another-connection", 1.0)


def test_heartbeats_carry_only_what_changed():
    fleet = Fleet(15, 60)
    fleet.register("n1", {}, b"i", 0.0)
    fleet.heartbeat("n1", {"seq": 1, "memory": {"available_bytes": 5}, "load": {"load1": 0.5}}, b"i", 1.0)
    fleet.heartbeat("n1", {"seq": 2, "load": {"load1": 0.7}}, b"i", 2.0)
    view = fleet.describe(2.0)[0]
    assert view.to_dict()["status"] == {"memory": {"available_bytes": 5}, "load": {"load1": 0.7}}
    assert (view.facts.memory_available_bytes, view.facts.load1) == (5, 0.7)


def test_the_node_view_is_typed_from_the_messages_and_not_known_stays_none():
    fleet = Fleet(15, 60)
    registration = {"node_id": "n1", "labels": {"rack": "r1"}, "cpu": {"count": 8},
                    "memory": {"total_bytes": 64}, "disk": {"free_bytes": 10, "total_bytes": 100},
                    "gpus": [{"index": 0, "class": "l40s-45g", "name": "NVIDIA L40S", "memory_total_bytes": 48,
                              "memory_used_bytes": 1, "health": "ok"},
                             {"index": 1, "class": "l40s-45g", "health": "ok"}]}
    fleet.register("n1", registration, b"i", 0.0, "10.0.0.5")
    fleet.heartbeat("n1", {"seq": 1, "disk": {"free_bytes": 7},
                           "gpus": [{"index": 0, "memory_used_bytes": 30, "utilization_percent": 95.0}]}, b"i", 1.0,
                    "10.0.0.5")
    # From another address than it registered from: not taken.
    assert not fleet.heartbeat("n1", {"seq": 2, "disk": {"free_bytes": 1}}, b"i", 1.5, "10.6.6.6")
    fleet.heartbeat("n1", {"seq": 2, "gpus": [{"index": 1, "health": "failed"}]}, b"i", 2.0, "10.0.0.5")
    view = fleet.describe(2.0)[0]
    facts = view.facts
    assert (facts.cpu_count, facts.memory_total_bytes, facts.disk_free_bytes, facts.disk_total_bytes) == (8, 64, 7, 100)
    # Not said is not known: no engines table, no available memory, no load.
    assert (facts.engines, facts.memory_available_bytes, facts.load1, facts.shard_loads) == (None, None, None, None)
    first, second = facts.gpus
    assert (first.memory_used_bytes, first.utilization_percent, first.healthy) == (30, 95.0, True)
    assert (second.memory_total_bytes, second.utilization_percent, second.health, second.healthy) == (
        None, None, "failed", False)
    # The admin API's JSON is the messages as sent, the heartbeats' GPUs merged by index.
    assert view.to_dict() == {"node_id": "n1", "state": READY, "last_heard_s": 0.0, "registered_s": 2.0,
                              "address": "10.0.0.5", "facts": registration,
                              "status": {"disk": {"free_bytes": 7}, "gpus": [
                                  {"index": 0, "memory_used_bytes": 30, "utilization_percent": 95.0},
                                  {"index": 1, "health": "failed"}]}}
    # A registration is newer than every heartbeat before it: the card it calls healthy is healthy.
    fleet.register("n1", registration, b"j", 3.0)
    assert [g.health for g in fleet.describe(3.0)[0].facts.gpus] == ["ok", "ok"]
    assert fleet.describe(3.0)[0].facts.disk_free_bytes == 10
    assert node_facts({}, {}).gpus is None  # the GPU probe did not run: not known, not "no GPUs"


def test_cordon_survives_re_registration_and_remove_needs_a_lost_node():
    fleet = Fleet(15, 60)
    fleet.register("n1", {}, b"i", 0.0)
    fleet.set_cordon("n1", True)
    fleet.register("n1", {}, b"j", 1.0)
    assert fleet.describe(1.0)[0].state == CORDONED
    with pytest.raises(FleetError, match="only a lost node"):
        fleet.remove("n1", 2.0)
    fleet.remove("n1", 100.0)
    assert fleet.describe(100.0) == []
    with pytest.raises(FleetError, match="no node 'n1'"):
        fleet.remove("n1", 100.0)

"""`ctl nodes` and `ctl replicas` filters on a fleet of four nodes and three replicas (the filters are one
predicate for the table and `--json`; tests/test_up.py runs them against a real controller)."""

import click
import pytest

from llmgw.cli import filters


def node(node_id, state, fabric=None, gpu_class=None, **labels):
    gpus = [{"index": 0, "class": gpu_class}] if gpu_class else []
    return {"node_id": node_id, "state": state, "facts": {"gpus": gpus, "labels": labels},
            "status": {"fabrics": [{"name": fabric}] if fabric else []}}


FLEET = [node("n1", "ready", "ib-a", "h100-80g", role="cpu-large", rack="r1"),
         node("n2", "ready", "ib-b", "h100-80g", role="cpu-large"),
         node("n3", "cordoned", "ib-a", "l40s-45g"),
         node("n4", "ready")]
NODES = {n["node_id"]: n for n in FLEET}
REPLICAS = [{"shard_id": "r1", "model": "big", "node": "n1", "state": "ready", "gpus": [0]},
            {"shard_id": "r2", "model": "small", "node": "n4", "state": "starting", "gpus": []},
            {"shard_id": "r3", "model": "big", "node": "n2", "state": "ready", "gpus": [0]}]


def nodes_for(**wanted) -> list[str]:
    labels = tuple(filters.labels_wanted(wanted.pop("labels", ())))
    chosen = filters.NodeFilter(labels=labels, **wanted)
    return [n["node_id"] for n in FLEET if chosen.matches(n)]


def replicas_for(**wanted) -> list[str]:
    return [r["shard_id"] for r in REPLICAS if filters.ReplicaFilter(**wanted).matches(r, NODES)]


def test_nodes_by_fabric_class_state_and_labels_combined():
    assert nodes_for(fabric="ib-a") == ["n1", "n3"]
    assert nodes_for(gpu_class="l40s-45g") == ["n3"]
    assert nodes_for(state="cord") == ["n3"]  # its start is enough
    assert nodes_for(fabric="ib-a", state="ready") == ["n1"]
    assert nodes_for(labels=("role",)) == ["n1", "n2"]  # a key alone: any value
    assert nodes_for(labels=("role=cpu-large", "rack=r1")) == ["n1"]
    assert nodes_for(labels=("rack=r9",)) == []


def test_a_label_with_no_key_is_refused_rather_than_ignored():
    with pytest.raises(click.BadParameter, match="names no label"):
        filters.labels_wanted(("=value",))


def test_replicas_by_node_state_and_pool():
    assert [filters.pool_of(r, NODES) for r in REPLICAS] == ["ib-a/h100-80g", "none/cpu", "ib-b/h100-80g"]
    assert replicas_for(pool="h100-80g") == ["r1", "r3"] and replicas_for(pool="ib-a") == ["r1"]
    assert replicas_for(state="START") == ["r2"]
    assert replicas_for(node="n2", state="ready") == ["r3"] and replicas_for(model="big") == ["r1", "r3"]


def test_the_empty_answer_says_what_matched_nothing_and_how_many_there_are():
    chosen = filters.NodeFilter(fabric="ib-c", labels=(("rack", "r1"),))
    assert not chosen.empty() and filters.NodeFilter().empty()
    said = filters.no_matches("nodes", chosen.describe(), 12)
    assert said == "no nodes match fabric ib-c, label rack=r1. 12 nodes in total; run without the filter to see them."

"""Which GPUs of a node a replica gets (llmgw/control/gpusets.py), by example and by property: the set
chosen is always the best by the rules, checked against a scorer written here from the rules alone."""

import itertools
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control import gpusets, placement
from llmgw.control.catalog import Model, Profile
from llmgw.control.fleet import Gpu, NodeView, node_facts
from llmgw.node import gputopology
from tests.conftest import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
RANK = ["PIX", "PXB", "PHB", "NODE", "SYS"]


def card(index, nvlink=(), nics=None, numa=None):
    return Gpu(index=index, gpu_class="a100-80g", name="NVIDIA A100", memory_total_bytes=80 << 30,
               memory_used_bytes=0, utilization_percent=None, health="ok", nvlink={p: 12 for p in nvlink},
               nic_paths=nics or {}, numa_node=numa)


def test_bridged_pairs_are_kept_together():
    # Four PCIe A100s bridged 0-1 and 2-3 (the older topo layout): two cards are a bridged pair, never 1 and 2.
    with open(os.path.join(FIXTURES, "nvidia-smi-topo-4xa100-bridged-old.txt")) as f:
        topo = gputopology.parse_topo(f.read())
    cards = [card(i, topo[i]["nvlink"], topo[i]["nics"], topo[i]["numa"]) for i in range(4)]
    assert gpusets.choose(cards, 2) == (0, 1)
    assert gpusets.choose([c for c in cards if c.index != 0], 2) == (2, 3)  # not (1, 2): lowest indices lose
    # A shard of a multi-node replica sending on mlx5_1 is given the pair beside that adapter.
    assert gpusets.choose(cards, 2, adapters=("mlx5_1",)) == (2, 3)


def test_cards_joined_to_each_other_beat_cards_joined_to_one_card():
    # 0 is joined to 1, 2 and 3, which are not joined to each other; 4, 5, 6 are all joined. Growing from
    # card 0's peers gives 0, 1, 2 (two pairs); the best set has three.
    cards = [card(0, (1, 2, 3)), card(1, (0,)), card(2, (0,)), card(3, (0,)),
             card(4, (5, 6)), card(5, (4, 6)), card(6, (4, 5))]
    assert gpusets.choose(cards, 3) == (4, 5, 6)


def test_without_topology_the_lowest_indices_are_taken():
    assert gpusets.choose([card(3), card(1), card(7), card(2)], 2) == (1, 2)


def test_fewer_numa_nodes_win_when_nvlink_is_equal():
    cards = [card(0, numa=0), card(1, numa=1), card(2, numa=1)]
    assert gpusets.choose(cards, 2) == (1, 2)


def test_placement_gives_the_nvlink_pair_and_says_so():
    with open(os.path.join(FIXTURES, "nvidia-smi-topo-4xa100-bridged-old.txt")) as f:
        topo = gputopology.parse_topo(f.read())
    gpus = [{"index": i, "class": "a100-80g", "health": "ok", "pci_bus": ""} for i in range(4)]
    gputopology.apply(gpus, topo, {})
    registration = {"gpus": gpus, "engines": {"vllm": "0.32.0"}, "engines_probed": True,
                    "memory": {"total_bytes": 512 << 30}}
    node = NodeView("gpu-01", "ready", 0.0, 0.0, node_facts(registration, {}))
    model = Model(name="m", source="/m", profiles=(Profile(name="tp2", engine="vllm", gpus=2),))
    held = [placement.Claim("gpu-01", "other", 0, (0,))]
    decision, _ = placement.place(model, [node], held)
    assert decision.gpus == (2, 3)
    [row] = placement.explain(model, [node], held)
    assert row["reason"] == "fits (GPUs 2, 3; 1 NVLink pair among them)"


def _rules_score(cards, adapters):
    """The rules as the docstring states them, written again without the module's code."""
    chosen = {c.index for c in cards}
    pairs = len({frozenset((c.index, p)) for c in cards for p in c.nvlink if p in chosen})
    near = sum(min([RANK.index(c.nic_paths[a]) if a in c.nic_paths else 5 for a in adapters]) for c in cards) \
        if adapters else 0
    numa = len({c.numa_node for c in cards} - {None})
    return (-pairs, near, numa, sorted(chosen))


@st.composite
def nodes(draw):
    count = draw(st.integers(1, 8))
    links = draw(st.sets(st.tuples(st.integers(0, count - 1), st.integers(0, count - 1))
                         .filter(lambda t: t[0] < t[1])))
    cards = []
    for i in range(count):
        peers = [b if a == i else a for a, b in links if i in (a, b)]
        nics = draw(st.dictionaries(st.sampled_from(["mlx5_0", "mlx5_1"]), st.sampled_from(RANK)))
        cards.append(card(i, peers, nics, draw(st.one_of(st.none(), st.integers(0, 1)))))
    free = draw(st.lists(st.sampled_from(cards), min_size=1, unique_by=lambda c: c.index))
    want = draw(st.integers(1, len(free)))
    adapters = tuple(draw(st.lists(st.sampled_from(["mlx5_0", "mlx5_1"]), unique=True)))
    return free, want, adapters


@settings(max_examples=300, deadline=None)
@given(nodes())
def test_the_set_chosen_is_the_best_scored_and_only_free_cards(case):
    free, want, adapters = case
    chosen = gpusets.choose(free, want, adapters)
    assert len(chosen) == want and len(set(chosen)) == want
    assert set(chosen) <= {c.index for c in free}
    best = min(_rules_score(s, adapters) for s in itertools.combinations(free, want))
    assert _rules_score([c for c in free if c.index in chosen], adapters) == best

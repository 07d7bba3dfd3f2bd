"""Which of a node's free GPUs a replica gets: every set of the right size scored, the best taken.

A tensor-parallel group talks on every layer, so its cards should be joined to each other by NVLink:
the set with the most NVLink pairs among its own cards wins. Growing a set from one card's peers (the
Go version's first way) picked cards joined to that card but not to each other. Then, for a shard of a
multi-node replica, each card's nearness to the fabric adapters its traffic leaves by (one PCIe switch
beats crossing the CPU, which beats crossing NUMA nodes); then the fewest NUMA nodes; then the lowest
indices, which is also the whole choice on a node that reported no topology.

Scoring every subset is cheap at the sizes nodes have (8 cards choose 4: 70 sets; 16 choose 8: 12,870);
past SUBSETS_AT_MOST sets it would not be, and the lowest indices are taken, as without topology.
"""

from __future__ import annotations

import itertools
import math

from llmgw.control.fleet import Gpu

SUBSETS_AT_MOST = 50_000
# A card's path to an adapter as `nvidia-smi topo -m` names it (llmgw/node/gputopology.py), nearest first,
# as NCCL ranks them; unknown is farthest.
PATH_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
UNKNOWN_PATH = 5


def _score(cards: tuple[Gpu, ...], adapters: tuple[str, ...]) -> tuple:
    indices = {g.index for g in cards}
    pairs = sum(1 for g in cards for peer in g.nvlink if peer in indices and peer > g.index)
    nearness = sum(min((PATH_RANK.get(g.nic_paths.get(a, ""), UNKNOWN_PATH) for a in adapters),
                       default=UNKNOWN_PATH) for g in cards) if adapters else 0
    numa = len({g.numa_node for g in cards if g.numa_node is not None})
    return (-pairs, nearness, numa, tuple(sorted(indices)))


def choose(free: list[Gpu], count: int, adapters: tuple[str, ...] = ()) -> tuple[int, ...]:
    """The indices of the COUNT cards of FREE to give a replica (FREE must hold at least COUNT). ADAPTERS:
    the fabric adapters a multi-node replica's shard sends on (none for a replica on one node)."""
    cards = sorted(free, key=lambda g: g.index)
    if count >= len(cards) or math.comb(len(cards), count) > SUBSETS_AT_MOST:
        return tuple(g.index for g in cards[:count])
    best = min(itertools.combinations(cards, count), key=lambda subset: _score(subset, adapters))
    return tuple(g.index for g in best)


def nvlink_pairs(cards: list[Gpu], chosen: tuple[int, ...]) -> int:
    """How many pairs of the CHOSEN cards NVLink joins: what `ctl explain-placement` says of a choice."""
    return -_score(tuple(g for g in cards if g.index in chosen), ())[0]

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

SUBSETS_AT_MOST = 13_000  # 16 cards choose 8; a pass scores each node's in about a tenth of a second
# A card's path to an adapter as `nvidia-smi topo -m` names it (llmgw/node/gputopology.py), nearest first,
# as NCCL ranks them; unknown is farthest.
PATH_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
UNKNOWN_PATH = 5


class _Card:
    """A card as a subset is scored: its index, its NVLink peers among the cards considered, its nearness to
    the adapters, its NUMA node. Made once a choice, so a node's report (up to 1,024 peers a card on the
    wire) is read once, not once a subset."""

    __slots__ = ("index", "peers", "near", "numa")

    def __init__(self, gpu: Gpu, among: set[int], adapters: tuple[str, ...]):
        self.index = gpu.index
        self.peers = frozenset(p for p in gpu.nvlink if p in among and p > gpu.index)
        self.near = min((PATH_RANK.get(gpu.nic_paths.get(a, ""), UNKNOWN_PATH) for a in adapters),
                        default=UNKNOWN_PATH) if adapters else 0
        self.numa = gpu.numa_node


def _score(cards: tuple[_Card, ...]) -> tuple:
    indices = {c.index for c in cards}
    pairs = sum(len(c.peers & indices) for c in cards)
    numa = len({c.numa for c in cards if c.numa is not None})
    return (-pairs, sum(c.near for c in cards), numa, tuple(sorted(indices)))


def choose(free: list[Gpu], count: int, adapters: tuple[str, ...] = ()) -> tuple[int, ...]:
    """The indices of the COUNT cards of FREE to give a replica (FREE must hold at least COUNT). ADAPTERS:
    the fabric adapters a multi-node replica's shard sends on (none for a replica on one node)."""
    ordered = sorted(free, key=lambda g: g.index)
    if count >= len(ordered) or math.comb(len(ordered), count) > SUBSETS_AT_MOST:
        return tuple(g.index for g in ordered[:count])
    among = {g.index for g in ordered}
    cards = [_Card(g, among, adapters) for g in ordered]
    best = min(itertools.combinations(cards, count), key=_score)
    return tuple(c.index for c in best)


def nvlink_pairs(cards: list[Gpu], chosen: tuple[int, ...]) -> int:
    """How many pairs of the CHOSEN cards NVLink joins: what `ctl explain-placement` says of a choice."""
    among = set(chosen)
    return -_score(tuple(_Card(g, among, ()) for g in cards if g.index in among))[0]

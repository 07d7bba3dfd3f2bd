"""How full a model's pool of replicas is, as one number: 1.0 at the most it holds healthily.

Saturation is the worse of two figures. The queue: the requests held by the
pool's replicas, plus those waiting in a worker's admission queue, over the
most those replicas should hold at once, as admission counts them
(`balancer.ReplicaState.held`): everyone's requests against a replica's
measured limit (`llmgw ctl bench --save`), or, not measured, the worker's own
against `routing.max_outstanding`. The KV caches: the mean of the replicas' own
reports of KV cache use, where a full cache is 1.0 (past it an engine queues or
preempts). Above 1.0 requests wait; sustained, the model needs another replica
or less traffic.

A replica with no limit adds nothing to the queue's figure, and a pool none of
whose replicas has a limit has none; a replica whose engine did not report its
KV cache (or not lately) adds nothing to that one. When neither figure is
known, nor is the saturation: None is an answer.
"""

from __future__ import annotations

from collections.abc import Iterable

KV_FULL = 1.0  # a replica's reported KV cache use at its healthy limit


def pool_saturation(replicas: Iterable[tuple[float, int, float | None]], queued: int) -> float | None:
    """The saturation of a pool whose REPLICAS in rotation are (requests in flight, the most it should hold
    at once or 0 for no limit, KV cache use from 0 to 1 or None), with QUEUED requests waiting for room."""
    in_flight: float = 0
    limit: float = 0
    caches = []
    for outstanding, most, kv in replicas:
        if most:
            in_flight += outstanding
            limit += most
        if kv is not None:
            caches.append(kv)
    figures = []
    if limit:
        figures.append((in_flight + queued) / limit)
    if caches:
        figures.append(sum(caches) / len(caches) / KV_FULL)
    return max(figures) if figures else None

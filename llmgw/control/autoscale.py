"""Scaling with load: between a model's `scaling.min` and `scaling.max`, a replica more while its replicas stay busy,
one fewer while they stay quiet.

What it reads is what the controller already has: each ready replica's load as its node last measured it
(its engine's own requests waiting and running, in the heartbeats' `load.shards`), and the requests in
flight its profile was measured to take (`llmgw ctl bench --save`), where it was.

- A replica is **busy** when its engine has requests waiting, or, measured, holds its limit or more.
- A model is **saturated** when every ready replica of it is busy. Saturated for `controller.scale_up_after`
  (30 s): one replica more, up to `scaling.max`.
- A model is **quiet** when no replica has requests waiting and what runs would fit in one replica fewer at
  half their capacity. A replica's capacity is its measured limit, else the most requests its engine has
  been seen running while others waited (its real concurrency, learnt); with neither, only nothing running
  is quiet. Quiet for `controller.scale_down_after` (5 minutes): one replica fewer, down to the base.
- The base is `scaling.min`, or for an on-demand model what demand asks (one while used, none when idle:
  then the added replicas go too).

So that it does not flap: the two windows differ in length, the two conditions leave a band between them
in which nothing changes, a change restarts both windows, and no replica is added while one added before is
not ready yet. Each decision is logged, and the latest ones, with their reasons, are kept for `llmgw ctl
explain-placement` and the cluster page.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

from llmgw.control.catalog import Model
from llmgw.control.reconciler import Replica

log = logging.getLogger("llmgw.controller")

HISTORY = 20  # decisions kept per model
QUIET_SHARE = 0.5  # of the capacity of one replica fewer that what runs must fit in to be quiet


@dataclasses.dataclass
class ModelScaling:
    extra: int = 0  # replicas above the base, added for load
    busy_since: float | None = None
    quiet_since: float | None = None
    state: str = "steady"  # steady, saturated, quiet: what the last pass saw
    said: str = ""  # the last pass's words on it
    history: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=HISTORY))


class Scaler:
    def __init__(self, up_after: float, down_after: float):
        self.up_after = up_after
        self.down_after = down_after
        self.models: dict[str, ModelScaling] = {}
        self.ceilings: dict[str, float] = {}  # replica -> the most running its engine reported while some waited
        self.lock = threading.Lock()  # passes run in the scheduler's thread, `explain` in the admin API's

    def clear(self) -> None:
        """Forget everything: a controller that comes to lead starts afresh, taking what runs as it finds it."""
        with self.lock:
            self.models.clear()
            self.ceilings.clear()

    def wanted(self, models: dict[str, Model], replicas: list[Replica], loads: dict[str, dict],
               limits: dict[tuple[str, str], int], base: dict[str, int], now: float) -> dict[str, int]:
        """Replicas each model with room to scale should have now (models at their base are left out). LOADS:
        replica -> its node's last measure of it; LIMITS: (model, profile fingerprint) -> requests in flight
        measured; BASE: what each model wants without load (its minimum, or demand's word)."""
        with self.lock:
            return self._wanted(models, replicas, loads, limits, base, now)

    def _wanted(self, models, replicas, loads, limits, base, now) -> dict[str, int]:
        out = {}
        for name in list(self.models):
            if name not in models:
                del self.models[name]
        for name, model in models.items():
            floor = base.get(name, model.min_replicas)
            if model.max_replicas <= floor:
                self.models.pop(name, None)
                continue
            mine = [r for r in replicas if r.model == name and r.state != "stopping"]
            scaling = self.models.get(name)
            if scaling is None:
                # First seen (this controller just started, or just came to lead): what runs above the base
                # was added for load before, and stays until it is quiet; stopping it would be a decision
                # nobody made.
                scaling = self.models[name] = ModelScaling(extra=max(0, min(len(mine), model.max_replicas) - floor))
            if floor == 0:
                if scaling.extra:
                    self._decide(scaling, name, -scaling.extra, "back to its base: it is idle (no request within its "
                                                                "idle_timeout)")
                scaling.busy_since = scaling.quiet_since = None
                continue
            ready = [r for r in mine if r.state == "ready"]
            self._judge(scaling, name, model, floor, mine, ready, loads, limits, now)
            scaling.extra = max(0, min(scaling.extra, model.max_replicas - floor))
            if scaling.extra:
                out[name] = floor + scaling.extra
        live = {r.shard_id for r in replicas}
        self.ceilings = {k: v for k, v in self.ceilings.items() if k in live}
        return out

    def _judge(self, scaling: ModelScaling, name: str, model: Model, floor: int, mine: list[Replica],
               ready: list[Replica], loads: dict[str, dict], limits: dict[tuple[str, str], int], now: float) -> None:
        seen = [(r, loads.get(r.shard_id) or {}) for r in ready]
        # A load without the engine's figures (its /metrics did not answer that heartbeat) is no measure:
        # read as nothing running, it would count toward stopping a replica that is serving.
        if not ready or any(not ({"waiting", "running"} & load.keys()) for _, load in seen):
            scaling.state, scaling.said = "steady", "waiting for every ready replica's load to be measured"
            scaling.busy_since = scaling.quiet_since = None
            return
        waiting = running = 0.0
        busy = 0
        capacities = []
        for r, load in seen:
            w, n = load.get("waiting", 0.0), load.get("running", 0.0)
            waiting, running = waiting + w, running + n
            limit = limits.get((r.model, r.profile_fp or ""))
            if w > 0:
                self.ceilings[r.shard_id] = max(self.ceilings.get(r.shard_id, 0.0), n)
            if w > 0 or (limit is not None and n + w >= limit):
                busy += 1
            capacities.append(limit if limit is not None else self.ceilings.get(r.shard_id))
        # A replica not measured nor seen full is taken to hold what its model's others were found to hold.
        learnt = max((c for c in capacities if c), default=None)
        capacity = sum(c or learnt for c in capacities) if learnt else None
        count = len(ready)
        total = floor + scaling.extra
        if busy == count:
            scaling.quiet_since = None
            scaling.state = "saturated"
            scaling.said = (f"all {count} ready replicas are busy ({waiting:g} requests waiting, {running:g} "
                            "running)")
            if scaling.busy_since is None:
                scaling.busy_since = now
            if total >= model.max_replicas:
                scaling.said += f"; it is at scaling.max ({model.max_replicas})"
            elif len(mine) > count:
                scaling.said += "; a replica added before is not ready yet"
                scaling.busy_since = None  # the window counts from when every replica serves
            elif now - scaling.busy_since >= self.up_after:
                self._decide(scaling, name, +1, f"{scaling.said} for {now - scaling.busy_since:.0f} s "
                                                "(controller.scale_up_after)")
                scaling.busy_since = None
            return
        scaling.busy_since = None
        fewer = count - 1
        if capacity is not None and count:
            fits = waiting == 0 and running <= QUIET_SHARE * capacity * fewer / count
        else:
            fits = waiting == 0 and running == 0
        if not fits or scaling.extra == 0:
            scaling.quiet_since = None
            scaling.state, scaling.said = "steady", f"{busy} of {count} ready replicas busy; {running:g} running"
            return
        scaling.state = "quiet"
        scaling.said = (f"{running:g} requests running would fit in {fewer} replicas at half their capacity, and "
                        "none waits")
        if scaling.quiet_since is None:
            scaling.quiet_since = now
        if now - scaling.quiet_since >= self.down_after:
            self._decide(scaling, name, -1, f"{scaling.said}, for {now - scaling.quiet_since:.0f} s "
                                            "(controller.scale_down_after)")
            scaling.quiet_since = None

    def _decide(self, scaling: ModelScaling, name: str, step: int, why: str) -> None:
        scaling.extra += step
        said = why if why.startswith("back to") else f"{'one replica more' if step > 0 else 'one replica fewer'}: {why}"
        scaling.history.append({"at": round(time.time(), 3), "step": step, "reason": said})
        log.info("scaling %s: %s", name, said)

    def explain(self, name: str) -> dict | None:
        """What the last pass saw of NAME and the latest decisions (newest last), or None when it cannot scale."""
        with self.lock:
            scaling = self.models.get(name)
            if scaling is None:
                return None
            return {"state": scaling.state, "now": scaling.said, "extra": scaling.extra,
                    "decisions": list(scaling.history)}

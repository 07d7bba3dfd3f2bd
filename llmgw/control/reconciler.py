"""Keeping the right replicas running: what the catalog asks for, against what the agents report.

The controller keeps no record of replicas of its own: each one is known from
its agent's reports (a shard status, or the shards listed at registration,
which are all a node runs), so a restarted controller rebuilds the same view
and places nothing twice. Every pass compares each model's live replicas with
its scaling and decides what to start and what to stop, with reasons; it never
stops a serving replica just because its profile changed (that replica is
shown as running a stale profile), and after a replica fails the model waits
before the next try: 10 s, doubling, up to 5 minutes, reset once a replica is
ready. The last failure's output is kept for the operator.

Replicas in flux stay served. A lost node's ready replicas are replaced
elsewhere but stay in the snapshot (their engines may well still answer; a
gateway's breaker takes out one that does not) until their replacements are
ready; then they are retired, and stopped if their node comes back. Where two
replicas stand for one (a late agent's, and the one placed meanwhile), the
extra one is stopped: the one not yet ready, else the one that became ready
last, so the replica already serving stays.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import traceback
import uuid

from llmgw.control import placement, seals
from llmgw.control.catalog import Model
from llmgw.control.fleet import DRAINING, LOST, NodeView

log = logging.getLogger("llmgw.controller")

# Unhealthy: its engine fails its node's health probes. It is out of the snapshot (so out of every gateway's
# rotation) but still the model's replica, which its node restarts in place if it does not recover.
# Waiting: a rank above 0 of a replica over several nodes, placed, not yet sent (it waits for rank 0's master).
LIVE = ("waiting", "pending", "fetching", "starting", "ready", "unhealthy")
MAX_BACKOFF = 300.0
LINES_MOST, LINE_MOST = 50, 500  # of a failed engine's last output, kept for the operator


@dataclasses.dataclass
class Replica:
    shard_id: str
    model: str
    node_id: str
    state: str  # pending (sent, not yet reported), fetching, starting, ready, unhealthy, stopping
    profile_fp: str | None = None
    engine: str | None = None
    url: str | None = None
    gpus: tuple[int, ...] = ()
    memory_bytes: int = 0
    fetch: dict | None = None
    api_key: str | None = None  # what its engine wants in `Authorization: Bearer`; told to gateways only
    address: str | None = None  # its node's address, which its URL is on; gateways dial nothing else
    context: int | None = None  # tokens a request may use there, as its engine says once ready
    since: float = 0.0  # when it was placed, or first heard of; once ready, when it became ready
    detail: str | None = None  # its node's words on its state (why it is unhealthy)
    restarts: int = 0  # by its node, for failing its health probes
    restart_reason: str | None = None  # the last one
    # A shard of a replica over several nodes: its group (the replica's id), rank and ranks; rank 0's master
    # (HOST:PORT where the ranks meet, as its node said); a waiting rank's start, sent once that is known.
    group: str | None = None
    rank: int = 0
    ranks: int = 1
    master: str | None = None
    deferred: Start | None = None


@dataclasses.dataclass
class Failure:
    shard_id: str
    node_id: str
    at: float
    detail: str | None
    last_output: list[str]
    count: int  # failures in a row for this model


@dataclasses.dataclass(frozen=True)
class Start:
    model: str
    shard_id: str
    decision: placement.Decision
    # A rank of a replica over several nodes: its group, rank, ranks, the fabric (or NVLink domain) it was
    # placed on and its node's adapters there (from which its node sets NCCL's variables), and for a rank
    # above 0 where it joins rank 0.
    group: str | None = None
    rank: int = 0
    ranks: int = 1
    fabric: str | None = None
    adapters: tuple[str, ...] = ()
    master: str | None = None
    seal: str | None = None  # llmgw/control/seals.py


class Unit:
    """A replica as scaling counts it: one shard, or every rank of a replica over several nodes."""

    __slots__ = ("members", "group", "model", "ranks", "node_ids", "since", "state")

    def __init__(self, members: list[Replica]):
        if len(members) == 1:  # a replica on one node, nearly every one: a pass makes one a replica
            head = members[0]
            self.group, self.model, self.ranks = head.group, head.model, head.ranks
            self.members, self.node_ids, self.since, self.state = members, {head.node_id}, head.since, head.state
            return
        self.members = sorted(members, key=lambda r: r.rank)
        head = self.members[0]
        self.group, self.model, self.ranks = head.group, head.model, head.ranks
        self.node_ids = {r.node_id for r in self.members}
        self.since = max(r.since for r in self.members)
        self.state = self._state({r.state for r in self.members})

    @staticmethod
    def _state(states: set[str]) -> str:
        """Stopping once any rank is; unhealthy while any is; else its least advanced rank's state (so ready
        only when every rank is)."""
        for state in ("stopping", "unhealthy", *LIVE):
            if state in states:
                return state
        return states.pop()

    def missing(self) -> list[str]:
        """The ranks of a group that are no longer there (failed, stopped, or never heard of), in words."""
        have = {r.rank for r in self.members}
        return [f"rank {rank} is gone" for rank in range(self.ranks) if rank not in have]


def units(replicas) -> list[Unit]:
    """REPLICAS as scaling counts them (`Unit`): a replica over several nodes once, its ranks together."""
    grouped: dict[tuple[str, str], list[Replica]] = {}
    for r in replicas:
        grouped.setdefault(("group", r.group) if r.group else ("shard", r.shard_id), []).append(r)
    return [Unit(members) for members in grouped.values()]


def whole(replicas: list[Replica]) -> list[Replica]:
    """One row for each replica, as gateways, scaling and the replica metrics see it: a replica on one node as
    it is; a replica over several nodes as its rank 0 (which serves HTTP), in its group's state (ready only
    once every rank is), and only while every rank is there."""
    # Only the ranks of replicas over several nodes are grouped: grouping every replica was most of this.
    groups = {unit.members[0].shard_id: unit for unit in units([r for r in replicas if r.group])}
    out = []
    for r in replicas:
        if not r.group:
            out.append(r)
            continue
        unit = groups.get(r.shard_id)  # only a group's lowest rank present is a key
        if unit is not None and r.rank == 0 and not unit.missing():
            out.append(dataclasses.replace(r, state=unit.state))
    return out


@dataclasses.dataclass(frozen=True)
class Stop:
    shard_id: str
    node_id: str
    reason: str


class Replicas:
    """Replicas as agents report them, plus each model's last failure and backoff. Thread-safe."""

    def __init__(self, base_backoff: float = 10.0, seal_key: bytes | None = None):
        """SEAL_KEY: what the ranks of a replica over several nodes are sealed with (llmgw/control/seals.py);
        None in plaintext mode."""
        self.base_backoff = base_backoff
        self.seal_key = seal_key
        self.items: dict[str, Replica] = {}
        self.failures: dict[str, Failure] = {}
        self.retry_at: dict[str, float] = {}
        self.retired: dict[str, str] = {}  # shard id -> node id: replaced while its node was lost
        self.orders: list[Stop] = []  # stops decided between passes, sent by the next one
        self.plan_errors: dict[str, str] = {}  # model -> what planning it last raised, while it still does
        self.restarted: dict[str, int] = {}  # model -> engines its nodes restarted, since this controller started
        self.lock = threading.RLock()
        # Counted up by whatever may change a replica (each method below that writes, and a pass): the loop
        # makes the gateways' snapshot again only when it moved.
        self.revision = 0

    def clear(self) -> None:
        """Forget every replica, failure and order: a controller that comes to lead learns them again from its
        agents, as a restarted one does."""
        with self.lock:
            self.revision += 1
            self.items.clear()
            self.failures.clear()
            self.retry_at.clear()
            self.retired.clear()
            self.orders.clear()
            self.plan_errors.clear()

    def knows(self, shard_id: str) -> bool:
        """Whether this controller placed SHARD_ID, or took it from its node since it started."""
        with self.lock:
            return shard_id in self.items or shard_id in self.retired

    def registered(self, node_id: str, shards: list[dict], now: float,
                   address: str | None = None) -> list[tuple[str, str]]:
        """Take a node's registration from ADDRESS: SHARDS is everything it runs. A replica recorded there
        and not listed is gone (its engine died while the agent was away), unless it was only just placed:
        its start_shard may still be on its way. Returns (shard id, reason) for each listed shard
        that is another node's."""
        with self.lock:
            self.revision += 1
            listed = {s["shard_id"] for s in shards}
            for r in [r for r in self.items.values() if r.node_id == node_id and r.shard_id not in listed]:
                if r.state not in ("waiting", "pending"):
                    del self.items[r.shard_id]
            for shard_id in [k for k, v in self.retired.items() if v == node_id and k not in listed]:
                del self.retired[shard_id]
            refused = [(shard["shard_id"], self.report(node_id, shard, now, address=address)) for shard in shards]
            return [(shard_id, reason) for shard_id, reason in refused if reason is not None]

    def report(self, node_id: str, status: dict, now: float, memory_bytes: int | None = None,
               address: str | None = None) -> str | None:
        """Take one shard_status (or a shard listed at registration) from NODE_ID at ADDRESS; the reason it was
        refused, or None. A node speaks only for shards placed on it: once a node with a valid key took over
        another's replica this way, and gateways sent that replica's prompts to it. Whether it may speak of a
        shard at all (its engine's address, a shard this controller did not place) is judged before
        (llmgw/control/claims.py)."""
        with self.lock:
            self.revision += 1
            shard_id, state = status["shard_id"], status["state"]
            current = self.items.get(shard_id)
            owner = current.node_id if current is not None else self.retired.get(shard_id, node_id)
            if owner != node_id:
                return f"shard {shard_id} is placed on {owner}, not on {node_id}"
            if shard_id in self.retired:
                if state in ("failed", "stopped"):
                    del self.retired[shard_id]
                    self.items.pop(shard_id, None)
                elif current is None:
                    # Its node is back, and another replica has taken its place: stop it, out of the snapshot.
                    self.items[shard_id] = Replica(shard_id, status.get("model", "?"), node_id, "stopping",
                                                   url=status.get("url"), since=now)
                    self.orders.append(Stop(shard_id, node_id, f"it was replaced while {node_id} was lost"))
                return None
            if state in ("failed", "stopped"):
                self.items.pop(shard_id, None)
                # The model placed, not the one the node names: a node once put any model it liked into
                # backoff this way, with words of its own as the failure an operator reads.
                model = current.model if current is not None else status.get("model")
                if state == "failed" and model:
                    count = self.failures[model].count + 1 if model in self.failures else 1
                    output = [line[:LINE_MOST] for line in (status.get("last_output") or [])[-LINES_MOST:]]
                    self.failures[model] = Failure(shard_id, node_id, now, status.get("detail"), output, count)
                    self.retry_at[model] = now + min(self.base_backoff * 2 ** (count - 1), MAX_BACKOFF)
                return None
            heard_before = current is not None
            if current is None:
                # A shard of a replica over several nodes, brought back by its node: its group as the node says,
                # held to its id's form when the claim was judged (llmgw/control/claims.py).
                current = Replica(shard_id, status.get("model", "?"), node_id, state, since=now,
                                  memory_bytes=memory_bytes or 0, group=status.get("group"),
                                  rank=status.get("rank", 0), ranks=status.get("ranks", 1))
                self.items[shard_id] = current
            if current.state != "stopping":
                current.state = state
            if address is not None:
                current.address = address
            for field in ("profile_fp", "engine", "url", "fetch", "api_key", "context", "restart_reason"):
                if field in status:
                    setattr(current, field, status[field])
            current.detail = status.get("detail")
            restarts = status.get("restarts", 0)
            if restarts > current.restarts:
                if heard_before:  # restarts from before this controller heard of it are not counted again
                    self.restarted[current.model] = self.restarted.get(current.model, 0) + restarts - current.restarts
                current.restarts = restarts
            if "gpus" in status:
                current.gpus = tuple(status["gpus"])
            if current.group and current.rank == 0 and "master" in status:
                current.master = status["master"]
            if state == "ready":
                if "ready_s" in status:
                    # The agent's own count, kept across its restarts: what tells the replica that has
                    # served for an hour from the one placed a minute ago, whichever was heard first.
                    current.since = now - status["ready_s"]
                self.retry_at.pop(current.model, None)
                failure = self.failures.get(current.model)
                if failure is not None:
                    failure.count = 0
            return None

    def forget_node(self, node_id: str) -> list[str]:
        """Drop every replica of NODE_ID at once, out of the snapshot (its key was revoked: no prompt goes
        to a node the controller no longer trusts); the next pass places them elsewhere. Returns their ids."""
        with self.lock:
            self.revision += 1
            gone = sorted(shard_id for shard_id, r in self.items.items() if r.node_id == node_id)
            for shard_id in gone:
                del self.items[shard_id]
            for shard_id in [k for k, v in self.retired.items() if v == node_id]:
                del self.retired[shard_id]
            self.orders = [order for order in self.orders if order.node_id != node_id]
            return gone

    def plan_failed(self, model: str, error: Exception) -> str:
        """Planning MODEL raised ERROR: logged with its traceback once for each distinct error, not at
        every pass (a pass runs every few seconds); returns the error in words, for the next pass to compare."""
        said = f"{type(error).__name__}: {error}"
        if self.plan_errors.get(model) != said:
            log.error("could not plan %s this pass (the other models were planned; this is logged again only "
                      "if the error changes): %s", model, "".join(traceback.format_exception(error)).rstrip())
        return said

    def stop(self, unit: Unit, why: str, drained: bool = False) -> list[Stop]:
        """Stop every shard of UNIT for WHY: the Stop orders to send (a rank never sent has nothing to stop).
        DRAINED (a replica stopped on purpose, not broken): of a replica over several nodes, only rank 0 now,
        which finishes the requests it has; the other ranks once it has gone (`_keep_groups_whole`), since
        without them it could finish none."""
        self.revision += 1
        out = []
        leader = unit.members[0]
        for r in unit.members:
            if self.items.get(r.shard_id) is not r:
                continue  # retired: stopped if its node comes back
            if r.state == "waiting":
                del self.items[r.shard_id]
            elif r.state != "stopping" and not (drained and unit.group and leader.rank == 0 and r is not leader):
                r.state = "stopping"
                out.append(Stop(r.shard_id, r.node_id, why))
        return out

    def placed(self, model: Model, decision, claims: list[placement.Claim], now: float) -> Start:
        """Record DECISION (placement's, for one more replica of MODEL): its shards as replicas, pending (a
        rank above 0 waiting for rank 0), its claims added to CLAIMS; returns the Start to send now."""
        self.revision += 1
        name = model.name
        if isinstance(decision, placement.Decision):
            ranks, group, fabric = [(f"{name}-{uuid.uuid4().hex[:8]}", decision, ())], None, None
        else:
            group, fabric = f"{name}-{uuid.uuid4().hex[:8]}", decision.island.key
            ranks = [(f"{group}-r{i}", placement.Decision(rank.node_id, decision.profile, rank.gpus), rank.adapters)
                     for i, rank in enumerate(decision.ranks)]
        starts = [Start(name, shard_id, one, group=group, rank=i, ranks=len(ranks), fabric=fabric, adapters=adapters,
                        seal=seals.seal(self.seal_key, one.node_id, name, group, i, len(ranks))
                        if group and self.seal_key else None)
                  for i, (shard_id, one, adapters) in enumerate(ranks)]
        for i, start in enumerate(starts):
            one = start.decision
            memory = placement.memory_claim(one.profile)
            claims.append(placement.Claim(one.node_id, name, memory, one.gpus))
            self.items[start.shard_id] = Replica(start.shard_id, name, one.node_id, "waiting" if i else "pending",
                                                 profile_fp=model.fingerprint(one.profile), engine=one.profile.engine,
                                                 gpus=one.gpus, memory_bytes=memory, since=now, group=group, rank=i,
                                                 ranks=len(ranks), deferred=start if i else None)
        return starts[0]

    def retire(self, replica: Replica) -> None:
        self.revision += 1
        del self.items[replica.shard_id]
        self.retired[replica.shard_id] = replica.node_id

    def claims(self) -> list[placement.Claim]:
        with self.lock:
            return [placement.Claim(r.node_id, r.model, r.memory_bytes, r.gpus) for r in self.items.values()
                    if r.state in LIVE]

    def snapshot(self) -> list[Replica]:
        with self.lock:
            return [copy.copy(r) for r in self.items.values()]  # half of `dataclasses.replace`'s cost


DEFAULT_IDLE_TIMEOUT = 900.0  # an on-demand model with no idle_timeout stops after 15 minutes unused


class Demand:
    """When each model was last wanted (asked for, or served) according to the gateways."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.lock = threading.Lock()

    def note(self, model: str, now: float) -> None:
        with self.lock:
            self.last[model] = now

    def clear(self) -> None:
        with self.lock:
            self.last.clear()

    def wanted(self, models: dict[str, Model], now: float) -> dict[str, int]:
        """For models that run on demand (min 0): one replica while used within its idle timeout, else none."""
        with self.lock:
            out = {}
            for name, model in models.items():
                if model.min_replicas == 0:
                    idle = model.idle_timeout if model.idle_timeout is not None else DEFAULT_IDLE_TIMEOUT
                    out[name] = 1 if now - self.last.get(name, float("-inf")) < idle else 0
            return out


def plan(models: dict[str, Model], nodes: list[NodeView], replicas: Replicas, now: float,
         wanted: dict[str, int] | None = None, leaves: dict[str, dict[str, str]] | None = None,
         adopting: bool = False) -> tuple[list[Start | Stop], dict[str, dict[str, str]]]:
    """One pass: what to start and stop, and for each model that could not be placed, why, by node.

    WANTED overrides a model's count within its scaling (demand for an
    on-demand model); otherwise a model wants its minimum. LEAVES: each
    fabric's adapters' leaf switches (llmgw/control/fabricmaps.py), for
    replicas over several nodes. ADOPTING: whether nodes may still bring
    back replicas this controller has not heard of (`Fleet.adopting`).
    """
    unplaced: dict[str, dict[str, str]] = {}
    reachable = {n.node_id for n in nodes if n.state != LOST}
    # Planning and recording what was planned happen under one lock: a replica
    # decided here is a claim at once, so the next pass cannot place it twice.
    with replicas.lock:
        # Counted at the start, under the lock: a pass writes replicas directly too (`_keep_groups_whole`), and
        # whatever it raises, the loop reads the revision moved and makes the snapshot once the pass is done.
        replicas.revision += 1
        actions: list[Start | Stop] = list(replicas.orders)
        replicas.orders.clear()
        actions += _keep_groups_whole(replicas, reachable, now, adopting)
        stranded = [r for r in replicas.items.values() if r.node_id not in reachable]
        for replica in stranded:
            if replica.state != "ready" or replica.model not in models:
                replicas.retire(replica)  # not serving, or not wanted: nothing to keep in the snapshot
        stranded = [r for r in stranded if r.shard_id in replicas.items]
        current = [r for r in replicas.items.values() if r.node_id in reachable]
        stranded_of: dict[str, list[Replica]] = {}
        for r in stranded:
            stranded_of.setdefault(r.model, []).append(r)
        claims = replicas.claims()
        placer = placement.Placer(nodes, claims, leaves)
        # Grouped once a pass: grouping every replica for each use was most of a steady pass (0.65 of 0.77 s
        # at 20,000 replicas).
        units_of: dict[str, list[Unit]] = {}
        for unit in units(current):
            units_of.setdefault(unit.model, []).append(unit)
            if unit.model not in models and unit.state != "stopping":
                actions += replicas.stop(unit, f"{unit.model} is no longer in the catalog", drained=True)
        draining = {n.node_id for n in nodes if n.state == DRAINING}
        moving = False  # a drain moves one replica at a time, across every model
        errors: dict[str, str] = {}
        for name, model in sorted(models.items()):
            try:
                live = [u for u in units_of.get(name, ()) if u.state in LIVE]
                staying = [u for u in live if not u.node_ids & draining]
                leaving = [u for u in live if u.node_ids & draining]
                want = model.min_replicas if wanted is None or name not in wanted else \
                    max(model.min_replicas, min(model.max_replicas, wanted[name]))
                # A lost node's replicas are counted as gone (so they are replaced) but stay in the
                # snapshot until enough replacements are ready, the oldest kept longest.
                replaced = sum(1 for u in staying if u.state == "ready")
                for r in sorted(stranded_of.get(name, ()), key=lambda r: r.since)[max(0, want - replaced):]:
                    replicas.retire(r)
                if len(staying) > want or (len(staying) == want and leaving and
                                           all(u.state == "ready" for u in staying)):
                    # Stop the least useful first: those on a draining node, not yet ready, the newest.
                    for u in sorted(live, key=lambda u: (not u.node_ids & draining, u.state == "ready",
                                                         -u.since))[:len(live) - want]:
                        on = sorted(u.node_ids & draining)
                        why = f"{', '.join(on)} {'is' if len(on) == 1 else 'are'} draining" if on else \
                            f"{name} wants {want} replicas, had {len(live)}"
                        actions += replicas.stop(u, why, drained=True)
                    continue
                if leaving and (moving or any(u.state != "ready" for u in staying)):
                    moving = True  # a replacement is on its way; the next one waits for it
                    continue
                if len(staying) >= want or now < replicas.retry_at.get(name, 0.0):
                    continue
                for _ in range(min(want - len(staying), 1 if leaving else want)):
                    decision, reasons = placer.place(model)
                    if decision is None:
                        unplaced[name] = reasons
                        break
                    placed = len(claims)
                    actions.append(replicas.placed(model, decision, claims, now))
                    placer.taken(claims[placed:])
                    moving = moving or bool(leaving)
            except Exception as e:
                # One model's bad facts or bad bug must never stop the pass for every other model.
                errors[name] = replicas.plan_failed(name, e)
        replicas.plan_errors = errors  # a model planned without error this pass is logged afresh if it fails again
    return actions, unplaced


def _keep_groups_whole(replicas: Replicas, reachable: set[str], now: float, adopting: bool) -> list[Start | Stop]:
    """A replica over several nodes lives and dies whole: once any of its ranks failed, stopped or is on a
    lost node, the rest are stopped (a real vLLM's rank 0 goes on answering /health with a rank gone, and
    hangs the next request; its headless ranks never exit by themselves); their replacement is placed
    whole. A rank not heard of while nodes may still bring theirs back (ADOPTING) is waited for: its node
    may be late. Rank 0 stopped on purpose goes first (`Replicas.stop`), the others once it has. The ranks
    above 0 waiting for rank 0's master address are sent once it is known."""
    actions: list[Start | Stop] = []
    for unit in units([r for r in replicas.items.values() if r.group]):
        missing = unit.missing()
        lost = [f"rank {r.rank}'s node {r.node_id} is lost" for r in unit.members if r.node_id not in reachable]
        stopping = [f"rank {r.rank} on {r.node_id} is being stopped" for r in unit.members
                    if r.state == "stopping" and r.rank > 0]
        if missing and adopting and not (lost or stopping):
            continue
        gone = missing + lost + stopping
        if gone:
            for r in unit.members:
                if r.node_id in reachable:
                    continue
                if r.state == "waiting":
                    del replicas.items[r.shard_id]  # never sent: nothing runs there
                else:
                    replicas.retire(r)  # stopped if its node comes back
            actions += replicas.stop(unit, f"{'; '.join(gone)}: a replica over {unit.ranks} nodes is stopped whole")
            continue
        leader = unit.members[0]
        if leader.rank == 0 and leader.master and leader.state in ("fetching", "starting", "ready"):
            for r in unit.members:
                if r.state == "waiting" and r.deferred is not None:
                    r.state, r.since = "pending", now
                    actions.append(dataclasses.replace(r.deferred, master=leader.master))
                    r.deferred = None
    return actions


def start_message(model: Model, action: Start) -> dict:
    """The fields of the start_shard command that carries out ACTION."""
    profile = action.decision.profile
    message: dict[str, object] = {"request_id": uuid.uuid4().hex, "shard_id": action.shard_id, "model": model.name,
               "engine": profile.engine, "source": model.source_of(profile), "args": list(profile.args),
               "env": dict(profile.env),
               "gpus": list(action.decision.gpus) if profile.gpus else None, "profile_fp": model.fingerprint(profile),
               "max_context": model.max_context}
    if profile.start_limit is not None:
        message["start_limit"] = profile.start_limit
    if action.group:
        message.update(group=action.group, rank=action.rank, ranks=action.ranks, fabric=action.fabric,
                       adapters=list(action.adapters))
        if action.seal:
            message["seal"] = action.seal
        if action.master:
            message["master"] = action.master
    return message

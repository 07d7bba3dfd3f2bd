"""Failover, measured: two controllers on PostgreSQL, agents with engines, a gateway following both.

    python bench/failover.py [--agents 3] [--lost 0] [--rounds 3] [--ttl 10] [--renew 3] [--out FILE]

Real processes with the default timings (a 10 s lease renewed every 3 s, heartbeats every 5 s): two
controllers sharing a PostgreSQL server of the bench's own, AGENTS agents each running one engine of a
simulated model, and a gateway with two workers following both controllers, while a client sends one
request after another through it. Each round kills the leading controller (SIGKILL) and measures, from
the kill:

- leadership moved: the standby's admin API says it leads;
- agents back: every node ready on the new leader;
- replicas known: every replica ready on the new leader, with the same shard ids as before;
- the gateway follows: a rate-limited request admitted by the new leader's accountant (the gateway's
  count of requests served without an accountant does not move for it);

and counts the client's failed requests and the engines started anew (both should be 0). With
`--lost N`, N more nodes have keys but never run, as nodes lost for good: a new leader then waits
`controller.unreachable_after` (15 s) for them before it places or publishes replicas, and
"gateway follows" shows whether budgeted and rate-limited requests wait for that too. The killed
controller is then started again and stands by for the next round. A last round stops the leader
cleanly (SIGTERM): it gives the lease up, and the standby takes it at its next renewal. Then the
database itself is stopped for a while under the same load and started again (the bench runs a
PostgreSQL of its own for this, tests/pgserver.py): the client goes on being served, the leader
stands by once its lease runs out and leads again after. At the end every usage row the client's
requests made is counted in the store: rows lost should be 0.

The baseline is the lease's own promise, lease_ttl + lease_renew_interval, the longest a dead leader
can hold the cluster; each figure is printed beside it as a ratio. (The Go version measured leadership
moving in 3 s and agents back in 6 s with its own timings.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmgw import store  # noqa: E402
from llmgw.people import keys, limits  # noqa: E402
from llmgw.procs import wait_for  # noqa: E402
from tests.cluster import Agent, Controller, Traffic  # noqa: E402
from tests.conftest import Gateway, count_usage, post  # noqa: E402
from tests.pgserver import OwnPostgres  # noqa: E402

CHAT = {"model": "simmy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
WAIT = 120.0


def role(c: Controller) -> str | None:
    try:
        return c.api("/api/v1/status")["role"]
    except OSError:
        return None


def until(what: str, check, since: float) -> float:
    """Seconds from SINCE until CHECK() is true, polled every 50 ms."""
    wait_for(what, WAIT, check, interval=0.05)
    return time.monotonic() - since


class Rig:
    def __init__(self, folder: Path, agents: int, ttl: float, renew: float, lost: int = 0):
        self.database = OwnPostgres()
        self.url = self.database.url
        timings = {"controller__lease_ttl": ttl, "controller__lease_renew_interval": renew,
                   # The defaults, not the quick ones the tests use.
                   "controller__unreachable_after": 15.0, "controller__lost_after": 60.0,
                   "controller__reconcile_interval": 2.0, "agent__heartbeat_interval": 5.0,
                   "agent__reconnect_max": 30.0}
        self.made = []
        model = {"name": "simmy", "source": "/dev/null", "scaling": {"min": agents, "max": agents},
                 "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5", "--tokens-per-s", "0"]}]}
        self.controllers = []
        for name in ("a", "b"):
            (folder / name).mkdir()
            self.controllers.append(self._made(Controller(folder / name, store_url=self.url, models=[model],
                                                          controller__keys_dir=str(folder / "keys"), **timings)))
            if name == "a":
                wait_for("a leads", WAIT, lambda: role(self.controllers[0]) == "leader")
        a = self.controllers[0]
        addresses = [f"127.0.0.1:{c.agent_port}" for c in self.controllers]
        self.agents = [self._made(Agent(folder, addresses, f"n{i}", a.issue_key(f"n{i}"), **timings))
                       for i in range(agents)]
        for i in range(lost):
            a.issue_key(f"lost{i}")
        wait_for("every replica ready", WAIT, lambda: len(a.ready("simmy")) == agents)
        engine = store.open_store(self.url)
        try:
            record, self.free = keys.create_key(engine, "free")
            self.free_id = record.id
            record, self.limited = keys.create_key(engine, "limited")
            limits.set_limits(engine, "key", record.id, "bench", rpm=1_000_000)  # never refuses; always asks
        finally:
            engine.dispose()
        self.gateway = self._made(Gateway(folder, self.url, workers=2, gateway__key_file=a.gateway_key_file(),
                                          gateway__controller=[f"127.0.0.1:{c.gateway_port}"
                                                               for c in self.controllers]))
        self.traffic = self._made(Traffic(self.gateway.url, self.free))

    def _made(self, thing):
        self.made.append(thing)
        return thing

    def leader(self) -> Controller:
        return next(c for c in self.controllers if c.proc.poll() is None and role(c) == "leader")

    def admitted_by_an_accountant(self) -> bool:
        waived = self.gateway.metric_total("llmgw_accountant_unavailable_total")
        status = post(self.gateway.url + "/v1/chat/completions", CHAT, self.limited)[0]
        return status == 200 and self.gateway.metric_total("llmgw_accountant_unavailable_total") == waived

    def round(self, sig: int) -> dict:
        leader = self.leader()
        standby = next(c for c in self.controllers if c is not leader)
        shards = sorted(r["shard_id"] for r in leader.ready("simmy"))
        engines = [a.engines() for a in self.agents]
        failed, sent = len(self.traffic.failures), self.traffic.sent
        wait_for("the gateway admitting through the leader", WAIT, self.admitted_by_an_accountant)
        killed = time.monotonic()
        leader.stop(sig=sig)
        figures = {"leadership": until("the standby leads", lambda: role(standby) == "leader", killed)}
        if sig == signal.SIGKILL:
            # Polled beside the others, not after them: the gateway may follow before the replicas are known.
            gateway = threading.Thread(target=lambda: figures.update(gateway=until(
                "the gateway following", self.admitted_by_an_accountant, killed)))
            gateway.start()
            want = len(self.agents)
            figures["agents"] = until("every agent back", lambda: sum(
                n["state"] == "ready" for n in standby.api("/api/v1/nodes")["nodes"]) == want, killed)
            figures["replicas"] = until("every replica known", lambda: sorted(
                r["shard_id"] for r in standby.ready("simmy")) == shards, killed)
            gateway.join()
        self.traffic.more(20)
        figures["failed_requests"] = len(self.traffic.failures) - failed
        figures["requests"] = self.traffic.sent - sent
        figures["engines_restarted"] = sum(before != a.engines() for before, a in zip(engines, self.agents))
        leader.start()  # back as the standby
        wait_for("the old leader stands by", WAIT, lambda: role(leader) == "standby")
        return figures

    def database_restart(self, down: float) -> dict:
        """Stop the database for DOWN seconds under load, start it again; what the client saw."""
        failed, sent = len(self.traffic.failures), self.traffic.sent
        self.database.stop()
        stopped = time.monotonic()
        while time.monotonic() - stopped < down:  # the outage lasts this long, whatever happens meanwhile
            time.sleep(0.1)
        self.database.start()
        back = time.monotonic()
        figures = {"down": down, "leader_again": until("a controller leading again", lambda: any(
            c.proc.poll() is None and role(c) == "leader" for c in self.controllers), back)}
        self.traffic.more(20)
        figures["failed_requests"] = len(self.traffic.failures) - failed
        figures["requests"] = self.traffic.sent - sent
        return figures

    def rows_lost(self) -> int:
        """Stop the client and the gateway (which writes what it holds); requests made minus rows stored."""
        served = self.traffic.sent - len(self.traffic.stop())
        self.gateway.stop()
        return served - count_usage(self.url, key_id=self.free_id)

    def close(self) -> None:
        for thing in reversed(self.made):
            thing.stop()
        self.database.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--lost", type=int, default=0, help="nodes with keys that never come (a new leader "
                        "waits unreachable_after for them)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--renew", type=float, default=3.0)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    bound = args.ttl + args.renew
    with tempfile.TemporaryDirectory(prefix="llmgw-failover-") as tmp:
        rig = Rig(Path(tmp), args.agents, args.ttl, args.renew, args.lost)
        try:
            killed = [rig.round(signal.SIGKILL) for _ in range(args.rounds)]
            stopped = rig.round(signal.SIGTERM)
            outage = rig.database_restart(args.ttl + 5.0)
            lost = rig.rows_lost()
        finally:
            rig.close()
    print(f"failover with {args.agents} agents ({args.lost} lost), a {args.ttl:g} s lease renewed every {args.renew:g} s "
          f"(bound {bound:g} s), on {platform.node()}")
    print(f"{'leader killed (SIGKILL)':<34}{'worst s':>9}{'mean s':>9}{'/ bound':>9}")
    for name, label in (("leadership", "leadership moved"), ("agents", "agents back"),
                        ("replicas", "replicas known"), ("gateway", "gateway follows")):
        values = [r[name] for r in killed]
        print(f"  {label:<32}{max(values):>9.2f}{sum(values) / len(values):>9.2f}{max(values) / bound:>9.2f}")
    print(f"  {'failed requests':<32}{sum(r['failed_requests'] for r in killed):>9d} of "
          f"{sum(r['requests'] for r in killed)}")
    print(f"  {'engines restarted':<32}{sum(r['engines_restarted'] for r in killed):>9d}")
    print(f"leader stopped (SIGTERM): leadership moved in {stopped['leadership']:.2f} s "
          f"({stopped['leadership'] / args.renew:.2f} of one renewal interval), "
          f"{stopped['failed_requests']} failed requests")
    print(f"database stopped {outage['down']:.0f} s under load: {outage['failed_requests']} of {outage['requests']} "
          f"requests failed; a controller led again {outage['leader_again']:.2f} s after it was back")
    print(f"usage rows lost over the whole run: {lost}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ttl": args.ttl, "renew": args.renew, "agents": args.agents, "lost": args.lost, "killed": killed,
                       "stopped": stopped, "database_restart": outage, "usage_rows_lost": lost}, f, indent=2)


if __name__ == "__main__":
    main()

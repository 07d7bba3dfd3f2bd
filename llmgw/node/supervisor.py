"""The agent's engines: start them, watch them, stop them, and adopt them after a restart.

Each engine (a shard) runs in its own session and process group, writing to
a log file in the work directory, with a small state file beside it. So an
engine outlives its agent: an agent killed with SIGKILL and started again reads
the state files, finds the processes still running, and adopts them (the same
processes; requests in flight go on). A shard moves through fetching,
starting, ready, and ends stopped or failed; every transition is reported, a
failed one with the last lines the engine printed. Starting is idempotent by
shard id: the controller may send the same command twice.

Each engine listens only where gateways reach it (`agent.engine_host`, by
default the node's own address on its route to the controller) and answers
only requests that carry its replica's key: a secret made here when the shard
starts, kept in its state file (mode 0600) so an adopted engine keeps it, and
told to the controller in the shard's status over the CURVE channel, which
gives it to gateways only. Before, engines listened on every address with no
key, and anyone who reached the node used them past every key, limit and
budget.

A ready engine's `/health` is probed every `agent.health_interval`. One that
fails `agent.unhealthy_after` probes in a row is reported `unhealthy`, which
takes it out of every gateway's rotation at the controller's next snapshot;
a probe that passes brings it back. One unhealthy for longer than
`agent.restart_unhealthy_after` is restarted in place: the same replica and
key (on a new port), its restarts counted and the reason kept. Before, a hung engine (stopped,
deadlocked in a collective) stayed ready, and each request sent to it waited
for `timeouts.first_byte` (300 s) before anything noticed.

A shard of a replica over several nodes (`group`, `rank`, `ranks` in its
spec) is one rank of an engine that runs on every node of its group. Rank 0
serves HTTP as any shard does, and picks the port its ranks meet at
(`master`, reported at once, so that every rank fetches its weights at the
same time; only rank 0 reports it); the others run headless: no port,
no URL, no key told to anyone, `ready` as soon as they run, since their
readiness is rank 0's (its `/health` passes only once every rank has joined).
No rank is restarted alone: its engine cannot rejoin a group whose collectives
are set up, so a rank that goes on failing its probes is stopped as failed,
and the controller starts the replica again whole.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

from llmgw import addresses, engines, weights
from llmgw.engines import metrics as enginemetrics
from llmgw.engines import nccl
from llmgw.node import discovery, shardfiles
from llmgw.node.installer import InstallError
from llmgw.procs import free_port

log = logging.getLogger("llmgw.supervisor")

# Seconds an engine may take to answer /health, unless its profile says (`start_limit`): a 70B model loads
# slowly, and vLLM compiling a large one takes longer still.
START_LIMIT = 600.0
HEALTH_INTERVAL = 0.5
DRAINED_READINGS = 2  # idle readings in a row that let a draining engine stop (Supervisor._drain)
STOP_TIMEOUT = 30.0
LAST_LINES = 40
ALIVE = ("fetching", "starting", "ready", "unhealthy")
SERVING = ("ready", "unhealthy")  # started, and probed: an unhealthy engine is only out of rotation


@dataclasses.dataclass(frozen=True)
class Health:
    """How engines are probed once ready, and when one is restarted (the `agent.health_*` settings)."""

    interval: float = 2.0
    timeout: float = 3.0
    unhealthy_after: int = 2
    restart_after: float = 60.0  # 0: never

    @classmethod
    def from_settings(cls, cfg) -> "Health":
        return cls(cfg["agent.health_interval"], cfg["agent.health_timeout"], cfg["agent.unhealthy_after"],
                   cfg["agent.restart_unhealthy_after"])


class Shard:
    def __init__(self, spec: dict, port: int | None, log_path: str, api_key: str | None):
        self.spec = spec
        self.shard_id = spec["shard_id"]
        self.port = port
        self.log_path = log_path
        self.api_key = api_key  # None only for an engine adopted from an agent that made no keys
        self.state = "fetching"
        self.pid: int | None = None
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.fetch: dict | None = None
        self.detail: str | None = None
        self.ready_at: float | None = None  # wall clock: kept in the state file, so it survives the agent
        self.context: int | None = None  # tokens a request may use, as the engine says once ready
        self.failed_probes = 0  # health probes failed in a row
        self.unhealthy_since: float | None = None  # monotonic
        self.restarts = 0  # by this node, for failing its probes; kept in the state file
        self.restart_reason: str | None = None  # the last one
        self.stop_asked = False  # a stop that came while it was being restarted is carried out once it runs
        self.master_port: int | None = None  # rank 0 of a replica over several nodes: where its ranks meet

    @property
    def rank(self) -> int | None:
        """Its rank in a replica over several nodes, None for a replica on one node."""
        return self.spec.get("rank") if self.spec.get("group") else None

    @property
    def headless(self) -> bool:
        return bool(self.rank)


def tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return data.splitlines()[-lines:]


class Supervisor:
    def __init__(self, node_id: str, work_dir: str, weights_dir: str, engine_host: str, address: str, report,
                 local_sources: list[str] = (), named: dict[str, tuple[str, str]] | None = None, installer=None,
                 health: Health = Health(), ports=lambda: []):
        """REPORT(fields) is called (from any thread) with each shard_status to send. Engines listen on
        ENGINE_HOST, or on ADDRESS (where gateways reach this node) when it is empty. An engine is given a
        local source only inside WEIGHTS_DIR or LOCAL_SOURCES (`agent.local_sources`). An engine runs from
        what the configuration NAMED (`engines.named`), else from what INSTALLER (llmgw/node/installer.py)
        installed, installing it first when its catalogue has it, else from llmgw's own environment. HEALTH:
        how ready engines are probed and when one is restarted. PORTS(): the node's InfiniBand and RoCE ports
        now (llmgw/node/ibports.py), for the NCCL variables of a replica over several nodes."""
        self.node_id = node_id
        self.health = health
        self.ports = ports
        self.named = named or {}
        self.installer = installer
        self.work_dir = work_dir
        self.weights_dir = weights_dir
        self.local_sources = local_sources
        self.engine_host = engine_host or address
        # Gateways dial the address the engine listens on; a wildcard listens on ADDRESS too.
        self.url_host = address if self.engine_host in addresses.WILDCARDS else self.engine_host
        self.probe_host = addresses.dial_host(self.engine_host)
        self.report = report
        self.shards: dict[str, Shard] = {}
        self.lock = threading.RLock()
        self.cpu_samples: dict[str, tuple[float, float]] = {}  # shard -> (cpu seconds, when)
        os.makedirs(os.path.join(work_dir, "shards"), exist_ok=True)

    # --- reporting -------------------------------------------------------------------------

    def status(self, shard: Shard) -> dict:
        spec = shard.spec
        fields = dict(node_id=self.node_id, shard_id=shard.shard_id, state=shard.state, model=spec["model"],
                      engine=spec["engine"], profile_fp=spec.get("profile_fp"), gpus=spec.get("gpus"), pid=shard.pid,
                      exit_code=shard.exit_code, fetch=shard.fetch, detail=shard.detail,
                      ready_s=round(max(0.0, time.time() - shard.ready_at), 1) if shard.ready_at else None,
                      context=shard.context, restarts=shard.restarts or None, restart_reason=shard.restart_reason)
        if not shard.headless:
            fields.update(port=shard.port, url=f"http://{addresses.join(self.url_host, shard.port)}",
                          api_key=shard.api_key)
        if shard.rank is not None:
            fields.update(group=spec["group"], rank=shard.rank, ranks=spec.get("ranks"), seal=spec.get("seal"))
            if shard.rank == 0:
                fields["master"] = self._master(shard)
        if shard.state == "failed":
            fields["last_output"] = tail(shard.log_path, LAST_LINES)
        return {k: v for k, v in fields.items() if v is not None}

    def _master(self, shard: Shard) -> str:
        """Where SHARD's group meets: rank 0 picked it on this node; the others were told."""
        return addresses.join(self.url_host, shard.master_port) if shard.rank == 0 else shard.spec["master"]

    def _set(self, shard: Shard, state: str, detail: str | None = None) -> None:
        shard.state = state
        shard.detail = detail
        if state == "ready" and shard.ready_at is None:
            shard.ready_at = time.time()
        self._save(shard)
        self.report(self.status(shard))
        if state in ("failed", "stopped"):
            # The controller keeps a failed shard's last output; the agent forgets it.
            with self.lock:
                if self.shards.get(shard.shard_id) is shard:
                    del self.shards[shard.shard_id]
        log.info("shard %s (%s): %s%s", shard.shard_id, shard.spec["model"], state, f": {detail}" if detail else "")

    def loads(self) -> list[dict]:
        """Each running engine's CPU (in cores, since the last call) and resident memory, its workers
        included, and for a ready one the requests it reports waiting and running and its KV cache use."""
        out = []
        with self.lock:
            shards = [s for s in self.shards.values() if s.pid and s.state in ALIVE]
        now = time.monotonic()
        for shard in shards:
            usage = discovery.group_usage(shard.pid)
            if usage is None:
                continue
            cpu, rss = usage
            entry = {"shard_id": shard.shard_id, "memory_rss_bytes": rss}
            previous = self.cpu_samples.get(shard.shard_id)
            if previous is not None and now > previous[1]:
                # A worker that exited takes its CPU seconds out of the sum: never a negative figure.
                entry["cpu_cores"] = round(max(0.0, (cpu - previous[0]) / (now - previous[1])), 2)
            self.cpu_samples[shard.shard_id] = (cpu, now)
            if shard.state == "ready" and not shard.headless:
                try:
                    entry.update(self._load(shard, timeout=1))
                except OSError:
                    pass  # not known this time: left out
            out.append(entry)
        return out

    def _get(self, shard: Shard, path: str, timeout: float):
        """GET PATH from SHARD's engine, with its key (llama.cpp wants it for everything but /health)."""
        headers = {"Authorization": f"Bearer {shard.api_key}"} if shard.api_key else {}
        request = urllib.request.Request(f"http://{addresses.join(self.probe_host, shard.port)}{path}",
                                         headers=headers)
        return urllib.request.urlopen(request, timeout=timeout)

    def _load(self, shard: Shard, timeout: float) -> dict[str, float]:
        """The figures SHARD's engine reports on /metrics; raises OSError when it does not answer."""
        with self._get(shard, "/metrics", timeout) as resp:
            return enginemetrics.parse_load(resp.read().decode("utf-8", "replace"))

    def describe(self) -> list[dict]:
        with self.lock:
            return [self.status(s) for s in self.shards.values()]

    # --- state files: what lets a restarted agent adopt its engines --------------------------

    def _save(self, shard: Shard) -> None:
        data = None if shard.state in ("stopped", "failed") else {
            "spec": shard.spec, "port": shard.port, "pid": shard.pid, "state": shard.state,
            "log_path": shard.log_path, "ready_at": shard.ready_at, "api_key": shard.api_key,
            "context": shard.context, "restarts": shard.restarts, "restart_reason": shard.restart_reason,
            "master_port": shard.master_port}
        shardfiles.save(self.work_dir, shard.shard_id, data)

    def adopt(self) -> list[str]:
        """Take back engines a previous agent left running; forget the ones that died meanwhile."""
        adopted = []
        for data in shardfiles.left_running(self.work_dir):
            pid = data["pid"]
            shard = Shard(data["spec"], data["port"], data["log_path"], data.get("api_key"))
            shard.pid = pid
            # An unhealthy engine is taken back as ready: its probes start again, and say within a few seconds. A
            # headless rank has nothing to probe: running is all it can say.
            shard.state = "ready" if data["state"] in SERVING or shard.headless else "starting"
            shard.ready_at = data.get("ready_at") if shard.state == "ready" else None
            shard.context = data.get("context") if isinstance(data.get("context"), int) else None
            shard.restarts = data.get("restarts") if isinstance(data.get("restarts"), int) else 0
            shard.restart_reason = data.get("restart_reason") if isinstance(data.get("restart_reason"), str) else None
            shard.master_port = data.get("master_port") if isinstance(data.get("master_port"), int) else None
            with self.lock:
                self.shards[shard.shard_id] = shard
            adopted.append(shard.shard_id)
            log.info("adopted shard %s (%s), pid %d, still running from before this agent started",
                     shard.shard_id, shard.spec["model"], pid)
            threading.Thread(target=self._wait_ready if shard.state == "starting" else self._watch_health,
                             args=(shard,), daemon=True).start()
        return adopted

    # --- commands --------------------------------------------------------------------------

    def start(self, spec: dict) -> None:
        """Start the shard SPEC describes, unless it already runs."""
        with self.lock:
            existing = self.shards.get(spec["shard_id"])
            if existing is not None and existing.state in ALIVE:
                self.report(self.status(existing))  # the controller may have missed it
                return
            log_path = os.path.join(self.work_dir, "shards", f"{spec['shard_id']}.log")
            shard = Shard(spec, None, log_path, secrets.token_urlsafe(32))
            if not shard.headless:
                shard.port = free_port(self.probe_host)
            if shard.rank == 0:
                shard.master_port = free_port(self.probe_host)
            self.shards[shard.shard_id] = shard
        threading.Thread(target=self._run, args=(shard,), name=f"shard-{shard.shard_id}", daemon=True).start()

    def _run(self, shard: Shard) -> None:
        spec = shard.spec
        if weights.is_url(spec["source"]):
            self._set(shard, "fetching")
        try:
            def progress(done, total):
                shard.fetch = {"source": spec["source"], "bytes_done": done, **({"bytes_total": total} if total else {})}
                self.report(self.status(shard))

            path = self._weights(spec, progress)
        except weights.LocalRefused as e:
            log.warning("refused shard %s (%s): %s", shard.shard_id, spec["model"], e)  # someone may be probing
            self._set(shard, "failed", str(e))
            return
        except weights.FetchError as e:
            self._set(shard, "failed", str(e))
            return
        try:
            launch = self._launch(shard)
        except InstallError as e:
            self._set(shard, "failed", f"installing engine {spec['engine']} failed: {e.detail}; {e.fix}")
            return
        ranks = None
        try:
            if shard.rank is not None:
                ranks = engines.Ranks(spec["group"], shard.rank, spec.get("ranks") or 1, self._master(shard))
                env_fabric = self._fabric_environment(shard)
            argv = engines.command(spec["engine"], path, spec["model"], self.engine_host, shard.port,
                                   spec.get("gpus") or [], spec.get("max_context"), spec.get("args") or [],
                                   replica=shard.shard_id, api_key=shard.api_key, launch=launch, ranks=ranks)
        except (ValueError, KeyError) as e:
            self._set(shard, "failed", f"cannot start it: {e}")
            return
        env = dict(os.environ)
        if ranks is not None:
            env.update(env_fabric)
        env.update(spec.get("env") or {})
        env.update(engines.environment(spec["engine"], shard.api_key, self.engine_host))
        if spec.get("gpus") is not None:
            # The indices are NVML's, which counts cards in PCI bus order; CUDA counts the fastest first unless
            # told otherwise, so on a node of mixed cards an engine landed on another GPU than placement counted.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec["gpus"])
        with open(shard.log_path, "ab") as out:
            # The log is shown to operators (`llmgw ctl logs`): never the key, where the command carries it.
            shown = " ".join(argv).replace(shard.api_key, "<replica key>")
            out.write(f"--- llmgw: starting {shown}\n".encode())
            out.flush()
            try:
                # A session of its own: the engine outlives the agent, and is stopped as a group.
                shard.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              cwd=self.work_dir, start_new_session=True)
            except OSError as e:
                self._set(shard, "failed", f"cannot run {argv[0]}: {e.strerror}")
                return
        shard.pid = shard.proc.pid
        self._set(shard, "starting")
        if shard.stop_asked:  # while it was being restarted
            self._stop(shard, None)
            return
        if shard.headless:
            self._set(shard, "ready", f"rank {shard.rank} of {spec.get('ranks')}: it serves through rank 0, "
                                      f"joining it at {spec['master']}")
            return
        self._wait_ready(shard)

    def _fabric_environment(self, shard: Shard) -> dict[str, str]:
        """NCCL's variables for SHARD's rank (llmgw/engines/nccl.py): the adapters its replica was placed on,
        their ports as they are now, and the bootstrap over this node's own interface (the one holding the
        address the other nodes reach it at)."""
        from llmgw.node.doctor import interface_of

        spec = shard.spec
        ports, adapters = self.ports(), list(spec.get("adapters") or ())
        if adapters and not nccl.rails(ports, adapters):
            # NCCL would fall back to sockets over the management network without a word: a replica that
            # passes its health checks and runs many times slower. Better failed, and placed again.
            raise ValueError(f"none of the adapters its replica was placed on ({', '.join(adapters)}) has an "
                             "active port now")
        return nccl.environment(spec.get("ranks") or 1, nccl.rails(ports, adapters), nccl.gid_index(ports, adapters),
                                interface_of(addresses.dial_host(self.url_host), "/"), spec.get("fabric") or "")

    def _launch(self, shard: Shard) -> tuple[str, str] | None:
        """What SHARD's engine runs from (see `__init__`), installing it first where the catalogue says how;
        raises InstallError."""
        engine = shard.spec["engine"]
        if engine in self.named:
            return self.named[engine]
        if self.installer is None or engine not in self.installer.entries:
            return None
        if engine not in self.installer.installed():
            self._set(shard, "fetching", f"installing engine {engine} {self.installer.entries[engine]['version']}")
            self.installer.ensure(engine)
        return self.installer.launch(engine)

    def _weights(self, spec: dict, progress) -> str:
        """The path SPEC's engine is given: a URL's download, or a local path inside the weights directory or
        `agent.local_sources`. The simulator is given no weights, so its local source is only a name, with
        nothing to bound (tests and benchmarks call it /dev/null)."""
        if spec["engine"] == "sim" and not weights.is_url(spec["source"]):
            return spec["source"]
        return weights.fetch(spec["source"], self.weights_dir, progress, self.local_sources)

    def _wait_ready(self, shard: Shard) -> None:
        limit = shard.spec.get("start_limit") or START_LIMIT
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if shard.state != "starting":
                return
            if not self._running(shard):
                self._set(shard, "failed", f"the engine exited with status {shard.exit_code} while starting")
                return
            try:
                with self._get(shard, "/health", timeout=2) as resp:
                    if resp.status == 200:
                        shard.context = self._served_context(shard)
                        self._set(shard, "ready")
                        threading.Thread(target=self._watch_health, args=(shard,), daemon=True,
                                         name=f"health-{shard.shard_id}").start()
                        return
            except OSError:
                pass
            time.sleep(HEALTH_INTERVAL)
        self.stop(shard.shard_id, reason=f"it did not answer /health within {limit:.0f} s (its profile's "
                                          "start_limit, or the agent's default)")

    def _served_context(self, shard: Shard) -> int | None:
        """What the engine says a request may use (engines.served_context); None when it does not say."""
        def get_json(path: str):
            with self._get(shard, path, timeout=5) as resp:
                return json.loads(resp.read(1 << 20))

        try:
            return engines.served_context(shard.spec["engine"], get_json)
        except (OSError, ValueError, AttributeError, IndexError):
            return None

    def _running(self, shard: Shard) -> bool:
        if shard.proc is not None:
            code = shard.proc.poll()
            if code is not None:
                shard.exit_code = code
                return False
            return True
        return shard.pid is not None and shardfiles.alive(shard.pid)

    # --- health: probed once ready, out of rotation when it fails, restarted when it goes on failing ----------

    def _probe(self, shard: Shard) -> str | None:
        """Why SHARD's engine fails its health probe now, or None when it passes."""
        try:
            with self._get(shard, "/health", timeout=self.health.timeout) as resp:
                return None if resp.status == 200 else f"it answered {resp.status}"
        except urllib.error.HTTPError as e:
            e.close()
            return f"it answered {e.code}"
        except OSError as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                return f"it did not answer within {self.health.timeout:g} s"
            return f"it could not be reached ({reason})"

    def _watch_health(self, shard: Shard) -> None:
        """Probe SHARD for as long as it serves (ready or unhealthy) under this agent; a headless rank has
        nothing to probe (`check` sees it exit)."""
        health = self.health
        while not shard.headless:
            time.sleep(health.interval)
            with self.lock:
                if self.shards.get(shard.shard_id) is not shard or shard.state not in SERVING:
                    return
            problem = self._probe(shard)
            if shard.state not in SERVING:
                return  # stopped or failed while the probe waited
            if problem is None:
                shard.failed_probes = 0
                if shard.state == "unhealthy":
                    shard.unhealthy_since = None
                    self._set(shard, "ready")
                continue
            shard.failed_probes += 1
            now = time.monotonic()
            if shard.state == "ready" and shard.failed_probes >= health.unhealthy_after:
                shard.unhealthy_since = now
                self._set(shard, "unhealthy", f"its /health failed {shard.failed_probes} probes in a row: {problem}")
            elif shard.state == "unhealthy":
                if health.restart_after and now - shard.unhealthy_since >= health.restart_after:
                    why = (f"its /health failed for {now - shard.unhealthy_since:.0f} s "
                           f"(agent.restart_unhealthy_after): {problem}")
                    if shard.rank is not None:
                        self.stop(shard.shard_id, reason=f"{why}; a rank of a replica over several nodes is not "
                                                         "restarted alone: the replica is started again whole")
                    else:
                        self._restart(shard, why)
                    return

    def _restart(self, shard: Shard, reason: str) -> None:
        """Stop SHARD's engine and start it again in place: the same replica and key on a new port (the old one
        may linger in TIME_WAIT with the gateways' connections); the controller sees it start, become ready
        again, and gateways take its new address from the next snapshot."""
        shard.restarts += 1
        shard.restart_reason = reason
        log.warning("restarting shard %s (%s), restart %d: %s", shard.shard_id, shard.spec["model"],
                    shard.restarts, reason)
        shard.state = "restarting"  # no probe, no second restart, while it goes; not reported
        self._kill(shard)
        shard.proc, shard.pid, shard.exit_code, shard.ready_at = None, None, None, None
        shard.failed_probes, shard.unhealthy_since = 0, None
        shard.port = free_port(self.probe_host)
        with open(shard.log_path, "ab") as out:
            out.write(f"--- llmgw: restarting the engine: {reason}\n".encode())
        threading.Thread(target=self._run, args=(shard,), name=f"shard-{shard.shard_id}", daemon=True).start()

    def check(self) -> None:
        """Notice engines that died (called every second or so by the agent's loop)."""
        with self.lock:
            shards = list(self.shards.values())
        for shard in shards:
            if shard.state in SERVING and not self._running(shard):
                hint = " (SIGKILL: out of memory?)" if shard.exit_code == -signal.SIGKILL else ""
                self._set(shard, "failed", f"the engine exited with status {shard.exit_code}{hint}")

    def stop(self, shard_id: str, reason: str | None = None, drain: float | None = None) -> bool:
        """Stop a shard: SIGTERM to its process group, SIGKILL after STOP_TIMEOUT. With DRAIN, first wait
        (at most that many seconds) until its engine has no request running or waiting. False if unknown."""
        with self.lock:
            shard = self.shards.get(shard_id)
        if shard is None:
            return False
        shard.stop_asked = True
        if shard.state not in ALIVE:
            return True
        serving, shard.state = shard.state in SERVING, "stopping"
        # An engine not yet serving has nothing to finish: it stops at once, freeing its GPUs for the next.
        target, args = (self._drain, (shard, drain)) if drain is not None and serving else (self._stop, (shard, reason))
        threading.Thread(target=target, args=args, daemon=True).start()
        return True

    def _drain(self, shard: Shard, timeout: float) -> None:
        """Stop SHARD once its engine has said twice in a row, HEALTH_INTERVAL apart, that it runs and queues
        nothing, or at TIMEOUT. Twice: vLLM counts a request done once its engine has made the last token, which
        can be before its API server has written the last events and [DONE] to the stream. An engine slow to
        answer (a busy CPU) is asked again, where it was stopped at once; one with no metrics to wait on (an
        HTTP error) or not listening is stopped at once."""
        deadline = time.monotonic() + timeout
        idle = 0
        while (left := deadline - time.monotonic()) > 0 and self._running(shard) and not shard.headless:
            try:
                load = self._load(shard, timeout=min(2.0, max(0.1, left)))
            except urllib.error.HTTPError:
                break
            except OSError as e:
                if isinstance(getattr(e, "reason", e), ConnectionRefusedError):
                    break  # nothing listens, so nothing is being answered
                idle = 0
            else:
                if not load:
                    break  # it reports no load figures: nothing to wait on
                idle = idle + 1 if load.get("running", 0) + load.get("waiting", 0) == 0 else 0
                if idle == DRAINED_READINGS:
                    break
            time.sleep(min(HEALTH_INTERVAL, max(0.0, deadline - time.monotonic())))
        self._stop(shard, None)

    def _stop(self, shard: Shard, reason: str | None) -> None:
        self._kill(shard)
        self._set(shard, "failed" if reason else "stopped", reason)

    def _kill(self, shard: Shard) -> None:
        """SIGTERM to SHARD's process group (continued first: a stopped engine would not see it until then),
        SIGKILL after STOP_TIMEOUT; returns once it has gone."""
        if not shard.pid:
            return
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(shard.pid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + STOP_TIMEOUT
        while self._running(shard) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._running(shard):
            log.warning("shard %s did not stop within %.0f s of SIGTERM; killing it", shard.shard_id, STOP_TIMEOUT)
            try:
                os.killpg(shard.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + STOP_TIMEOUT
            while self._running(shard) and time.monotonic() < deadline:
                time.sleep(0.1)

    def weights_in_use(self) -> dict[str, list[str]]:
        """Entry of the weights directory -> the shards (fetching, starting or ready) that use it."""
        used: dict[str, list[str]] = {}
        with self.lock:
            for shard in self.shards.values():
                if shard.state not in ALIVE:
                    continue
                source = shard.spec.get("source", "")
                if weights.is_url(source):
                    name = weights.fetched_name(source)
                else:
                    path = source[len("file://"):] if source.startswith("file://") else source
                    name = weights.entry_of(path, self.weights_dir) if os.path.isabs(path) else None
                if name is not None:
                    used.setdefault(name, []).append(shard.shard_id)
        return used

    def weights(self, most: int = weights.LISTED_MOST) -> dict:
        """What the weights directory holds (`weights.inventory`), with the shards using each entry."""
        return weights.inventory(self.weights_dir, self.local_sources, self.weights_in_use(), most)

    def reclaim(self, names: list) -> tuple[list[str], dict[str, str]]:
        """Remove each of NAMES that `weights.reclaim` allows: (those removed, name -> why not). Under the lock,
        so no shard can start using an entry between the check and the removal."""
        removed, refused = [], {}
        with self.lock:
            in_use = self.weights_in_use()
            for name in names:
                why = weights.reclaim(name, self.weights_dir, self.local_sources, in_use)
                if why is None:
                    removed.append(name)
                else:
                    refused[str(name)] = why
        for name in removed:
            log.info("reclaimed %s from the weights directory", name)
        for name, why in refused.items():
            log.warning("refused to reclaim %r: %s", name, why)
        return removed, refused

    def remove_weights(self, source: str) -> str | None:
        """Delete what was fetched for SOURCE; the reason when it is refused."""
        if not weights.is_url(source):
            return f"{source} is not a download: llmgw never deletes files it did not fetch"
        return self.reclaim([weights.fetched_name(source)])[1].get(weights.fetched_name(source))

    def engine_logs(self) -> dict[str, str]:
        """{shard id: its log file} of every engine this node has a log of: the live shards first, then
        those that ran here before, newest first (a failed replica's log says why it failed)."""
        with self.lock:
            live = {shard_id: shard.log_path for shard_id, shard in sorted(self.shards.items())}
        folder = os.path.join(self.work_dir, "shards")
        past = []
        for entry in os.scandir(folder) if os.path.isdir(folder) else ():
            name = entry.name[:-len(".log")]
            if entry.name.endswith(".log") and name not in live and entry.is_file(follow_symlinks=False):
                past.append((entry.stat().st_mtime, name, entry.path))
        return {**live, **{name: path for _, name, path in sorted(past, reverse=True)}}

"""The fleet as Prometheus series, read from the controller's memory at each scrape.

Agents publish nothing themselves: one scrape of the controller shows every
node. A figure a node did not report is left out, not written as 0 (a GPU
whose driver cannot say its utilisation has no utilisation series).

Only the leading controller publishes the fleet. A standby's view is stale:
the nodes it knew as leader moved to the new one, and would age to `lost`
here and alert for nodes that are fine.
"""

from __future__ import annotations

import contextlib
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmgw.control import fabricview
from llmgw.control.fleet import STATES, Fleet
from llmgw.control.reconciler import whole


class FleetCollector:
    def __init__(self, fleet: Fleet, replicas=None, models=lambda: {}, leading=lambda: True):
        """REPLICAS is the controller's Replicas; MODELS() returns the catalog's models; LEADING() whether
        this controller leads (the lease's `held`)."""
        self.fleet = fleet
        self.replicas = replicas
        self.models = models
        self.leading = leading

    def collect(self):
        leading = self.leading()
        nodes = self.fleet.describe(time.monotonic()) if leading else []
        up = GaugeMetricFamily("llmgw_node_up", "1 for the state each node is in.", labels=["node", "state"])
        seen = GaugeMetricFamily("llmgw_node_last_seen_seconds", "Seconds since the node was last heard.",
                                 labels=["node"])
        cpus = GaugeMetricFamily("llmgw_node_cpus", "CPUs of the node.", labels=["node"])
        mem_total = GaugeMetricFamily("llmgw_node_memory_total_bytes", "Memory of the node.", labels=["node"])
        mem_avail = GaugeMetricFamily("llmgw_node_memory_available_bytes", "Memory available on the node.",
                                      labels=["node"])
        mem_used = GaugeMetricFamily("llmgw_node_memory_used_bytes", "Memory in use on the node: its total less "
                                     "what is available.", labels=["node"])
        load = GaugeMetricFamily("llmgw_node_load", "1-minute load average of the node.", labels=["node"])
        cpu_util = GaugeMetricFamily("llmgw_node_cpu_utilization_percent", "CPU use of the whole node, 0-100.",
                                     labels=["node"])
        disk_free = GaugeMetricFamily("llmgw_node_disk_free_bytes", "Free space where the node keeps weights.",
                                      labels=["node"])
        disk_total = GaugeMetricFamily("llmgw_node_disk_total_bytes", "Size of the disk holding the weights.",
                                       labels=["node"])
        gpu_mem = GaugeMetricFamily("llmgw_gpu_memory_used_bytes", "GPU memory in use.", labels=["node", "gpu"])
        gpu_total = GaugeMetricFamily("llmgw_gpu_memory_total_bytes", "GPU memory.", labels=["node", "gpu"])
        gpu_util = GaugeMetricFamily("llmgw_gpu_utilization_percent", "GPU utilisation, where the driver reports it.",
                                     labels=["node", "gpu"])
        gpu_ok = GaugeMetricFamily("llmgw_gpu_healthy", "1 while the GPU reports healthy.", labels=["node", "gpu"])
        shard_cpu = GaugeMetricFamily("llmgw_shard_cpu_cores", "CPU cores an engine uses, its workers included.",
                                      labels=["node", "shard"])
        shard_mem = GaugeMetricFamily("llmgw_shard_memory_bytes", "Resident memory of an engine and its workers.",
                                      labels=["node", "shard"])
        shard_waiting = GaugeMetricFamily("llmgw_shard_requests_waiting", "Requests waiting in an engine, as it reports.",
                                          labels=["node", "shard"])
        shard_running = GaugeMetricFamily("llmgw_shard_requests_running", "Requests an engine is generating for.",
                                          labels=["node", "shard"])
        shard_kv = GaugeMetricFamily("llmgw_shard_kv_cache_usage", "An engine's KV cache use, 0 to 1, where it reports it.",
                                     labels=["node", "shard"])
        for n in nodes:
            node, facts = n.node_id, n.facts
            for state in STATES:
                up.add_metric([node, state], 1.0 if n.state == state else 0.0)
            seen.add_metric([node], n.last_heard_s)
            for family, value in ((cpus, facts.cpu_count), (mem_total, facts.memory_total_bytes),
                                  (mem_avail, facts.memory_available_bytes), (load, facts.load1),
                                  (cpu_util, facts.cpu_percent), (disk_free, facts.disk_free_bytes),
                                  (disk_total, facts.disk_total_bytes)):
                if value is not None:
                    family.add_metric([node], value)
            if facts.memory_total_bytes is not None and facts.memory_available_bytes is not None:
                mem_used.add_metric([node], facts.memory_total_bytes - facts.memory_available_bytes)
            for shard in facts.shard_loads or []:
                if "cpu_cores" in shard:
                    shard_cpu.add_metric([node, shard["shard_id"]], shard["cpu_cores"])
                if "memory_rss_bytes" in shard:
                    shard_mem.add_metric([node, shard["shard_id"]], shard["memory_rss_bytes"])
                for family, field in ((shard_waiting, "waiting"), (shard_running, "running"), (shard_kv, "kv_cache")):
                    if field in shard:
                        family.add_metric([node, shard["shard_id"]], shard[field])
            for gpu in facts.gpus or ():
                index = str(gpu.index)
                for family, value in ((gpu_total, gpu.memory_total_bytes), (gpu_mem, gpu.memory_used_bytes),
                                      (gpu_util, gpu.utilization_percent)):
                    if value is not None:
                        family.add_metric([node, index], value)
                gpu_ok.add_metric([node, index], 1.0 if gpu.healthy else 0.0)
        yield from (up, seen, cpus, mem_total, mem_avail, mem_used, load, cpu_util, disk_free, disk_total,
                    gpu_total, gpu_mem, gpu_util, gpu_ok, shard_cpu, shard_mem, shard_waiting, shard_running, shard_kv)
        yield from fabric_families(nodes)
        yield from self._replica_families(leading)

    def _replica_families(self, leading: bool):
        by_state = GaugeMetricFamily("llmgw_replicas", "Replicas by state.", labels=["state"])
        ready = GaugeMetricFamily("llmgw_model_replicas_ready",
                                  "Ready replicas of each model that should be running (absent for a stopped one).",
                                  labels=["model"])
        restarts = CounterMetricFamily("llmgw_engine_restarts", "Engines their nodes restarted for failing their "
                                       "health probes (agent.restart_unhealthy_after), since this controller led.",
                                       labels=["model"])
        where = GaugeMetricFamily("llmgw_replica_info", "1 for each replica the controller knows, with its model "
                                  "and node: joined on `replica`, it tells the gateways' replica series their node.",
                                  labels=["replica", "model", "node"])
        if not leading:
            yield from (by_state, ready, where, restarts)
            return
        shards = self.replicas.snapshot() if self.replicas is not None else []
        for state in ("waiting", "pending", "fetching", "starting", "ready", "unhealthy", "stopping"):
            by_state.add_metric([state], sum(1 for r in shards if r.state == state))
        for r in shards:
            where.add_metric([r.shard_id, r.model, r.node_id], 1)
        models = self.models()
        serving = whole(shards)  # a replica over several nodes once, ready once every rank is
        for name, model in models.items():
            count = sum(1 for r in serving if r.model == name and r.state == "ready")
            live = any(r.model == name for r in shards)
            if live or model.min_replicas > 0:
                ready.add_metric([name], count)
        with self.replicas.lock if self.replicas is not None else contextlib.nullcontext():
            counts = dict(self.replicas.restarted) if self.replicas is not None else {}
        for name in sorted(set(counts) | set(models)):
            restarts.add_metric([name], counts.get(name, 0))
        yield by_state
        yield ready
        yield where
        yield restarts


def fabric_families(nodes):
    """The fabrics as series: each port's state, rate and counters, each fabric's subnet managers (once a
    fabric, however many nodes see it), each node's usable fabrics and their problems, each GPU's NVLink peers
    and domain, IMEX. Only what a node reported is written."""
    active = GaugeMetricFamily("llmgw_ib_port_active", "1 while an InfiniBand or RoCE port is ACTIVE; its state and "
                               "physical state as labels.", labels=["node", "hca", "port", "state", "phys_state"])
    rate = GaugeMetricFamily("llmgw_ib_port_rate_gbps", "A port's link rate.", labels=["node", "hca", "port"])
    counters = CounterMetricFamily("llmgw_ib_port_counter", "A port's counters as the kernel keeps them (error counts; "
                                   "port_xmit_data and port_rcv_data in bytes).",
                                   labels=["node", "hca", "port", "counter"])
    master = GaugeMetricFamily("llmgw_fabric_master_sm", "1 for the master subnet manager of each InfiniBand fabric.",
                               labels=["fabric", "sm_guid"])
    managers = GaugeMetricFamily("llmgw_fabric_subnet_managers", "Subnet managers of each InfiniBand fabric by state "
                                 "(a standby count of 0: no failover).", labels=["fabric", "state"])
    usable = GaugeMetricFamily("llmgw_node_fabric", "1 for each fabric a node can run a multi-node replica's "
                               "collectives on, with its physical identity.", labels=["node", "fabric", "physical"])
    degraded = GaugeMetricFamily("llmgw_node_fabric_degraded", "1 where a port of the node's fabric runs below its "
                                 "rate (placed last for multi-node replicas).", labels=["node", "fabric"])
    problems = GaugeMetricFamily("llmgw_fabric_problems", "Declared fabrics a node cannot use, and why not (its "
                                 "node's page says).", labels=["node"])
    peers = GaugeMetricFamily("llmgw_gpu_nvlink_peers", "GPUs a GPU is joined to by NVLink (0 on every card of a "
                              "node: PCIe only, or the topology not read).", labels=["node", "gpu"])
    joined = GaugeMetricFamily("llmgw_gpu_nvlink_joined", "1 for a GPU that joined a multi-node NVLink domain.",
                               labels=["node", "gpu", "domain"])
    imex = GaugeMetricFamily("llmgw_imex_up", "1 while the node's nvidia-imex is active (where it is installed).",
                             labels=["node"])
    for fabric, listed in sorted(fabricview.managers(nodes).items()):
        for m in listed:
            if m.get("state") == "master":
                master.add_metric([fabric, m["guid"]], 1.0)
        for state in ("master", "standby"):
            managers.add_metric([fabric, state], sum(1 for m in listed if m.get("state") == state))
    for n in nodes:
        node, facts = n.node_id, n.facts
        for port in facts.ib_ports:
            where = [node, port["hca"], str(port["port"])]
            active.add_metric(where + [port.get("state", ""), port.get("phys_state", "")],
                              1.0 if port.get("state", "").upper() == "ACTIVE" else 0.0)
            if port.get("rate_gbps") is not None:
                rate.add_metric(where, port["rate_gbps"])
            for name, value in sorted((port.get("counters") or {}).items()):
                counters.add_metric(where + [name], value)
        for fabric in facts.fabrics:
            usable.add_metric([node, fabric["name"], fabric.get("physical", "")], 1.0)
            degraded.add_metric([node, fabric["name"]], 1.0 if fabric.get("degraded") else 0.0)
        reported = facts.status.get("fabric_problems", facts.registration.get("fabric_problems"))
        if reported is not None:
            problems.add_metric([node], len(reported))
        for gpu in facts.gpus or ():
            peers.add_metric([node, str(gpu.index)], len(gpu.nvlink))
            if gpu.nvlink_domain:
                joined.add_metric([node, str(gpu.index), gpu.nvlink_domain], 1.0)
        state = (facts.status.get("imex") or facts.registration.get("imex") or {}).get("state")
        if state:
            imex.add_metric([node], 1.0 if state == "active" else 0.0)
    yield from (active, rate, counters, master, managers, usable, degraded, problems, peers, joined, imex)

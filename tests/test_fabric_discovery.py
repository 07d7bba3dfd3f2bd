"""What a node finds out about its fabrics and GPU topology, on fixtures (tests/fixtures/README.md says
where each shape comes from): InfiniBand and RoCE ports from sysfs trees, subnet managers, declared
fabrics checked against what was found, `nvidia-smi topo -m` in both layouts, and multi-node NVLink
domains from `nvidia-smi -q`."""

import os

import pytest

from llmgw import settings
from llmgw.node import fabrics, gputopology, ibports, subnetmanagers
from tests.conftest import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def fixture(name: str) -> str:
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


def ib_port(root, hca, port=1, state="4: ACTIVE", phys="5: LinkUp", rate="400 Gb/sec (4X NDR)",
            link_layer="InfiniBand", node_guid="0c42:a103:0045:bd6c", gids=("fe80:0000:0000:0000:0c42:a103:0045:bd6c",),
            types=(), ndevs=(), counters=None, numa="0"):
    """One port in the kernel's sysfs layout under ROOT."""
    hca_dir = root / "sys" / "class" / "infiniband" / hca
    folder = hca_dir / "ports" / str(port)
    for sub in ("counters", "gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (hca_dir / "device").mkdir(exist_ok=True)
    (hca_dir / "device" / "numa_node").write_text(numa + "\n")
    (hca_dir / "node_guid").write_text(node_guid + "\n")
    (hca_dir / "fw_ver").write_text("28.39.1002\n")
    (folder / "state").write_text(state + "\n")
    (folder / "phys_state").write_text(phys + "\n")
    (folder / "rate").write_text(rate + "\n")
    (folder / "link_layer").write_text(link_layer + "\n")
    (folder / "lid").write_text("0x1a\n")
    (folder / "sm_lid").write_text("0x1\n")
    for i, gid in enumerate(gids):
        (folder / "gids" / str(i)).write_text(gid + "\n")
    for i, kind in enumerate(types):
        (folder / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
    for i, dev in enumerate(ndevs):
        (folder / "gid_attrs" / "ndevs" / str(i)).write_text(dev + "\n")
    for name, value in (counters or {}).items():
        (folder / "counters" / name).write_text(f"{value}\n")


def test_a_ports_state_rate_guids_and_counters_are_read(tmp_path):
    ib_port(tmp_path, "mlx5_0", counters={"symbol_error": 3, "link_downed": 1, "port_xmit_data": 1000})
    ib_port(tmp_path, "mlx5_1", state="1: DOWN", phys="3: Disabled", rate="10 Gb/sec (4X SDR)", numa="-1")
    first, second = ibports.read_ports(str(tmp_path / "sys/class/infiniband"))
    assert first["hca"] == "mlx5_0" and first["port"] == 1
    assert first["state"] == "ACTIVE" and first["phys_state"] == "LinkUp" and first["rate_gbps"] == 400.0
    assert first["node_guid"] == "0x0c42a1030045bd6c" and first["port_guid"] == "0x0c42a1030045bd6c"
    assert first["lid"] == 0x1A and first["sm_lid"] == 1 and first["numa_node"] == 0
    # Data counters are in 4-byte words in sysfs; a counter the driver lacks is absent, not 0.
    assert first["counters"] == {"symbol_error": 3, "link_downed": 1, "port_xmit_data": 4000}
    assert ibports.active(first) and not ibports.active(second)
    assert second["phys_state"] == "Disabled" and "numa_node" not in second  # -1: the kernel does not know


def test_guids_written_either_way_are_one():
    assert ibports.normal_guid("0c42:a103:0045:bd6c") == ibports.normal_guid("0xc42a1030045bd6c")
    assert ibports.normal_guid("0000:0000:0000:0000") == "" and ibports.normal_guid("not hex") == ""


def test_roce_finds_its_routable_gid_and_network(tmp_path):
    # Index 0: RoCE v1 link-local; 1: RoCE v2 link-local; 2: v1 IPv4; 3: v2 IPv4, the one NCCL must use.
    gids = ("fe80:0000:0000:0000:ba3f:d2ff:fe12:3456", "fe80:0000:0000:0000:ba3f:d2ff:fe12:3456",
            "0000:0000:0000:0000:0000:ffff:0a00:0005", "0000:0000:0000:0000:0000:ffff:0a00:0005")
    ib_port(tmp_path, "mlx5_2", rate="200 Gb/sec (4X HDR)", link_layer="Ethernet", gids=gids,
            types=("IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"), ndevs=("ens1f0np0",) * 4)
    ib_port(tmp_path, "mlx5_0")
    prefixes = {"ens1f0np0": 24}
    by_hca = {p["hca"]: p for p in ibports.read_ports(str(tmp_path / "sys/class/infiniband"), netmask_of=prefixes.get)}
    assert by_hca["mlx5_2"]["roce_gid_index"] == 3
    assert by_hca["mlx5_2"]["network"] == "10.0.0.0/24"
    assert fabrics.port_identity(by_hca["mlx5_2"]) == "roce:10.0.0.0/24"
    assert "roce_gid_index" not in by_hca["mlx5_0"]  # InfiniBand: NCCL's own choice
    assert ibports.gid_ipv4("fe80:0000:0000:0000:ba3f:d2ff:fe12:3456") is None


def test_the_subnet_manager_lines_are_read():
    master = subnetmanagers.parse_sminfo(fixture("sminfo-master.txt"))
    assert master == {"guid": "0x248a0703005abcde", "lid": 1, "priority": 15, "state": "master"}
    with pytest.raises(ValueError, match="unrecognised sminfo output"):
        subnetmanagers.parse_sminfo(fixture("sminfo-no-port.txt"))
    every = subnetmanagers.parse_smir(fixture("saquery-smir.txt"))
    assert [(m["guid"], m["lid"], m["priority"], m["state"]) for m in every] == [
        ("0x248a0703005abcde", 1, 15, "master"), ("0x248a0703005a0012", 12, 14, "standby")]
    with pytest.raises(ValueError, match="no subnet manager records"):
        subnetmanagers.parse_smir("")


def _ports(*names):
    return [{"hca": n, "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 400.0} for n in names]


def test_a_fabric_is_named_by_its_lowest_subnet_manager_so_a_failover_does_not_split_it():
    smir = subnetmanagers.parse_smir(fixture("saquery-smir.txt"))
    master, standby = smir
    clock = [0.0]
    seen = {"master": master}
    asked = []

    def sminfo(hca, port):
        asked.append(("sminfo", hca))
        return seen["master"]

    def ask_smir(hca, port):
        asked.append(("smir", hca))
        return smir

    watch = subnetmanagers.Watch(sminfo, ask_smir, clock=lambda: clock[0], installed=lambda: True, background=False)
    ports = _ports("mlx5_0", "mlx5_1")
    watch.look(ports)
    # Each port asks its master; the list of managers once for the master they share, shown on one port.
    assert asked == [("sminfo", "mlx5_0"), ("smir", "mlx5_0"), ("sminfo", "mlx5_1")]
    assert [p["fabric_id"] for p in ports] == ["sm:0x248a0703005a0012"] * 2
    assert "subnet_managers" in ports[0] and "subnet_managers" not in ports[1]
    # Within the minute nothing is asked again; the ports keep what was found.
    again = _ports("mlx5_0", "mlx5_1")
    watch.look(again)
    assert len(asked) == 3 and again[1]["fabric_id"] == "sm:0x248a0703005a0012"
    # The master fails over to the standby: the fabric keeps its identity.
    seen["master"] = {**standby, "state": "master"}
    clock[0] = 61.0
    after = _ports("mlx5_0", "mlx5_1")
    watch.look(after)
    assert [p["fabric_id"] for p in after] == ["sm:0x248a0703005a0012"] * 2
    assert after[0]["sm"]["guid"] == standby["guid"]


def test_after_the_first_time_a_slow_subnet_manager_holds_up_no_heartbeat():
    import threading
    import time

    master = subnetmanagers.parse_sminfo(fixture("sminfo-master.txt"))
    release = threading.Event()
    calls = []

    def sminfo(hca, port):
        calls.append(hca)
        if len(calls) > 1:
            release.wait(30)  # a subnet manager that does not answer
        return master

    clock = [0.0]
    watch = subnetmanagers.Watch(sminfo, lambda hca, port: [master], clock=lambda: clock[0], installed=lambda: True)
    watch.look(_ports("mlx5_0"))  # the first time, at once: the registration waits for it
    clock[0] = 61.0
    started = time.monotonic()
    later = _ports("mlx5_0")
    watch.look(later)
    assert time.monotonic() - started < 5 and later[0]["fabric_id"] == "sm:0x248a0703005abcde"  # the last answer
    release.set()
    watch.asking.join(30)


def test_without_infiniband_diags_a_port_says_what_to_install():
    watch = subnetmanagers.Watch(installed=lambda: False)
    ports = _ports("mlx5_0")
    watch.look(ports)
    assert ports[0]["sm_error"] == subnetmanagers.NO_DIAGS and "fabric_id" not in ports[0]
    assert "infiniband-diags" in subnetmanagers.NO_DIAGS


def test_declared_fabrics_are_checked_against_the_ports():
    a = "sm:0x00000000000000aa"
    ports = [{"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 400.0,
              "fabric_id": a},
             {"hca": "mlx5_1", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 200.0,
              "fabric_id": a},
             {"hca": "mlx5_2", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 400.0,
              "fabric_id": "sm:0x00000000000000bb"},
             {"hca": "mlx5_3", "port": 1, "state": "DOWN", "phys_state": "Polling", "link_layer": "InfiniBand"}]
    usable, problems = fabrics.check([{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"], "rate_gbps": 400.0}], ports)
    assert problems == []
    [ib_a] = usable
    assert ib_a["physical"] == a and ib_a["adapters"] == ["mlx5_0", "mlx5_1"]
    # A collective runs at its slowest link; a port trained down marks the node degraded on the fabric.
    assert ib_a["rate_gbps"] == 200.0 and "mlx5_1/1 at 200 Gb/s of 400" in ib_a["degraded"]
    # Two physical fabrics under one name: refused, both named.
    usable, problems = fabrics.check([{"name": "ib", "adapters": ["mlx5_0", "mlx5_2"]}], ports)
    [(split, refused)] = problems
    assert usable == [] and refused and "2 physical fabrics" in split and "mlx5_2 on sm:0x00000000000000bb" in split
    # A fabric whose only port is down is not usable, and says why; an adapter the node lacks is named.
    usable, problems = fabrics.check([{"name": "ib-c", "adapters": ["mlx5_3", "mlx5_9"]}], ports)
    assert usable == []
    assert ("fabric ib-c: this node has no adapter mlx5_9 (it has mlx5_0, mlx5_1, mlx5_2, mlx5_3)", True) in problems
    assert any("mlx5_3/1 DOWN, Polling" in p and not refused for p, refused in problems)
    # A port whose subnet managers are not known yet is kept, unverified.
    unknown = [{**ports[0], "fabric_id": ""}]
    [kept], _ = fabrics.check([{"name": "ib-a", "adapters": ["mlx5_0"]}], unknown)
    assert kept["physical"] == "" and "degraded" not in kept


def test_a_configuration_that_puts_one_adapter_under_two_fabrics_is_refused(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('[[fabrics]]\nname = "ib-a"\nadapters = ["mlx5_0", "mlx5_1"]\n'
                    '[[fabrics]]\nname = "ib-b"\nadapters = ["mlx5_1"]\n')
    with pytest.raises(settings.ConfigError, match="adapter mlx5_1 is under both ib-a and ib-b"):
        settings.load(str(path))
    path.write_text('[[fabrics]]\nname = "ib-a"\n[[fabrics]]\nname = "ib-b"\nadapters = ["mlx5_1"]\n')
    with pytest.raises(settings.ConfigError, match="ib-a names no adapters"):
        settings.load(str(path))
    path.write_text('[[fabrics]]\nname = "ib a"\n')
    with pytest.raises(settings.ConfigError, match="must be 1-64 letters"):
        settings.load(str(path))
    path.write_text('[[fabrics]]\nname = "ib-a"\nadapters = ["mlx5_0"]\nrate_gbps = 400\n')
    assert settings.load(str(path)).fabrics == [{"name": "ib-a", "adapters": ["mlx5_0"], "rate_gbps": 400}]


def test_nvlink_and_adapter_distance_are_read_from_the_newer_layout():
    topo = gputopology.parse_topo(fixture("nvidia-smi-topo-8xh100.txt"))
    assert sorted(topo) == list(range(8))
    assert topo[0]["nvlink"] == {peer: 18 for peer in range(1, 8)}
    # The NIC legend turns NIC0/NIC1 into the adapters' names.
    assert topo[0]["nics"] == {"mlx5_0": "PIX", "mlx5_1": "SYS"}
    assert topo[4]["nics"] == {"mlx5_0": "SYS", "mlx5_1": "PIX"}
    assert topo[0]["numa"] == 0 and topo[7]["numa"] == 1


def test_older_drivers_name_adapters_in_the_header():
    topo = gputopology.parse_topo(fixture("nvidia-smi-topo-4xa100-bridged-old.txt"))
    assert topo[0]["nvlink"] == {1: 12} and topo[2]["nvlink"] == {3: 12}
    assert topo[0]["nics"] == {"mlx5_0": "NODE", "mlx5_1": "SYS"} and topo[3]["numa"] == 1


def test_something_that_is_not_a_matrix_is_an_error():
    with pytest.raises(ValueError, match="no GPU matrix"):
        gputopology.parse_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")


def test_a_gpus_nvlink_domain_is_read_and_a_single_machines_nvswitch_is_none():
    gb200 = gputopology.parse_gpu_fabric(fixture("nvidia-smi-q-gb200.txt"))
    joined, pending = gb200["00000009:01:00.0"], gb200["00000019:01:00.0"]
    assert joined == {"state": "Completed", "status": "Success", "clique_id": "32766",
                      "cluster_uuid": "76B1AD76-7C24-4B6B-9F6C-2A1E0D8C11AA", "bandwidth": "Full"}
    assert gputopology.domain(joined) == "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa/32766"
    assert pending["state"] == "In Progress" and gputopology.domain(pending) == ""
    hgx = gputopology.parse_gpu_fabric(fixture("nvidia-smi-q-hgx-h100.txt"))
    assert [gputopology.domain(card) for card in hgx.values()] == ["", ""]
    assert gputopology.parse_gpu_fabric(fixture("nvidia-smi-q-l40s.txt")) == {}  # no fabric: no entry


def test_the_topology_and_domains_are_put_on_the_gpus():
    gpus = [{"index": 0, "pci_bus": "00000009:01:00.0"}, {"index": 1, "pci_bus": "00000019:01:00.0"}]
    topo = gputopology.parse_topo(fixture("nvidia-smi-topo-8xh100.txt"))
    gputopology.apply(gpus, topo, gputopology.parse_gpu_fabric(fixture("nvidia-smi-q-gb200.txt")))
    assert gpus[0]["nvlink"]["1"] == 18 and gpus[0]["nic_paths"]["mlx5_0"] == "PIX" and gpus[0]["numa_node"] == 0
    assert gpus[0]["nvlink_domain"] == "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa/32766"
    assert gpus[1]["nvlink_domain"] == "" and gpus[1]["nvlink_fabric"]["state"] == "In Progress"


FAKE_DIAGS = os.path.join(ROOT, "tests", "fake-infiniband-diags")
# An agent's environment with infiniband-diags and nvidia-smi's topology and -q replayed from the fixtures.
FABRIC_ENV = {"PATH": FAKE_DIAGS + os.pathsep + os.environ["PATH"],
              "LLMGW_FAKE_SMINFO": os.path.join(FIXTURES, "sminfo-master.txt"),
              "LLMGW_FAKE_SMIR": os.path.join(FIXTURES, "saquery-smir.txt"),
              "LLMGW_FAKE_IBNETDISCOVER": os.path.join(FIXTURES, "ibnetdiscover-two-leaves.txt"),
              "LLMGW_FAKE_TOPO": os.path.join(FIXTURES, "nvidia-smi-topo-8xh100.txt"),
              "LLMGW_FAKE_Q": os.path.join(FIXTURES, "nvidia-smi-q-hgx-h100.txt")}


class QuietSupervisor:
    """What a reporter asks of its supervisor, for a node running nothing."""

    def describe(self):
        return []

    def loads(self):
        return []

    def weights(self, most=0):
        return {"bytes": 0, "entries": 0, "fetched_bytes": 0}


@pytest.fixture
def diags(monkeypatch):
    """infiniband-diags' sminfo and saquery, replaying the fixtures, first on the PATH."""
    monkeypatch.setenv("PATH", FAKE_DIAGS + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("LLMGW_FAKE_SMINFO", os.path.join(FIXTURES, "sminfo-master.txt"))
    monkeypatch.setenv("LLMGW_FAKE_SMIR", os.path.join(FIXTURES, "saquery-smir.txt"))


def test_a_port_going_down_is_told_to_the_controller_once(tmp_path, diags):
    from llmgw.node.reporter import Reporter

    ib_port(tmp_path, "mlx5_0")
    ib_port(tmp_path, "mlx5_1", node_guid="0c42:a103:0045:bd6d", gids=("fe80:0000:0000:0000:0c42:a103:0045:bd6d",))
    config = tmp_path / "agent.toml"
    config.write_text(settings.to_toml({"agent.infiniband_dir": str(tmp_path / "sys/class/infiniband"),
                                        "agent.weights_dir": str(tmp_path / "weights"), "agent.nvidia_smi": "/bin/false"},
                                       fabrics=[{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"]}]))
    reporter = Reporter("n1", settings.load(str(config)), QuietSupervisor(), "127.0.0.1")
    registered = reporter.register()
    [ib_a] = registered["fabrics"]
    assert ib_a["physical"] == "sm:0x248a0703005a0012" and ib_a["adapters"] == ["mlx5_0", "mlx5_1"]
    assert registered["fabric_problems"] == [] and len(registered["ib_ports"]) == 2
    quiet = reporter.heartbeat()
    assert "fabrics" not in quiet and "fabrics_changed" not in quiet and "ib_ports" not in quiet
    # A cable pulled on one adapter: the fabric stays, on the other; pulled on both, it is withdrawn, once.
    (tmp_path / "sys/class/infiniband/mlx5_0/ports/1/state").write_text("1: DOWN\n")
    one_down = reporter.heartbeat()
    assert one_down["fabrics_changed"] and one_down["fabrics"][0]["adapters"] == ["mlx5_1"]
    assert one_down["ib_ports"][0]["state"] == "DOWN"
    (tmp_path / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")
    gone = reporter.heartbeat()
    assert gone["fabrics_changed"] and gone["fabrics"] == []
    assert "no port of mlx5_0, mlx5_1 is active" in gone["fabric_problems"][0]
    after = reporter.heartbeat()
    assert "fabrics" not in after and "fabrics_changed" not in after


def test_a_node_says_its_fabrics_and_gpu_topology_to_the_controller(tmp_path):
    from llmgw.procs import wait_for
    from tests.cluster import Agent, Controller

    ib_port(tmp_path, "mlx5_0")
    ib_port(tmp_path, "mlx5_1", node_guid="0c42:a103:0045:bd6d", gids=("fe80:0000:0000:0000:0c42:a103:0045:bd6d",),
            rate="200 Gb/sec (4X HDR)")
    ctl = Controller(tmp_path)
    agent = None
    try:
        agent = Agent(tmp_path, [f"127.0.0.1:{ctl.agent_port}"], "gpu-01", ctl.issue_key("gpu-01"),
                      nvidia_smi_capture="nvidia-smi-8xh100.csv",
                      env=FABRIC_ENV,
                      fabrics=[{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"], "rate_gbps": 400.0}],
                      agent__infiniband_dir=str(tmp_path / "sys/class/infiniband"))
        wait_for("the node registers", 60, lambda: "gpu-01" in ctl.nodes())
        node = ctl.nodes()["gpu-01"]
        [ib_a] = node["facts"]["fabrics"]
        assert ib_a["name"] == "ib-a" and ib_a["physical"] == "sm:0x248a0703005a0012"
        assert "mlx5_1/1 at 200 Gb/s of 400" in ib_a["degraded"]
        gpu0 = node["facts"]["gpus"][0]
        assert gpu0["nvlink"]["7"] == 18 and gpu0["nic_paths"] == {"mlx5_0": "PIX", "mlx5_1": "SYS"}
        assert gpu0["numa_node"] == 0 and gpu0["nvlink_domain"] == ""  # an HGX's own NVSwitch: no domain
        [listed] = ctl.api("/api/v1/fabrics")["fabrics"]
        assert listed["id"] == "sm:0x248a0703005a0012" and listed["names"] == ["ib-a"] and listed["standby"] == 1
        assert [n["node"] for n in listed["nodes"]] == ["gpu-01"]
        assert ctl.api("/api/v1/nvlink") == {"domains": []}
        # The fabric's map, scanned through the agent: which leaf switch each adapter hangs off.
        mapped = ctl.api("/api/v1/fabrics/sm:0x248a0703005a0012/topology")
        assert mapped["by"] == "gpu-01" and mapped["hosts"]["0x0c42a1030045bd6c"]["leaf"] == "0x7cfe900300a1b2c3"
        assert mapped["switches"]["0x7cfe900300a1b2c3"]["description"] == "MF0;leaf-01:MQM9700/U1"
        for hca in ("mlx5_0", "mlx5_1"):
            (tmp_path / f"sys/class/infiniband/{hca}/ports/1/state").write_text("1: DOWN\n")
        wait_for("the fabric to be withdrawn", 60, lambda: ctl.nodes()["gpu-01"]["status"].get("fabrics") == [])
        assert ctl.api("/api/v1/fabrics")["problems"][0]["problem"].startswith("fabric ib-a: no port of")
    finally:
        if agent is not None:
            agent.stop()
        ctl.stop()


def findings(facts):
    from llmgw.node import fabricdoctor

    return [(f.level, f.message) for f in fabricdoctor.evaluate(facts)]


def test_the_doctor_reads_a_fabric_node_and_says_what_a_shard_would_get(tmp_path, diags):
    from llmgw.node import doctor

    ib_port(tmp_path, "mlx5_0", counters={"symbol_error": 2})
    ib_port(tmp_path, "mlx5_1", node_guid="0c42:a103:0045:bd6d", gids=("fe80:0000:0000:0000:0c42:a103:0045:bd6d",))
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "modules").write_text("ib_uverbs 184320 0 - Live 0x0\nmlx5_ib 483328 0 - Live 0x0\n")
    facts = doctor.collect(str(tmp_path), nvidia_smi="/bin/false", weights_dir=str(tmp_path),
                           known={"gpu": {"gpus": [], "gpus_probed": True}, "engines": {}},
                           declared=[{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"]}])
    facts["interface"] = "ens3"
    found = findings(facts)
    assert ("WARN", "mlx5_0/1 counts errors: symbol_error=2") in found
    assert ("OK", "mlx5_1/1 active at 400 Gb/s (InfiniBand)") in found
    # The fixture's fabric has a master and a standby: no warning about a lone subnet manager.
    assert not any("no standby" in message for _, message in found)
    assert ("OK", "fabric ib-a: mlx5_0, mlx5_1 at 400 Gb/s on sm:0x248a0703005a0012; a shard there gets "
                  "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1 NCCL_IB_DISABLE=0 NCCL_SOCKET_IFNAME==ens3 GLOO_SOCKET_IFNAME=ens3") in found
    assert facts["modules"] == ["ib_uverbs", "mlx5_ib"]


def test_the_doctor_fails_what_would_hang_a_replica_and_warns_of_the_rest():
    port = {"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 400.0,
            "counters": {}, "fabric_id": "sm:0x00000000000000aa",
            "subnet_managers": [{"guid": "0x00000000000000aa", "state": "master"}]}
    roce = {"hca": "mlx5_2", "port": 1, "state": "ACTIVE", "link_layer": "Ethernet", "rate_gbps": 200.0, "counters": {}}
    facts = {"infiniband": [port, roce], "modules": ["mlx5_ib"], "gpu": {"gpus": [{"index": 0}]},
             "nvswitches": 4, "fabricmanager": "inactive", "memlock": {"soft": 8 << 20},
             "gpu_fabric": {"00000009:01:00.0": {"state": "Completed", "cluster_uuid": "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa",
                                                 "clique_id": "7"},
                            "00000019:01:00.0": {"state": "In Progress", "cluster_uuid": "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa"}},
             "imex": {"state": "inactive"},
             "fabric_problems": [{"message": "fabric ib names adapters on 2 physical fabrics (...)", "refused": True}]}
    found = findings(facts)
    levels = dict((message.split(":")[0], level) for level, message in found)
    assert levels["4 NVSwitch(es) on the PCI bus and nvidia-fabricmanager is inactive"] == "FAIL"
    assert ("FAIL", "fabric ib names adapters on 2 physical fabrics (...)") in found
    messages = " | ".join(message for _, message in found)
    for words in ("ib_uverbs module is not loaded", "nvidia_peermem is not loaded",
                  "sm:0x00000000000000aa has one subnet manager and no standby",
                  "mlx5_2/1 (RoCE) has no RoCE v2 GID", "1 GPU(s) have not joined their NVLink domain",
                  "but IMEX is inactive", "the memlock limit is 8192 KiB"):
        assert words in messages, words
    # Most serious first, as the doctor prints them.
    from llmgw.node import doctor
    ordered = [f.level for f in doctor.evaluate({**facts, "cpu": {}, "memory": {}})]
    assert ordered == sorted(ordered, key=doctor.ORDER.get)


def test_the_nccl_environment_follows_the_fabric():
    from llmgw.engines import nccl

    # "=" makes NCCL take the names whole: mlx5_1 alone would take mlx5_10 and mlx5_11 too.
    assert nccl.environment(2, ["mlx5_0:1", "mlx5_1:1"], None, "ens3") == {
        "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "=ens3",
        "GLOO_SOCKET_IFNAME": "ens3"}
    assert nccl.environment(2, ["mlx5_2:1"], 3, None)["NCCL_IB_GID_INDEX"] == "3"  # RoCE v2
    assert nccl.environment(1, [], None, None) == {"NCCL_IB_DISABLE": "1"}
    nvl = nccl.environment(2, [], None, "ens3", island="nvl:76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa/7")
    assert nvl["NCCL_MNNVL_ENABLE"] == "1" and nvl["NCCL_CUMEM_ENABLE"] == "1"
    assert "NCCL_MNNVL_ENABLE" not in nccl.environment(2, ["mlx5_0:1"], None, None, island="sm:0x00000000000000aa")
    ports = [{"hca": "mlx5_2", "port": 1, "state": "ACTIVE", "roce_gid_index": 3},
             {"hca": "mlx5_0", "port": 2, "state": "ACTIVE"}, {"hca": "mlx5_1", "port": 1, "state": "DOWN"}]
    assert nccl.gid_index(ports, ["mlx5_2"]) == 3 and nccl.gid_index(ports, ["mlx5_0"]) is None
    assert nccl.rails(ports, ["mlx5_0", "mlx5_1", "mlx5_2"]) == ["mlx5_0:2", "mlx5_2:1"]


def test_the_fabrics_are_series_once_a_fabric_and_only_as_reported():
    from prometheus_client import CollectorRegistry, generate_latest

    from llmgw.control.fleet import NodeView, node_facts
    from llmgw.control.fleetmetrics import fabric_families

    managers = subnetmanagers.parse_smir(fixture("saquery-smir.txt"))
    port = {"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 400.0,
            "counters": {"symbol_error": 3, "port_xmit_data": 4000}, "fabric_id": "sm:0x248a0703005a0012",
            "subnet_managers": managers}
    down = {"hca": "mlx5_1", "port": 1, "state": "DOWN", "phys_state": "Polling", "counters": {}}
    first = {"ib_ports": [port, down], "fabrics": [{"name": "ib-a", "physical": "sm:0x248a0703005a0012",
                                                     "degraded": "mlx5_1/1 at 200 Gb/s of 400"}],
             "fabric_problems": [], "imex": {"state": "failed"},
             "gpus": [{"index": 0, "nvlink": {"1": 18}, "nvlink_domain": "u/7"}, {"index": 1, "nvlink": {"0": 18}}]}
    second = {"ib_ports": [port], "fabric_problems": ["fabric ib-b: no port of mlx5_2 is active (...)"]}
    nodes = [NodeView("a", "ready", 0, 0, node_facts(first, {})), NodeView("b", "ready", 0, 0, node_facts(second, {}))]

    class Fabrics:
        def collect(self):
            return fabric_families(nodes)

    registry = CollectorRegistry()
    registry.register(Fabrics())
    text = generate_latest(registry).decode()
    assert 'llmgw_ib_port_active{hca="mlx5_0",node="a",phys_state="LinkUp",port="1",state="ACTIVE"} 1.0' in text
    assert 'llmgw_ib_port_active{hca="mlx5_1",node="a",phys_state="Polling",port="1",state="DOWN"} 0.0' in text
    assert 'llmgw_ib_port_counter_total{counter="symbol_error",hca="mlx5_0",node="a",port="1"} 3.0' in text
    # Two nodes see the same fabric's managers: its series are written once.
    assert text.count("llmgw_fabric_master_sm{") == 1
    assert 'llmgw_fabric_subnet_managers{fabric="sm:0x248a0703005a0012",state="standby"} 1.0' in text
    assert 'llmgw_node_fabric_degraded{fabric="ib-a",node="a"} 1.0' in text
    assert 'llmgw_fabric_problems{node="a"} 0.0' in text and 'llmgw_fabric_problems{node="b"} 1.0' in text
    assert 'llmgw_gpu_nvlink_peers{gpu="0",node="a"} 1.0' in text
    assert 'llmgw_gpu_nvlink_joined{domain="u/7",gpu="0",node="a"} 1.0' in text
    assert 'llmgw_imex_up{node="a"} 0.0' in text and 'llmgw_imex_up{node="b"}' not in text
    assert 'llmgw_ib_port_rate_gbps{hca="mlx5_1"' not in text  # a rate not reported is not written

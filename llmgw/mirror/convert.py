"""The Hugging Face folder of a GGUF the mirror holds, for engines that load only that form.

vLLM 0.32 no longer loads GGUF files, and llama.cpp loads nothing else, so a
catalog model served by both names two forms of one set of weights: the GGUF
for its llama.cpp profile, and for its vLLM profile a folder (config,
tokenizer, safetensors) that transformers makes from the GGUF, dequantized to
bfloat16 (about three times a 4-bit GGUF's size). It works for the
architectures transformers reads from GGUF (llama, mistral, qwen2, phi3, ...);
for another one the conversion fails with transformers' own reason.

transformers runs in `mirror.convert_python`, an interpreter whose environment
has torch, transformers and gguf, not in the mirror's own: those are gigabytes
the mirror does not otherwise need. A vLLM environment the node installer made
has the first two; its lock with `gguf` added has all three. It runs offline
(no hub lookups), in the arriving folder, on the GGUF alone (linked into a
folder of its own, so nothing beside it in its version is read), one at a
time, bounded in time, refused when the machine's free memory cannot hold the
model dequantized, and stopped, with every process it started, when the disk
falls below what the mirror keeps free.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from llmgw.mirror.store import MirrorError

CONVERT_LIMIT = 3600.0  # seconds a conversion may take
# What a conversion writes, and holds in memory while it does, against its GGUF's size: bfloat16 is 16 bits a
# weight, a 4-bit GGUF about 4.5. An 8-bit one needs less; the estimate stays on the safe side.
GROWTH = 4
LOG_TAIL = 64 * 1024  # bytes of the converter's output read back for its reason
GiB = 1 << 30
# Read by the converting interpreter: the GGUF's folder, its name, and the folder to write.
SCRIPT = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
folder, name, out = sys.argv[1:]
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
                                     quantization_config=GgufConfig(dequantize=True)).save_pretrained(out)
"""
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "DO_NOT_TRACK": "1"}


def check_python(python: str) -> str:
    """PYTHON, the configured interpreter, when it can be run; else MirrorError saying what to set."""
    if not python:
        raise MirrorError("this mirror converts nothing: set mirror.convert_python to an interpreter with torch, "
                          "transformers and gguf (a vLLM environment's bin/python, with gguf installed)")
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        raise MirrorError(f"mirror.convert_python is {python}, which is not an interpreter this mirror can run")
    return python


def check_memory(gguf: str) -> None:
    """Refuse (MirrorError) a conversion of GGUF that this machine's available memory cannot hold dequantized:
    past it, the kernel's OOM killer picks a process, and on a mirror beside a controller it may pick that."""
    need = os.path.getsize(gguf) * GROWTH
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return  # not Linux, or not said: nothing to judge by
    if need > free:
        raise MirrorError(f"converting {os.path.basename(gguf)} needs about {need / GiB:.1f} GiB of memory (the model "
                          f"dequantized), and this machine has {free / GiB:.1f} GiB available: convert it on a "
                          "machine with more, and fetch the folder into the mirror")


def convert(python: str, gguf: str, out: str, still_room) -> None:
    """Write the Hugging Face folder of the GGUF file GGUF into OUT with PYTHON. STILL_ROOM() is called every
    second and raises to stop it; raises MirrorError with transformers' reason when it fails."""
    # The GGUF alone in a folder of its own: transformers reads what lies beside the file it is given (a
    # tokenizer, a chat template), and the version's other files are no part of this one. Linked, not copied
    # (it may be gigabytes), so the version being removed meanwhile takes nothing from under it.
    source = os.path.join(out, ".gguf")
    os.makedirs(source)
    linked = os.path.join(source, os.path.basename(gguf))
    try:
        os.link(gguf, linked)
    except OSError:
        os.symlink(gguf, linked)
    log_path = os.path.join(out, ".convert.log")
    env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}, **OFFLINE}
    try:
        with open(log_path, "wb+") as log:
            # A session of its own: torch starts helper processes, and stopping means stopping all of them.
            proc = subprocess.Popen([python, "-c", SCRIPT, source, os.path.basename(gguf), out], cwd=out,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            deadline = time.monotonic() + CONVERT_LIMIT
            try:
                while True:
                    try:
                        proc.wait(timeout=1)
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() > deadline:
                            raise MirrorError(f"converting {os.path.basename(gguf)} took over {CONVERT_LIMIT:.0f} s; "
                                              "convert it on a faster machine and fetch the folder into the "
                                              "mirror") from None
                        still_room()
            finally:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL))
            said = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    finally:
        shutil.rmtree(source, ignore_errors=True)
        if os.path.exists(log_path):
            os.remove(log_path)
    if proc.returncode != 0:
        reason = said[-1] if said else f"status {proc.returncode}"
        raise MirrorError(f"transformers could not convert {os.path.basename(gguf)}: {reason[:500]}")

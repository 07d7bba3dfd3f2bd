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
(no hub lookups), in the arriving folder, bounded in time, and is stopped when
the disk falls below what the mirror keeps free.
"""

from __future__ import annotations

import os
import subprocess
import time

from llmgw.mirror.store import MirrorError

CONVERT_LIMIT = 3600.0  # seconds a conversion may take
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


def convert(python: str, gguf: str, out: str, still_room) -> None:
    """Write the Hugging Face folder of the GGUF file GGUF into OUT with PYTHON. STILL_ROOM() is called every
    second and raises to stop it; raises MirrorError with transformers' reason when it fails."""
    log_path = os.path.join(out, ".convert.log")
    env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}, **OFFLINE}
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([python, "-c", SCRIPT, os.path.dirname(gguf), os.path.basename(gguf), out],
                                cwd=out, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + CONVERT_LIMIT
        try:
            while True:
                try:
                    proc.wait(timeout=1)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        raise MirrorError(f"converting {os.path.basename(gguf)} took over {CONVERT_LIMIT:.0f} s") \
                            from None
                    still_room()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        said = [line.strip() for line in log.read().splitlines() if line.strip()]
    os.remove(log_path)
    if proc.returncode != 0:
        reason = said[-1] if said else f"status {proc.returncode}"
        raise MirrorError(f"transformers could not convert {os.path.basename(gguf)}: {reason[:500]}")

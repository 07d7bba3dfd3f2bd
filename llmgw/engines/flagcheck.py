"""Whether an engine takes the flags llmgw builds for it (`llmgw ctl engine-check`).

Flags drift between an engine's releases, and a flag an engine does not know
stops it at once: a node would start the engine, see it exit, and start it
again. Probing never runs an engine (llmgw/engines/llamacpp.py says why), so
this is done on purpose, by someone who means to run the one named: its
version, its own help, and every command line llmgw builds for it (one card or
several, with a key, each rank of a replica over several nodes) held against
that help.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

from llmgw import engines
from llmgw.engines import llamacpp

# An option as argparse and llama.cpp print it: at a line's start, or after a comma among its other spellings.
FLAG = re.compile(r"(?:^\s+|, )(--?[a-zA-Z][\w-]*)", re.M)
ENGINES = ("llamacpp", "vllm", "sglang")


@dataclasses.dataclass(frozen=True)
class Checked:
    engine: str
    program: str  # what was run, as said to the operator
    version: str | None
    given: frozenset[str]  # every flag llmgw builds for it
    missing: frozenset[str]  # those its help does not list


def known_flags(help_text: str) -> set[str]:
    """The options an engine's --help lists."""
    return set(FLAG.findall(help_text))


def given_flags(engine: str, launch: tuple[str, str] | None) -> set[str]:
    """Every flag of every command line llmgw builds for ENGINE run by LAUNCH (("binary", path), ("python",
    interpreter) or None for llmgw's own): one card and two, a key, a context, and for vLLM each rank of a
    replica over several nodes."""
    shapes = [([0], None), ([0, 1], None)]
    if engine == "vllm":
        shapes += [([0, 1], engines.Ranks("g", rank, 2, "10.0.0.4:29500")) for rank in (0, 1)]
    found: set[str] = set()
    for gpus, ranks in shapes:
        argv = engines.command(engine, "/models/m", "m", "10.0.0.5", None if ranks and ranks.rank else 8001, gpus,
                               4096, [], "r1", api_key="k", launch=launch, ranks=ranks)
        found |= {arg for arg in argv[_program_length(engine, launch):] if arg.startswith("-")}
    return found


def _program_length(engine: str, launch: tuple[str, str] | None) -> int:
    """How many leading words of ENGINE's command line name the program (and a subcommand), not its flags."""
    if engine == "vllm":
        return 2 if launch and launch[0] == "binary" else 4  # `vllm serve`; `python -m MODULE serve`
    if engine == "sglang":
        return 3  # python -m sglang.launch_server
    if launch and launch[0] == "binary":
        return 1  # llama-server
    return 3  # python -I FILE (a node's environment), python -m MODULE (llmgw's own)


def help_command(engine: str, launch: tuple[str, str] | None) -> list[str]:
    """What prints ENGINE's options, run as LAUNCH would run it."""
    kind, path = launch or ("python", sys.executable)
    if engine == "vllm":
        program = [path] if kind == "binary" else [path, "-m", "vllm.entrypoints.cli.main"]
        return [*program, "serve", "--help=all"]
    if engine == "sglang":
        return [path, "-m", "sglang.launch_server", "--help"]
    if kind == "binary":
        return [path, "--help"]
    return [path, "-I", llamacpp.SERVER_FILE, "--help"]


def version_of(engine: str, launch: tuple[str, str] | None, timeout: float) -> str | None:
    kind, path = launch or ("python", sys.executable)
    if kind == "binary":
        return engines.probe_binary(engine, path)
    module = {"llamacpp": "xllamacpp", "vllm": "vllm", "sglang": "sglang"}[engine]
    try:
        run = subprocess.run([path, "-c", f"import importlib.metadata as m; print(m.version({module!r}))"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"{module} {run.stdout.strip()}" if run.returncode == 0 and run.stdout.strip() else None


def check(engine: str, launch: tuple[str, str] | None, timeout: float = 300) -> Checked:
    """ENGINE as LAUNCH runs it, held against every flag llmgw builds; raises RuntimeError where its help
    cannot be read (it is not there, does not run, or says nothing of options)."""
    argv = help_command(engine, launch)
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise RuntimeError(f"{argv[0]} is not there") from None
    except PermissionError:
        raise RuntimeError(f"{argv[0]} cannot be run (permission denied)") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    known = known_flags(run.stdout + run.stderr)
    if run.returncode != 0 or not known:
        said = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`{' '.join(argv)}` printed no options (exit {run.returncode}): {' / '.join(said)}")
    given = given_flags(engine, launch)
    return Checked(engine, " ".join(argv[:-1] if argv[-1].startswith("--help") else argv),
                   version_of(engine, launch, timeout), frozenset(given), frozenset(given - known))

"""The engines llmgw runs, one module each: how to launch it and how to read its load.

`LOAD_METRICS` maps each engine's Prometheus names onto the three figures
routing uses (requests waiting, requests running, KV cache use from 0 to 1).
The gateway does not need to know which engine a replica runs: the names do
not overlap, so one table reads them all.

Imported by: the agent (launching, probing), the gateway (reading a
replica's load from its `/metrics`) and `llmgw sim` (the simulated engine, a
gevent process of its own).
Concurrency: none here; `sim` runs under gevent in its own process.
May import: the top-level modules except `store`. Never another llmgw
package: both sides of the cluster use it.
"""

import dataclasses

from llmgw import __version__, addresses
from llmgw.engines import llamacpp, sglang, vllm


@dataclasses.dataclass(frozen=True)
class Ranks:
    """An engine's place in a replica over several nodes: rank RANK of RANKS in GROUP, meeting at MASTER
    (rank 0's HOST:PORT)."""
    group: str
    rank: int
    ranks: int
    master: str

LOAD_METRICS: dict[str, str] = {**vllm.LOAD_METRICS, **llamacpp.LOAD_METRICS, **sglang.LOAD_METRICS}


def named(cfg) -> dict[str, tuple[str, str]]:
    """Engine -> ("binary", path) for each engine binary the configuration names explicitly: the only
    binaries besides the ones the node installed itself that probing may run."""
    given = {"llamacpp": cfg["agent.llama_server"], "vllm": cfg["agent.vllm"]}
    return {name: ("binary", path) for name, path in given.items() if path}


def probe_binary(engine: str, path: str) -> str | None:
    """The version ENGINE's program at PATH reports (llama-server, vllm), or None where it does not run."""
    return llamacpp.probe(path) if engine == "llamacpp" else vllm.probe(path) if engine == "vllm" else None


def installed(given: dict[str, tuple[str, str]] | None = None) -> dict[str, str]:
    """Engine name -> version, for each engine llmgw may run here: the simulator (part of llmgw), the engines
    llmgw's own environment has (read from their metadata), and GIVEN's binaries (`named`), each asked its
    version. Nothing is looked up on the PATH."""
    found = {"sim": __version__}
    for name, version in (("llamacpp", llamacpp.probe()), ("sglang", sglang.probe())):
        if version:
            found[name] = version
    for name, (_kind, path) in (given or {}).items():
        version = probe_binary(name, path)
        if version:
            found[name] = version
        else:
            found.pop(name, None)  # the one the configuration names is the one that runs, or none
    return found



# Where each engine reads its API key from the environment, rather than its command line: any local user
# of the node reads a command line (`ps`, /proc/PID/cmdline), and llmgw writes it into the engine's log,
# which `llmgw ctl logs` shows; an environment is readable by the engine's own user only. SGLang reads
# its key only from `--api-key`, so `command` puts it there.
KEY_ENVIRONMENT = {"llamacpp": "LLAMA_API_KEY", "vllm": "VLLM_API_KEY", "sim": "LLMGW_SIM_API_KEY"}


def environment(engine: str, api_key: str, host: str) -> dict[str, str]:
    """The environment variables ENGINE is started with besides the node's: its API KEY (none for an engine that
    takes it as a flag), and what it needs to listen at HOST only and tell nobody about itself (vLLM)."""
    variable = KEY_ENVIRONMENT.get(engine)
    found = {variable: api_key} if variable else {}
    if engine == "vllm":
        found.update(vllm.environment(host))
    return found


# Engines that run one replica over several nodes (a rank a node); placement offers `nodes` above 1 only to them.
OVER_NODES = ("vllm", "sim")


def command(engine: str, source: str, name: str, host: str, port: int | None, gpus: list[int], max_context: int | None,
            args: list[str], replica: str, api_key: str | None = None,
            launch: tuple[str, str] | None = None, ranks: Ranks | None = None) -> list[str]:
    """The command line that serves SOURCE as NAME on HOST:PORT with ENGINE. API_KEY goes on it only for
    an engine that reads it nowhere else (see `key_environment`). LAUNCH: ("binary", path) or ("python",
    interpreter) the engine runs from (`named`, or what the node installed); None: llmgw's own environment.
    RANKS: this engine's place in a replica over several nodes (rank 0 serves at HOST:PORT, the others
    have no port)."""
    import sys

    if ranks is not None and engine not in OVER_NODES:
        raise ValueError(f"engine {engine} does not run a replica over several nodes")
    kind, path = launch or (None, None)
    binary, python = (path, None) if kind == "binary" else (None, path)
    if engine == "llamacpp":
        # llama.cpp divides --ctx-size among its slots; a request may use one slot's share, so that is what
        # max_context names. Once it started with the model's 4,096 and four slots: 1,024 a request, while
        # the catalog, /v1/models and the gateway's own refusals said 4,096.
        slots = llamacpp.slots(args)
        return llamacpp.command(source, port, name, ctx_size=(max_context or llamacpp.CONTEXT) * slots, host=host,
                                parallel=slots, binary=binary, python=python) + list(args)
    if engine == "vllm":
        return vllm.command(source, name, host, port, gpus, max_context, args, binary=binary, python=python,
                            ranks=ranks)
    if engine == "sglang":
        return sglang.command(source, name, host, port, gpus, max_context, args, api_key, python=python)
    if engine == "sim":
        argv = [sys.executable, "-m", "llmgw", "sim"]
        if port is not None:
            argv += ["--listen", addresses.join(host, port)]
        argv += ["--model", name, "--replica", replica]
        if ranks is not None:
            argv += ["--ranks", str(ranks.ranks), "--rank", str(ranks.rank), "--group", ranks.group,
                     "--master", ranks.master]
        return argv + list(args)
    raise ValueError(f"unknown engine {engine!r}")


# A context no engine serves; what an engine says past it is not believed.
MOST_CONTEXT = 1 << 24


def served_context(engine: str, get_json) -> int | None:
    """The tokens one request may use on ENGINE's running server, as the server itself says: llama.cpp a slot's
    context (`/props`, which is capped at what the model was trained on whatever --ctx-size asked), vLLM and
    the others `max_model_len` in `/v1/models`. GET_JSON(path) is the server's JSON answer there (it may
    raise OSError or ValueError); None when it does not say."""
    if engine == "llamacpp":
        value = (get_json("/props").get("default_generation_settings") or {}).get("n_ctx")
    else:
        data = get_json("/v1/models").get("data") or [{}]
        value = data[0].get("max_model_len") if isinstance(data[0], dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MOST_CONTEXT:
        return value
    return None

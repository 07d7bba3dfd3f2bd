"""Engine command lines, exactly as their documentation gives them."""

import dataclasses
import os
import subprocess
import sys

import pytest

from llmgw import engines
from llmgw.engines import flagcheck, llamacpp, sglang, vllm


def test_vllm_serve():
    assert vllm.command("/models/qwen", "qwen2.5-7b", "0.0.0.0", 8001, [2, 3], 32768, ["--enforce-eager"],
                        binary="/opt/vllm/bin/vllm") == [
        "/opt/vllm/bin/vllm", "serve", "/models/qwen", "--served-model-name", "qwen2.5-7b", "--host", "0.0.0.0",
        "--port", "8001", "--tensor-parallel-size", "2", "--max-model-len", "32768", "--enable-prefix-caching",
        "--enforce-eager"]
    assert "--tensor-parallel-size" not in vllm.command("/m", "m", "0.0.0.0", 1, [0], None, [], binary="vllm")
    # Installed into an environment of its own: its command-line module, from its interpreter.
    assert vllm.command("/m", "m", "0.0.0.0", 1, [], None, [], python="/e/venv/bin/python")[:4] == [
        "/e/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve"]


def test_every_flag_llmgw_gives_vllm_is_in_its_own_help():
    # The help of a real vLLM (tests/fixtures/README.md): a flag it does not know stops it at once. The same
    # check as `llmgw ctl engine-check`, on the captured help, for every command line (multi-node included).
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "vllm-0.32.0-serve-help.txt")) as f:
        known = flagcheck.known_flags(f.read())
    assert {"--served-model-name", "--api-key", "--enforce-eager"} <= known  # the capture is the real one
    argv = engines.command("vllm", "/models/m", "m", "10.0.0.5", 8001, [0, 1], 4096, [], "r1", api_key="k",
                           launch=("python", "/e/venv/bin/python"))
    assert argv[:4] == ["/e/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve"]
    assert "k" not in argv  # the key goes by environment, where no other user of the node reads it
    for launch in (("python", "/e/venv/bin/python"), ("binary", "vllm")):
        given = flagcheck.given_flags("vllm", launch)
        assert {"--nnodes", "--headless", "--tensor-parallel-size"} <= given and given <= known, given - known


def test_vllm_over_two_nodes():
    ranks = engines.Ranks("big-1", 0, 2, "10.0.0.4:29500")
    leader = vllm.command("/m", "m", "10.0.0.4", 8001, [0, 1, 2, 3], None, ["--pipeline-parallel-size", "1"],
                          binary="vllm", ranks=ranks)
    assert leader[leader.index("--host"):leader.index("--host") + 4] == ["--host", "10.0.0.4", "--port", "8001"]
    joined = " ".join(leader)
    assert ("--tensor-parallel-size 4 --distributed-executor-backend mp --pipeline-parallel-size 2 --nnodes 2 "
            "--node-rank 0 --master-addr 10.0.0.4 --master-port 29500") in joined
    assert "--headless" not in leader
    assert leader[-2:] == ["--pipeline-parallel-size", "1"]  # the profile's own, later, wins
    follower = vllm.command("/m", "m", "10.0.0.5", None, [0, 1, 2, 3], None, [], binary="vllm",
                            ranks=dataclasses.replace(ranks, rank=1))
    assert "--headless" in follower and "--host" not in follower and "--port" not in follower
    assert "--node-rank 1 --master-addr 10.0.0.4" in " ".join(follower)
    with pytest.raises(ValueError, match="does not run a replica over several nodes"):
        engines.command("llamacpp", "/m", "m", "10.0.0.4", 1, [], None, [], "r", ranks=ranks)


def test_vllm_is_started_quiet_and_on_its_nodes_address():
    env = engines.environment("vllm", "secret", "10.0.0.5")
    assert env == {"VLLM_API_KEY": "secret", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                   "VLLM_HOST_IP": "10.0.0.5"}
    assert "VLLM_HOST_IP" not in engines.environment("vllm", "secret", "0.0.0.0")  # a wildcard is no address
    assert engines.environment("llamacpp", "secret", "10.0.0.5") == {"LLAMA_API_KEY": "secret"}


def test_every_flag_llmgw_gives_sglang_is_in_its_own_parser():
    # SGLang's parser, printed from its own module (tests/fixtures/README.md); it cannot run here.
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "sglang-0.5.23-launch-server-help.txt")) as f:
        known = flagcheck.known_flags(f.read())
    assert {"--model-path", "--enable-metrics", "--api-key"} <= known
    argv = engines.command("sglang", "/models/m", "m", "10.0.0.5", 30000, [0, 1], 8192, [], "r1", api_key="k",
                           launch=("python", "/e/venv/bin/python"))
    assert argv[:3] == ["/e/venv/bin/python", "-m", "sglang.launch_server"]
    given = flagcheck.given_flags("sglang", ("python", "/e/venv/bin/python"))
    assert "--api-key" in given and given <= known, given - known


def engine_check(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "engine-check", *argv], capture_output=True,
                          text=True, timeout=600)


def test_engine_check_runs_the_engines_help_and_names_a_flag_it_no_longer_takes(tmp_path):
    ours = engine_check("llamacpp")  # the xllamacpp wheel's server, as llmgw runs it
    assert ours.returncode == 0 and "xllamacpp" in ours.stdout and "takes every one of the 8 flags" in ours.stdout
    # A llama-server of a release that renamed --pooling: the node would start it and see it exit.
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'version: 9999 (abc)'; exit 0; fi\n"
                    "cat <<'EOF'\n  -m, --model FNAME\n  --alias A\n  --host H\n  --port P\n  -c, --ctx-size N\n"
                    "  -t, --threads N\n  -np, --parallel N\n  --metrics\n  --embeddings\n  --pooling-type X\n"
                    "  --jinja\n  --no-webui\nEOF\n")
    fake.chmod(0o755)
    drifted = engine_check("llamacpp", "--bin", str(fake))
    assert drifted.returncode == 1 and "9999" in drifted.stdout
    assert "it does not take 1 of the 12 flags llmgw builds for it: --pooling." in drifted.stderr
    missing = engine_check("llamacpp", "--bin", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "nowhere is not there" in missing.stderr
    assert engine_check("vllm").returncode == 2  # which vLLM is the operator's to say


def test_engine_check_of_a_real_vllm():
    from tests import realvllm

    try:
        home = realvllm.environment()
    except realvllm.Unavailable as e:
        pytest.fail(f"vLLM's CPU build could not be installed: {e}")
    checked = engine_check("vllm", "--bin", os.path.join(home, "bin", "vllm"))
    assert checked.returncode == 0, checked.stderr
    assert f"vllm {realvllm.VERSION}" in checked.stdout and "--nnodes" in checked.stdout


def test_sglangs_load_figures_are_names_it_registers():
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "sglang-0.5.23-metric-names.txt")) as f:
        registered = set(f.read().split())
    assert set(sglang.LOAD_METRICS) <= registered


def test_sglang_launch_server():
    assert sglang.command("/models/llama", "llama", "0.0.0.0", 30000, [0, 1, 2, 3], 8192, []) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/llama", "--served-model-name",
        "llama", "--host", "0.0.0.0", "--port", "30000", "--enable-metrics", "--tp-size", "4", "--context-length", "8192"]


def test_llama_server_binary():
    assert llamacpp.command("/w/m.gguf", 8002, "m", ctx_size=4096, threads=8, parallel=4, host="0.0.0.0",
                            binary="/opt/llama.cpp/llama-server") == [
        "/opt/llama.cpp/llama-server", "--model", "/w/m.gguf", "--alias", "m", "--host", "0.0.0.0", "--port", "8002",
        "--ctx-size", "4096", "--threads", "8", "--parallel", "4", "--metrics", "--embeddings", "--pooling", "mean",
        "--jinja", "--no-webui"]


def test_llamacpp_from_the_wheel_when_no_binary():
    argv = llamacpp.command("/w/m.gguf", 8002, "m", threads=2)
    assert argv[:3] == [sys.executable, "-m", "llmgw.engines.xllamacpp_server"] and "--alias" in argv
    assert "--jinja" in argv  # tool calls, as with the binary
    # From an environment the node installed: the server's file, run isolated (that interpreter has no llmgw).
    argv = llamacpp.command("/w/m.gguf", 8002, "m", threads=2, python="/e/venv/bin/python")
    assert argv[:3] == ["/e/venv/bin/python", "-I", llamacpp.SERVER_FILE] and "--jinja" in argv


def test_sim_ranks():
    ranks = engines.Ranks("g-1", 1, 2, "127.0.0.1:29500")
    argv = engines.command("sim", "/dev/null", "m", "127.0.0.1", None, [], None, [], replica="g-1-r1", ranks=ranks)
    assert "--listen" not in argv
    assert argv[-8:] == ["--ranks", "2", "--rank", "1", "--group", "g-1", "--master", "127.0.0.1:29500"]


def test_sim_and_extra_args():
    argv = engines.command("sim", "/dev/null", "m", "127.0.0.1", 9000, [], None, ["--ttft-ms", "5"], replica="r1")
    assert argv == [sys.executable, "-m", "llmgw", "sim", "--listen", "127.0.0.1:9000", "--model", "m",
                    "--replica", "r1", "--ttft-ms", "5"]


def test_installed_engines_here():
    found = engines.installed()
    assert "sim" in found and found["llamacpp"].startswith("xllamacpp ")

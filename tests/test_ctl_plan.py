"""`llmgw ctl plan`: a model's shape read from a GGUF header or a Hugging Face folder's config (never its
weights), what a replica of it needs, and which nodes of a real controller's fleet it fits, on what."""

import json
import struct

import pytest

from llmgw.cli import plan
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller

GiB = 1 << 30


def gguf_file(path, size: int, **keys) -> str:
    """A GGUF v3 header with llama's shape KEYS, in a sparse file of SIZE bytes (no disk for the rest)."""
    def string(s):
        return struct.pack("<Q", len(s.encode())) + s.encode()
    entries = string("general.architecture") + struct.pack("<I", 8) + string("llama")
    for key, value in keys.items():
        entries += string(f"llama.{key}") + struct.pack("<I", 4) + struct.pack("<I", value)
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<I", 3) + struct.pack("<Q", 0) + struct.pack("<Q", 1 + len(keys)) + entries)
        f.truncate(size)
    return str(path)


SEVENTY_B = {"block_count": 80, "embedding_length": 8192, "attention.head_count": 64,
             "attention.head_count_kv": 8, "context_length": 131072}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    c = Controller(tmp)
    agents = [Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "h100", c.issue_key("h100"),
                    nvidia_smi_capture="nvidia-smi-8xh100.csv"),
              Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "cpu", c.issue_key("cpu"))]
    try:
        wait_for("both nodes", 60, lambda: all(c.state(a.node_id) == "ready" for a in agents))
        yield c, tmp
    finally:
        for a in agents:
            a.stop()
        c.stop()


def test_a_gguf_is_planned_from_its_header_onto_one_card_and_not_onto_a_small_cpu_node(fleet, tmp_path):
    c, _ = fleet
    model = gguf_file(tmp_path / "llama-70b-q2.gguf", 20 * GiB, **SEVENTY_B)
    shape = plan.read_shape(model)
    # Two vectors of 8 heads of 128 in 16 bits, in each of 80 layers: 320 KiB a token.
    assert shape.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2 and shape.trained_context == 131072
    run = c.ctl("plan", model, "--json")
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["context"] == 32768 and found["needed_bytes"] == 20 * GiB + 10 * GiB + GiB
    nodes = {n["node"]: n for n in found["nodes"]}
    assert nodes["h100"]["fits"] and nodes["h100"]["profile"] == {"engine": "llamacpp", "gpu_class": "h100-80g",
                                                                  "gpus": 1}
    said = c.ctl("plan", model, "--context", "4096")
    assert said.returncode == 0 and "h100: fits on one card of" in said.stdout and 'gpu_class = "h100-80g"' in said.stdout


def test_a_safetensors_folder_too_big_for_one_card_is_planned_over_several(fleet, tmp_path):
    c, _ = fleet
    folder = tmp_path / "llama-70b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072}))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 140 * GiB}}))
    found = json.loads(c.ctl("plan", str(folder), "--json").stdout)
    nodes = {n["node"]: n for n in found["nodes"]}
    # 151 GiB: two cards give 144 of their 160, so four, as vLLM splits heads in powers of two.
    assert nodes["h100"]["profile"] == {"engine": "vllm", "gpu_class": "h100-80g", "gpus": 4}
    assert not nodes["cpu"]["fits"] and "has no GPU" in nodes["cpu"]["how"]


def test_what_cannot_be_read_is_said(fleet, tmp_path):
    c, _ = fleet
    (tmp_path / "notes.gguf").write_text("not a model")
    for source, said in ((str(tmp_path / "notes.gguf"), "is not a GGUF file"),
                         (str(tmp_path), "no config.json"), (str(tmp_path / "gone.gguf"), "cannot be read")):
        run = c.ctl("plan", source)
        assert run.returncode == 1 and said in run.stderr, run.stderr


def test_a_model_is_planned_from_the_registry_and_from_a_signed_url_of_a_shard_set(fleet, tmp_path):
    import subprocess
    import sys
    import threading

    from werkzeug.serving import make_server
    from werkzeug.utils import send_from_directory
    from werkzeug.wrappers import Request

    from tests.conftest import write_config

    c, _ = fleet
    folder = tmp_path / "registry" / "acme" / "big-GGUF" / "resolve" / "main"
    folder.mkdir(parents=True)
    gguf_file(folder / "big-00001-of-00002.gguf", 12 * GiB, **SEVENTY_B)
    gguf_file(folder / "big-00002-of-00002.gguf", 8 * GiB)

    def app(environ, start_response):  # files with Range requests, as a registry or the mirror answers
        path = Request(environ).path.lstrip("/")
        return send_from_directory(str(tmp_path / "registry"), path, environ, conditional=True)(environ, start_response)

    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    config = write_config(tmp_path / "plan.toml", {**c.values, "mirror.hf_endpoint": url})
    try:
        for source in ("hf:acme/big-GGUF/big-00001-of-00002.gguf",
                       f"{url}/acme/big-GGUF/resolve/main/big-00001-of-00002.gguf?token=signed"):
            run = subprocess.run([sys.executable, "-m", "llmgw", "--config", config, "ctl", "plan", source, "--json"],
                                 capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stderr
            found = json.loads(run.stdout)
            assert found["needed_bytes"] == 20 * GiB + 10 * GiB + GiB, found  # both parts' weights
        said = subprocess.run([sys.executable, "-m", "llmgw", "--config", config, "ctl", "plan",
                               "hf:acme/big-GGUF/big-00001-of-00002.gguf"], capture_output=True, text=True, timeout=60)
        assert "cpu: does not fit: has " in said.stdout, said.stdout
        assert plan.from_registry("hf:acme/x@v1.0", url) == f"{url}/acme/x/resolve/v1.0"
        with pytest.raises(plan.PlanError, match="is not a registry source"):
            plan.from_registry("hf:acme/../x", url)
    finally:
        server.shutdown()
        server.server_close()

"""The real coding agents and SDKs against one real gateway: Codex CLI and Claude Code (pinned in tests/clients,
installed by `make clients`) and the official openai and anthropic SDKs, with the starter model behind
llama.cpp, a sim scripted to call Claude Code's shell tool, and a sim that says one line; and the files the
`/setup/<tool>` scripts write, driving the real CLIs with nothing else.

The CLIs' own prompts are replaced for the starter model: Claude Code's is some 9,000 tokens, more than
SmolLM2's 8,192-token context (llama.cpp answers 400 "exceeds the available context size"), and Codex's
~4,600 tokens take 30-40 s to read on two busy cores. Codex still offers all its tools, Claude Code its Bash.
"""

import json
import subprocess
import urllib.request
from types import SimpleNamespace

import anthropic
import openai
import pytest

from llmgw.cli import starter
from tests.conftest import Sim, codex, gateway_over, llamacpp_engine, make_key, run_cli, run_setup_script

QUESTION = "What is the capital of France? Answer in one sentence."
BRIEF = "You are a helpful assistant. Answer in one sentence."
BASH_COMMAND = "echo hello-from-bash > out.txt; cat out.txt"
REPLY = "Hello from the gateway."


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    url = f"sqlite:///{tmp}/gw.db"
    key = make_key(url)
    # One slot: llama.cpp caps a slot at the model's 8,192 training tokens, and these tests take turns.
    # Greedy sampling (top-k 1, which the CLIs do not send; Claude Code sends temperature 1): at temperature 1
    # SmolLM2 sometimes rambled to max_output, and Claude Code fails an answer that stops at its limit.
    with llamacpp_engine(tmp, ctx_size=8192, parallel=1, extra=("--top-k", "1")) as engine_url:
        sims = {"bash": Sim(model="bash", replica="b", ttft_ms=1, tokens_per_s=500,
                            tool_call=("Bash", json.dumps({"command": BASH_COMMAND}))),
                "echo": Sim(model="echo", replica="e", ttft_ms=1, tokens_per_s=500, reply=REPLY)}
        # Claude Code asks for claude-* names: its main model and a small one, which the operator aliases.
        models = [{"name": starter.NAME, "aliases": ["starter", "claude-sonnet-4-6", "claude-haiku-4-5"],
                   "max_output": 256},
                  {"name": "bash"}, {"name": "echo"}]
        cpu = {"id": "cpu", "url": engine_url, "models": [starter.NAME]}
        with gateway_over(tmp, url, sims, models, more_endpoints=[cpu], workers=2) as gw:
            yield SimpleNamespace(gw=gw, url=gw.url, key=key)


def claude(cli: str, env, cwd, model: str, prompt: str, *flags) -> subprocess.CompletedProcess:
    """`claude -p` once against the gateway, in a home of its own under CWD, with no traffic but the gateway's
    and retries off (a failure is then one request, not eleven over three minutes)."""
    home = cwd / "claude-home"
    home.mkdir(exist_ok=True)
    return run_cli([cli, "-p", prompt, *flags], cwd,
                   {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home), "ANTHROPIC_BASE_URL": env.url,
                    "ANTHROPIC_API_KEY": env.key, "ANTHROPIC_MODEL": model,
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": "claude-haiku-4-5",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_RETRIES": "0"})


# --- the CLIs -------------------------------------------------------------------------------------


def test_claude_code_answers_a_question_with_the_starter_model(claude_cli, env, tmp_path):
    run = claude(claude_cli, env, tmp_path, "claude-sonnet-4-6", QUESTION, "--system-prompt", BRIEF, "--tools", "Bash")
    assert run.stdout.strip(), run.stderr


def test_claude_code_runs_a_bash_tool_loop(claude_cli, env, tmp_path):
    # Without --allowedTools, print mode denies the command and tells the model so.
    run = claude(claude_cli, env, tmp_path, "bash", "Create out.txt", "--allowedTools", "Bash")
    assert (tmp_path / "out.txt").read_text() == "hello-from-bash\n"
    assert "The tool said: " in run.stdout and "hello-from-bash" in run.stdout


def test_codex_answers_a_question_with_the_starter_model(codex_cli, env, tmp_path):
    instructions = tmp_path / "instructions.md"
    instructions.write_text(BRIEF + "\n")
    run = codex(codex_cli, env.url, env.key, tmp_path, "starter", QUESTION,
                f"model_instructions_file={json.dumps(str(instructions))}")
    assert run.stdout.strip(), run.stderr


# --- the setup scripts' files, and nothing else, drive the real CLIs ----------------------------------


def setup(env, tool: str, home, model: str) -> None:
    """`curl -fsSL GATEWAY/setup/TOOL?model=MODEL | sh` under HOME, as the account page says."""
    with urllib.request.urlopen(f"{env.url}/setup/{tool}?model={model}", timeout=30) as answer:
        script = answer.read().decode()
    home.mkdir()
    done = run_setup_script(script, home, env.key)
    assert done.returncode == 0, done.stdout + done.stderr


def test_what_the_codex_script_writes_runs_codex(codex_cli, env, tmp_path):
    home = tmp_path / "home"
    setup(env, "codex", home, "echo")
    # The script's own advice, `codex --profile llmgw`, in its non-interactive form.
    run = run_cli([codex_cli, "--profile", "llmgw", "exec", "--skip-git-repo-check", "Say hello."], tmp_path,
                  {"HOME": str(home), "LLMGW_API_KEY": env.key})
    assert run.stdout.strip() == REPLY


def test_what_the_claude_script_writes_runs_claude_code(claude_cli, env, tmp_path):
    home = tmp_path / "home"
    setup(env, "claude", home, "echo")
    # The family names a person picks (`--model opus`, `/model opus`) reach the same model.
    for flags in ([], ["--model", "opus"]):
        run = run_cli([claude_cli, "-p", "Say hello.", *flags], tmp_path,
                      {"HOME": str(home), "LLMGW_API_KEY": env.key})
        assert run.stdout.strip() == REPLY


# --- the SDKs with the starter model (tool round trips: test_tools, test_responses, test_messages) ----------


@pytest.fixture(scope="module")
def openai_client(env):
    with openai.OpenAI(base_url=env.url + "/v1", api_key=env.key, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def anthropic_client(env):
    with anthropic.Anthropic(base_url=env.url, api_key=env.key, max_retries=0, timeout=60) as client:
        yield client


def test_openai_sdk_responses(openai_client):
    reply = openai_client.responses.create(model="starter", input=QUESTION, max_output_tokens=40)
    assert reply.output_text.strip() and reply.usage.input_tokens > 5 and reply.usage.output_tokens > 0


def test_openai_sdk_responses_streamed(openai_client):
    events = list(openai_client.responses.create(model="starter", input=QUESTION, max_output_tokens=40,
                                                 stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text.strip() and final.output_text == text
    assert final.usage.input_tokens > 5 and final.usage.output_tokens > 0


def test_anthropic_sdk_messages(anthropic_client):
    message = anthropic_client.messages.create(model="claude-sonnet-4-6", max_tokens=40,
                                               messages=[{"role": "user", "content": QUESTION}])
    assert message.content[0].text.strip() and prompt_tokens(message.usage) > 5 and message.usage.output_tokens > 0
    counted = anthropic_client.messages.count_tokens(model="claude-sonnet-4-6",
                                                     messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens > 5


def test_anthropic_sdk_messages_streamed(anthropic_client):
    with anthropic_client.messages.stream(model="claude-haiku-4-5", max_tokens=40,
                                          messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].text == text
    assert prompt_tokens(final.usage) > 5 and final.usage.output_tokens > 0


def prompt_tokens(usage) -> int:
    """All of an Anthropic answer's prompt: its input_tokens leave out what llama.cpp's prompt cache held, as
    Anthropic's leave out cache reads (the questions here are the same, so the second is mostly cached)."""
    return usage.input_tokens + usage.cache_read_input_tokens

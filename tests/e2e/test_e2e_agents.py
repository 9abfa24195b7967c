"""Coding agents against a real `tailrace serve`: the requests Claude Code and Codex CLI
send (tests/fixtures/agents, recorded), replayed with the `anthropic` and `openai` SDKs,
streamed and not, with their tools; then the CLIs themselves, unchanged, for one
non-interactive turn each (installed by `make install-dev` where npm is present: the CLI
tests skip and say why where they are not).

One server for all of it. Its chat template renders only the last line of the last user
turn: on two busy CPU cores the bundled model takes 10-40 s to prefill Claude Code's
~3,000-token prompt, and
what these tests check is the wire (every field, tool and item accepted; replies the SDKs
and CLIs read), not the model. The real template renders the same requests in
tests/stages/api/test_agent_fixtures.py. Neither CLI sends a temperature, so the server's
default (--override-generation-config) makes the turn greedy: the 135M model answers
"say hi" in 45 tokens and stops, where sampled it ran on to Claude Code's max_tokens
(2,000 tokens, over ten minutes on a loaded box). Measured on the loaded 2-core machine
(load average 9): a Claude Code turn 4.4 s, a Codex turn 4.0 s."""
from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
from pathlib import Path

import anthropic
import openai
import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures" / "agents"
CLI_DIR = Path(__file__).parent.parent / "agents" / "node_modules" / ".bin"
MODEL = "SmolLM2-135M-Instruct"
# the last line of the last user turn: the CLIs' "say hi" (a model this small, asked that
# alone, answers in a line and stops; greedy, it rambles to its token limit)
LAST_USER_LINE = (
    r"{%- for m in messages if m.role == 'user' -%}{%- if loop.last -%}"
    r"<|im_start|>user{{ '\n' }}{{ (m.content if m.content is string else '').strip()"
    r".split('\n')[-1] }}<|im_end|>{{ '\n' }}{%- endif -%}{%- endfor -%}"
    r"{%- if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif -%}")
CLI_TIMEOUT_S = 120      # a turn is about 4 s, also on a busy 2-core box


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_with_flags):
    tmp = tmp_path_factory.mktemp("e2e-agents")
    (tmp / "template.jinja").write_text(LAST_USER_LINE)
    # --max-model-len 4096: Codex sends no max_output_tokens, so a reply may take what the
    # context leaves, and the default test KV cache (256 MiB) must hold that much
    serve = serve_with_flags(tmp, "--max-model-len", "4096", "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes",
                             "--chat-template", str(tmp / "template.jinja"),
                             "--override-generation-config", '{"temperature": 0}')
    yield next(serve)
    serve.close()


def _split(create, body: dict, **changes) -> dict:
    """The body as SDK keyword arguments: what `create` names, the rest in extra_body
    (context_management, client_metadata, ...: sent exactly as recorded)."""
    body = {**body, **changes}
    body.pop("stream", None)
    names = set(inspect.signature(create).parameters)
    kwargs = {k: v for k, v in body.items() if k in names}
    extra = {k: v for k, v in body.items() if k not in names}
    return {**kwargs, "extra_body": extra} if extra else kwargs


# -- Claude Code's requests, with the anthropic SDK ------------------------------------------

@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("name", ["claude_code_first_turn", "claude_code_tool_results"])
def test_claude_codes_requests_get_messages_streamed_and_not(claude, name):
    recorded = fixture(name)
    headers = {"anthropic-beta": recorded["anthropic_beta"]}
    kwargs = _split(claude.messages.create, recorded["body"], max_tokens=8)
    message = claude.messages.create(**kwargs, extra_headers=headers)
    assert message.model == MODEL and message.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in message.content] == ["text"] and message.usage.output_tokens >= 1
    with claude.messages.stream(**kwargs, extra_headers=headers) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            + final.usage.cache_creation_input_tokens) > 0


def test_claude_codes_tools_are_called_by_name(claude):
    body = fixture("claude_code_first_turn")["body"]
    kwargs = _split(claude.messages.create, body, max_tokens=32,
                    tool_choice={"type": "tool", "name": "CronList"})
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    [call] = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "CronList" and isinstance(call.input, dict)
    assert call.id.startswith("toolu_")


# -- Codex's requests, with the openai SDK -----------------------------------------------------

@pytest.fixture(scope="module")
def codex(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("name", ["codex_first_turn", "codex_tool_outputs"])
def test_codexs_requests_get_responses_streamed_and_not(codex, name):
    body = fixture(name)["body"]
    kwargs = _split(codex.responses.create, body, max_output_tokens=8)
    response = codex.responses.create(**kwargs)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.store is False and response.parallel_tool_calls is True
    with codex.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text       # (the SDK's final response needs completed)


def test_codexs_tools_are_called_by_name(codex):
    body = fixture("codex_first_turn")["body"]
    kwargs = _split(codex.responses.create, body, max_output_tokens=32,
                    tool_choice={"type": "function", "name": "get_goal"})
    response = codex.responses.create(**kwargs)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_goal" and isinstance(json.loads(call.arguments), dict)


# -- the CLIs themselves ---------------------------------------------------------------------

def _cli(name: str) -> str:
    path = CLI_DIR / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"no `{name}` CLI: `make install-dev` installs it with npm into "
                    f"{CLI_DIR.parent} where npm is present")
    return found


def _run(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env={**os.environ, **env}, cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def test_claude_code_completes_a_turn(server, tmp_path):
    claude = _cli("claude")
    done = _run([claude, "-p", "say hi", "--max-turns", "1"], {
        "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "x",
        "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        # its default max_tokens is 32000, more than --max-model-len leaves (docs/api.md);
        # a reply cut at this many makes it retry, then fail: room for the model to stop
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "2048",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"},
        tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() and "API Error" not in done.stdout


def test_codex_completes_a_turn(server, tmp_path):
    codex = _cli("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "tailrace"\n\n[model_providers.tailrace]\n'
        f'name = "tailrace"\nbase_url = "{server.base_url}"\nwire_api = "responses"\n'
        'env_key = "TAILRACE_API_KEY"\n')
    done = _run([codex, "exec", "--skip-git-repo-check", "say hi"], {
        "HOME": str(tmp_path), "CODEX_HOME": str(home), "TAILRACE_API_KEY": "x"}, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() and "ERROR" not in done.stdout + done.stderr

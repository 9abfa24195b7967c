"""One real `tailrace serve` subprocess per test session, on a free port.

The server prints `tailrace: listening on http://HOST:PORT` once the model is
loaded and the socket is bound; the fixture waits for that line (stdout goes
to a file, so a chatty server can never block on a full pipe).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
from pipeline.layouts.process import death_hook  # test servers die with pytest

LISTENING = "tailrace: listening on "
START_TIMEOUT_S = 300        # model load on a busy 2-core CI box
STOP_TIMEOUT_S = 30


@attrs.frozen
class Server:
    url: str                  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def _command() -> list[str]:
    exe = Path(sys.executable).with_name("tailrace")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "web.cli"]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _serve(tmp: Path, *flags: str):
    """Start `tailrace serve --port 0 ...FLAGS`, yield its Server, stop it with SIGTERM."""
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with open(out, "wb") as out_f, open(err, "wb") as err_f:
        proc = subprocess.Popen(
            # float32: the tests check fp32's greedy answers; `auto` is bf16 on CPUs with
            # native bf16, which ties differently (tests/gpu/test_bf16_agreement.py)
            _command() + ["serve", "--port", "0", "--max-model-len", "1024",
                          "--max-num-seqs", "32", "--dtype", "float32",
                          # a quarter of the CPU default: the session's servers live at once
                          "--kv-cache-memory-bytes", "256Mi",
                          "--log-level", "warning", *flags],
            stdout=out_f, stderr=err_f, env=env, preexec_fn=death_hook())
    try:
        url = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while url is None:
            for line in _tail(out, 100_000).splitlines():
                if line.startswith(LISTENING):
                    url = line[len(LISTENING):].strip()
            if url is None:
                if proc.poll() is not None:
                    pytest.fail(f"tailrace serve exited with {proc.returncode}:\n{_tail(err)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"tailrace serve did not start in {START_TIMEOUT_S}s:\n"
                                f"{_tail(err)}")
                time.sleep(0.2)
        yield Server(url=url, proc=proc, log=err)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:       # drains and exits within a second or so; reaped here or at the end
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                _STOPPING.append(proc)


# Servers sent SIGTERM whose exit nobody has waited for yet: the session's servers are
# torn down one after another, and waiting for each one's graceful exit in turn cost ~8 s
# at the session's end; they exit side by side instead, and are reaped (killed past
# STOP_TIMEOUT_S) when the session finishes.
_STOPPING: list[subprocess.Popen] = []


def pytest_sessionfinish(session, exitstatus):
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in _STOPPING:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _STOPPING.clear()


@pytest.fixture(scope="session")
def serve_with_flags():
    """`_serve(tmp, *flags)`: a generator yielding a Server, stopped by closing it (for a
    module that needs a server of its own)."""
    return _serve


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    # usage.prompt_tokens_details (cached_tokens) is sent only with its flag, as in vLLM
    yield from _serve(tmp_path_factory.mktemp("e2e-server"), "--enable-prompt-tokens-details")


@pytest.fixture(scope="session")
def reasoning_server(tmp_path_factory) -> Server:
    """deepseek_r1's parser starts in reasoning: everything SmolLM2 says is reasoning
    (it never closes a </think>). Two names: replies must name the first."""
    yield from _serve(tmp_path_factory.mktemp("e2e-reasoning-server"),
                      "--reasoning-parser", "deepseek_r1",
                      "--served-model-name", "thinker", "thinker-alias")


CUSTOM_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\nCUSTOM"
                   "{% endif %}")


@pytest.fixture(scope="session")
def configured_server(tmp_path_factory) -> Server:
    """Server-wide options: forced usage, per-request metrics, a max_new_tokens ceiling, a
    chat template file, a stream interval of 3 tokens."""
    tmp = tmp_path_factory.mktemp("e2e-configured-server")
    template = tmp / "template.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    yield from _serve(tmp, "--enable-force-include-usage", "--enable-per-request-metrics",
                      "--chat-template", str(template),
                      "--override-generation-config", '{"max_new_tokens": 5}',
                      "--stream-interval", "3")


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory) -> Server:
    yield from _serve(tmp_path_factory.mktemp("e2e-tools-server"),
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="session")
def tools_client(tools_server):
    import openai

    return openai.OpenAI(base_url=tools_server.base_url, api_key="x", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def gpt_oss_client(tmp_path_factory):
    """The tiny dummy gpt-oss (gpu/configs/gpt-oss-tiny, random weights), served in
    Harmony with no parser flags: they are implied by its model_type."""
    import openai

    config = Path(__file__).parents[2] / "gpu" / "configs" / "gpt-oss-tiny"
    for server in _serve(tmp_path_factory.mktemp("e2e-gpt-oss-server"), str(config),
                         "--load-format", "dummy"):
        yield openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenless_server(tmp_path_factory) -> Server:
    """--skip-tokenizer-init: token ids in, token ids out."""
    yield from _serve(tmp_path_factory.mktemp("e2e-tokenless-server"), "--skip-tokenizer-init")


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def tokenizer():
    from gpu.tokenizers.files import load_tokenizer

    return load_tokenizer(None)

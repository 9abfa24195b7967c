"""Tokenizer: the SmolLM2 GGUF tokenizer, chat templates, HF-directory loading."""

import json

import pytest
import tokenizers

from gpu.tokenizers.files import load_tokenizer
from gpu.tokenizers.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


def test_encode_known_ids_and_round_trip(tok):
    ids = tok.encode("What is the capital of France?")
    assert ids == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.decode(ids) == "What is the capital of France?"
    for text in ["héllo wörld 🌍\n\tdef f(x):\n    return x**2  # ok", "  leading spaces", "日本語のテキスト"]:
        assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_individually(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5 and tok.decode(ids) == "12345"


def test_special_tokens(tok):
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert set(range(17)) <= tok.all_special_ids
    assert tok.vocab_size == 49152
    ids = tok.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert tok.decode(ids) == "assistant\nParis"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nParis<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # SmolLM2 adds no BOS


def test_decode_stream_on_hf_tokenizer(tok):
    stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
    pieces = [stream.step(tok.hf, i) for i in tok.encode("Paris, naïve café")]
    assert "".join(p for p in pieces if p) == "Paris, naïve café"


def test_smollm2_chat_template(tok):
    assert tok.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")


def test_template_runtime_type_error_is_value_error(tok):
    with pytest.raises(ValueError, match="chat template error: TypeError"):
        tok.apply_chat_template([{"role": "user", "content": None}])


def _tok(template):
    return Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=template)


def test_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="no chat template"):
        _tok(None).apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="roles must alternate"):
        _tok("{{ raise_exception('roles must alternate') }}").apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="does not parse"):
        _tok("{% if %}").apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="chat template error"):
        _tok("{{ messages[0].content.__class__.__mro__ }}").apply_chat_template(MESSAGES)  # sandboxed


def test_template_helpers():
    tools = [{"name": "météo", "parameters": {"b": 1, "a": [1, 2]}}]
    template = ("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) | length > 0 }}|{{ bos_token }}|"
                "{{ strftime_now('%Y') | length }}|{% generation %}{{ messages[-1].content }}{% endgeneration %}|"
                "{{ enable_thinking }}")
    out = _tok(template).apply_chat_template(MESSAGES, tools=tools, enable_thinking=False)
    assert out == ('[{"name": "météo", "parameters": {"b": 1, "a": [1, 2]}}]|True||4|'
                   "What is the capital of France?|False")


def test_load_tokenizer_from_gguf_and_hf_dir(tok, tmp_path):
    from gpu.loader.decoder import default_model_path

    assert load_tokenizer(default_model_path()).encode("Hello world") == tok.encode("Hello world")
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}))
    hf_tok = load_tokenizer(tmp_path)
    assert hf_tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert hf_tok.bos_token_id == 1 and hf_tok.eos_token_ids == (2,) and {0, 1, 2} <= hf_tok.all_special_ids
    assert hf_tok.apply_chat_template(MESSAGES) == "[user]What is the capital of France?"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")  # takes precedence, as in transformers 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf_tok = load_tokenizer(tmp_path)
    assert hf_tok.apply_chat_template(MESSAGES) == "<|im_end|>"
    assert hf_tok.eos_token_ids == (2,)     # its own; gpu.loader.decoder.merge_eos_ids adds the model's


def test_gguf_tokenizer_matches_transformers_gguf_conversion(tok):
    """transformers builds its own tokenizer from the same GGUF metadata: an independent reference."""
    from transformers import AutoTokenizer

    from gpu.loader.decoder import default_model_path

    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["12345 and 3.14159, 1,000,000", "  multiple   spaces\n\n\ttabs\r\n", "héllo 🌍 日本語 Ελληνικά",
             "def f(x):\n    return x**2  # comment\n", "I'm can't we'll THEY'RE", "a\u00a0b\u200bc",
             "<|im_start|>user\nhi<|im_end|>", "<repo_name>x<file_sep>y"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text

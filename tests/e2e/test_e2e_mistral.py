"""--tokenizer-mode mistral over HTTP with the openai client: a tiny random-weight
MistralForCausalLM (transformers) with the tekken vocabulary from the mistral-common wheel
(and one with its SentencePiece v3 model, as `tokenizer.model.v3`).
The prompt's ids are mistral-common's encoding of the chat, the greedy reply is
transformers' greedy generation from those ids, and a named tool call's id is Mistral's
9 alphanumerics, which mistral-common then accepts back in the conversation."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import openai
import pytest

mistral_common = pytest.importorskip("mistral_common")

from tests.support.live_servers import threaded_server  # noqa: E402

DATA = os.path.join(os.path.dirname(mistral_common.__file__), "data")
TEKKEN = os.path.join(DATA, "tekken_240718.json")
SPM_V3 = os.path.join(DATA, "mistral_instruct_tokenizer_240323.model.v3")
# an enum, so that random weights finish the constrained arguments in a few tokens
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
HI = [{"role": "user", "content": "Hello, who are you?"}]


def tiny_mistral(out: Path, vocab_size: int):
    import torch
    import transformers

    config = transformers.MistralConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        sliding_window=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


@contextlib.contextmanager
def mistral_server(out: Path, model, **flags):
    with threaded_server(None, model=str(out), tokenizer_mode="mistral", max_model_len=256,
                         dtype="float32", kv_cache_memory_bytes=64 << 20, **flags) as srv:
        yield srv, model, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x",
                                         max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral-tiny")
    model = tiny_mistral(out, 131072)
    shutil.copy(TEKKEN, out / "tekken.json")
    with mistral_server(out, model, tool_call_parser="hermes") as served:
        yield served


@pytest.fixture(scope="module")
def mistral_spm(tmp_path_factory):
    """A SentencePiece Mistral (v3's instruct format), as Mistral-7B-Instruct-v0.3 ships."""
    pytest.importorskip("sentencepiece")
    out = tmp_path_factory.mktemp("mistral-spm-tiny")
    model = tiny_mistral(out, 32768)
    shutil.copy(SPM_V3, out / "tokenizer.model.v3")
    with mistral_server(out, model) as served:
        yield served


@pytest.mark.parametrize("which", ["mistral", "mistral_spm"])
def test_chat_prompt_is_mistral_commons_and_the_reply_transformers(request, which):
    import torch
    from mistral_common.protocol.instruct.messages import UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    srv, model, client = request.getfixturevalue(which)
    r = client.chat.completions.create(model="", messages=HI, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True,
                                                   "ignore_eos": True})
    tok = srv.engine.render_context.tokenizer
    want = tok.mistral.encode_chat_completion(ChatCompletionRequest(
        messages=[UserMessage(content=HI[0]["content"])])).tokens
    assert r.model_extra["prompt_token_ids"] == want
    with torch.no_grad():
        ref = model.generate(torch.tensor([want]), max_new_tokens=6, do_sample=False,
                             min_new_tokens=6)[0, len(want):].tolist()
    assert r.choices[0].model_extra["token_ids"] == ref
    # the reply's text in the prompt's context (a SentencePiece reply keeps the space its
    # first token's "▁" spells, which decoding the reply alone strips as a dummy prefix)
    assert r.choices[0].message.content == tok.decode(want + ref)[len(tok.decode(want)):]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="", messages=HI, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == r.choices[0].message.content


def test_a_named_tool_call_has_a_mistral_id_that_goes_back_in(mistral):
    _, _, client = mistral
    r = client.chat.completions.create(
        model="", messages=HI, tools=[WEATHER], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"      # a named tool_choice's, as vLLM
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert re.fullmatch(r"[a-zA-Z0-9]{9}", call.id)
    again = client.chat.completions.create(model="", max_tokens=2, tools=[WEATHER],
                                           tool_choice="none", messages=[
        *HI, {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert again.usage.prompt_tokens > r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:       # OpenAI's ids: refused
        client.chat.completions.create(model="", max_tokens=2, tools=[WEATHER],
                                       tool_choice="none", messages=[
            *HI, {"role": "assistant", "tool_calls": [{**call.model_dump(), "id": "call_1"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert "length of 9" in info.value.body["message"]


def test_a_too_long_chat_is_a_400(mistral):
    _, _, client = mistral
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", max_tokens=2, messages=[
            {"role": "user", "content": "word " * 300}])
    assert info.value.body["code"] == "context_length_exceeded"

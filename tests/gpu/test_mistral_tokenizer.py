"""--tokenizer-mode mistral (gpu/tokenizers/mistral.py): the tekken vocabulary and the SentencePiece
models (v3, v7; v1 for text) that ship in the mistral-common wheel, offline. The oracle
is mistral-common itself: its tokenizer's encode for text, and its typed request classes'
encode_chat_completion for chats, against tailrace's render of the OpenAI-shaped body."""
from __future__ import annotations

import os
import re

import pytest

mistral_common = pytest.importorskip("mistral_common")

from mistral_common.protocol.instruct.messages import (AssistantMessage, SystemMessage,  # noqa: E402
                                                       ToolMessage, UserMessage)
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.protocol.instruct.tool_calls import (Function, FunctionCall, Tool,  # noqa: E402
                                                         ToolCall)

from gpu.tokenizers.mistral import MistralTokenizer  # noqa: E402
from stages.api.tool_parsers import CALL_IDS  # noqa: E402
from stages.messages import Submission  # noqa: E402
from stages.render import RenderContext, RequestError, render  # noqa: E402

DATA = os.path.join(os.path.dirname(mistral_common.__file__), "data")
TEKKEN = os.path.join(DATA, "tekken_240718.json")
SPM_V3 = os.path.join(DATA, "mistral_instruct_tokenizer_240323.model.v3")
SPM_V7 = os.path.join(DATA, "mistral_instruct_tokenizer_241114.model.v7")
SPM_V1 = os.path.join(DATA, "tokenizer.model.v1")
# file -> its vocabulary's size
VOCABS = {TEKKEN: 131072, SPM_V3: 32768, SPM_V7: 32768}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL = Tool(function=Function(name="get_weather", description="The weather in a city.",
                              parameters=WEATHER["function"]["parameters"]))


@pytest.fixture(scope="module", params=list(VOCABS), ids=["tekken", "spm-v3", "spm-v7"])
def tok(request) -> MistralTokenizer:
    if request.param != TEKKEN:
        pytest.importorskip("sentencepiece")
    return MistralTokenizer(request.param)


def ctx(tok, max_model_len=4096) -> RenderContext:
    return RenderContext(tokenizer=tok, served_model_names=("m",), max_model_len=max_model_len,
                         vocab_size=tok.vocab_size, mistral=True)


def rendered_ids(tok, body, max_model_len=4096) -> list[int]:
    req = render(Submission("r", "chat", {"max_tokens": 4, **body}, 0.0), ctx(tok, max_model_len))
    return list(req.prompt_token_ids)


def oracle(tok, messages, tools=None) -> list[int]:
    return tok.mistral.encode_chat_completion(
        ChatCompletionRequest(messages=messages, tools=tools)).tokens


@pytest.mark.parametrize("text", ["Hello, world!", "東京 🙂 Zürich\n\n  x  y", "def f(x):\n\treturn 12345",
                                  " leading and trailing ", "don't we'll 3.14159"])
def test_text_ids_equal_mistral_commons(tok, text):
    inner = tok.mistral.instruct_tokenizer.tokenizer
    assert tok.encode(text) == inner.encode(text, bos=False, eos=False)
    assert tok.decode(tok.encode(text)) == text == inner.decode(tok.encode(text))
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))
    assert tok.vocab_size == inner.n_words == VOCABS[str(inner.file_path)]


def test_a_v1_sentencepiece_model_and_the_choice_of_file_in_a_folder(tmp_path):
    """tekken.json first, else the highest tokenizer.model.vN, else tokenizer.model (v1),
    as mistral-common picks for a model folder."""
    import shutil

    from gpu.tokenizers.mistral import tokenizer_file

    pytest.importorskip("sentencepiece")
    shutil.copy(SPM_V1, tmp_path / "tokenizer.model")
    assert tokenizer_file(tmp_path) == tmp_path / "tokenizer.model"
    tok = MistralTokenizer(tmp_path)
    inner = tok.mistral.instruct_tokenizer.tokenizer
    for text in ("Hello, world!", " 東京 🙂  x"):
        assert tok.encode(text) == inner.encode(text, bos=False, eos=False)
    assert tok.vocab_size == 32000
    shutil.copy(SPM_V3, tmp_path / "tokenizer.model.v3")
    shutil.copy(SPM_V7, tmp_path / "tokenizer.model.v7")
    assert tokenizer_file(tmp_path) == tmp_path / "tokenizer.model.v7"
    shutil.copy(TEKKEN, tmp_path / "tekken.json")
    assert tokenizer_file(tmp_path) == tmp_path / "tekken.json"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tekken.json"):
        tokenizer_file(tmp_path / "empty")


def test_a_chat_is_mistral_commons_encoding(tok):
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi there"}]}
    want = oracle(tok, [SystemMessage(content="Be brief."), UserMessage(content="Hi there")])
    assert rendered_ids(tok, body) == want
    text = tok.decode(want, skip_special_tokens=False)   # v7 puts a system prompt first
    assert text.startswith(("<s>[INST]", "<s>[SYSTEM_PROMPT]")) and "[/INST]" in text


def test_tools_and_a_multi_turn_conversation_are_mistral_commons_encoding(tok):
    call_id = CALL_IDS["mistral"]("r", 0)
    body = {"tools": [WEATHER], "tool_choice": "none", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21C"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And in Rome?"}]}
    want = oracle(tok, [
        UserMessage(content="Weather in Paris?"),
        AssistantMessage(tool_calls=[ToolCall(id=call_id, function=FunctionCall(
            name="get_weather", arguments='{"city": "Paris"}'))]),
        ToolMessage(tool_call_id=call_id, content="sunny, 21C"),
        AssistantMessage(content="It is sunny."),
        UserMessage(content="And in Rome?")], tools=[TOOL])
    assert rendered_ids(tok, body) == want
    text = tok.decode(want, skip_special_tokens=False)
    assert "[AVAILABLE_TOOLS]" in text and "[TOOL_RESULTS]" in text


def test_mistral_tool_call_ids_are_nine_alphanumerics():
    ids = {CALL_IDS["mistral"](f"req-{i}", j) for i in range(50) for j in range(3)}
    assert len(ids) == 150 and all(re.fullmatch(r"[a-zA-Z0-9]{9}", i) for i in ids)
    assert CALL_IDS["mistral"]("a", 0) == CALL_IDS["mistral"]("a", 0)    # a replay's too


def test_what_mistral_common_refuses_is_a_400(tok):
    bad_id = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "call_abc", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"}], "tools": [WEATHER],
        "tool_choice": "none"}
    with pytest.raises(RequestError) as info:
        rendered_ids(tok, bad_id)
    assert info.value.status == 400 and "length of 9" in str(info.value)
    with pytest.raises(RequestError) as info:
        rendered_ids(tok, {"messages": [{"role": "user", "content": "x"}],
                           "chat_template": "{{ messages }}"})
    assert info.value.param == "chat_template"


def test_a_too_long_prompt_is_refused_by_its_token_count(tok):
    """The ids mistral-common renders are checked against the context like every prompt
    (vLLM's test_serving_chat_mistral_token_ids_prompt_too_long_is_rejected); so are token
    ids sent as the prompt."""
    long = {"messages": [{"role": "user", "content": "word " * 200}]}
    n = len(rendered_ids(tok, long))
    with pytest.raises(RequestError) as info:
        rendered_ids(tok, long, max_model_len=n)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as info:
        render(Submission("r", "completions", {"prompt": [5] * 64, "max_tokens": 1}, 0.0),
               ctx(tok, max_model_len=32))
    assert info.value.code == "context_length_exceeded"

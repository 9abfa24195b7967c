"""The fields SGLang's router and vllm-router add to every request they forward."""
import pytest

from stages.api.chat import ChatCompletionRequest
from stages.api.common import RequestError, parse_request
from stages.api.completions import CompletionRequest

# what vllm-router 0.1.17 sent a worker for {"prompt": ...} and {"messages": ...}
# (captured with an echo server; docs/scaling.md)
COMPLETION = {"prompt": "Hello", "max_tokens": 3, "stream": False, "echo": False,
              "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
              "return_hidden_states": False}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "max_tokens": 3, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
        "continue_final_message": False, "skip_special_tokens": True,
        "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
        "include_reasoning": True}


def test_what_the_router_adds_is_accepted():
    assert parse_request(COMPLETION, CompletionRequest).max_tokens == 3
    assert parse_request(CHAT, ChatCompletionRequest).max_tokens == 3


@pytest.mark.parametrize("cls, body, field, value", [
    (CompletionRequest, COMPLETION, "no_stop_trim", True),
    (CompletionRequest, COMPLETION, "return_hidden_states", True),
    (ChatCompletionRequest, CHAT, "separate_reasoning", False),
    (ChatCompletionRequest, CHAT, "stream_reasoning", False),
])
def test_any_other_value_is_a_400_naming_the_field(cls, body, field, value):
    with pytest.raises(RequestError) as info:
        parse_request({**body, field: value}, cls)
    assert (info.value.status, info.value.param) == (400, field)
    assert "not supported" in info.value.message


def test_completions_ignore_the_chat_only_ones():
    # not a field of completions: ignored (and logged), as any field it does not know
    assert (parse_request({**COMPLETION, "separate_reasoning": False}, CompletionRequest)
            == parse_request(COMPLETION, CompletionRequest))

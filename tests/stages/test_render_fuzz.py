"""Property: whatever JSON a client sends, render either returns a request or raises
RequestError (a 4xx/5xx with an OpenAI body) -- never any other exception (a 500 with a
traceback)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.render import RenderContext, RenderedRequest, RequestError, Submission, render

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)

FIELDS = ["model", "messages", "prompt", "input", "instructions", "max_tokens", "max_completion_tokens",
          "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "n", "stream", "stream_options", "ignore_eos", "min_tokens", "frequency_penalty",
          "presence_penalty", "repetition_penalty", "logprobs", "tools", "tool_choice", "echo",
          "chat_template_kwargs", "response_format", "include_stop_str_in_output", "skip_special_tokens",
          "logit_bias", "allowed_token_ids", "bad_words"]

message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]),
                                 "content": st.one_of(st.text(max_size=20), json_values)})
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=3)},
                          optional={k: json_values for k in ("max_tokens", "temperature", "stop", "stream")}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 70000), max_size=5))},
                          optional={k: json_values for k in ("max_tokens", "top_k", "seed", "echo")}),
)


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_render_never_raises_anything_but_request_error(smollm_tokenizer, api, body):
    ctx = RenderContext(tokenizer=smollm_tokenizer, served_model_names=("m",), max_model_len=256,
                        vocab_size=49152)
    try:
        out = render(Submission("r", api, body, 0.0), ctx)
    except RequestError as err:
        assert 400 <= err.status < 600 and err.message
        return
    assert isinstance(out, RenderedRequest)
    assert 0 < len(out.prompt_token_ids) < 256
    assert out.sampling.max_tokens >= 1
    assert len(out.prompt_token_ids) + out.sampling.max_tokens <= 256
    assert all(0 <= t < 49152 for t in out.prompt_token_ids)


@pytest.mark.parametrize("field,value", [("seed", 2**64), ("seed", -2**63 - 1),
                                         ("stop_token_ids", [49152]), ("stop_token_ids", [-1])])
def test_values_the_engine_cannot_take_are_refused(smollm_tokenizer, field, value):
    ctx = RenderContext(tokenizer=smollm_tokenizer, served_model_names=("m",), max_model_len=256,
                        vocab_size=49152)
    with pytest.raises(RequestError) as err:
        render(Submission("r", "completions", {"prompt": "hi", field: value}, 0.0), ctx)
    assert err.value.status == 400 and err.value.param == field

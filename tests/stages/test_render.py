"""render core: validation, chat template path, sampling defaults, max_tokens. (The
protocol's field policy on its own: tests/stages/api/test_protocol.py.)"""
import pytest

from stages.messages import Submission
from stages.render import RenderContext, RequestError, render
from tests.support.render_requests import chat, completion, error_of, make_ctx, responses


# -- chat ----------------------------------------------------------------------

def test_chat_renders_template_and_tokenizes_without_special_tokens():
    req = chat({"model": "alias"})
    prompt = "<user>hi<assistant>"
    assert req.prompt_token_ids == tuple(ord(c) % 900 for c in prompt)
    assert req.model == "tiny"      # replies name the first served model, whatever alias
    assert req.api == "chat" and req.request_id == "r1" and req.arrival == 1.5
    assert req.sampling.max_tokens == 100 - len(prompt)    # default: the rest of the context
    assert req.stream is False and req.include_usage is True


def test_chat_content_parts_roles_and_template_kwargs():
    ctx = make_ctx()
    chat({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ], "chat_template_kwargs": {"enable_thinking": False, "add_generation_prompt": False},
        "add_generation_prompt": True}, ctx)
    messages, add_generation_prompt, kwargs = ctx.tokenizer.template_calls[-1]
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert add_generation_prompt is True
    assert kwargs == {"enable_thinking": False}


def test_model_absent_means_first_served_name():
    assert chat({}).model == "tiny"


def test_unknown_model_is_404():
    err = error_of(chat, {"model": "gpt-4"})
    assert err.status == 404
    assert err.code == "model_not_found" and err.param == "model"
    assert err.to_dict()["error"]["message"] == "The model `gpt-4` does not exist."


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "", "content": "x"}], "messages[0].role"),     # (a custom role passes on)
    ([{"role": 3, "content": "x"}], "messages[0].role"),
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
])
def test_bad_messages(messages, param):
    err = error_of(chat, {"messages": messages})
    assert (err.status, err.param) == (400, param)


def test_missing_messages():
    err = error_of(render, Submission("r", "chat", {}, 0.0), make_ctx())
    assert err.param == "messages"


@pytest.mark.parametrize("body", [[1, 2], "text", None, 3])
def test_body_must_be_an_object(body):
    err = error_of(render, Submission("r", "chat", body, 0.0), make_ctx())
    assert err.status == 400 and "JSON object" in err.message


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "10"), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", "hot"), ("temperature", True), ("top_p", []), ("top_k", 1.0),
    ("seed", "x"), ("stream", "yes"), ("stop", 3), ("stop", ["a", 1]),
    ("stop_token_ids", [1, -1]), ("stop_token_ids", "1"), ("ignore_eos", 1),
    ("min_tokens", "1"), ("chat_template_kwargs", []), ("model", 3),
])
def test_wrong_types_name_the_param(field, value):
    err = error_of(chat, {field: value})
    assert (err.status, err.param) == (400, field)
    assert err.type == "invalid_request_error"


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -5), ("max_completion_tokens", 0),
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.1),
    ("top_k", -2), ("min_p", 1.5), ("frequency_penalty", 3), ("presence_penalty", -2.5),
    ("repetition_penalty", 0), ("min_tokens", -1), ("n", 0), ("n", 17), ("stop", [""]),
    ("logprobs", "yes"), ("top_logprobs", 3), ("top_logprobs", 21),
])
def test_out_of_range_or_unsupported_is_400(field, value):
    err = error_of(chat, {field: value})
    assert (err.status, err.param) == (400, field)


def test_null_counts_as_absent():
    req = chat({"temperature": None, "max_tokens": None, "stop": None, "logprobs": False,
                "n": 1, "tools": [], "tool_choice": "none"})
    assert req.sampling.options.temperature == 1.0


def test_empty_model_means_the_default_and_aliases_reply_with_the_first_name():
    assert chat({"model": ""}).model == "tiny"
    assert chat({"model": "alias"}).model == "tiny"


@pytest.mark.parametrize("body, param", [
    ({"tools": []}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tools"),
])
def test_empty_tools_and_tool_choice_without_tools_are_400_as_in_vllm(body, param):
    err = error_of(chat, body)
    assert (err.status, err.param) == (400, param)


def test_assistant_reasoning_reaches_the_template_under_both_names():
    ctx = make_ctx()
    chat({"messages": [{"role": "user", "content": "q"},
                       {"role": "assistant", "content": "a", "reasoning": "because"},
                       {"role": "assistant", "content": "b", "reasoning_content": "old name"},
                       {"role": "user", "content": "again"}]}, ctx)
    messages = ctx.tokenizer.template_calls[-1][0]
    assert messages[1]["reasoning"] == messages[1]["reasoning_content"] == "because"
    assert messages[2]["reasoning"] == messages[2]["reasoning_content"] == "old name"


def test_sampling_fields_reach_sampling_params():
    req = chat({"max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5,
                "top_k": 40, "min_p": 0.1, "seed": 3, "frequency_penalty": 0.5,
                "presence_penalty": -0.5, "repetition_penalty": 1.2, "stop": "END",
                "stop_token_ids": [5], "ignore_eos": True, "min_tokens": 2,
                "include_stop_str_in_output": True, "skip_special_tokens": False})
    s, o = req.sampling, req.sampling.options
    assert s.max_tokens == 7          # max_completion_tokens wins over max_tokens
    assert o.temperature == 0.0       # greedy
    assert (o.top_p, o.top_k, o.min_p, o.seed) == (0.5, 40, 0.1, 3)
    assert (o.frequency_penalty, o.presence_penalty, o.repetition_penalty) == (0.5, -0.5, 1.2)
    assert s.stop == ("END",) and o.stop_token_ids == (5,)
    assert s.ignore_eos and s.include_stop_str_in_output and not s.skip_special_tokens
    assert o.min_tokens == 2


def test_generation_config_defaults_fill_omitted_fields():
    ctx = make_ctx(default_sampling={"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                     "repetition_penalty": 1.1, "max_new_tokens": 10})
    req = chat({}, ctx)
    s, o = req.sampling, req.sampling.options
    assert (o.temperature, o.top_p, o.top_k, o.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert s.max_tokens == 10
    assert chat({"temperature": 0.0, "max_tokens": 50}, ctx).sampling.options.temperature == 0.0
    assert chat({"max_tokens": 5}, ctx).sampling.max_tokens == 5


def test_min_tokens_above_max_tokens():
    err = error_of(chat, {"max_tokens": 3, "min_tokens": 4})
    assert err.param == "min_tokens"


def test_stream_options():
    req = chat({"stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.include_usage
    assert chat({"stream": True}).include_usage is False
    err = error_of(chat, {"stream_options": {"include_usage": True}})
    assert err.param == "stream_options"
    err = error_of(chat, {"stream": True, "stream_options": {"include_usage": "yes"}})
    assert err.param == "stream_options.include_usage"


def test_template_error_is_400():
    err = error_of(chat, {"chat_template_kwargs": {"explode": True}})
    assert err.status == 400 and "template exploded" in err.message


# -- context length ------------------------------------------------------------

def test_prompt_filling_the_context_is_400():
    ctx = make_ctx(max_model_len=20)     # "<user>hi<assistant>" is 19 tokens
    assert chat({}, ctx).sampling.max_tokens == 1
    err = error_of(chat, {"messages": [{"role": "user", "content": "hi!"}]}, ctx)
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert "maximum context length is 20 tokens" in err.message


def test_prompt_plus_max_tokens_over_the_context_uses_vllm_wording():
    err = error_of(chat, {"max_tokens": 90})
    assert err.status == 400 and err.param == "max_tokens"
    assert err.message == (
        "This model's maximum context length is 100 tokens. However, you requested 109 "
        "tokens (19 in the messages, 90 in the completion). Please reduce the length of the "
        "messages or completion.")


# -- completions ---------------------------------------------------------------

def test_completion_string_prompt_adds_special_tokens_and_defaults_to_16():
    req = completion({})
    assert req.prompt_token_ids == (998,) + tuple(ord(c) % 900 for c in "hello")
    assert req.sampling.max_tokens == 16


def test_completion_default_max_tokens_is_capped_by_the_context():
    assert completion({}, make_ctx(max_model_len=10)).sampling.max_tokens == 4


@pytest.mark.parametrize("prompt, ids", [
    ([1, 2, 3], (1, 2, 3)), ([[4, 5]], (4, 5)), (["hi"], (998, ord("h"), ord("i"))),
])
def test_completion_prompt_forms(prompt, ids):
    assert completion({"prompt": prompt}).prompt_token_ids == ids


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 5000]}, "prompt"), ({"prompt": [[1], [5000]]}, "prompt[1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": ["a", [1]]}, "prompt"), ({"prompt": ["a"] * 17, "n": 4}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"suffix": "x"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"best_of": 2}, "best_of"), ({"max_tokens": -1}, "max_tokens"),
])
def test_completion_errors(body, param):
    err = error_of(completion, body)
    assert (err.status, err.param) == (400, param)


def test_completion_prompt_list_is_several_prompts():
    req = completion({"prompt": ["hi", "yo!"], "n": 2})
    assert req.prompts == ((998, ord("h"), ord("i")), (998, ord("y"), ord("o"), ord("!")))
    assert req.prompt_token_ids == req.prompts[0] and req.num_choices == 4
    assert [req.prompt_of(i) for i in range(4)] == [req.prompts[0]] * 2 + [req.prompts[1]] * 2
    assert req.num_prompt_tokens == 7
    # the default max_tokens is each prompt's own: 16, or what the context leaves
    long = completion({"prompt": [[1] * 90, [1] * 10]})
    assert long.prompt_max_tokens == (10, 16)
    ids = completion({"prompt": [[1, 2], [3]]})
    assert ids.prompts == ((1, 2), (3,))
    one = completion({"prompt": [[4, 5]]})           # a list of one prompt is one prompt
    assert one.prompts == () and one.num_choices == 1


def test_completion_echo_and_prompt_logprobs():
    req = completion({"prompt": ["hi", "yo"], "echo": True, "max_tokens": 0, "logprobs": 2})
    assert req.echo == ("hi", "yo") and req.sampling.max_tokens == 0
    assert completion({"prompt": [[ord("y")], [ord("o")]], "echo": True}).echo == ("y", "o")
    assert req.sampling.prompt_logprobs == 2          # echo with logprobs: the prompt's too
    assert completion({"prompt": "hi", "echo": True}).sampling.prompt_logprobs is None
    assert completion({"prompt": "hi", "prompt_logprobs": 3}).sampling.prompt_logprobs == 3
    assert completion({"prompt": "hi", "echo": True, "return_token_ids": True}).echo == ("",)
    # streamed, prompt_logprobs 0 asks for nothing to show
    assert completion({"prompt_logprobs": 0, "stream": True}).sampling.prompt_logprobs is None


def test_chat_echo_prepends_a_final_assistant_message():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    assert chat({"messages": msgs, "echo": True}).echo == ("Sure,",)
    assert chat({"messages": msgs[:1], "echo": True}).echo == ("",)
    # without a generation prompt the reply continues the final message, whatever its role
    assert chat({"messages": msgs[:1], "echo": True, "add_generation_prompt": False}
                ).echo == ("hi",)
    assert chat({"messages": msgs}).echo is None
    req = chat({"messages": msgs, "echo": True, "logprobs": True, "top_logprobs": 2})
    assert req.sampling.prompt_logprobs == 2
    assert chat({"prompt_logprobs": 1}).sampling.prompt_logprobs == 1


def test_completion_add_special_tokens_false():
    assert completion({"prompt": "x", "add_special_tokens": False}).prompt_token_ids == (ord("x"),)


def test_completion_too_long_names_the_prompt():
    err = error_of(completion, {"max_tokens": 99})
    assert err.message.startswith("This model's maximum context length is 100 tokens. However, "
                                  "you requested 105 tokens (6 in the prompt, 99 in the "
                                  "completion).")


# -- responses -----------------------------------------------------------------

def test_responses_string_input_with_instructions():
    ctx = make_ctx()
    req = responses({"instructions": "be nice", "max_output_tokens": 5, "temperature": 0.5,
                     "store": True, "metadata": {"k": "v"}}, ctx)
    assert ctx.tokenizer.template_calls[-1][0] == [
        {"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}]
    assert req.sampling.max_tokens == 5 and req.sampling.options.temperature == 0.5
    r = req.reply.response
    assert (r.instructions, r.max_output_tokens, r.metadata) == ("be nice", 5, {"k": "v"})
    assert req.sampling.options.top_p == 1.0


def test_responses_message_items():
    ctx = make_ctx()
    responses({"input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"role": "user", "content": "again"},
    ]}, ctx)
    assert ctx.tokenizer.template_calls[-1][0] == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "again"}]


def test_responses_max_output_tokens_absent_fills_the_context():
    req = responses({})
    assert req.sampling.max_tokens == 100 - len("<user>hi<assistant>")
    assert req.reply.response.max_output_tokens is None


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": 7}]}, "tools[0].type"),   # (a hosted tool is left out: agent tests)
    ({"background": True, "store": False}, "background"),
    ({"include": ["nonsense"]}, "include[0]"),     # (known include values are served)
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": []}, "input"), ({"input": 3}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": 3}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 1000}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"stream": "true"}, "stream"),
])
def test_responses_errors(body, param):
    err = error_of(responses, body)
    assert (err.status, err.param) == (400, param)


def test_responses_reasoning_effort_is_accepted_with_a_reasoning_parser():
    req = responses({"reasoning": {"effort": "low"}}, make_ctx(reasoning=True))
    assert req.reply.response.reasoning_effort == "low"


def test_responses_accepts_harmless_defaults():
    req = responses({"background": False, "text": {"format": {"type": "text"}},
                     "tool_choice": "auto", "tools": [], "include": [], "stream": True})
    assert req.stream and req.include_usage


# -- issue 8: truncation, prompt token ids, media, templates, generation config --------------

@pytest.mark.parametrize("side, expect", [("left", "<assistant>"), ("right", "<user>hi<as")])
def test_truncate_prompt_tokens_keeps_one_end(side, expect):
    req = chat({"truncate_prompt_tokens": 11, "truncation_side": side, "max_tokens": 5})
    assert req.prompt_token_ids == tuple(ord(c) % 900 for c in expect)
    assert len(req.prompt_token_ids) == 11 and req.sampling.max_tokens == 5


def test_truncate_prompt_tokens_default_side_is_left_and_sets_the_room():
    req = chat({"messages": [{"role": "user", "content": "x" * 200}],
                "truncate_prompt_tokens": 40})
    assert req.prompt_token_ids[-len("<assistant>"):] == tuple(ord(c) % 900 for c in "<assistant>")
    assert req.sampling.max_tokens == 100 - 40      # computed from the truncated length
    assert len(completion({"prompt": "hello world", "truncate_prompt_tokens": -1})
               .prompt_token_ids) == 12             # -1: max_model_len, so nothing cut here


@pytest.mark.parametrize("value", [-2, "3", True])
def test_truncate_prompt_tokens_is_checked(value):
    err = error_of(chat, {"truncate_prompt_tokens": value})
    assert (err.status, err.param) == (400, "truncate_prompt_tokens")


def test_kv_transfer_params_prompt_token_ids_replace_the_rendered_prompt():
    ctx = make_ctx()
    req = chat({"kv_transfer_params": {"prompt_token_ids": [5, 6, 7], "other": 1}}, ctx)
    assert req.prompt_token_ids == (5, 6, 7)


@pytest.mark.parametrize("ids, words", [
    ([], "non-negative integers"), ([1, -1], "non-negative integers"), ("12", "non-negative integers"),
    ([1, 1.5], "non-negative integers"), ([1, 5000], "out of vocabulary"),
    ([1.0], "non-negative integers"), ([True], "non-negative integers"),
    (["1"], "non-negative integers"), (5, "non-negative integers")])
def test_bad_kv_prompt_token_ids_are_400(ids, words):
    err = error_of(chat, {"kv_transfer_params": {"prompt_token_ids": ids}})
    assert err.status == 400 and words in err.message
    assert err.param == "kv_transfer_params.prompt_token_ids"


def test_echo_renders_the_messages_not_the_kv_prompt_token_ids():
    """echo needs the messages' text: kv_transfer_params.prompt_token_ids is not the
    prompt then (as vLLM)."""
    ctx = make_ctx()
    plain = chat({"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "Hel"}], "echo": True}, ctx)
    req = chat({"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "Hel"}], "echo": True,
                "kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}}, ctx)
    assert req.prompt_token_ids == plain.prompt_token_ids != (5, 6, 7)
    assert req.echo == ("Hel",)


ASSISTANT_PARTS = [{"type": "text", "text": "I can't"},
                   {"type": "refusal", "refusal": "do that."},
                   {"type": "thinking", "thinking": "Policy says no.", "closed": True}]


def test_refusal_and_thinking_parts_of_a_replayed_assistant_turn():
    """What OpenAI's SDK (refusal) and vLLM (thinking) replay of an assistant turn: the
    refusal is the turn's text, the thinking its reasoning (for templates that read it)."""
    ctx = make_ctx()
    chat({"messages": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": ASSISTANT_PARTS},
                       {"role": "user", "content": "why?"}]}, ctx)
    turn = ctx.tokenizer.template_calls[-1][0][1]
    assert turn["content"] == "I can't\ndo that."
    assert turn["reasoning"] == turn["reasoning_content"] == "Policy says no."
    # an explicit reasoning wins over the parts
    chat({"messages": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": ASSISTANT_PARTS, "reasoning": "R"}]}, ctx)
    assert ctx.tokenizer.template_calls[-1][0][1]["reasoning"] == "R"
    # with kv_transfer_params.prompt_token_ids the parts are checked and the ids used
    req = chat({"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": ASSISTANT_PARTS}],
                "kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}}, ctx)
    assert req.prompt_token_ids == (5, 6, 7)


@pytest.mark.parametrize("part, param", [({"type": "refusal"}, "refusal"),
                                         ({"type": "refusal", "text": "x"}, "refusal"),
                                         ({"type": "thinking"}, "thinking")])
def test_a_refusal_or_thinking_part_without_its_text_is_a_400(part, param):
    err = error_of(chat, {"messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": [part]}]})
    assert (err.status, err.param) == (400, f"messages[1].content[0].{param}")


@pytest.mark.parametrize("part, kind", [
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
    ({"type": "video_url", "video_url": {"url": "v"}}, "video_url"),
    ({"type": "text", "text": "look", "image_url": {"url": "u"}}, "image_url"),
])
def test_media_parts_are_400_naming_the_part_type(part, kind):
    err = error_of(chat, {"messages": [{"role": "user", "content": [part]}]})
    assert err.status == 400 and kind in err.message
    assert err.param == "messages[0].content[0].type"


def test_a_part_with_a_uuid_is_the_picture_its_image_url_names_whatever_its_type():
    """As vLLM's parser: with a `uuid`, a part carrying an image_url is that image, even
    one that says it is text (the uuid form), and not a 400."""
    from stages.api.chat import CHAT_PART_TYPES, content_text
    from stages.api.common import converter
    from stages.api.request_types import ContentPart

    parts = converter.structure([
        {"type": "text", "image_url": {"url": "http://x/y.png"}, "uuid": "img-1"},
        {"type": "text", "text": "what is it?"}], list[ContentPart])
    out = content_text(tuple(parts), "messages[0].content", CHAT_PART_TYPES)
    assert out == [{"type": "image", "image_url": "http://x/y.png",
                    "param": "messages[0].content[0].image_url"},
                   {"type": "text", "text": "what is it?"}]


def test_request_chat_template_wins_and_server_template_is_the_default():
    ctx = make_ctx(chat_template="SERVER")
    chat({}, ctx)
    assert ctx.tokenizer.template_calls[-1][2]["chat_template"] == "SERVER"
    chat({"chat_template": "REQUEST"}, ctx)
    assert ctx.tokenizer.template_calls[-1][2]["chat_template"] == "REQUEST"


def test_continue_final_message_ends_inside_the_last_message():
    req = chat({"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "Par"}],
                "add_generation_prompt": False, "continue_final_message": True})
    assert req.prompt_token_ids == tuple(ord(c) % 900 for c in "<user>hi<assistant>Par")
    err = error_of(chat, {"continue_final_message": True})     # add_generation_prompt true
    assert err.param == "continue_final_message"


def test_generation_config_max_new_tokens_is_a_default_not_a_ceiling():
    """As vLLM (the seed's test_serving_chat.py): the model's generation config (or a
    --generation-config folder's) max_new_tokens is the default of a request that asks for
    none; a request for 15 with a config of 10 gets 15. Completions keep their own default
    of 16. Only --override-generation-config's max_new_tokens caps."""
    folder = make_ctx(default_sampling={"max_new_tokens": 10})
    assert chat({"max_tokens": 15}, folder).sampling.max_tokens == 15
    assert chat({"max_tokens": 4}, folder).sampling.max_tokens == 4
    assert chat({}, folder).sampling.max_tokens == 10
    assert completion({}, folder).sampling.max_tokens == 16
    assert completion({"max_tokens": 15}, folder).sampling.max_tokens == 15
    capped = make_ctx(default_sampling={"max_new_tokens": 10}, max_tokens_ceiling=7)
    assert chat({"max_tokens": 50}, capped).sampling.max_tokens == 7
    assert chat({}, capped).sampling.max_tokens == 7
    assert completion({}, capped).sampling.max_tokens == 7


def test_explicit_temperature_zero_beats_generation_config():
    ctx = make_ctx(default_sampling={"temperature": 0.7})
    assert chat({"temperature": 0}, ctx).sampling.options.temperature == 0.0
    assert chat({}, ctx).sampling.options.temperature == 0.7


def test_stream_usage_options():
    plain = chat({"stream": True, "stream_options": {}})
    assert not plain.include_usage and not plain.continuous_usage     # {} adds nothing
    # as vLLM: continuous_usage_stats without include_usage turns nothing on (chat and
    # completions alike)
    for fn in (chat, completion):
        alone = fn({"stream": True, "stream_options": {"continuous_usage_stats": True}})
        assert not alone.include_usage and not alone.continuous_usage
        off = fn({"stream": True, "stream_options": {"include_usage": False,
                                                      "continuous_usage_stats": True}})
        assert not off.include_usage and not off.continuous_usage
        cont = fn({"stream": True, "stream_options": {"include_usage": True,
                                                       "continuous_usage_stats": True}})
        assert cont.include_usage and cont.continuous_usage
    forced = chat({"stream": True}, make_ctx(force_include_usage=True))
    assert forced.include_usage and forced.continuous_usage


# -- logit controls ------------------------------------------------------------

@pytest.mark.parametrize("fn", [chat, completion])
def test_logit_controls_reach_the_sampler(fn):
    o = fn({"logit_bias": {"7": 150, "3": -2.5, "9": -1000}, "allowed_token_ids": [5, 2, 5],
            "bad_words": ["ab", " c"]}).sampling.options
    assert o.logit_bias == ((3, -2.5), (7, 100.0), (9, -100.0))   # clamped to [-100, 100]
    assert o.allowed_token_ids == (2, 5)
    # FakeTokenizer: one token per character, so " c" and "c" differ in length: only the
    # word as it starts the text is banned (vLLM's rule), and "ab" also after a space
    # only when that is a different first token with as many tokens (never, here).
    assert o.bad_words_token_ids == ((ord("a"), ord("b")), (ord("c"),))
    assert o.controls_logits


def test_no_logit_controls_by_default():
    o = chat({}).sampling.options
    assert not o.controls_logits
    assert not responses({}).sampling.options.controls_logits


@pytest.mark.parametrize("field, value, words", [
    ("logit_bias", {"abc": 1}, "token ids"), ("logit_bias", {"-1": 1}, "token ids"),
    ("logit_bias", {"1.5": 1}, "token ids"), ("logit_bias", {"1": "x"}, "finite numbers"),
    ("logit_bias", {"1": True}, "finite numbers"), ("logit_bias", {"1": float("nan")}, "finite"),
    ("logit_bias", {"1000": 1}, "out of vocabulary"), ("logit_bias", [1], "object"),
    ("allowed_token_ids", [], "empty"), ("allowed_token_ids", [1, -2], "non-negative"),
    ("allowed_token_ids", [1, 1000], "out of vocabulary"), ("allowed_token_ids", "1", "array"),
    ("allowed_token_ids", [1.0], "integer"),
    ("bad_words", "word", "array"), ("bad_words", ["ok", ""], "empty"),
    ("bad_words", [" "], "blank"), ("bad_words", [3], "string"),
])
@pytest.mark.parametrize("fn", [chat, completion])
def test_bad_logit_controls_are_400_naming_the_param(fn, field, value, words):
    err = error_of(fn, {field: value})
    assert (err.status, err.type) == (400, "invalid_request_error")
    assert err.param.split("[")[0] == field     # the JSON path: allowed_token_ids[0]
    assert words in err.message


def test_logit_controls_use_the_models_vocabulary():
    # the model's embedding rows (vocab_size) bound the ids, not the tokenizer's
    ctx = make_ctx(vocab_size=2000)
    assert chat({"logit_bias": {"1500": 1}}, ctx).sampling.options.logit_bias == ((1500, 1.0),)
    assert error_of(chat, {"allowed_token_ids": [2000]}, ctx).param == "allowed_token_ids"


def test_bad_words_need_a_tokenizer():
    ctx = RenderContext(tokenizer=None, served_model_names=("tiny",), max_model_len=100,
                        vocab_size=1000)
    body = {"prompt": [1, 2], "bad_words": ["x"]}
    err = error_of(render, Submission("r1", "completions", body, 1.5), ctx)
    assert (err.status, err.param) == (400, "bad_words")
    body = {"prompt": [1, 2], "logit_bias": {"5": 3}}
    assert render(Submission("r1", "completions", body, 1.5), ctx).sampling.options.logit_bias


def test_a_huge_integer_bias_is_clamped():
    assert chat({"logit_bias": {"4": 10**400}}).sampling.options.logit_bias == ((4, 100.0),)


# -- --max-logprobs, -1 and logprob_token_ids (issue 37) ----------------------------------

def test_minus_one_is_the_whole_vocabulary_under_max_logprobs_minus_one():
    whole = make_ctx(max_logprobs=-1)    # FakeTokenizer's vocabulary: 1000
    req = chat({"logprobs": True, "top_logprobs": -1}, whole)
    assert req.sampling.options.logprobs == 1000
    assert chat({"prompt_logprobs": -1}, whole).sampling.prompt_logprobs == 1000
    assert completion({"logprobs": -1}, whole).sampling.options.logprobs == 1000
    both = completion({"logprobs": 999, "prompt_logprobs": 1000}, whole)
    assert (both.sampling.options.logprobs, both.sampling.prompt_logprobs) == (999, 1000)
    # the embedding rows, when the model has more than the tokenizer
    assert completion({"logprobs": -1}, make_ctx(max_logprobs=-1, vocab_size=1024)
                      ).sampling.options.logprobs == 1024


@pytest.mark.parametrize("fn, body, param, message", [
    (chat, {"logprobs": True, "top_logprobs": -1}, "top_logprobs",
     "Requested sample logprobs of 1000, which is greater than max allowed: 20"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (chat, {"prompt_logprobs": -1}, "prompt_logprobs",
     "Requested prompt logprobs of 1000, which is greater than max allowed: 20"),
    (completion, {"logprobs": -1}, "logprobs",
     "Requested sample logprobs of 1000, which is greater than max allowed: 20"),
    (completion, {"prompt_logprobs": 21}, "prompt_logprobs",
     "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    (chat, {"logprobs": True, "top_logprobs": -2}, "top_logprobs", "or -1 for the whole"),
    (completion, {"logprobs": -2}, "logprobs", "or -1 for the whole"),
    (chat, {"prompt_logprobs": -2}, "prompt_logprobs", "or -1 for the whole"),
    (chat, {"top_logprobs": -1}, "top_logprobs", "needs 'logprobs' set to true"),
    (chat, {"prompt_logprobs": -1, "stream": True}, "prompt_logprobs", "not available"),
])
def test_logprobs_beyond_max_logprobs_are_vllms_400(fn, body, param, message):
    err = error_of(fn, body)
    assert (err.status, err.param) == (400, param) and message in err.message


def test_max_logprobs_raises_and_lowers_the_limit():
    assert chat({"logprobs": True, "top_logprobs": 50}, make_ctx(max_logprobs=50)
                ).sampling.options.logprobs == 50
    err = error_of(completion, {"logprobs": 3}, make_ctx(max_logprobs=2))
    assert err.message == "Requested sample logprobs of 3, which is greater than max allowed: 2"
    # 0 asks for no alternatives: never over the limit (vLLM's check skips it)
    assert completion({"logprobs": 0}, make_ctx(max_logprobs=0)).sampling.options.logprobs == 0


def test_logprob_token_ids_replace_the_top_alternatives():
    req = chat({"logprobs": True, "top_logprobs": 5, "logprob_token_ids": [7, 3, 7]})
    # logprobs stays on with no top-k: the sampler gathers the chosen ids instead
    assert req.sampling.options.logprobs == 0
    assert req.sampling.options.logprob_token_ids == (7, 3, 7)
    req = completion({"logprobs": 1, "logprob_token_ids": [999]})
    assert (req.sampling.options.logprobs, req.sampling.options.logprob_token_ids) == (0, (999,))
    assert chat({"logprobs": True}).sampling.options.logprob_token_ids == ()


@pytest.mark.parametrize("fn, body, message", [
    (chat, {"logprob_token_ids": [1]}, "when using 'logprob_token_ids', 'logprobs' must be "
                                       "set to true."),
    (completion, {"logprob_token_ids": [1]}, "when using 'logprob_token_ids', 'logprobs' "
                                             "must be set."),
    (chat, {"logprobs": True, "logprob_token_ids": []}, "must not be an empty list"),
    (chat, {"logprobs": True, "logprob_token_ids": [5, 1000]},
     "token_id(s) [1000] in logprob_token_ids contain out-of-vocab token ids. Vocabulary "
     "size: 1000"),
    (completion, {"logprobs": 0, "logprob_token_ids": [-1]}, "token_id(s) [-1]"),
    (completion, {"logprobs": 0, "logprob_token_ids": list(range(129))},
     "Requested logprob_token_ids of length 129, which is greater than max allowed: 128"),
])
def test_logprob_token_ids_errors_are_vllms(fn, body, message):
    err = error_of(fn, body)
    assert (err.status, err.param) == (400, "logprob_token_ids") and message in err.message


def test_enable_response_messages_keeps_the_rendered_prompt():
    req = responses({"enable_response_messages": True})
    echo = req.reply.response
    assert echo.prompt_token_ids == req.prompt_token_ids
    assert echo.prompt_text == "<user>hi<assistant>"     # FakeTokenizer's template, decoded
    assert responses({}).reply.response.prompt_text is None


def test_beam_search_renders_its_width_and_length_penalty():
    r = chat({"use_beam_search": True, "n": 3, "length_penalty": 0.5, "max_tokens": 4})
    assert (r.sampling.beam_width, r.sampling.length_penalty, r.n) == (3, 0.5, 3)
    assert chat({"n": 3, "length_penalty": 0.5}).sampling.beam_width == 0  # read by beams only
    assert completion({"use_beam_search": True, "prompt": ["a", "b"]}).sampling.beam_width == 1


@pytest.mark.parametrize("body, says", [
    ({"stop": ["x"]}, "'stop'"), ({"prompt_logprobs": 1}, "'prompt_logprobs'"),
    ({"response_format": {"type": "json_object"}}, "constrained output"),
])
def test_beam_search_refuses_what_it_does_not_combine_with(body, says):
    with pytest.raises(RequestError) as err:
        chat({"use_beam_search": True, "n": 2, **body})
    assert err.value.param == "use_beam_search" and says in err.value.message
    with pytest.raises(RequestError) as err:
        completion({"use_beam_search": True, "max_tokens": 0, "echo": True})
    assert err.value.param == "use_beam_search" and "max_tokens" in err.value.message

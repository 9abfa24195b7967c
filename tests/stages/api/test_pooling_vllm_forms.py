"""The pooling requests vLLM's own HTTP tests send, which tailrace refused or answered
otherwise (issue 59): /score's other names for its two sides, /pooling's `task`,
`use_activation` on embeddings, /classify's chat-style `messages`, truncate_prompt_tokens
above the model's length, /invocations' `messages` on a pooling model, /rerank's usage."""
from __future__ import annotations

import pytest

from gpu.config.pooling import PoolingSpec
from stages.api.common import RequestError, parse_request
from stages.api.pooling import POOLING_APIS, PoolingInput, PoolingReply, body
from stages.api.pooling_inputs import input_ids
from stages.render import RenderContext, Submission, render

EMBED = PoolingSpec(task="embed", pooling_type="MEAN", normalize=True, use_activation=True,
                    hidden_size=4, encoder=True)
CLASSES = PoolingSpec(task="classify", pooling_type="CLS", normalize=False, use_activation=True,
                      hidden_size=4, num_labels=2, labels=("neg", "pos"), encoder=True)


def plan(api: str, body_: dict, spec: PoolingSpec = EMBED):
    cls, fn = POOLING_APIS[api]
    return fn(parse_request(body_, cls), spec)


@pytest.mark.parametrize("left, right", [("text_1", "text_2"), ("queries", "documents"),
                                          ("queries", "items"), ("data_1", "data_2")])
def test_score_takes_each_of_vllms_names_for_its_sides(left, right):
    p = plan("score", {left: "what is it", right: ["a cat", "a dog"]})
    assert [i.text for i in p.inputs] == ["what is it", "a cat", "a dog"]
    assert p.reply.pairs == ((0, 1), (0, 2))
    assert p.inputs[1].param == f"{right}[0]"


def test_score_with_one_side_names_the_missing_one():
    with pytest.raises(RequestError) as err:
        plan("score", {"queries": "q"})
    assert err.value.param == "documents"


def test_pooling_takes_vllms_task_and_embeddings_use_activation():
    assert plan("pooling", {"input": "a", "task": "embed"}).inputs[0].text == "a"
    assert plan("embeddings", {"input": "a", "use_activation": True}).inputs[0].text == "a"


def test_classify_takes_chat_style_messages():
    messages = [{"role": "user", "content": "I loved it"}]
    p = plan("classify", {"messages": messages}, CLASSES)
    assert p.messages[0].content == "I loved it" and p.inputs[0].param == "messages"
    with pytest.raises(RequestError) as err:
        plan("classify", {"messages": messages, "input": "x"}, CLASSES)
    assert err.value.param == "input"


def test_truncate_prompt_tokens_above_the_models_length_is_a_400():
    with pytest.raises(RequestError) as err:
        input_ids(PoolingInput(token_ids=(1, 2, 3), max_tokens=257), None, 256, None)
    assert err.value.param == "truncate_prompt_tokens" and "257" in err.value.message
    assert input_ids(PoolingInput(token_ids=(1, 2, 3), max_tokens=256), None, 256, None)[0] \
        == [1, 2, 3]


def test_rerank_usage_has_prompt_tokens_as_vllms():
    import numpy as np
    import orjson

    vecs = [np.array(v, dtype="<f4").tobytes() for v in ([1, 0], [1, 0], [0, 1])]
    out = orjson.loads(body(PoolingReply("rerank", pairs=((0, 1), (0, 2))), request_id="r",
                            model="m", created=0, vectors=vecs, prompt_tokens=7))
    assert out["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def test_invocations_messages_go_to_chat_or_on_a_pooling_model_to_embeddings():
    """(told apart by which API's refusal a server without a tokenizer gives)"""
    from stages.api.pooling import INVOCATION_MESSAGES

    sub = Submission("r", INVOCATION_MESSAGES, {"messages": [
        {"role": "user", "content": "hi there"}], "max_tokens": 2}, 0.0)
    with pytest.raises(RequestError) as err:    # no tokenizer: the chat API's own refusal
        render(sub, RenderContext(tokenizer=None, served_model_names=("m",), max_model_len=64,
                                  vocab_size=100))
    assert err.value.param == "messages"
    pooled = RenderContext(tokenizer=None, served_model_names=("m",), max_model_len=64,
                           vocab_size=100, pooling=EMBED)
    with pytest.raises(RequestError) as err:
        render(sub, pooled)
    assert "no tokenizer: 'messages' cannot be rendered" in err.value.message   # embeddings'

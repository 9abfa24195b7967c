import orjson
import pytest

from web.bench.backends import BenchConfigError
from web.bench.datasets import custom_requests, random_requests, sharegpt_requests

from tests.support.sse_server import FakeTokenizer


def test_random_lengths_within_range_and_shared_prefix():
    tok = FakeTokenizer(vocab_size=50)
    reqs = random_requests(tok, num_prompts=200, input_len=20, output_len=10, range_ratio=0.5, prefix_len=4, seed=1)
    assert len(reqs) == 200
    prefixes = {tuple(tok.encode(r.prompt)[:4]) for r in reqs}
    assert len(prefixes) == 1
    for r in reqs:
        assert 4 + 10 <= r.prompt_len <= 4 + 30  # prefix + uniform [20*0.5, 20*1.5]
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert 5 <= r.expected_output_len <= 15
    assert {r.expected_output_len for r in reqs} == set(range(5, 16))


def test_random_is_seeded_and_fixed_without_range():
    tok = FakeTokenizer()
    a = random_requests(tok, num_prompts=5, input_len=8, output_len=3, seed=3)
    assert a == random_requests(tok, num_prompts=5, input_len=8, output_len=3, seed=3)
    assert a != random_requests(tok, num_prompts=5, input_len=8, output_len=3, seed=4)
    assert {(r.prompt_len, r.expected_output_len) for r in a} == {(8, 3)}


def test_random_rejects_bad_ratio():
    with pytest.raises(BenchConfigError):
        random_requests(FakeTokenizer(), num_prompts=1, input_len=8, output_len=3, range_ratio=1.0)


def conversation(prompt_words, answer_words):
    return {"conversations": [{"from": "human", "value": " ".join(["q"] * prompt_words)},
                              {"from": "gpt", "value": " ".join(["a"] * answer_words)}]}


def test_sharegpt_lengths_and_filtering(tmp_path):
    path = tmp_path / "sharegpt.json"
    data = [conversation(5, 7), conversation(6, 9), conversation(2, 9),  # prompt too short
            conversation(5, 1),  # answer too short
            {"conversations": [{"from": "human", "value": "only one turn here"}]}]
    path.write_bytes(orjson.dumps(data))
    reqs = sharegpt_requests(FakeTokenizer(), path, num_prompts=2, seed=0)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(5, 7), (6, 9)]
    fixed = sharegpt_requests(FakeTokenizer(), path, num_prompts=3, output_len=32, seed=0)
    assert {r.expected_output_len for r in fixed} == {32}
    assert sorted(r.prompt_len for r in fixed) == [5, 5, 6]  # the short answer is fine with a fixed length


def test_sharegpt_oversamples_when_short(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_bytes(orjson.dumps([conversation(5, 7)]))
    reqs = sharegpt_requests(FakeTokenizer(), path, num_prompts=4)
    assert len(reqs) == 4 and len(set(reqs)) == 1


def test_custom_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a b c", "output_tokens": 9}\n\n{"prompt": "d e"}\n')
    reqs = custom_requests(FakeTokenizer(), path, num_prompts=2, output_len=4, seed=0, shuffle=False)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == [("a b c", 3, 9), ("d e", 2, 4)]


def test_custom_jsonl_requires_prompt(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.raises(BenchConfigError, match="prompt"):
        custom_requests(FakeTokenizer(), path, num_prompts=1, output_len=4)

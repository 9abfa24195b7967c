"""thinking_token_budget (issue 37): the scheduler and the runner on a tiny random model,
with stand-in <think>/</think> ids. A logit bias keeps the model from ever closing its
reasoning (or makes it open one at every token), so that each </think> seen is the forced
one: after exactly `budget` reasoning tokens."""
import json

import pytest
import torch

from gpu.layers.attention import KVCache
from gpu.interface import SamplingOptions
from gpu.loader.decoder import load_model
from gpu.worker.runner import ModelRunner
from tests.support.rendered import rendered
from stages.schedule import AsyncScheduler, Scheduler
from stages.schedule.blocks import BlockManager

OPEN, CLOSE = 10, 11


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-think")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 128, "eos_token_id": 1}))
    return load_model(str(path), load_format="dummy", dtype="float32", progress=False)


def generate(tiny, prompt, n, cls=Scheduler, **options):
    mc = tiny.config
    cache = KVCache(mc.num_hidden_layers, 16, 4, mc.num_key_value_heads, mc.head_dim,
                    torch.float32, "cpu")
    runner = ModelRunner(tiny.model, cache, device=torch.device("cpu"))
    s = cls(BlockManager(16, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
            eos_token_ids=(1,), think_ids=(OPEN, CLOSE))
    s.add(rendered("r", prompt, max_tokens=n, ignore_eos=True,
                   logit_bias=((1, -100.0), *options.pop("bias", ())), **options))
    out, ahead = [], []
    while s.has_work() or ahead:
        if len(ahead) < s.max_in_flight and s.has_work():
            plan = s.schedule()
            ahead.append((plan, runner.execute(plan)))
            if len(ahead) < s.max_in_flight:
                continue
        plan, result = ahead.pop(0)
        for d in s.update(plan, result).deltas:
            out += d.token_ids
    return out


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_the_budget_forces_the_close_after_exactly_budget_reasoning_tokens(tiny, cls):
    never_close = ((CLOSE, -100.0),)
    free = generate(tiny, [3, 4, OPEN], 8, cls, bias=never_close)
    assert CLOSE not in free
    out = generate(tiny, [3, 4, OPEN], 8, cls, bias=never_close, thinking_token_budget=3)
    assert out[:3] == free[:3] and out[3] == CLOSE and CLOSE not in out[4:]
    assert generate(tiny, [3, 4, OPEN], 4, cls, bias=never_close,
                    thinking_token_budget=0)[0] == CLOSE


def test_every_reasoning_span_gets_the_budget_anew(tiny):
    # the prompt opens nothing; the bias makes the model open a <think> at every token
    out = generate(tiny, [3, 4, 5], 8, bias=((OPEN, 100.0),), thinking_token_budget=2)
    assert out == [OPEN, OPEN, OPEN, CLOSE, OPEN, OPEN, OPEN, CLOSE]


def test_a_tokenizer_without_single_token_tags_fails_the_request():
    from stages.delta import FinishReason

    s = Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=64, eos_token_ids=(1,), think_ids=None)
    s.add(rendered("r", [3, 4], max_tokens=4, thinking_token_budget=2))
    [d] = s.drain().deltas
    assert d.finish_reason == FinishReason.ERROR and "single tokens" in d.error

"""A speculative Harmony stream that really crosses from the analysis channel to the final
channel inside one multi-token step, with the drafts accepted (issue 59; the seed's
test_gpt_oss_speculative_reasoning_leakage). The random gpt-oss of
test_e2e_spec_harmony.py never writes an analysis channel, so its reasoning side is empty.

Here a one-layer gpt-oss has weights shaped by hand (saved with transformers), so that
greedy decoding writes exactly

    <|channel|>analysis<|message|> think more<|end|><|start|>assistant<|channel|>final
    <|message|> hello world<|return|>

- the residual stream is the current token's one-hot embedding; the lm_head maps it to
  the next token of that chain (a bigram table, logit 800);
- `<|channel|>` and `<|message|>` come twice with different successors, so one attention
  head keeps a state: its queries and keys are zero (every earlier position weighs the
  same), its value is +1 for `analysis` and -1 for `final`, so its output is positive
  between the analysis header and the final one and zero elsewhere (the prompt's
  history holds one of each). That output tips `<|channel|>` to `final` (over
  `analysis`) and `<|message|>` to ` think` (over ` hello`) by a margin a hundred times
  the float error, and moves no other choice;
- the MLP's experts are zero.

The request's history holds an earlier assistant turn whose reasoning and answer are
the same words, which Harmony renders as the same tokens: the n-gram drafter (prompt
lookup, 12 tokens) drafts the whole answer from it after the first token, the model
accepts every draft, and one step brings `analysis ... hello world<|return|>`. Parsed
per token, that one delta holds the reasoning and the content; a parser that gave a
delta's text to one channel, or to the channel of its last token, fails here."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

CONFIG = Path(__file__).parents[2] / "gpu" / "configs" / "gpt-oss-tiny"
# the chain, and the two tokens whose successor the attention's state decides
CHAN, MSG, END, START, RET = 200005, 200008, 200007, 200006, 200002
ANALYSIS, FINAL, ASSISTANT = 35644, 17196, 173781
THINK, MORE, HELLO, WORLD = 2411, 945, 40617, 2375
NEXT = {ASSISTANT: CHAN, ANALYSIS: MSG, FINAL: MSG, THINK: MORE, MORE: END, END: START,
        START: ASSISTANT, HELLO: WORLD, WORLD: RET}
STATEFUL = {CHAN: (ANALYSIS, FINAL), MSG: (HELLO, THINK)}   # (state 0, state > 0)
STATE_DIM = 40                  # the residual dimension the attention writes
HISTORY = [{"role": "user", "content": "Say hello."},
           {"role": "assistant", "reasoning": " think more", "content": " hello world"},
           {"role": "user", "content": "Again."}]
SPEC = {"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_min": 1,
        "prompt_lookup_max": 5, "adaptive": False}


def shaped_gpt_oss(out: Path) -> None:
    """The checkpoint, in the names and shapes of transformers' GptOssForCausalLM (built
    here directly: transformers' own would initialise 2 x 201,088 x 64 random weights only
    to have them zeroed, half a minute on a busy CPU)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((CONFIG / "config.json").read_text())
    cfg.update(num_hidden_layers=1, layer_types=["full_attention"])
    hidden, vocab, experts = cfg["hidden_size"], cfg["vocab_size"], cfg["num_local_experts"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    inter = cfg["intermediate_size"]
    layer = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,), layer + "input_layernorm.weight": (hidden,),
              layer + "post_attention_layernorm.weight": (hidden,),
              layer + "self_attn.sinks": (cfg["num_attention_heads"],),
              layer + "mlp.router.weight": (experts, hidden), layer + "mlp.router.bias": (experts,),
              layer + "mlp.experts.gate_up_proj": (experts, hidden, 2 * inter),
              layer + "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
              layer + "mlp.experts.down_proj": (experts, inter, hidden),
              layer + "mlp.experts.down_proj_bias": (experts, hidden)}
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", hidden)):
        shapes[f"{layer}self_attn.{name}.weight"] = (rows, q if name == "o_proj" else hidden)
        shapes[f"{layer}self_attn.{name}.bias"] = (rows,)
    w = {n: torch.ones(s) if "norm" in n else torch.zeros(s) for n, s in shapes.items()}
    tokens = sorted({*NEXT, *NEXT.values(), *STATEFUL, *(t for p in STATEFUL.values() for t in p)})
    dim = {t: i for i, t in enumerate(tokens)}
    assert len(tokens) < STATE_DIM < hidden
    for t, i in dim.items():
        w["model.embed_tokens.weight"][t, i] = 1.0
    attn = "model.layers.0.self_attn."
    w[attn + "sinks"].fill_(-30.0)                       # no attention sink
    w[attn + "v_proj.weight"][0, dim[ANALYSIS]] = 1.0    # kv head 0, dim 0: +analysis -final
    w[attn + "v_proj.weight"][0, dim[FINAL]] = -1.0
    w[attn + "o_proj.weight"][STATE_DIM, 0] = 1.0        # q head 0 (on kv head 0), dim 0
    head = w["lm_head.weight"]
    for cur, nxt in NEXT.items():
        head[nxt, dim[cur]] = 100.0
    for cur, (off, on) in STATEFUL.items():
        head[off, dim[cur]] = 100.0
        head[on, dim[cur]] = 95.0
        head[on, STATE_DIM] = 400.0
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text((CONFIG / "generation_config.json").read_text())


@pytest.fixture(scope="module")
def server(serve_with_flags, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e-spec-crossing")
    shaped_gpt_oss(tmp / "model")
    for server in serve_with_flags(tmp, str(tmp / "model"), "--served-model-name", "shaped",
                                   "--speculative-config", json.dumps(SPEC)):
        yield server


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def _stream(server, messages) -> list[dict]:
    """The stream's deltas that carry text, one per step (a step's tokens are one chunk)."""
    body = {"model": "shaped", "messages": messages, "stream": True, "max_tokens": 24,
            "temperature": 0}
    deltas = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                d = choice["delta"]
                if d.get("content") or d.get("reasoning") or choice.get("finish_reason"):
                    deltas.append({"content": d.get("content") or "",
                                   "reasoning": d.get("reasoning") or "",
                                   "finish": choice.get("finish_reason")})
    return deltas


def test_the_prompt_holds_as_many_analysis_headers_as_final_ones(server):
    """The attention's state starts at zero: the prompt's channel words cancel out."""
    r = httpx.post(f"{server.url}/tokenize", json={"model": "shaped", "messages": HISTORY},
                   timeout=60)
    ids = r.json()["tokens"]
    assert ids.count(ANALYSIS) == ids.count(FINAL) == 1 and ids[-1] == ASSISTANT


def test_one_step_crosses_from_analysis_to_final_with_every_draft_accepted(server):
    accepted = _metric(server, "vllm:spec_decode_num_accepted_tokens_total")
    deltas = _stream(server, HISTORY)
    # the answer: reasoning and content apart, however the steps fell
    assert "".join(d["reasoning"] for d in deltas) == " think more"
    assert "".join(d["content"] for d in deltas) == " hello world"
    assert deltas[-1]["finish"] == "stop"
    # one step brought both: its delta has the analysis text and the final text
    both = [d for d in deltas if d["reasoning"] and d["content"]]
    assert both == [{"content": " hello world", "reasoning": " think more", "finish": None}]
    # 12 drafts accepted in it: analysis <|message|> think more <|end|> <|start|>
    # assistant <|channel|> final <|message|> hello world (then <|return|>, sampled)
    assert _metric(server, "vllm:spec_decode_num_accepted_tokens_total") - accepted == 12


def test_a_history_that_drafts_only_part_of_the_answer_gives_the_same_answer(server):
    """Drafts from a history whose words differ: some drafts rejected, steps of several
    sizes, the channel changing between steps; the same reasoning and content."""
    history = [HISTORY[0], {**HISTORY[1], "reasoning": " think"}, HISTORY[2]]
    deltas = _stream(server, history)
    assert "".join(d["reasoning"] for d in deltas) == " think more"
    assert "".join(d["content"] for d in deltas) == " hello world"
    assert len([d for d in deltas if d["reasoning"] or d["content"]]) > 1

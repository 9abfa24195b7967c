"""A GGUF file's vocabulary as a `tokenizers.Tokenizer`, the one transformers makes of the
same file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, held equal by
tests/gpu/test_gguf_vocab.py), and the chat template a family's files go without.

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE over the file's merges, split first by
  the regex its `tokenizer.ggml.pre` names (PRE_TOKENIZER_SPLITS, llama.cpp's names);
- `"llama"`: SentencePiece's BPE with byte fallback. The file's merges, or (most files
  have none) the merges its vocabulary implies: every token cut in two known halves,
  ranked by the token's score (Gemma: by its place in the file, as its scores do not
  follow its merge order). Gemma normalizes spaces to "▁" and stores its runs of spaces
  as spaces; Llama 2 and Mistral prepend "▁" to the text (Metaspace).

Token types 3 (control) become special added tokens, 4 (user-defined) plain added ones.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # gguf token_type values that become added tokens
SPACE = "\u2581"

# The split regexes of the pre-tokenizers llama.cpp names in tokenizer.ggml.pre (the
# matching HF tokenizer.json's Split pattern; llama.cpp's llama-vocab.cpp lists the same).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx",
                     "smaug-bpe", "lfm2", "midm-2.0"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# Names whose whole-word vocabulary hits skip merging (tiktoken-converted vocabularies)
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")
_GEMMA = ("gemma", "gemma2", "gemma3")


def byte_level_bpe(field: Callable[..., Any], name: str) -> tokenizers.Tokenizer:
    """tokenizer.ggml.model "gpt2". field(key, default) reads the file's metadata."""
    tokens: list[str] = field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    pre = field("tokenizer.ggml.pre", "default")
    hf = tokenizers.Tokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges,
                                         ignore_merges=pre in _IGNORE_MERGES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in PRE_TOKENIZER_SPLITS:
        split = pre_tokenizers.Split(tokenizers.Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in ("gpt2", "default"):
            log.warning("%s: pre-tokenizer %r unknown; using GPT-2's", name, pre)
        hf.pre_tokenizer = byte_level
    hf.decoder = decoders.ByteLevel()
    _add_typed_tokens(hf, tokens, field("tokenizer.ggml.token_type", []))
    return hf


def sentencepiece_bpe(field: Callable[..., Any], arch: str) -> tokenizers.Tokenizer:
    """tokenizer.ggml.model "llama" (Gemma, Llama 1/2, Mistral v0.x, Phi-3)."""
    file_tokens: list[str] = field("tokenizer.ggml.tokens")
    gemma = arch in _GEMMA
    if gemma:   # runs of spaces are stored as spaces; the normalizer makes them "▁"s
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in file_tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}
    else:
        tokens = file_tokens
        ranks = dict(zip(tokens, field("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    file_merges = field("tokenizer.ggml.merges")
    merges = ([tuple(m.split(" ")) for m in file_merges] if file_merges is not None
              else implied_merges(vocab, ranks))
    if gemma:
        unk = field("tokenizer.ggml.unknown_token_id")
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                             unk_token=file_tokens[unk] if unk is not None else "<unk>"))
        hf.normalizer = normalizers.Replace(" ", SPACE)
        hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    elif arch == "phi3":    # the prefix space from a normalizer (as Phi-3's tokenizer.json has it)
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
        hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(content=" ", left=1)])
    else:
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
        hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(content=" ", left=1)])
    _add_typed_tokens(hf, file_tokens, field("tokenizer.ggml.token_type", []))
    return hf


def implied_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a BPE vocabulary implies: every (left, right) cut of a token whose halves
    are tokens too, best-ranked token first, then longer left halves first (the order
    transformers' generate_merges gives, ties kept in vocabulary order)."""
    found = []
    for token, rank in ranks.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token))
                if token[:i] in vocab and token[i:] in vocab]
        cuts.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((left, right, rank) for left, right in cuts)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_typed_tokens(hf: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    hf.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t == _CONTROL])
    vocab = hf.get_vocab()
    hf.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == _USER_DEFINED and tokens[i] in vocab])


# The chat template a family's GGUF files go without (llama.cpp falls back to its built-in
# one by architecture): (template, tokens that end a turn). Gemma's, as its HF
# tokenizer_config.json has it (the system message joins the first user turn).
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
KNOWN_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    **dict.fromkeys(_GEMMA, (_GEMMA_TEMPLATE, ("<end_of_turn>",))),
}


def known_template(arch: str) -> tuple[str, tuple[str, ...]] | None:
    """(the family's chat template, the tokens that end its turns), or None."""
    return KNOWN_TEMPLATES.get(arch)

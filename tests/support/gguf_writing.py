"""GGUF files written with gguf-py for the family tests (moved from
tests/gpu/test_gguf_families.py; shared by several test modules)."""
from __future__ import annotations

import gguf
import numpy as np
from gpu.formats.gguf import _TOP_LEVEL


def _gguf_name(hf_name: str, per_block: dict[str, str]) -> str:
    to_gguf = {v: k for k, v in _TOP_LEVEL.items()} | {v: k for k, v in per_block.items()}
    base, kind = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{to_gguf[rest]}.{kind}"
    return f"{to_gguf[base]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _writer(path, arch: str, c) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    return w


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _spm_vocab(size: int) -> tuple[list[str], list[int]]:
    """A SentencePiece-style vocabulary as Gemma's GGUF files hold it: control tokens, the
    256 byte-fallback tokens, "▁"-prefixed pieces, and runs of spaces stored as spaces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["  ", "   ", "\n", "\n\n"]
    types = [3] * len(specials) + [6] * 256 + [4] * 4
    chars = list("▁etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ.,!?'0123456789")
    pieces = chars + ["▁t", "th", "he", "▁th", "▁the", "in", "er", "an", "▁a", "on", "re", "▁w", "at",
                      "en", "nd", "▁s", "▁o", "ou", "▁c", "it", "is", "▁i", "es", "or", "▁the▁", "ing",
                      "▁in", "▁of", "▁to", "▁and", "▁is", "▁it", "ed", "▁he", "ll", "▁hello", "▁world",
                      "▁wor", "ld", "lo", "hel", "▁hel", "ello", "▁qu", "ick", "▁quick", "▁fox", "▁br",
                      "own", "▁brown", "▁cat", "▁sat", "▁on", "▁mat", "▁The", "Th", "▁T", "▁H", "He"]
    for p in pieces:
        if p not in tokens and len(tokens) < size:
            tokens.append(p)
            types.append(1)
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(3)
    return tokens, types

"""Read a llama.cpp GGUF file: config, dequantized HF-named tensors, and the tokenizer.

GGUF quirks undone here:
- ggml shapes are listed fastest-dimension first; the reader's numpy arrays are already in
  row-major (HF) order, so tensors are reshaped to the reversed ggml shape.
- For `llama`, convert_hf_to_gguf.py permutes the rows of attn_q/attn_k (per head, interleaving the
  two rotary halves) for llama.cpp's RoPE; `_unpermute` restores HF's rotate_half layout.
  qwen2/qwen3 are not permuted.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from gpu.formats.gguf_reader import GGUFHeader
from gpu.tokenizers.tokenizer import Tokenizer

if TYPE_CHECKING:   # torch only where tensors are made: reading the tokenizer needs none
    import torch

log = logging.getLogger(__name__)

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, the experts stacked [E, out, in] (gpu/loader/experts.py
    # interleaves gate and up), Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)

# Pre-tokenizer split patterns by tokenizer.ggml.pre (the regexes of the matching HF tokenizer.json).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # gguf token_type values that become added tokens


def _round_f32(x: float) -> float:
    """GGUF stores floats as float32; 9.9999997e-06 -> 1e-05 like the HF config had."""
    return float(str(np.float32(x)))


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's permute: per head, rows (Dh/2, 2) -> (2, Dh/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _PER_BLOCK:
        return f"model.layers.{m.group(1)}.{_PER_BLOCK[m.group(2)]}.{kind}"
    return None


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def _dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's blocks -> float32 of shape. The packed-CPU kernels' dequantization
    (gpu/kernels/cpu/quant.c) for the formats they take, bit-identical to gguf-py's and 6x faster
    (0.18 s against 1.2 s for SmolLM2's Q4_1); F32 and F16 cast; gguf-py for the rest or
    without the kernels."""
    import torch

    from gpu.kernels.cpu import quant as cpu_quant

    k = cpu_quant.kernels() if ggml_type in cpu_quant.FORMATS and len(shape) == 2 else None
    if k is not None:
        blocks = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(shape[0], -1))  # a copy: the map is read-only
        try:
            return k.dequantize(ggml_type, blocks, shape[1])
        except ValueError:
            pass   # a shape the kernel declines: gguf-py's own
    if ggml_type in (0, 1):    # F32, F16: a cast, as gguf-py's
        return torch.from_numpy(data.astype(np.float32).reshape(shape))
    import gguf.quants    # its package imports mistral-common: only where it is needed

    w = gguf.quants.dequantize(data, ggml_type).reshape(shape)
    return torch.from_numpy(w if w.flags.writeable else w.copy())


class GGUFFile:
    @staticmethod
    def open(path: str | Path) -> GGUFFile:
        """The file's GGUFFile, parsed once per process while the file is unchanged: a server
        reads the same file for its tokenizer (render) and its weights (the runner)."""
        p = Path(path).resolve()
        st = p.stat()
        return _open_cached(p, st.st_mtime_ns, st.st_size)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFHeader(self.path)   # gguf-py's GGUFReader took 1.4 s of every start
        self.arch = self.field("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    @property
    def name(self) -> str:
        """Served model name: the file name without its quantisation suffix, e.g. SmolLM2-135M-Instruct."""
        return _QUANT_SUFFIX.sub("", self.path.stem) or self.field("general.name") or self.path.stem

    def config_dict(self) -> dict[str, Any]:
        """A HF config.json-style dict for ModelConfig.from_hf."""
        a = self.arch
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(f"{self.path.name}: per-frequency RoPE factors (rope_freqs, llama3 scaling) are not supported")
        heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        rope_scaling = None
        scaling_type = self.field(f"{a}.rope.scaling.type")
        if scaling_type in ("linear", "yarn"):
            rope_scaling = {"rope_type": scaling_type, "factor": _round_f32(self.field(f"{a}.rope.scaling.factor"))}
            if scaling_type == "yarn":
                rope_scaling["original_max_position_embeddings"] = self.field(f"{a}.rope.scaling.original_context_length")
        elif scaling_type not in (None, "none"):
            raise ValueError(f"{self.path.name}: unsupported rope scaling {scaling_type!r}")
        eos = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return {
            **self._experts_config(),
            "model_type": a,
            "vocab_size": int(self.tensors["token_embd.weight"].shape[-1]),
            "hidden_size": hidden,
            "intermediate_size": self.field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.field(f"{a}.attention.head_count_kv", heads),
            "head_dim": self.field(f"{a}.attention.key_length") or hidden // heads,
            "rms_norm_eps": _round_f32(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _round_f32(self.field(f"{a}.rope.freq_base", 10000.0)),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.field(f"{a}.context_length"),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
        }

    def _experts_config(self) -> dict[str, Any]:
        """A mixture's keys, as the family's config.json names them (none for a dense model).
        llama.cpp renormalises qwen3moe's top-k weights and not qwen2moe's unless the file
        says otherwise (expert_weights_norm)."""
        a = self.arch
        experts = self.field(f"{a}.expert_count")
        if not experts:
            return {}
        return {
            "num_experts": experts,
            "num_experts_per_tok": self.field(f"{a}.expert_used_count"),
            "moe_intermediate_size": self.field(f"{a}.expert_feed_forward_length"),
            "shared_expert_intermediate_size": self.field(f"{a}.expert_shared_feed_forward_length", 0),
            "norm_topk_prob": bool(self.field(f"{a}.expert_weights_norm", a == "qwen3moe")),
        }

    def generation_config(self) -> dict[str, Any]:
        c = self.config_dict()
        return {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]}

    def packed(self, gguf_name: str) -> tuple[int, torch.Tensor]:
        """(ggml type id, the tensor's blocks as stored: uint8 [rows, row_bytes]), rows
        un-permuted as named_tensors un-permutes them (a row holds whole blocks, so rows
        move as they are): for the packed CPU linears (gpu/quantization/gguf.py)."""
        import torch

        t = self.tensors[gguf_name]
        data = torch.from_numpy(np.array(t.data.view(np.ndarray), dtype=np.uint8, copy=True))
        data = data.reshape(int(t.shape[-1]), -1)
        a = self.arch
        heads = self.field(f"{a}.attention.head_count")
        if a == "llama" and ".attn_q." in gguf_name:
            data = _unpermute(data, heads)
        elif a == "llama" and ".attn_k." in gguf_name:
            data = _unpermute(data, self.field(f"{a}.attention.head_count_kv", heads))
        return int(t.tensor_type), data.contiguous()

    def named_tensors(self, select=None, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every weight, dequantized and un-permuted; the GGUF
        names in skip are left out (the ones kept packed).

        select(name, shape) -> slices (a tensor-parallel rank's part) or None: a cut along the
        first dimension (whole rows: whole quantisation blocks) is made before dequantising;
        other tensors come whole, for the caller to cut."""
        import torch

        a = self.arch
        heads = self.field(f"{a}.attention.head_count")
        kv_heads = self.field(f"{a}.attention.head_count_kv", heads)
        for t in self.reader.tensors:
            if t.name in skip:
                continue
            name = _hf_name(t.name)
            if name is None:
                raise ValueError(f"{self.path.name}: unexpected tensor {t.name!r}")
            # A plain ndarray view: numpy's memmap subclass makes dequantize ~2x slower.
            data, shape = t.data.view(np.ndarray), tuple(reversed(t.shape.tolist()))
            index = select(name, shape) if select is not None else None
            full_rows = shape[0]
            if index is not None and len(index) == 1 and data.shape[0] == full_rows:
                data = data[index[0]]
                shape = (data.shape[0], *shape[1:])
            w = _dequantize(data, int(t.tensor_type), shape)
            if a == "llama" and ".attn_q." in t.name:   # per head: a cut of whole heads keeps its own
                w = _unpermute(w, heads * shape[0] // full_rows)
            elif a == "llama" and ".attn_k." in t.name:
                w = _unpermute(w, kv_heads * shape[0] // full_rows)
            yield name, w

    def tokenizer(self) -> Tokenizer | None:
        """Byte-level BPE ("gpt2") tokenizers only; None (with a warning) for anything else."""
        kind = self.field("tokenizer.ggml.model")
        if kind is None:
            return None
        if kind != "gpt2":
            log.warning("%s: tokenizer model %r is not supported; serving without a tokenizer", self.path.name, kind)
            return None
        hf = _byte_level_bpe(self)
        bos = self.field("tokenizer.ggml.bos_token_id")
        if self.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
            bos_tok = hf.id_to_token(bos)
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)])
        return Tokenizer(hf, bos_token_id=bos, eos_token_ids=self.config_dict()["eos_token_id"],
                         chat_template=self.field("tokenizer.chat_template"))


def _byte_level_bpe(f: GGUFFile) -> tokenizers.Tokenizer:
    tokens: list[str] = f.field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in f.field("tokenizer.ggml.merges", [])]
    pre = f.field("tokenizer.ggml.pre", "default")
    hf = tokenizers.Tokenizer(models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges,
        ignore_merges=pre == "llama-bpe",  # llama 3: whole-word vocab hits skip merging
    ))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "qwen2"):
        split = pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT),
                                     behavior="isolated")
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in ("gpt2", "default"):
            log.warning("%s: pre-tokenizer %r unknown; using GPT-2's", f.path.name, pre)
        hf.pre_tokenizer = byte_level
    hf.decoder = decoders.ByteLevel()
    types = f.field("tokenizer.ggml.token_type", [])
    hf.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t == _CONTROL])
    hf.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == _USER_DEFINED])
    return hf

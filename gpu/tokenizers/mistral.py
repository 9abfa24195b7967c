"""--tokenizer-mode mistral: a Mistral model's tokenizer (tekken or SentencePiece) through
mistral-common.

As vLLM's MistralTokenizer: the vocabulary is the model folder's `tekken.json`, else its
SentencePiece model (`tokenizer.model.vN`, the highest N, else `tokenizer.model`), or the
file --tokenizer names, read by mistral-common's `MistralTokenizer.from_file` (which takes
the instruct version, v1..v7, from the file's name); a chat is rendered by mistral-common's
own request encoding (`encode_chat_completion`: its instruct format, its tool schema and its
validation of the conversation), not by a Jinja template.

Detokenize, xgrammar and /tokenize work on a `tokenizers` tokenizer with the same ids,
written once to a cache directory:
- tekken: built from tekken's ranks (byte-level BPE, merges derived from the ranks as
  gpu/tokenizers/harmony.py does for o200k; tekken's pre-tokenizer pattern; the special tokens first,
  at ids 0..num_special-1, the vocabulary after them);
- SentencePiece: the model's pieces at their ids, merges derived from the pieces' scores
  (a piece's merge ranks by its score), SentencePiece's dummy prefix and "▁" for spaces,
  byte fallback, and its control pieces ([INST], [TOOL_CALLS], ...) as special tokens.
tests/gpu/test_mistral_tokenizer.py checks their ids against mistral-common's.

No import of torch, trio or stages.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from gpu.tokenizers.harmony import _byte_chars, _write_once, cache_dir
from gpu.tokenizers.tokenizer import Tokenizer

TEKKEN_FILE = "tekken.json"
SENTENCEPIECE_FILE = "tokenizer.model"


def tokenizer_file(path: str | Path) -> Path:
    """The Mistral tokenizer of a model folder, or the file itself. In a folder,
    mistral-common's own choice (`get_one_valid_tokenizer_file`, which vLLM uses too):
    tekken.json wins, else the last by name of the SentencePiece files (tokenizer.model.v7
    after .v3 after tokenizer.model; mistral-common reads a bare .model as v1)."""
    from mistral_common.tokens.tokenizers.utils import get_one_valid_tokenizer_file

    path = Path(path).expanduser()
    if path.is_dir():
        try:
            path = Path(get_one_valid_tokenizer_file([str(p) for p in path.iterdir()]))
        except ValueError:
            raise FileNotFoundError(f"--tokenizer-mode mistral: no {TEKKEN_FILE}, "
                                    f"{SENTENCEPIECE_FILE}.vN or {SENTENCEPIECE_FILE} in "
                                    f"{path}") from None
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer-mode mistral: no tokenizer file at {path}")
    return path


def _sentencepiece_json(sp, path: Path) -> None:
    """A `tokenizers` tokenizer with a SentencePiece BPE model's ids (see the module's
    docstring)."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    specials = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    skip = set(specials)
    merges = sorted((-sp.get_score(i), i, vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:])
                    for piece, i in vocab.items() if i not in skip and not sp.is_byte(i)
                    for k in range(1, len(piece))
                    if piece[:k] in vocab and piece[k:] in vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                                 unk_token=sp.id_to_piece(sp.unk_id()), byte_fallback=True,
                                 fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False)
                            for i in specials])
    for i in specials:
        if tok.token_to_id(sp.id_to_piece(i)) != i:
            raise RuntimeError(f"SentencePiece control piece {sp.id_to_piece(i)} got id "
                               f"{tok.token_to_id(sp.id_to_piece(i))}, not {i}")
    _write_once(path, tok.to_str().encode())


def _tokenizers_json(tekken, path: Path) -> None:
    """A `tokenizers` tokenizer with tekken's ids (see the module's docstring)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    raw = json.loads(Path(tekken.file_path).read_text())
    num_special = tekken.num_special_tokens
    keep = tekken.n_words - num_special        # tekken cuts its vocabulary to this
    ranks = {}
    for entry in raw["vocab"][:keep]:
        ranks[base64.b64decode(entry["token_bytes"])] = entry["rank"]
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    merges = sorted((rank, b[:i], b[i:]) for b, rank in ranks.items() if len(b) > 1
                    for i in range(1, len(b))
                    if ranks.get(b[:i], rank) < rank and ranks.get(b[i:], rank) < rank)
    specials = [tekken.id_to_piece(i) for i in range(num_special)]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({text(b): r + num_special for b, r in ranks.items()})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(text(a), text(b)) for _, a, b in merges],
                                 ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(raw["config"]["pattern"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for i in (0, tekken.bos_id, tekken.eos_id, num_special - 1):
        if tok.token_to_id(specials[i]) != i:
            raise RuntimeError(f"tekken special token {specials[i]} got id "
                               f"{tok.token_to_id(specials[i])}, not {i}")
    _write_once(path, tok.to_str().encode())


class MistralTokenizer(Tokenizer):
    """A Tokenizer whose chats are rendered by mistral-common (`encode_chat`)."""

    tool_call_ids = "mistral"     # 9 alphanumerics (stages/api/tool_parsers/base.py)

    def __init__(self, path: str | Path) -> None:
        import tokenizers
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as Mistral

        file = tokenizer_file(path)
        try:
            self.mistral = Mistral.from_file(str(file))
        except ImportError as e:     # SentencePiece files need the sentencepiece package
            raise RuntimeError(f"--tokenizer-mode mistral: {e}") from e
        inner = self.mistral.instruct_tokenizer.tokenizer
        sentencepiece = file.name != TEKKEN_FILE and file.suffix != ".json"
        kind = "spm" if sentencepiece else "tekken"
        digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        built = cache_dir().parent / "mistral" / f"{kind}-{digest}.tokenizer.json"
        if not built.is_file():
            if sentencepiece:
                from sentencepiece import SentencePieceProcessor
                _sentencepiece_json(SentencePieceProcessor(model_file=str(file)), built)
            else:
                _tokenizers_json(inner, built)
        super().__init__(tokenizers.Tokenizer.from_file(str(built)), bos_token_id=inner.bos_id,
                         eos_token_ids=(inner.eos_id,))

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, *,
                    continue_final_message: bool = False) -> list[int]:
        """The conversation's prompt ids as mistral-common encodes it; ValueError (its
        validation's message) for a conversation it refuses."""
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.from_openai(
                _openai_messages(messages), tools=tools or None,
                continue_final_message=continue_final_message)
            return self.mistral.encode_chat_completion(request).tokens
        except (MistralCommonException, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"mistral-common refused the conversation: {e}") from e


def _openai_messages(messages: list[dict]) -> list[dict[str, Any]]:
    """Render's template messages back in OpenAI's shape, as mistral-common reads them:
    arguments a JSON string, no reasoning keys."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("reasoning", "reasoning_content")}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": (
                    c["function"]["arguments"] if isinstance(c["function"].get("arguments"), str)
                    else getattr(c["function"]["arguments"], "raw", "")
                    or json.dumps(c["function"]["arguments"]))}}
                for c in m["tool_calls"]]
            if not m.get("content"):
                m.pop("content", None)
        out.append(m)
    return out

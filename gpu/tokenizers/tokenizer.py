"""Tokenizer: a `tokenizers.Tokenizer` plus special ids and the chat template, from a HF directory
or a GGUF file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpu.formats.hf import read_json


class Tokenizer:
    tool_call_ids = "openai"    # the form of the tool-call ids replies give ("mistral": 9 alphanumerics)

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | dict[str, str] | None = None,
    ):
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        # Named templates (HF allows a list of {"name", "template"}); "default" is the main one.
        self._templates = dict(chat_template) if isinstance(chat_template, dict) else (
            {"default": chat_template} if chat_template else {})
        special = {i for i, tok in hf.get_added_tokens_decoder().items() if tok.special}
        special |= set(self.eos_token_ids) | ({bos_token_id} if bos_token_id is not None else set())
        self.all_special_ids: frozenset[int] = frozenset(special)
        self._compiled: dict[str, jinja2.Template] = {}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._templates.get("default") or next(iter(self._templates.values()), None)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.hf.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.hf.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
        chat_template: str | None = None, **template_kwargs: Any,
    ) -> str:
        """Render the conversation to a prompt string; ValueError when there is no template or it fails.
        `chat_template` (Jinja source) replaces the tokenizer's own."""
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        source = chat_template or self._templates.get(name) or self.chat_template
        if not source:
            raise ValueError("this model's tokenizer has no chat template; send a completion request instead")
        context = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        context.update(template_kwargs)
        try:
            return self._compile(source).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context)
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
            # Messages come from clients: e.g. `content: null` meeting `'...' + message['content']`.
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e

    def _compile(self, source: str) -> jinja2.Template:
        if source not in self._compiled:
            try:
                self._compiled[source] = _jinja_env().from_string(source)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat template does not parse: {e}") from e
        return self._compiled[source]


class _TemplateRaised(jinja2.TemplateError):
    pass


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Same defaults as transformers' chat template tojson (not jinja's HTML-escaping one).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` markers; the body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) from a HF model directory.
    eos_token_ids: the tokenizer's own eos_token (gpu.loader.decoder.merge_eos_ids adds the model's)."""
    hf = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    # some tokenizer.json files (sentence-transformers' all-MiniLM-L6-v2) pad and truncate every
    # encoding to 128: the server decides lengths itself (render refuses or truncates)
    hf.no_truncation()
    hf.no_padding()
    cfg = read_json(path / "tokenizer_config.json")
    template: Any = cfg.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()

    def token_id(key: str) -> int | None:
        content = _token_content(cfg.get(key))
        return None if content is None else hf.token_to_id(content)

    eos = [i for i in (token_id("eos_token"),) if i is not None]
    return Tokenizer(hf, bos_token_id=token_id("bos_token"), eos_token_ids=eos, chat_template=template)

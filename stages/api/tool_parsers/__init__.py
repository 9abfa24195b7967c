"""Tool-call parsers: a model's text -> content and tool calls, incrementally.

A parser is fed the answer text (after any reasoning) piece by piece, as engine steps
produce it, and returns the content it is sure of and the calls it has completed. Every
decision depends only on the text so far, never on where the pieces were cut, so a reply
streamed token by token gets exactly the content and calls of the same reply parsed at
once (tests feed every split).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3,
  Hermes, SmolLM3-style templates); the text before the first call is content.
- `llama3_json`: Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`, several separated by `;`), when the answer starts with one.
- `pythonic` (and `llama4_pythonic`): `[f(a=1), g()]` (Llama 3.2/4 and others), when the
  answer starts with `[` or `<|python_start|>`.
- `qwen3_coder`, `qwen3_xml`, `glm45`, `kimi_k2`, `deepseek_v3`, `deepseek_v31`,
  `minimax_m2`: calls in tagged blocks after any content (tool_parsers/tagged.py).
- `mistral`: `[TOOL_CALLS]` followed by a JSON array, or by `NAME[ARGS]{...}` (v11+).
- `openai`: gpt-oss's Harmony calls (commentary to=functions.NAME). They are read from the
  token ids by stages/api/harmony.py, not from text; the name is here so the flag is accepted.

`--tool-parser-plugin PATH` imports a Python file that registers more with
`@register_tool_parser("name")` on a `ToolParser` subclass.

Two internal parsers serve tool_choice "required" and named functions, whose output is
constrained to JSON (a list of {"name", "parameters"} or the function's arguments).

One module per parser family; base.py holds the contract and the registry. Importing the
package registers the built-in parsers.
"""
from __future__ import annotations

from stages.api.tool_parsers.base import (CALL_IDS, TOOL_PARSERS, ToolCall, ToolParser, arguments_text, call_id,
                                      load_plugin, register_tool_parser)
from stages.api.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from stages.api.tool_parsers.harmony import HarmonyToolParser
from stages.api.tool_parsers.hermes import HermesToolParser
from stages.api.tool_parsers.llama3_json import Llama3JsonToolParser
from stages.api.tool_parsers.mistral import MistralToolParser
from stages.api.tool_parsers.pythonic import PythonicToolParser
from stages.api.tool_parsers.tagged import (DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                                            Glm45ToolParser, KimiK2ToolParser,
                                            MiniMaxM2ToolParser, Qwen3XmlToolParser)

__all__ = ["CALL_IDS", "TOOL_PARSERS", "DeepSeekV3ToolParser", "DeepSeekV31ToolParser",
           "Glm45ToolParser", "HarmonyToolParser", "HermesToolParser", "KimiK2ToolParser",
           "Llama3JsonToolParser", "MiniMaxM2ToolParser", "MistralToolParser",
           "NamedToolParser", "PythonicToolParser", "Qwen3XmlToolParser", "RequiredToolParser", "ToolCall",
           "ToolParser", "arguments_text", "call_id", "load_plugin", "register_tool_parser"]

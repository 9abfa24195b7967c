"""tools and tool_choice -> what the template sees, how parse finds the calls, and (for
"required" and a named function) the constraint that makes the model call one.

As vLLM: tool_choice defaults to "auto" when tools are given; "auto" needs
--enable-auto-tool-choice and a --tool-call-parser; "required" and a named function need
a --tool-call-parser and are enforced by constrained decoding over the tools' parameter
schemas (compact JSON: no free whitespace for a small model to ramble in); "none" runs no
parser (the tools stay in the prompt unless
--exclude-tools-when-tool-choice-none).
"""
from __future__ import annotations

import json
from typing import Any

import attrs

from gpu.interface import Constraint
from stages.api.common import RequestError, ToolSettings, ignored_field
from stages.messages import ToolPlan
from stages.api.structured import named


@attrs.frozen
class ToolRequest:
    """The API-independent result: template tools, parse plan, constraint."""
    template_tools: list[dict] | None = None
    plan: ToolPlan | None = None
    constraint: Constraint | None = None


def chat_tools(tools: list[dict[str, Any]] | None, param: str = "tools") -> list[dict] | None:
    """Check chat-form tools: {"type": "function", "function": {"name", "description",
    "parameters", "strict"}}."""
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if tool.get("type", "function") != "function":
            raise RequestError(f"'{where}.type' must be \"function\", got "
                               f"{json.dumps(tool.get('type'))}.", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"'{where}.function' must be an object.", param=f"{where}.function")
        _check_function(fn, f"{where}.function")
    return tools


def _check_function(fn: dict, where: str) -> None:
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"'{where}.name' must be a non-empty string.", param=f"{where}.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestError(f"'{where}.parameters' must be a JSON schema object.",
                           param=f"{where}.parameters")


# A custom tool (Responses') takes free text, not JSON: the template sees a function of one
# string parameter, and a call of it is answered as a custom_tool_call with that string.
CUSTOM_INPUT = "input"
CUSTOM_PARAMETERS = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                     "required": [CUSTOM_INPUT]}


def responses_tools(tools: list[dict[str, Any]] | None, api: str = "/v1/responses"
                    ) -> list[dict] | None:
    """Responses-form tools ({"type": "function", "name", "parameters", ...}) in chat form.
    Custom tools are served as functions of one string (CUSTOM_PARAMETERS). A hosted tool
    (web_search, file_search, namespace, mcp, ...) runs on OpenAI's servers: as vLLM, it
    is left out of the prompt, logged once per type. None when no tool is left."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise RequestError(f"'{where}.type' must be a string.", param=f"{where}.type")
        if kind not in ("function", "custom"):
            ignored_field(api, f"tools[].type {kind}", "is a hosted tool, which this server "
                          "does not run: left out of the prompt")
            continue
        _check_function(tool, where)
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        if kind == "custom":
            fn["parameters"] = CUSTOM_PARAMETERS
        out.append({"type": "function", "function": fn})
    return out or None


def _choice(tool_choice: Any) -> tuple[str, str | None]:
    """(mode, function name) from "none" | "auto" | "required" | a named function, in
    chat form {"type": "function", "function": {"name"}} or Responses' {"type", "name"}."""
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return "named", name
    raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": NAME}}.",
                       param="tool_choice")


def tool_request(tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
                 settings: ToolSettings) -> ToolRequest:
    """`tools` in chat form, already checked."""
    if tool_choice is not None and tool_choice != "none" and tools is None:
        raise RequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if tools is not None and not tools and tool_choice != "none":
        raise RequestError("'tools' must not be empty: send at least one tool, or omit "
                           "'tools'.", param="tools")
    if not tools:
        return ToolRequest()
    mode, name = _choice("auto" if tool_choice is None else tool_choice)
    if mode == "none":
        return ToolRequest(None if settings.exclude_tools_when_tool_choice_none else tools)
    if mode == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                               "--tool-call-parser to be set.", param="tool_choice")
        return ToolRequest(tools, ToolPlan("auto", parser=settings.tool_call_parser,
                                           parallel=parallel is not False))
    if settings.tool_call_parser is None:
        what = ('tool_choice "required"' if mode == "required"
                else f"tool_choice naming function {name}")
        raise RequestError(f"{what} needs a tool-call parser: serve with --tool-call-parser "
                           "NAME.", param="tool_choice")
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if mode == "named":
        if name not in functions:
            raise RequestError(f"tool_choice names function {name}, which is not among the "
                               f"tools ({', '.join(functions)}).", param="tool_choice")
        schema = functions[name].get("parameters") or {"type": "object"}
        constraint = Constraint("json_schema", json.dumps(schema), compact=True)
        return ToolRequest(tools, ToolPlan("named", name=name),
                           named(constraint, "tools"))
    # required: a JSON array of {"name", "parameters"} calls, at least one.
    items = {"anyOf": [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [n]},
        "parameters": _rebased(fn.get("parameters") or {"type": "object"},
                               f"#/items/anyOf/{i}/properties/parameters")},
        "required": ["name", "parameters"]} for i, (n, fn) in enumerate(functions.items())]}
    schema = {"type": "array", "minItems": 1, "items": items}
    if parallel is False:
        schema["maxItems"] = 1
    return ToolRequest(tools, ToolPlan("required", parallel=parallel is not False),
                       named(Constraint("json_schema", json.dumps(schema), compact=True),
                             "tools"))


def _rebased(schema: Any, root: str) -> Any:
    """A tool's parameter schema moved from the root of a document to the JSON pointer
    `root`: its local references ("#/$defs/Item", pydantic's nested models, and "#" itself)
    follow it, so that each tool's $defs stay where its $refs resolve (xgrammar resolves a
    $ref from the root of the whole schema)."""
    if isinstance(schema, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebased(v, root)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    return schema

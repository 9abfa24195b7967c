"""Every way a request can ask for structured output, mapped to one `Constraint`.

- OpenAI's `response_format`: {"type": "json_object"} and {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} (chat and completions);
- vLLM's `structured_outputs`: json, regex, choice, grammar, json_object, structural_tag;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  and `structural_tag`;
- the Responses API's `text.format` (json_schema, json_object).

At most one may be given. Each constraint carries the field it came from, and admit checks
it (a schema that is not one, a regex that does not parse: `refusal`) so that the client
gets a 400 naming the field before the response starts.
"""
from __future__ import annotations

from collections.abc import Callable

import json
from typing import TYPE_CHECKING, Any

import attrs

from gpu.interface import Constraint, GrammarError
from stages.api.common import RequestError
from stages.api.request_types import ChoiceRequest

if TYPE_CHECKING:   # the API modules import this one
    from stages.api.responses import ResponsesRequest


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestError(f"'{param}' is not valid JSON: {exc}.", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise RequestError(f"'{param}' must be a JSON schema object.", param=param)
    return json.dumps(value)


def _choice(value: list[str], param: str) -> Constraint:
    if not value:
        raise RequestError(f"'{param}' must contain at least one choice.", param=param)
    return Constraint.choice(value)


def _from_response_format(fmt, param: str) -> Constraint | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object")
    if fmt.type == "json_schema":
        js = fmt.json_schema
        if js is None or js.schema is None:
            raise RequestError(f"'{param}.json_schema.schema' is required when "
                               f"'{param}.type' is \"json_schema\".",
                               param=f"{param}.json_schema")
        return Constraint("json_schema", _schema_text(js.schema, f"{param}.json_schema.schema"))
    raise RequestError(f"'{param}.type' must be one of text, json_object, json_schema, got "
                       f"{fmt.type!r}.", param=f"{param}.type")


def _from_structured_outputs(so, param: str) -> list[tuple[str, Constraint]]:
    found = []
    if so.json is not None:
        found.append((f"{param}.json", Constraint("json_schema",
                                                  _schema_text(so.json, f"{param}.json"))))
    if so.regex is not None:
        found.append((f"{param}.regex", Constraint("regex", so.regex)))
    if so.choice is not None:
        found.append((f"{param}.choice", _choice(so.choice, f"{param}.choice")))
    if so.grammar is not None:
        found.append((f"{param}.grammar", Constraint("grammar", so.grammar)))
    if so.json_object:
        found.append((f"{param}.json_object", Constraint("json_object")))
    if so.structural_tag is not None:
        found.append((f"{param}.structural_tag", Constraint("structural_tag",
                                                            so.structural_tag)))
    if not found:
        raise RequestError(f"'{param}' must set one of json, regex, choice, grammar, "
                           "json_object or structural_tag.", param=param)
    if so.disable_any_whitespace:
        found = [(p, attrs.evolve(c, compact=True)) for p, c in found]
    return found


def constraint_of(req: ChoiceRequest | ResponsesRequest) -> Constraint | None:
    """The request's one output constraint (None: free text); RequestError if it asks for
    more than one, or if the schema, regex or grammar is invalid."""
    found: list[tuple[str, Constraint]] = []
    if not isinstance(req, ChoiceRequest):   # the Responses API: text.format
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                found.append(("text.format", Constraint("json_object")))
            elif fmt.type == "json_schema":
                if fmt.schema is None:
                    raise RequestError("'text.format.schema' is required when "
                                       "'text.format.type' is \"json_schema\".",
                                       param="text.format.schema")
                found.append(("text.format", Constraint(
                    "json_schema", _schema_text(fmt.schema, "text.format.schema"))))
            else:
                raise RequestError("'text.format.type' must be one of text, json_object, "
                                   f"json_schema, got {fmt.type!r}.", param="text.format.type")
    else:
        if req.response_format is not None:
            c = _from_response_format(req.response_format, "response_format")
            if c is not None:
                found.append(("response_format", c))
        if req.structured_outputs is not None:
            found += _from_structured_outputs(req.structured_outputs, "structured_outputs")
        if req.guided_json is not None:
            found.append(("guided_json", Constraint(
                "json_schema", _schema_text(req.guided_json, "guided_json"))))
        if req.guided_regex is not None:
            found.append(("guided_regex", Constraint("regex", req.guided_regex)))
        if req.guided_choice is not None:
            found.append(("guided_choice", _choice(req.guided_choice, "guided_choice")))
        if req.guided_grammar is not None:
            found.append(("guided_grammar", Constraint("grammar", req.guided_grammar)))
        if req.structural_tag is not None:
            found.append(("structural_tag", Constraint("structural_tag", req.structural_tag)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{p}'" for p, _ in found)
        raise RequestError(f"Only one kind of structured output may be requested; got {names}.",
                           param=found[1][0])
    param, constraint = found[0]
    return named(constraint, param)


def named(constraint: Constraint, param: str) -> Constraint:
    """The constraint with the request field it came from, for admit's 400."""
    return attrs.evolve(constraint, param=param)


_WHAT = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar", "structural_tag": "structural tag"}


def refusal(constraint: Constraint, check: Callable[[Constraint], None]) -> RequestError | None:
    """A 400 naming the field when the schema, regex or grammar does not parse; None if it
    does. `check` raises GrammarError saying what is wrong (gpu/worker/grammar.py check,
    which start-up hands to admit). Called by admit (stages/admit.py), in the engine's
    process: xgrammar imports torch, which a frontend process (--api-server-count) never
    loads. Rendering stays torch-free; the refusal still comes before the response starts."""
    try:
        check(constraint)
    except GrammarError as exc:
        param = constraint.param or "response_format"
        what = _WHAT.get(constraint.kind, "constraint")
        return RequestError(f"'{param}' is not a valid {what}: {exc}", param=param)
    return None

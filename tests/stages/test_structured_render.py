"""Every request form of structured output maps to one Constraint on SamplingParams; a
constraint that does not parse is a 400 naming its field (render finds the request's
shape errors, admit the grammar's: stages/api/structured.py refusal)."""
from __future__ import annotations

import json

import pytest

from gpu.interface import Constraint
from gpu.worker.grammar import check
from stages.api.common import RequestError
from stages.api.structured import refusal
from tests.support.render_requests import chat, completion, responses

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
AS_SCHEMA = Constraint("json_schema", json.dumps(SCHEMA))


@pytest.mark.parametrize("fn, body, expected", [
    (chat, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     AS_SCHEMA),
    (chat, {"response_format": {"type": "json_object"}}, Constraint("json_object")),
    (chat, {"response_format": {"type": "text"}}, None),
    (chat, {"structured_outputs": {"json": SCHEMA}}, AS_SCHEMA),
    (chat, {"structured_outputs": {"json": json.dumps(SCHEMA)}}, AS_SCHEMA),
    (chat, {"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+")),
    (chat, {"structured_outputs": {"choice": ["x", "y"]}}, Constraint.choice(["x", "y"])),
    (chat, {"structured_outputs": {"grammar": 'root ::= "a"'}}, Constraint("grammar", 'root ::= "a"')),
    (chat, {"guided_json": SCHEMA}, AS_SCHEMA),
    (chat, {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, Constraint("regex", "a+")),
    (chat, {"guided_choice": ["x"]}, Constraint.choice(["x"])),
    (chat, {"guided_grammar": 'root ::= "a"'}, Constraint("grammar", 'root ::= "a"')),
    (completion, {"guided_json": SCHEMA}, AS_SCHEMA),
    (completion, {"response_format": {"type": "json_object"}}, Constraint("json_object")),
    (responses, {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}},
     AS_SCHEMA),
    (responses, {"text": {"format": {"type": "json_object"}}}, Constraint("json_object")),
    (chat, {}, None),
])
def test_request_forms_map_to_one_constraint(fn, body, expected):
    assert fn(body).sampling.constraint == expected


@pytest.mark.parametrize("fn, body, param, words", [
    (chat, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "required"),
    (chat, {"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    (chat, {"guided_json": {"type": "object", "properties": 3}}, "guided_json", "properties"),
    (chat, {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (chat, {"guided_regex": "(a"}, "guided_regex", "parenthesis"),
    (chat, {"guided_grammar": "root ::= b"}, "guided_grammar", "not defined"),
    (chat, {"structured_outputs": {}}, "structured_outputs", "one of"),
    (chat, {"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "Only one"),
    (responses, {"text": {"format": {"type": "json_schema", "schema": {"type": "foo"}}}},
     "text.format", "foo"),
])
def test_bad_constraints_are_400_naming_the_field(fn, body, param, words):
    try:
        err = refusal(fn(body).sampling.constraint, check)   # rendered: admit checks the grammar
    except RequestError as exc:                          # refused by render
        err = exc
    assert err is not None
    assert (err.status, err.param) == (400, param)
    assert words in err.message and "RuntimeError" not in err.message, err.message

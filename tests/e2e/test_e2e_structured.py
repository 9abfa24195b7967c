"""Structured outputs over HTTP with the official openai client."""
from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int


ASK = [{"role": "user", "content": "Give me a city as JSON: its name, its country and its "
                                   "population in millions."}]


def test_parse_with_a_pydantic_model(client, model_name):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=model_name, messages=ASK, response_format=City, max_tokens=80,
              temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


def test_streamed_json_schema_validates(client, model_name):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=model_name, messages=ASK, max_tokens=60, temperature=0.8, seed=7, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    text, reason = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_completions_regex_and_bad_regex(client, model_name):
    r = client.completions.create(model=model_name, prompt="The year is", max_tokens=10,
                                  extra_body={"structured_outputs": {"regex": r" \d{4}"}})
    assert r.choices[0].text[1:].isdigit() and len(r.choices[0].text) == 5
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "(unclosed"})
    assert info.value.param == "guided_regex"

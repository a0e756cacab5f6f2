"""End to end: constrained decoding through the official `openai` client on synthetic:tiny.

Random weights make this a strong test: whatever the weights, with a constraint every finished
output must validate against its schema. Many schemas are generated (nested objects, arrays,
enums, required and optional fields, strings with patterns and lengths, bounded numbers,
booleans), each asked for greedy and sampled; forced tool calls' arguments must validate
against the tool's parameters. A reply cut by `max_tokens` must say so (finish_reason
"length"); the bounded schemas here are built to finish, and the test demands that nearly all
of them do.

Usage: python3 tests/e2e/structured_output.py path/to/lily
"""

import json
import random
import sys

import jsonschema
import openai

from openai_client import HELLO, MODEL, NO_THINKING, Server, run_checks

SCHEMAS = 24
MAX_TOKENS = 200


def random_schema(rng, depth=0):
    """A schema a random model can finish within MAX_TOKENS: strings and arrays are bounded."""
    kinds = ["string", "pattern", "enum", "integer", "number", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{3}-[A-Z]{2}$", "^(yes|no)$"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "é"], rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "where", "nested"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def object_schema(rng):
    schema = random_schema(rng, 1)
    if schema.get("type") == "object":
        return schema
    return {"type": "object", "properties": {"value": schema}, "required": ["value"],
            "additionalProperties": False}


def ask(server, schema, temperature, seed, **extra):
    return server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
        extra_body=NO_THINKING, **extra,
    )


def check_json_schemas(server):
    rng = random.Random(16)
    finished = 0
    total = 0
    for i in range(SCHEMAS):
        schema = object_schema(rng)
        for temperature in (0.0, 1.0):
            reply = ask(server, schema, temperature, seed=i)
            choice = reply.choices[0]
            total += 1
            if choice.finish_reason == "length":
                assert reply.usage.completion_tokens == MAX_TOKENS, reply
                continue
            assert choice.finish_reason == "stop", (schema, choice)
            value = json.loads(choice.message.content)
            jsonschema.validate(value, schema)
            finished += 1
    print(f"  {finished} of {total} replies finished, every one valid")
    assert finished >= total * 0.9, f"only {finished} of {total} finished in {MAX_TOKENS} tokens"


def check_json_object_and_streaming(server):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in ask(server, schema, 1.0, seed=3, stream=True)
        if chunk.choices
    )
    jsonschema.validate(json.loads(text), schema)
    # n choices: each walks the grammar from its start, with its own seed.
    reply = ask(server, schema, 1.0, seed=5, n=3)
    assert len(reply.choices) == 3, reply
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    # Any object: keys are unbounded strings, which random weights rarely close, so only a
    # finished reply is parsed and a cut one must say "length".
    for seed in range(4):
        reply = server.client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=60, temperature=1.0, seed=seed,
            response_format={"type": "json_object"}, extra_body=NO_THINKING,
        )
        choice = reply.choices[0]
        assert choice.message.content.lstrip().startswith("{"), choice
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict), choice
        else:
            assert choice.finish_reason == "length", choice


def check_thinking(server):
    """With thinking on, the reasoning is free and the answer after it follows the schema; the
    reply cannot end before its answer, so it either has one or is cut ("length")."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for seed in range(3):
        reply = server.client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
        )
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            assert choice.finish_reason == "length", choice


def tool(rng, name):
    properties = {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                  "days": {"type": "integer", "minimum": 1, "maximum": 14},
                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                  "detail": random_schema(rng, 1)}
    if properties["detail"].get("type") == "string" and "pattern" not in properties["detail"]:
        properties["detail"] = {"type": "boolean"}
    if "type" not in properties["detail"]:
        properties["detail"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": ["city", "days"],
        "additionalProperties": False}}}


def check_forced_tool_calls(server):
    rng = random.Random(6)
    calls = 0
    for i in range(12):
        # One tool a request: two tools' schemas and the reply would not fit the context.
        tools = [tool(rng, "get_time")]
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        choice_field = "required" if i % 2 else {"type": "function", "function": {"name": "get_time"}}
        parallel = i % 4 == 1
        reply = server.client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=MAX_TOKENS, temperature=float(i % 3 != 0),
            seed=i, tools=tools, tool_choice=choice_field, parallel_tool_calls=parallel,
            extra_body=NO_THINKING,
        )
        choice = reply.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) >= 1, choice
        assert parallel or len(choice.message.tool_calls) == 1, choice
        for call in choice.message.tool_calls:
            if choice_field != "required":
                assert call.function.name == "get_time", call
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        calls += 1
    print(f"  {calls} of 12 forced calls finished, every one valid")
    assert calls >= 10, calls


def check_other_endpoints(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    # Completions (an extension vLLM and llama.cpp have too).
    reply = server.client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=40, temperature=1.0, seed=1,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
    )
    assert reply.choices[0].finish_reason == "stop", reply
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
    # Responses' text.format, flat.
    response = server.client.responses.create(
        model=MODEL, input="Hello", max_output_tokens=MAX_TOKENS, temperature=1.0,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)


def check_errors(server):
    for fields, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"tools": [tool(random.Random(1), "f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}]}}}}}],
          "tool_choice": "required"},
         "tools[0].function.parameters.properties.x"),
    ]:
        try:
            server.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **fields)
            raise AssertionError(f"{fields} was accepted")
        except openai.BadRequestError as e:
            assert e.param == param, (fields, e.body)


def main():
    # A forced call's prompt carries its tool's schema (~360 tokens) and the reply may take
    # MAX_TOKENS: the server refuses a request the context cannot hold.
    server = Server(sys.argv[1], max_seq=1024)
    checks = [
        ("json schemas", lambda: check_json_schemas(server)),
        ("json object and streaming", lambda: check_json_object_and_streaming(server)),
        ("thinking", lambda: check_thinking(server)),
        ("forced tool calls", lambda: check_forced_tool_calls(server)),
        ("completions and responses", lambda: check_other_endpoints(server)),
        ("errors", lambda: check_errors(server)),
    ]
    run_checks(checks, {"server": server})


if __name__ == "__main__":
    main()

"""End to end: the official `anthropic` client against `lily serve --model synthetic:tiny`'s
/v1/messages, which runs on the same engine as chat completions. Each check asserts real values
(the same greedy text as chat, token counts from /tokenize); any failure exits non-zero.

Usage: python3 tests/e2e/anthropic_client.py path/to/lily
"""

import json
import sys

import anthropic

from openai_client import (HELLO, HELLO_PROMPT_TOKENS, MODEL, NO_THINKING, REQUEST_TIMEOUT_S, Server, post,
                           run_checks)

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Return the current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
NO_THINK = {"type": "disabled"}
# A question, the tool call it got and the tool's result.
TOOL_HISTORY = [
    {"role": "user", "content": "Che tempo fa a Roma?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Roma"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sole, 24 gradi"}]},
]
# The current client has no sampling arguments; the server still reads them from the body.
GREEDY = {"temperature": 0}


def check_message(server, client):
    """The same greedy reply as chat completions, with Anthropic's shape and usage."""
    message = client.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, messages=HELLO, thinking=NO_THINK
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == MODEL and message.stop_reason in ("end_turn", "max_tokens"), message
    assert [b.type for b in message.content] == ["text"], message.content
    chat = server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, extra_body=NO_THINKING
    )
    assert message.content[0].text == chat.choices[0].message.content, (message, chat)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == HELLO_PROMPT_TOKENS, usage
    assert usage.output_tokens == chat.usage.completion_tokens, (usage, chat.usage)
    # A system prompt is the template's system message: the count /tokenize gives for it.
    system = "Answer in one word."
    message = client.messages.create(
        model=MODEL, max_tokens=2, extra_body=GREEDY, system=system, messages=HELLO, thinking=NO_THINK
    )
    counted = post(server, "/tokenize", {"messages": [{"role": "system", "content": system}, *HELLO],
                                          **NO_THINKING})[1]["count"]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted, (usage, counted)
    # Thinking on: the reply opens with a thinking block.
    message = client.messages.create(
        model=MODEL, max_tokens=6, extra_body=GREEDY, messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert message.content[0].type == "thinking" and message.content[0].thinking, message.content
    return chat.choices[0].message.content


def check_streaming(client, expected):
    """Named events in Anthropic's order; the text is the whole response's."""
    with client.messages.stream(
        model=MODEL, max_tokens=8, extra_body=GREEDY, messages=HELLO, thinking=NO_THINK
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds, kinds
    assert kinds[-2] == "message_delta", kinds
    assert final.content[0].text == expected, (final, expected)
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0, final


def check_tools(client):
    """Tools and a tool_use / tool_result history reach the template."""
    plain = client.messages.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY, thinking=NO_THINK,
        messages=[{"role": "user", "content": "Che tempo fa a Roma?"}],
    )
    with_tools = client.messages.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY, thinking=NO_THINK, tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "Che tempo fa a Roma?"}],
    )
    # The tool's description is in the prompt (whose tokens count as read from the cache when a
    # snapshot held them).
    prompt = lambda usage: usage.input_tokens + usage.cache_read_input_tokens
    assert prompt(with_tools.usage) > prompt(plain.usage) + 100, (plain.usage, with_tools.usage)
    message = client.messages.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY, thinking=NO_THINK, tools=[WEATHER_TOOL],
        messages=TOOL_HISTORY,
    )
    assert prompt(message.usage) > prompt(with_tools.usage), message.usage
    # The history after the question came from the snapshot of the question's turn.
    assert message.usage.cache_read_input_tokens > 0, message.usage
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use"), message


def check_constrained(client):
    """A forced tool call (`any`, `tool`) and `output_config.format` follow their schemas."""
    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Oslo"]}},
            "required": ["city"], "additionalProperties": False}
    tool = dict(WEATHER_TOOL, input_schema=city)
    valid = lambda use: use.name == "get_weather" and use.input["city"] in ("Rome", "Oslo")
    one_call = {"disable_parallel_tool_use": True}
    for seed, choice in enumerate([{"type": "any"}, {"type": "tool", "name": "get_weather"}]):
        message = client.messages.create(
            model=MODEL, max_tokens=120, messages=HELLO, thinking=NO_THINK, tools=[tool],
            tool_choice=dict(choice, **one_call), extra_body={"temperature": 1, "seed": seed},
        )
        assert message.stop_reason == "tool_use", message
        uses = [b for b in message.content if b.type == "tool_use"]
        assert len(uses) == 1 and valid(uses[0]), message
    # With parallel calls allowed a random model may repeat the call until `max_tokens` cuts it;
    # every call it finished still follows the schema.
    message = client.messages.create(
        model=MODEL, max_tokens=120, messages=HELLO, thinking=NO_THINK, tools=[tool],
        tool_choice={"type": "any"}, extra_body={"temperature": 1, "seed": 2},
    )
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason in ("tool_use", "max_tokens"), message
    finished = uses if message.stop_reason == "tool_use" else uses[:-1]
    assert uses and all(valid(u) for u in finished), message
    message = client.messages.create(
        model=MODEL, max_tokens=120, messages=HELLO, thinking=NO_THINK,
        output_config={"format": {"type": "json_schema", "schema": city}},
        extra_body={"temperature": 1, "seed": 3},
    )
    assert message.stop_reason == "end_turn", message
    assert json.loads(message.content[0].text)["city"] in ("Rome", "Oslo"), message


def check_count_tokens(client):
    """count_tokens gives the prompt tokens the same body prefills on /v1/messages: system,
    tools, a tool_use / tool_result history and thinking included."""
    cases = [
        {"messages": HELLO, "thinking": NO_THINK},
        {"messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"messages": TOOL_HISTORY, "system": "Answer in Italian.", "tools": [WEATHER_TOOL], "thinking": NO_THINK},
    ]
    counts = []
    for fields in cases:
        counted = client.messages.count_tokens(model=MODEL, **fields).input_tokens
        usage = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, **fields).usage
        assert counted == usage.input_tokens + usage.cache_read_input_tokens, (fields, counted, usage)
        counts.append(counted)
    # Thinking on opens the reply with "<think>" in the prompt: a different count.
    assert counts[0] != counts[1] and counts[2] > counts[0] + 100, counts
    try:
        client.messages.count_tokens(model=MODEL, messages=[])
        raise AssertionError("an empty conversation was counted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert e.body["error"]["message"].startswith("messages"), e.body
    try:
        client.messages.count_tokens(model="claude-opus-4", messages=HELLO)
        raise AssertionError("an unknown model was counted")
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body


def check_errors(client):
    """Anthropic's error shapes, raised as the client's own exceptions."""
    try:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=HELLO)
        raise AssertionError("an unknown model was accepted")
    except anthropic.NotFoundError as e:
        assert e.status_code == 404 and e.body["error"]["type"] == "not_found_error", e.body
    for fields, named in [
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "frob"}}}},
         "output_config.format"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "messages[0].content[0]"),
    ]:
        try:
            client.messages.create(**{"model": MODEL, "max_tokens": 4, "messages": HELLO, **fields})
            raise AssertionError(f"{fields} was accepted")
        except anthropic.BadRequestError as e:
            assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
            assert e.body["error"]["message"].startswith(named), e.body


def main():
    binary = sys.argv[1]
    server = Server(binary)
    client = anthropic.Anthropic(
        base_url=server.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
    )
    replies = {}
    checks = [
        ("message", lambda: replies.update(text=check_message(server, client))),
        ("streaming", lambda: check_streaming(client, replies["text"])),
        ("tools", lambda: check_tools(client)),
        ("constrained decoding", lambda: check_constrained(client)),
        ("count_tokens", lambda: check_count_tokens(client)),
        ("errors", lambda: check_errors(client)),
    ]
    run_checks(checks, {"server": server})


if __name__ == "__main__":
    main()

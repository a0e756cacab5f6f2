"""Thousands of generated bad requests: each must get a JSON 4xx (never a 5xx, never a dropped
connection), and the server must still answer afterwards. The generator is seeded, so a failure
reproduces; ROBUSTNESS_SEED picks another.

Every case is built to be invalid for a known reason (a wrong type or range in one field, a body
that Python's own strict JSON parser refuses, a path or method that does not exist, a body over
the server's --max-body-mb 1), so a 200 is a real finding, not noise.
"""

import concurrent.futures
import json
import os
import random
import time

from openai_client import HELLO, MODEL

CASES = 5000
WORKERS = 6
VOCAB = 10**9  # beyond any vocabulary, within u32

WEIRD = [None, True, False, 0, -1, 1.5, 1e308, -1e308, 10**40, -(10**40), "", "x" * 300, "\u0000",
         "\ud83d\ude00", [], [1, "a"], {}, {"a": {"b": [None]}}]

# (field, values that must be refused) for chat completions.
CHAT_BAD = {
    "model": [None, 5, True, [], {}, "gpt-4o", "", "synthetic:tiny "],
    "messages": [None, "hi", 5, {}, [], [1], [None], [[]], [{"role": "user"}], [{"content": "hi"}],
                 [{"role": "robot", "content": "hi"}], [{"role": 5, "content": "hi"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": {}}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "user", "content": [{"text": "no type"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "system", "content": None}],
                 [{"role": "assistant", "content": None, "tool_calls": "call"}],
                 [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
                 [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
                 [{"role": "assistant", "content": "x", "reasoning_content": 5}],
                 [{"role": "user", "content": "word " * 700}]],
    "temperature": ["hot", -0.1, 2.01, 1e308, 10**40, [], {}, True],
    "top_p": [0, -1, 1.01, "1", [], True, 1e308],
    "top_k": [-2, 1.5, "5", [], True, -(10**40)],
    "min_p": [-0.5, 1.5, "0", []],
    "max_tokens": [0, -1, 1.5, "10", [], True, 10**40, -(10**40), 1e300],
    "max_completion_tokens": [0, -5, "3", 2.5],
    "n": [17, 0, -1, "1", 1.5],
    "presence_penalty": [2.5, -2.01, "0", []],
    "frequency_penalty": [3, -3, "0"],
    "repetition_penalty": [0, -1, 2.5, "1"],
    "logit_bias": [{"x": 5}, {"1": 101}, {"1": "5"}, {str(VOCAB): 1}, "x", 5, []],
    "logprobs": ["yes", 1],
    # Without logprobs: true (whose values here are all bad), any top_logprobs is refused.
    "top_logprobs": [1, 5, 21, "0"],
    "seed": ["1", 1.5, [], {}, 10**40, True],
    "stream": ["yes", 1, 0, [], {}],
    "stream_options": ["x", 5, [], {"include_usage": "yes"}, {"include_usage": 1}],
    "stop": [5, [1], [""], [None], {"a": 1}, [str(i) for i in range(17)], True, ""],
    "tools": ["x", 5, {}, [1], [{}], [{"type": "retrieval"}], [{"type": "function"}],
              [{"type": "function", "function": {"name": 5}}],
              [{"type": "function", "function": {"name": "f"}}] * 129],
    "tool_choice": ["required", {"type": "function", "function": {"name": "f"}}, 5, "any", []],
    "response_format": [{"type": "yaml"}, {"type": "json_schema"}, "json", 5,
                        {"type": "json_schema", "json_schema": {"schema": 5}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}],
    "reasoning_effort": ["extreme", 5, [], ""],
    "functions": [[{"name": "f"}], "x"],
    "function_call": ["auto", {"name": "f"}],
    "audio": [{"voice": "alloy", "format": "wav"}],
    "modalities": [["text", "audio"], ["audio"], "text"],
    "prediction": [{"type": "content", "content": "x"}],
    "web_search_options": [{}],
    "parallel_tool_calls": ["no", 1, []],
    "chat_template_kwargs": [5, "x", [], {"messages": []}, {"tools": 1},
                             {"add_generation_prompt": False}, {"enable_thinking": "yes"},
                             {"enable_thinking": 1}],
}

# The same for text completions.
COMPLETION_BAD = {
    "model": [None, 7, "nope"],
    "prompt": [None, 5, "", [], [[]], [-1], [1.5], ["a", "b"], [[1], [2]], [VOCAB], [2**32],
               [10**40], [True], [{"a": 1}], {"text": "x"}, ["x", 1]],
    "max_tokens": [0, -3, "16", 1.25],
    "echo": [1, "false"],
    "suffix": ["tail", 5],
    "best_of": [2, 0, "1"],
    "logprobs": [21, -1, "5", 1.5, True],
    "temperature": [-1, 9, "0"],
    "stop": [[1, 2], 3, ["x"] * 17],
}

# The same for Anthropic's /v1/messages.
MESSAGES_BAD = {
    "model": [None, 7, "claude-opus-4"],
    "max_tokens": [None, 0, -1, "8", 1.5],
    "messages": [None, "hi", [], [{"role": "system", "content": "x"}], [{"role": "user"}],
                 [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "assistant", "content": [{"type": "tool_use", "input": {}}]}],
                 [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": [1]}]}],
                 [{"role": "user", "content": [{"type": "tool_result", "content": 5}]}]],
    "system": [5, [1], [{"type": "image"}]],
    "temperature": [1.5, -1, "0"],
    "top_p": [0, 2, "1"],
    "top_k": [-1, 1.5, "3"],
    "stop_sequences": ["x", [""], [5], ["a"] * 17],
    "stream": ["yes", 1],
    "thinking": [{"type": "on"}, 5, {"type": "enabled", "display": "omitted"}],
    "tools": [5, [{}], [{"name": 5}], [{"type": "web_search_20250305", "name": "w"}]],
    "tool_choice": [{"type": "any"}, {"type": "tool", "name": "f"}, "auto", {"type": 5}],
    "output_config": [{"format": {"type": "json_schema"}}, {"effort": "extreme"}],
}

# The same for /v1/responses.
RESPONSES_BAD = {
    "model": [None, 7, "gpt-4o"],
    "input": [None, 5, [], [1], [{"role": "robot", "content": "x"}], [{"role": "user"}],
              [{"role": "user", "content": [{"type": "input_image"}]}],
              [{"type": "function_call", "arguments": "{}"}],
              [{"type": "function_call", "name": "f", "arguments": "[1]"}],
              [{"type": "function_call_output", "output": 5}], [{"type": "item_reference"}]],
    "instructions": [5, []],
    "previous_response_id": [5, "resp_unknown"],
    "max_output_tokens": [0, -1, "8"],
    "temperature": [3, -1, "0"],
    "tools": [5, [{}], [{"type": "web_search"}], [{"type": "function"}]],
    "tool_choice": ["required", {"type": "function", "name": "f"}, 5],
    "reasoning": [{"effort": "max"}, {"effort": 5}],
    "text": [{"format": {"type": "json_schema"}}],
    "top_logprobs": [2],
    "background": [True, "yes"],
    "store": ["yes", 1],
    "parallel_tool_calls": ["no"],
}

UNKNOWN_PATHS = ["/", "/v1", "/v1/", "/v2/chat/completions", "/v1/chat", "/v1/embeddings",
                 "/v1/chat/completions/x", "/v1/models/gpt-4o", "/v1/models/%00", "/metrics/x",
                 "/health/", "/v1/completions/", "/../etc/passwd", "/v1/%2e%2e/health",
                 "/v1/audio/speech", "/" + "a" * 1500, "/v1/models/" + "z" * 900,
                 "/%ff%fe", "/v1/chat/completions%00", "/v1/models/%ff", "/v1/models/%c3%28"]
KNOWN_PATHS = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET",
               "/v1/models/synthetic:tiny": "GET", "/health": "GET", "/tokenize": "POST",
               "/detokenize": "POST", "/v1/messages": "POST",
               "/v1/responses": "POST"}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/xml", "application/octet-stream",
                 "application/json; charset=latin-1", None]


def valid_chat():
    return {"model": MODEL, "messages": list(HELLO), "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False}}


def valid_completion():
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}


def valid_messages():
    return {"model": MODEL, "max_tokens": 2, "messages": list(HELLO), "thinking": {"type": "disabled"}}


def valid_responses():
    return {"model": MODEL, "input": "Hello", "max_output_tokens": 2, "reasoning": {"effort": "none"}}


def with_noise(rng, body):
    """Unknown fields are ignored by design; they ride along with the real error."""
    for _ in range(rng.randrange(3)):
        body[f"x_{rng.randrange(1000)}"] = rng.choice(WEIRD)
    return body


def field_case(rng, valid, table, path):
    body = valid()
    for field in rng.sample(sorted(table), rng.choice([1, 1, 1, 2, 3])):
        body[field] = rng.choice(table[field])
    return ("POST", path, json.dumps(with_noise(rng, body)).encode(), "application/json")


def refused_by_python(data):
    try:
        json.loads(data.decode("utf-8"))
        return False
    except (UnicodeDecodeError, ValueError, RecursionError):
        return True


def byte_case(rng):
    """A valid body broken at the byte level until Python's strict parser refuses it too."""
    path, valid = rng.choice([("/v1/chat/completions", valid_chat),
                              ("/v1/completions", valid_completion)])
    data = bytearray(json.dumps(with_noise(rng, valid())).encode())
    while True:
        broken = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(broken))
            action = rng.randrange(5)
            if action == 0:
                del broken[at:]
                broken = broken or bytearray(b"{")
            elif action == 1:
                broken[at] = rng.randrange(256)
            elif action == 2:
                broken.insert(at, rng.choice(b'{}[]",:\\\x00\xff\xc3\xed\x80'))
            elif action == 3 and len(broken) > 1:
                del broken[at]
            else:
                broken[at:at] = rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800",
                                            b"NaN", b"1e999", b"\x00", b"\xef\xbb\xbf"])
        if refused_by_python(bytes(broken)):
            return ("POST", path, bytes(broken), rng.choice(CONTENT_TYPES))


def shape_case(rng):
    """Bodies that are not a request at all, under any content type."""
    body = rng.choice([b"", b" ", b"null", b"[]", b"[1,2]", b'"text"', b"42", b"true", b"{}",
                       b'{"model": "synthetic:tiny"}', b"model=synthetic:tiny&prompt=hi",
                       b"--x\r\nContent-Disposition: form-data\r\n\r\nhi\r\n--x--",
                       b"<request><model>synthetic:tiny</model></request>", b"\xff" * 64,
                       b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
                       json.dumps(valid_chat()).encode("utf-16"), b"\x00" * 100])
    path = rng.choice(["/v1/chat/completions", "/v1/completions"])
    return ("POST", path, body, rng.choice(CONTENT_TYPES))


def route_case(rng):
    if rng.random() < 0.5:
        path = rng.choice(UNKNOWN_PATHS)
        method = rng.choice(METHODS[:5])
    else:
        path, allowed = rng.choice(sorted(KNOWN_PATHS.items()))
        method = rng.choice([m for m in METHODS if m != allowed and not (allowed == "GET" and m == "HEAD")])
    body = json.dumps(valid_chat()).encode() if method in ("POST", "PUT", "PATCH") else None
    return (method, path, body, "application/json" if body else None)


def oversized_case(rng):
    """Over the server's 1 MiB body limit, as one huge field or many small ones."""
    body = valid_chat()
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": "y" * ((1 << 20) + rng.randrange(1 << 20))}]
    else:
        body["messages"] = [{"role": "user", "content": "hello"}] * rng.randrange(40_000, 60_000)
    return ("POST", "/v1/chat/completions", json.dumps(body).encode(), "application/json")


def generate(rng):
    cases = []
    for _ in range(CASES):
        kind = rng.random()
        if kind < 0.34:
            case = field_case(rng, valid_chat, CHAT_BAD, "/v1/chat/completions")
        elif kind < 0.45:
            case = field_case(rng, valid_completion, COMPLETION_BAD, "/v1/completions")
        elif kind < 0.50:
            case = field_case(rng, valid_messages, MESSAGES_BAD, "/v1/messages")
        elif kind < 0.55:
            case = field_case(rng, valid_responses, RESPONSES_BAD, "/v1/responses")
        elif kind < 0.80:
            case = byte_case(rng)
        elif kind < 0.88:
            case = shape_case(rng)
        elif kind < 0.985:
            case = route_case(rng)
        else:
            case = oversized_case(rng)
        cases.append(case)
    return cases


def send(server, call, case):
    """None if the answer is a JSON 4xx error, else what was wrong."""
    method, path, body, content_type = case
    headers = {"Content-Type": content_type} if content_type else {}
    try:
        status, _, answer = call(server, method, path, body, headers, timeout=60)
    except Exception as e:  # noqa: BLE001 - any failure to get an answer is a finding
        return f"no answer: {e!r}"
    if not 400 <= status < 500:
        return f"status {status}: {answer[:200]!r}"
    try:
        error = json.loads(answer)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
    except Exception:  # noqa: BLE001
        return f"status {status} without an OpenAI error body: {answer[:200]!r}"
    return None


def check_robustness(server, call):
    seed = int(os.environ.get("ROBUSTNESS_SEED", "8"))
    cases = generate(random.Random(seed))
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda case: send(server, call, case), cases))
    failures = [(case[:2], case[2][:120] if case[2] else None, why)
                for case, why in zip(cases, results) if why]
    print(f"  {len(cases)} bad requests (seed {seed}) in {time.monotonic() - started:.1f} s, "
          f"{len(failures)} not answered with a JSON 4xx", flush=True)
    assert not failures, failures[:10]
    status, _, answer = call(server, "GET", "/health")
    assert status == 200 and json.loads(answer) == {"status": "ok"}, answer
    status, _, answer = call(server, "POST", "/v1/chat/completions", valid_chat())
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] > 0, answer

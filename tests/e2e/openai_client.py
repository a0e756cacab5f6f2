"""End to end: the official `openai` client against `lily serve --model synthetic:tiny`.

synthetic:tiny has the real Qwen3.6 vocabulary, tokenizer and template with random weights, so
the text is gibberish but every token count, shape and error is real. Each check asserts real
values; any failure exits non-zero. Every wait is bounded.

Usage: python3 tests/e2e/openai_client.py path/to/lily
"""

import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

MODEL = "synthetic:tiny"
STARTUP_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# "Hello, how are you?" as a user turn with thinking off is 18 tokens (the tokenizer oracle).
HELLO = [{"role": "user", "content": "Hello, how are you?"}]
HELLO_PROMPT_TOKENS = 18
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Return the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Server:
    """A `lily serve` on a free loopback port; its log is collected for the checks."""

    def __init__(self, binary, *flags, env=None, model=MODEL, max_seq=512):
        self.log = []
        self.lines = queue.Queue()
        self.process = subprocess.Popen(
            [binary, "serve", "--model", model, "--port", "0", "--max-seq", str(max_seq), *flags],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        threading.Thread(target=self._read_log, daemon=True).start()
        self.base_url = self.wait_for_log(r"serving .* on (http://\S+/v1)", STARTUP_TIMEOUT_S).group(1)
        self.client = openai.OpenAI(
            base_url=self.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
        )

    def _read_log(self):
        for line in self.process.stderr:
            self.log.append(line.rstrip("\n"))
            self.lines.put(line)

    def wait_for_log(self, pattern, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None and self.lines.empty():
                raise AssertionError(f"lily serve exited with {self.process.returncode}: {self.log}")
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no log line matching {pattern!r} within {timeout_s} s: {self.log}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=20)


def chat_text(client, messages, **kwargs):
    response = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    return response, response.choices[0].message.content


def check_models(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL], models


def check_chat(server):
    response, text = chat_text(
        server.client, HELLO, max_tokens=12, temperature=0.7, seed=11, extra_body=NO_THINKING
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == MODEL
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(text, str) and text, choice
    assert choice.finish_reason in ("stop", "length"), choice
    usage = response.usage
    assert usage.prompt_tokens == HELLO_PROMPT_TOKENS, usage
    assert 0 < usage.completion_tokens <= 12 and usage.total_tokens == 18 + usage.completion_tokens
    # The same seed gives the same text.
    _, again = chat_text(
        server.client, HELLO, max_tokens=12, temperature=0.7, seed=11, extra_body=NO_THINKING
    )
    assert again == text, (again, text)
    # Thinking is on by default: the text goes to reasoning_content (the prompt opened <think>).
    response, _ = chat_text(server.client, HELLO, max_tokens=6, temperature=0)
    # "<think>\n" instead of "<think>\n\n</think>\n\n": two tokens fewer.
    assert response.usage.prompt_tokens == HELLO_PROMPT_TOKENS - 2, response.usage
    assert response.choices[0].message.model_extra.get("reasoning_content"), response
    # reasoning_effort "none" turns it off as enable_thinking false does.
    response, _ = chat_text(server.client, HELLO, max_tokens=6, temperature=0, reasoning_effort="none")
    assert response.usage.prompt_tokens == HELLO_PROMPT_TOKENS, response.usage
    assert not response.choices[0].message.model_extra.get("reasoning_content"), response
    return text


def check_streaming(server, expected_text):
    stream = server.client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=12,
        temperature=0.7,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINKING,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"]), finishes
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == HELLO_PROMPT_TOKENS
    assert all(c.usage is None for c in chunks[:-1])
    # Streamed and whole responses with the same seed agree.
    assert text == expected_text, (text, expected_text)


def check_multi_turn(server, cold_server):
    first, reply = chat_text(server.client, HELLO, max_tokens=8, temperature=0, extra_body=NO_THINKING)
    conversation = HELLO + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Tell me more."},
    ]
    second, warm_text = chat_text(
        server.client, conversation, max_tokens=8, temperature=0, extra_body=NO_THINKING
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens, second.usage
    cold, cold_text = chat_text(
        cold_server.client, conversation, max_tokens=8, temperature=0, extra_body=NO_THINKING
    )
    assert cold.usage.prompt_tokens_details.cached_tokens == 0, cold.usage
    assert warm_text == cold_text, (warm_text, cold_text)


def check_completions(server):
    response = server.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.choices[0].finish_reason in ("stop", "length")
    assert isinstance(response.choices[0].text, str)
    assert response.usage.prompt_tokens == 4 and 0 < response.usage.completion_tokens <= 5
    stream = server.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream)
    assert streamed == response.choices[0].text, (streamed, response.choices[0].text)


def check_tools(server):
    response, _ = chat_text(
        server.client,
        [{"role": "user", "content": "Che tempo fa a Roma?"}],
        tools=[WEATHER_TOOL],
        max_tokens=8,
        temperature=0,
    )
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The tool's description is in the prompt: it is far longer than the question alone.
    assert response.usage.prompt_tokens > 250, response.usage
    # A history with a tool call and its result.
    history = [
        {"role": "user", "content": "Che tempo fa a Roma?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Roma"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sole, 24 gradi"},
    ]
    response, _ = chat_text(server.client, history, tools=[WEATHER_TOOL], max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def check_errors(server):
    request = urllib.request.Request(
        server.base_url + "/chat/completions",
        data=b'{"model": "synthetic:tiny", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S)
        raise AssertionError("a malformed body was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        error = json.loads(e.read())["error"]
        assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"], error
        assert set(error) == {"message", "type", "param", "code"}, error

    try:
        chat_text(server.client, HELLO, max_tokens=2)
    except openai.APIError as e:
        raise AssertionError(f"a valid request failed: {e}") from e
    try:
        server.client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.code == "model_not_found" and e.param == "model", e.body

    long_text = "word " * 600
    try:
        server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=2
        )
        raise AssertionError("a prompt longer than the context was accepted")
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded", e.body
        assert "512" in e.message and re.search(r"has \d{3} tokens", e.message), e.message

    for fields, param in [
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"999999": 1}}, "logit_bias.999999"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
         "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        try:
            server.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **fields)
            raise AssertionError(f"{fields} was accepted")
        except openai.BadRequestError as e:
            assert e.param == param, (fields, e.body)


def post(server, path, body):
    """POST outside /v1 (where /tokenize lives), returning the status and the JSON body."""
    root = server.base_url.removesuffix("/v1")
    request = urllib.request.Request(
        root + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check_tokenize(server):
    """llama.cpp's and vLLM's shapes; the counts agree with what chat reports as usage."""
    status, answer = post(server, "/tokenize", {"content": "Hello, how are you?"})
    assert status == 200 and answer["tokens"] == [9419, 11, 1204, 513, 488, 30], answer
    status, answer = post(
        server, "/tokenize", {"model": MODEL, "messages": HELLO, **NO_THINKING}
    )
    assert status == 200 and answer["count"] == HELLO_PROMPT_TOKENS, answer
    assert answer["max_model_len"] == 512, answer
    status, back = post(server, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and back["prompt"].startswith("<|im_start|>user\nHello, how are you?"), back
    status, again = post(server, "/tokenize", {"prompt": back["content"]})
    assert again["tokens"] == answer["tokens"], (again, answer)
    status, error = post(server, "/detokenize", {"tokens": [1, -1]})
    assert status == 400 and error["error"]["param"] == "tokens[1]", error
    status, error = post(server, "/tokenize", {"model": "gpt-4o", "content": "x"})
    assert status == 404, error


def score(binary, tokens):
    """`lily score --json`: the teacher-forced log-probability of each next token."""
    scored = subprocess.run(
        [binary, "score", "--model", MODEL, "--tokens", ",".join(map(str, tokens)), "--json"],
        capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S, check=True,
    )
    return [p["logprob"] for p in json.loads(scored.stdout)["positions"][:-1]]


def ids(tokens):
    return [int(t.removeprefix("token_id:")) for t in tokens]


def check_logprobs(binary, server):
    """Log-probabilities of generated and echoed tokens are what `lily score` gives them."""
    prompt = [9419, 11, 1204, 513, 488, 30]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        response = server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, logprobs=3, echo=True,
            extra_body={"return_tokens_as_token_ids": True}, **sampling,
        )
        lp = response.choices[0].logprobs
        tokens = ids(lp.tokens)
        assert tokens[: len(prompt)] == prompt and len(tokens) == len(prompt) + 8, lp.tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
        expected = score(binary, tokens)
        for got, want in zip(lp.token_logprobs[1:], expected):
            assert abs(got - want) < 1e-4, (lp.token_logprobs, expected)
        assert all(len(top) == 3 for top in lp.top_logprobs[1:]), lp.top_logprobs
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp.text_offset
        # Streamed: the echoed prompt first, then the output, with the same log-probabilities.
        chunks = list(server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, logprobs=3, echo=True, stream=True,
            extra_body={"return_tokens_as_token_ids": True}, **sampling,
        ))
        streamed = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in streamed) == response.choices[0].text, streamed
        tokens_streamed = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
        logprobs_streamed = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
        assert tokens_streamed == lp.tokens, (tokens_streamed, lp.tokens)
        assert all(a == b or abs(a - b) < 1e-6 for a, b in
                   zip(logprobs_streamed[1:], lp.token_logprobs[1:])), (logprobs_streamed, lp)
        assert logprobs_streamed[0] is None and len(logprobs_streamed) == len(lp.token_logprobs)
    # Chat: one entry per generated token, greedy picks the top alternative.
    response = server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        extra_body=NO_THINKING,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens, content
    for entry in content:
        assert entry.token == entry.top_logprobs[0].token and len(entry.top_logprobs) == 2, entry
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or "\ufffd" in entry.token
    tokens = post(server, "/tokenize", {"messages": HELLO, **NO_THINKING})[1]["tokens"]
    generated = [int(e.token.removeprefix("token_id:")) for e in server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
        extra_body={**NO_THINKING, "return_tokens_as_token_ids": True},
    ).choices[0].logprobs.content]
    expected = score(binary, tokens + generated)[len(tokens) - 1:]
    for entry, want in zip(content, expected):
        assert abs(entry.logprob - want) < 1e-4, (content, expected)
    # Echo without generating scores the prompt alone, as evaluation harnesses ask.
    response = server.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=0, echo=True, logprobs=0
    )
    assert response.choices[0].text == "Once upon a time", response
    assert len(response.choices[0].logprobs.tokens) == 4 and response.usage.completion_tokens == 0


def check_choices_and_penalties(server):
    """n choices from one prefill; penalties and logit_bias are applied."""
    one, text = chat_text(server.client, HELLO, max_tokens=8, temperature=0, extra_body=NO_THINKING)
    three = server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, n=3, extra_body=NO_THINKING
    )
    assert [c.index for c in three.choices] == [0, 1, 2], three
    assert all(c.message.content == text for c in three.choices), (three, text)
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens, three.usage
    sampled = lambda: server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, seed=9, n=3,
        extra_body=NO_THINKING,
    )
    first, again = sampled(), sampled()
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) == 3, texts
    assert texts == [c.message.content for c in again.choices], (texts, again)
    stream = server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, seed=9, n=3, stream=True,
        extra_body=NO_THINKING,
    )
    streamed = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts, (streamed, texts)
    # logit_bias reaches the sampler on the greedy path too (which a GPU takes on the device).
    _, text = chat_text(
        server.client, HELLO, max_tokens=4, temperature=0, logit_bias={"9419": 100},
        extra_body=NO_THINKING,
    )
    assert text == "Hello" * 4, text
    # Qwen's recommended presence penalty is accepted (its effect is tested in the sampler).
    penalised, _ = chat_text(
        server.client, HELLO, max_tokens=4, presence_penalty=1.5, frequency_penalty=0.5,
        extra_body={**NO_THINKING, "repetition_penalty": 1.05},
    )
    assert penalised.usage.completion_tokens > 0, penalised


def check_responses(server):
    """/v1/responses: the same greedy text as chat, streamed events, tools, and a second turn
    that continues from previous_response_id out of the snapshot cache."""
    _, text = chat_text(server.client, HELLO, max_tokens=8, temperature=0, extra_body=NO_THINKING)
    first = server.client.responses.create(
        model=MODEL, input=HELLO[0]["content"], max_output_tokens=8, temperature=0,
        reasoning={"effort": "none"},
    )
    assert first.object == "response" and first.id.startswith("resp_"), first
    assert first.status in ("completed", "incomplete") and first.output_text == text, (first, text)
    assert first.usage.input_tokens == HELLO_PROMPT_TOKENS, first.usage
    assert [item.type for item in first.output] == ["message"], first.output
    # Instructions are the system message; items as chat messages give the same text.
    items = server.client.responses.create(
        model=MODEL, instructions="Be brief.", max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello, how are you?"}]}],
        reasoning={"effort": "none"},
    )
    _, with_system = chat_text(
        server.client, [{"role": "system", "content": "Be brief."}, *HELLO], max_tokens=6,
        temperature=0, extra_body=NO_THINKING,
    )
    assert items.output_text == with_system, (items.output_text, with_system)
    # The second turn renders the first again: the snapshot after it is reused.
    second = server.client.responses.create(
        model=MODEL, input="Tell me more.", previous_response_id=first.id, max_output_tokens=6,
        temperature=0, reasoning={"effort": "none"},
    )
    assert second.usage.input_tokens_details.cached_tokens > HELLO_PROMPT_TOKENS, second.usage
    conversation = HELLO + [{"role": "assistant", "content": text},
                            {"role": "user", "content": "Tell me more."}]
    _, continued = chat_text(server.client, conversation, max_tokens=6, temperature=0,
                             extra_body=NO_THINKING)
    assert second.output_text == continued, (second.output_text, continued)
    # Streamed: the events in order, the text as the whole response's.
    stream = server.client.responses.create(
        model=MODEL, input=HELLO[0]["content"], max_output_tokens=8, temperature=0,
        reasoning={"effort": "none"}, stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events))), events
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == text and events[-1].response.output_text == text, (streamed, text)
    # Thinking on: a reasoning item first. Tools and a call with its output reach the template.
    thought = server.client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                             temperature=0)
    assert thought.output[0].type == "reasoning" and thought.output[0].content[0].text, thought
    tool = {"type": "function", "name": "get_weather", "description": "Weather.",
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    history = [
        {"role": "user", "content": "Che tempo fa a Roma?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Roma"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sole, 24 gradi"},
    ]
    called = server.client.responses.create(model=MODEL, input=history, tools=[tool],
                                            max_output_tokens=4, temperature=0)
    assert called.usage.input_tokens > 250, called.usage
    for fields, param in [
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [tool]}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ]:
        try:
            server.client.responses.create(model=MODEL, input="Hi", **fields)
            raise AssertionError(f"{fields} was accepted")
        except openai.BadRequestError as e:
            assert e.param == param, (fields, e.body)
    try:
        server.client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
        raise AssertionError("an unknown previous_response_id was accepted")
    except openai.NotFoundError as e:
        assert e.param == "previous_response_id", e.body


def check_disconnect_and_queue(server):
    """A client that goes away cancels its generation; with the batch (of one) and the queue full,
    a further request answers 429."""
    stream = server.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=400, stream=True, extra_body=NO_THINKING
    )
    next(iter(stream))
    waiting = threading.Thread(
        target=lambda: server.client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=4, extra_body=NO_THINKING
        ),
        daemon=True,
    )
    waiting.start()
    time.sleep(1.0)
    try:
        server.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        raise AssertionError("a third request was accepted with --queue-size 1")
    except openai.RateLimitError as e:
        assert e.status_code == 429 and e.code == "queue_full", e.body
    stream.close()
    server.wait_for_log(r"generated in .* Cancelled", 60)
    waiting.join(timeout=REQUEST_TIMEOUT_S)
    assert not waiting.is_alive(), "the queued request never finished"


def check_cli_matches_server(binary, server):
    """`lily generate --prompt` and `lily chat` run the server's template, sampling and engine."""
    _, served = chat_text(server.client, HELLO, max_tokens=10, temperature=0, extra_body=NO_THINKING)
    generated = subprocess.run(
        [binary, "generate", "--model", MODEL, "--prompt", HELLO[0]["content"], "--no-thinking",
         "--max-tokens", "10", "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S, check=True,
    )
    result = json.loads(generated.stdout)
    assert result["text"] == served, (result, served)
    assert 0 < len(result["tokens"]) <= 10 and all(isinstance(t, int) for t in result["tokens"])

    chat = subprocess.run(
        [binary, "chat", "--model", MODEL, "--no-thinking", "--max-tokens", "6", "--temperature", "0"],
        input="Hello, how are you?\nTell me more.\n", capture_output=True, text=True,
        timeout=REQUEST_TIMEOUT_S, check=True,
    )
    _, first_reply = chat_text(server.client, HELLO, max_tokens=6, temperature=0, extra_body=NO_THINKING)
    assert chat.stdout.startswith(first_reply + "\n"), (chat.stdout, first_reply)
    reused = [int(n) for n in re.findall(r"(\d+) of \d+ prompt tokens reused", chat.stderr)]
    assert len(reused) == 2 and reused[0] == 0 and reused[1] > 0, chat.stderr
    assert re.search(r"\d+\.\d tok/s", chat.stderr), chat.stderr



def run_checks(checks, servers):
    """Runs the named checks in order, printing each; on a failure prints the servers' logs and
    the count, and re-raises. The servers are stopped either way (every e2e script's runner)."""
    passed = 0
    try:
        for name, check in checks:
            print(f"check: {name}", flush=True)
            check()
            passed += 1
    except BaseException:
        for label, server in servers.items():
            print(f"--- {label} log ---\n" + "\n".join(server.log), file=sys.stderr)
        print(f"{passed} passed, 1 failed", flush=True)
        raise
    finally:
        for server in servers.values():
            server.stop()
    print(f"{passed} passed, 0 failed")

def main():
    binary = sys.argv[1]
    server = Server(binary)
    cold_server = Server(
        binary, "--snapshot-cache-mb", "0", "--queue-size", "1", "--max-batch", "1"
    )
    replies = {}
    checks = [
        ("models", lambda: check_models(server)),
        ("chat", lambda: replies.update(chat=check_chat(server))),
        ("streaming chat", lambda: check_streaming(server, replies["chat"])),
        ("multi-turn reuse", lambda: check_multi_turn(server, cold_server)),
        ("completions", lambda: check_completions(server)),
        ("tools", lambda: check_tools(server)),
        ("errors", lambda: check_errors(server)),
        ("tokenize and detokenize", lambda: check_tokenize(server)),
        ("logprobs and echo", lambda: check_logprobs(binary, server)),
        ("n choices and penalties", lambda: check_choices_and_penalties(server)),
        ("responses", lambda: check_responses(server)),
        ("disconnect and queue", lambda: check_disconnect_and_queue(cold_server)),
        ("generate and chat commands", lambda: check_cli_matches_server(binary, server)),
    ]
    run_checks(checks, {"server": server, "cold server": cold_server})


if __name__ == "__main__":
    main()

"""Hardening, end to end against `lily serve --model synthetic:tiny` on loopback: API keys and CORS,
request limits, thousands of bad requests (robustness.py), /metrics, client disconnects, 16
concurrent streams against sequential ones, and SIGTERM. Every wait is bounded;
any failure exits non-zero.

Usage: python3 tests/e2e/hardening.py path/to/lily
"""

import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.parse

import openai

from openai_client import HELLO, MODEL, NO_THINKING, REQUEST_TIMEOUT_S, Server
from robustness import check_robustness

KEY = "sk-lily-test-0123456789"


def call(server, method, path, body=None, headers=None, timeout=REQUEST_TIMEOUT_S):
    """One request on a fresh connection: (status, lower-cased headers, body bytes)."""
    url = urllib.parse.urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def error_of(status, body, expected_status):
    """The OpenAI error object of a response that must have `expected_status`."""
    assert status == expected_status, (status, body[:300])
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    return error


def chat_body(**fields):
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **NO_THINKING, **fields}


def check_api_key(binary):
    server = Server(binary, "--api-key", KEY)
    try:
        bearer = {"Authorization": f"Bearer {KEY}"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}):
            for method, path, body in (("GET", "/v1/models", None),
                                       ("POST", "/v1/chat/completions", chat_body()),
                                       ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
                                       ("GET", "/no/such/path", None)):
                status, response_headers, answer = call(server, method, path, body, headers)
                error = error_of(status, answer, 401)
                assert error["code"] == "invalid_api_key", error
                assert response_headers.get("www-authenticate") == "Bearer", response_headers
        # A load balancer's probe has no key.
        status, _, answer = call(server, "GET", "/health")
        assert status == 200 and json.loads(answer) == {"status": "ok"}, answer
        status, _, answer = call(server, "GET", "/v1/models", headers=bearer)
        assert status == 200 and json.loads(answer)["data"][0]["id"] == MODEL, answer
        status, _, _ = call(server, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})
        assert status == 200, "the Bearer scheme is case-insensitive"
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                               extra_body=NO_THINKING)
        assert reply.usage.completion_tokens > 0, reply
        wrong = openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0,
                              timeout=REQUEST_TIMEOUT_S)
        try:
            wrong.models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and e.code == "invalid_api_key", e.body
    finally:
        server.stop()
    # The environment variable works as the flag does.
    server = Server(binary, env={**os.environ, "LILY_API_KEY": "sk-from-env"})
    try:
        assert call(server, "GET", "/v1/models")[0] == 401
        assert call(server, "GET", "/v1/models", headers={"Authorization": "Bearer sk-from-env"})[0] == 200
    finally:
        server.stop()


def check_cors(open_server, binary):
    """No CORS headers unless --cors-origin names the page's origin."""
    page = {"Origin": "https://app.example"}
    preflight = {**page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = call(open_server, "GET", "/v1/models", headers=page)
    assert status == 200 and "access-control-allow-origin" not in headers, headers
    status, headers, answer = call(open_server, "OPTIONS", "/v1/chat/completions", headers=preflight)
    error_of(status, answer, 405)
    assert "access-control-allow-origin" not in headers, headers

    server = Server(binary, "--cors-origin", "https://app.example", "--api-key", KEY)
    try:
        status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert status == 204, status
        assert headers["access-control-allow-origin"] == "https://app.example", headers
        assert "POST" in headers["access-control-allow-methods"], headers
        assert "authorization" in headers["access-control-allow-headers"], headers
        status, headers, _ = call(server, "GET", "/v1/models",
                                  headers={**page, "Authorization": f"Bearer {KEY}"})
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        # A refusal is readable by the page too.
        status, headers, _ = call(server, "GET", "/v1/models", headers=page)
        assert status == 401 and headers["access-control-allow-origin"] == "https://app.example"
        other = {"Origin": "https://evil.example"}
        status, headers, _ = call(server, "GET", "/v1/models",
                                  headers={**other, "Authorization": f"Bearer {KEY}"})
        assert status == 200 and "access-control-allow-origin" not in headers, headers
        status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions",
                                  headers={**preflight, **other})
        assert status == 401 and "access-control-allow-origin" not in headers, (status, headers)
    finally:
        server.stop()


def check_limits(server):
    """`server` runs with --max-body-mb 1."""
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (2 << 20)}])).encode()
    status, _, answer = call(server, "POST", "/v1/chat/completions", big,
                             {"Content-Type": "application/json"})
    error = error_of(status, answer, 413)
    assert error["type"] == "invalid_request_error", error
    cases = [
        (chat_body(messages=[{"role": "user", "content": "a"}] * 10_001), "messages", "10000"),
        (chat_body(tools=[{"type": "function", "function": {"name": "f"}}] * 129), "tools", "128"),
        (chat_body(stop=[str(i) for i in range(17)]), "stop", "16"),
        (chat_body(max_tokens=10**30), "max_tokens", "integer"),
        (chat_body(max_tokens=-1), "max_tokens", "integer"),
        (chat_body(max_tokens=0), "max_tokens", "at least 1"),
        (chat_body(messages=[{"role": "user", "content": "word " * 600}]), "messages", "512"),
    ]
    for body, param, says in cases:
        status, _, answer = call(server, "POST", "/v1/chat/completions", body)
        error = error_of(status, answer, 400)
        assert error["param"] == param and says in error["message"], error
    # max_tokens beyond what the context leaves is a 400 that says the numbers (as OpenAI and
    # vLLM answer); without max_tokens the reply may take the rest of the context.
    long_prompt = {"model": MODEL, "prompt": "word " * 500}
    status, _, answer = call(server, "POST", "/v1/completions", {**long_prompt, "max_tokens": 10**9})
    error = error_of(status, answer, 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded", error
    assert "context is 512 tokens" in error["message"], error
    status, _, answer = call(server, "POST", "/v1/completions", long_prompt)
    assert status == 200, answer
    usage = json.loads(answer)["usage"]
    assert 480 < usage["prompt_tokens"] < 512 and usage["total_tokens"] <= 512, usage


def check_slow_body(server):
    """`server` runs with --body-timeout-s 2: a body that stalls, or trickles in a byte at a time,
    is a 408 JSON error soon after, and the server goes on answering. Headers that never end
    get the connection closed."""
    url = urllib.parse.urlsplit(server.base_url)
    # Headers that never end: the connection is closed after the server's 10 s header timeout.
    slow_headers = socket.create_connection((url.hostname, url.port), timeout=20)
    slow_headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    headers_sent = time.monotonic()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    for trickle in (False, True):
        started = time.monotonic()
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(head + b'{"model"')
            answer = b""
            sock.settimeout(0.3)
            while time.monotonic() - started < 10 and b"\r\n\r\n" not in answer:
                if trickle:
                    try:
                        sock.sendall(b" ")
                    except OSError:
                        pass
                try:
                    answer += sock.recv(65536)
                except socket.timeout:
                    continue
            sock.settimeout(5)
            try:
                while True:
                    more = sock.recv(65536)
                    if not more:
                        break
                    answer += more
            except (socket.timeout, ConnectionResetError):
                pass
        elapsed = time.monotonic() - started
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), (trickle, answer[:300])
        body = rest.partition(b"\r\n\r\n")[2]
        assert "did not arrive" in json.loads(body)["error"]["message"], body
        assert 1.5 < elapsed < 8, (trickle, elapsed)
    assert call(server, "GET", "/health")[0] == 200
    try:
        while slow_headers.recv(65536):
            pass
    except ConnectionResetError:
        pass
    finally:
        slow_headers.close()
    elapsed = time.monotonic() - headers_sent
    assert 8 < elapsed < 15, f"a connection with unfinished headers was closed after {elapsed:.1f} s"


def check_connection_cap(binary):
    """Beyond --max-connections, a 503 JSON error at once; below it again, served as usual."""
    server = Server(binary, "--max-connections", "4")
    url = urllib.parse.urlsplit(server.base_url)
    idle = []
    try:
        for _ in range(4):
            sock = socket.create_connection((url.hostname, url.port), timeout=10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            idle.append(sock)
        time.sleep(0.3)
        status, headers, answer = call(server, "GET", "/v1/models", timeout=10)
        error = error_of(status, answer, 503)
        assert "--max-connections" in error["message"] and headers["retry-after"] == "1", error
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 5
        while call(server, "GET", "/health", timeout=10)[0] != 200:
            assert time.monotonic() < deadline, "connections were not released"
            time.sleep(0.1)
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def check_metrics(server):
    """After the limits and robustness checks: Prometheus text that counts what happened."""
    status, headers, answer = call(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in answer.decode().splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r'([a-z_]+(?:\{.*\})?) (\S+)', line)
        assert match, f"not a Prometheus sample: {line!r}"
        samples[match.group(1)] = float(match.group(2))
    requests = {k: v for k, v in samples.items() if k.startswith("lily_requests_total")}
    assert sum(requests.values()) >= 5000, requests
    for path, status in (("/v1/chat/completions", 400), ("/v1/chat/completions", 413),
                         ("/v1/chat/completions", 200), ("/v1/completions", 200), ("other", 404)):
        key = f'lily_requests_total{{path="{path}",status="{status}"}}'
        assert samples.get(key, 0) >= 1, (key, requests)
    assert samples["lily_generated_tokens_total"] > 0 and samples["lily_prompt_tokens_total"] > 500
    assert "lily_cached_prompt_tokens_total" in samples and samples["lily_queue_depth"] == 0
    assert samples["lily_running_generations"] == 0, samples
    ttft = samples["lily_time_to_first_token_seconds_count"]
    assert ttft >= 2 and samples['lily_time_to_first_token_seconds_bucket{le="+Inf"}'] == ttft
    assert samples["lily_inter_token_latency_seconds_count"] >= 1, samples
    # One JSON log line per request, and no prompt text anywhere in the log.
    time.sleep(0.5)
    lines = [json.loads(line[len("lily: "):]) for line in server.log if line.startswith("lily: {")]
    answered = [line for line in lines if line.get("event") == "request"]
    assert len(answered) >= 5000, len(answered)
    fields = {"event", "id", "client", "method", "path", "status", "headers_ms"}
    assert all(set(line) == fields for line in answered), answered[:3]
    # Each request has its own id, and the client's loopback address.
    assert len({line["id"] for line in answered}) == len(answered)
    assert all(line["client"].startswith("127.0.0.1:") for line in answered), answered[:3]
    # The engine's line about a generation carries its request's id.
    generations = [line for line in server.log if " generated in " in line]
    ids = {line["id"] for line in answered}
    assert generations and all(line.split(": ")[1] in ids for line in generations), generations[:3]
    assert not [line for line in server.log if HELLO[0]["content"] in line or "word word" in line]


def read_events(response, deadline):
    """The `data:` payloads of a server-sent event stream, until it ends."""
    events = []
    while time.monotonic() < deadline:
        line = response.readline()
        if not line:
            return events
        line = line.decode().strip()
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    raise AssertionError(f"the stream did not end: {events[-3:]}")


def open_stream(server, max_tokens, messages=HELLO):
    url = urllib.parse.urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=REQUEST_TIMEOUT_S)
    body = chat_body(max_tokens=max_tokens, stream=True, messages=messages, temperature=0)
    connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    return connection, response


def stream_text(server, content, max_tokens):
    """A greedy streamed chat: its text, after checking it ended with a final chunk and [DONE]."""
    connection, response = open_stream(server, max_tokens, [{"role": "user", "content": content}])
    try:
        events = read_events(response, time.monotonic() + REQUEST_TIMEOUT_S)
    finally:
        connection.close()
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def check_concurrent_streams(binary):
    """16 streaming clients at once are all answered, each as it would be alone (greedy)."""
    server = Server(binary, "--queue-size", "16")
    try:
        prompts = [f"Count to {i} in {lang}." for i, lang in
                   zip(range(16), ["English", "Italian", "French", "German"] * 4)]
        alone = [stream_text(server, p, 6) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda p: stream_text(server, p, 6), prompts))
        assert together == alone, list(zip(together, alone))
        assert len(set(alone)) > 1, "the prompts should not all give the same text"
    finally:
        server.stop()


def check_disconnect(server):
    """A client that goes away stops its generation within a few decode steps."""
    connection, response = open_stream(server, 400)
    for _ in range(4):
        assert response.readline()
    connection.close()
    line = server.wait_for_log(r"(\d+) generated in .* Cancelled", 60)
    generated = int(line.group(1))
    # At most about two tokens were read (an opening chunk, then text); the server needs one
    # failed write, plus the step already under way, to notice.
    assert generated <= 8, f"{generated} tokens were generated after the client left"
    print(f"  stopped after {generated} generated tokens", flush=True)


def check_sigterm(binary):
    """SIGTERM ends the running stream and the queued one with a final chunk and [DONE]; exit 0."""
    server = Server(binary, "--queue-size", "2")
    first, running = open_stream(server, 450)
    first_line = running.readline()
    assert first_line.startswith(b"data: "), first_line
    second, queued = open_stream(server, 450)
    time.sleep(0.5)
    server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for connection, response in ((first, running), (second, queued)):
        events = read_events(response, deadline)
        connection.close()
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finishes[-1] in ("stop", "length") and not any(finishes[:-1]), finishes
        assert all("error" not in c for c in chunks), chunks[-2:]
    code = server.process.wait(timeout=30)
    assert code == 0, (code, server.log)
    assert any("shutting down" in line for line in server.log), server.log
    # It no longer accepts connections.
    url = urllib.parse.urlsplit(server.base_url)
    try:
        http.client.HTTPConnection(url.hostname, url.port, timeout=5).request("GET", "/health")
        raise AssertionError("the server still accepts connections after exiting")
    except ConnectionRefusedError:
        pass


def check_checkpoint_changed_after_load(binary):
    """Weights are copied out of the memory-mapped files while loading and the maps are closed,
    so a checkpoint truncated or overwritten while the server runs cannot crash it (no SIGBUS)."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "tiny-mlx-q4")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        shutil.copytree(source, model_dir)
        # The fixture's tokenizer adds <|endoftext|> past its 256-row vocabulary; drop it here.
        tokenizer_path = os.path.join(model_dir, "tokenizer.json")
        with open(tokenizer_path) as f:
            tokenizer = json.load(f)
        tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < 256]
        with open(tokenizer_path, "w") as f:
            json.dump(tokenizer, f)
        server = Server(binary, model=model_dir)
        try:
            shards = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            assert shards, "the fixture has no shards"
            for i, name in enumerate(shards):
                path = os.path.join(model_dir, name)
                if i % 2 == 0:
                    with open(path, "r+b") as f:
                        f.truncate(16)
                else:
                    with open(path, "wb") as f:
                        f.write(os.urandom(4096))
            status, _, body = call(server, "GET", "/v1/models")
            assert status == 200, (status, body[:200])
            model_id = json.loads(body)["data"][0]["id"]
            request = {"model": model_id, "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
            status, _, body = call(server, "POST", "/v1/completions", request)
            assert status == 200, (status, body[:300])
            assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
            status, _, _ = call(server, "GET", "/health")
            assert status == 200
            assert server.process.poll() is None, "the server died"
        finally:
            server.stop()


def main():
    binary = sys.argv[1]
    small = Server(binary, "--max-body-mb", "1", "--queue-size", "4", "--body-timeout-s", "2")
    checks = [
        ("api key", lambda: check_api_key(binary)),
        ("cors", lambda: check_cors(small, binary)),
        ("limits", lambda: check_limits(small)),
        ("slow request body", lambda: check_slow_body(small)),
        ("robustness", lambda: check_robustness(small, call)),
        ("metrics", lambda: check_metrics(small)),
        ("disconnect", lambda: check_disconnect(small)),
        ("16 concurrent streams", lambda: check_concurrent_streams(binary)),
        ("connection cap", lambda: check_connection_cap(binary)),
        ("sigterm", lambda: check_sigterm(binary)),
        ("checkpoint changed after load", lambda: check_checkpoint_changed_after_load(binary)),
    ]
    passed = 0
    try:
        for name, check in checks:
            print(f"check: {name}", flush=True)
            started = time.monotonic()
            check()
            print(f"  {time.monotonic() - started:.1f} s", flush=True)
            passed += 1
    except BaseException:
        print("--- server log ---\n" + "\n".join(small.log[-50:]), file=sys.stderr)
        print(f"{passed} passed, 1 failed", flush=True)
        raise
    finally:
        small.stop()
    print(f"{passed} passed, 0 failed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`lily serve --device cuda` against real HTTP clients, on the GPU machine (standard library only).

    python3 tools/gpu_serve_check.py [--lily .gpu/lily] [--model synthetic:qwen3.6-35b-a3b]

Starts the server on a free port, then checks what the CPU-only tests cannot: that greedy replies
on the GPU are the same twice (the second from the snapshot of the first turn's prompt), that a
streamed sampled reply arrives as well-formed chunks ending in [DONE], that two clients at once
both get their replies, and that bad input gets a clear 4xx without taking the server down.
Prints each reply and exits non-zero on the first failure. Last, the time to the first streamed
token of a ~1K-token prompt (issue 18), as this client sees it: a figure, not a check.
"""

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request


def post(base, path, body, timeout=300):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def server_sums(base):
    """The server's own (sum, count) of its time-to-first-token and inter-token histograms."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    value = lambda name: float(next(l.split()[-1] for l in text.splitlines() if l.startswith(name + " ")))
    return {h: (value(f"lily_{h}_seconds_sum"), value(f"lily_{h}_seconds_count"))
            for h in ("time_to_first_token", "inter_token_latency")}


def stream_times(base, body):
    """Seconds from sending a streamed request to its first event, and to each chunk that
    carries generated text."""
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    first_event, texts = None, []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        now = time.perf_counter() - started
        first_event = now if first_event is None else first_event
        choices = json.loads(line[6:]).get("choices") or [{}]
        delta = choices[0].get("delta", {})
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            texts.append(now)
    conn.close()
    return first_event, texts


def chat(model, text, **extra):
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        sys.exit(1)


def start_server(lily, model, device, *extra):
    """`lily serve` on a free port, once it answers /health: the process, its base URL and its log
    so far (a thread keeps appending). Exits with the log's tail if it does not come up in 300 s."""
    server = subprocess.Popen(
        [lily, "serve", "--model", model, "--device", device, "--port", "0", "--max-seq", "4096", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = None
    started = time.time()
    log = []
    # The server prints the address it bound; it answers /health once the model is loaded.
    while base is None and time.time() - started < 300:
        line = server.stdout.readline()
        if not line:
            break
        log.append(line)
        for word in line.split():
            if word.startswith("http://"):
                base = word.rstrip("/.,").removesuffix("/v1")
    check(base is not None, "server printed its address:\n" + "".join(log[-20:]))
    threading.Thread(target=lambda: [log.append(l) for l in server.stdout], daemon=True).start()
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.time() - started > 300 or server.poll() is not None:
            server.kill()
            check(False, "server became healthy:\n" + "".join(log[-20:]))
        time.sleep(1)
    return server, base, log


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lily", default=".gpu/lily")
    ap.add_argument("--model", default="synthetic:qwen3.6-35b-a3b")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    started = time.time()
    server, base, log = start_server(a.lily, a.model, a.device)
    try:
        print(f"healthy after {time.time() - started:.0f} s at {base}", flush=True)
        m = a.model

        greedy = chat(m, "Name three colours.", max_tokens=24, temperature=0)
        code, first = post(base, "/v1/chat/completions", greedy)
        check(code == 200, f"greedy reply: {code} {first[:400]}")
        code, again = post(base, "/v1/chat/completions", greedy)
        check(code == 200, "greedy reply again")
        reply = lambda body: json.loads(body)["choices"][0]["message"]
        usage = lambda body: json.loads(body)["usage"]
        print("  reply:", json.dumps(reply(first))[:300], "usage:", usage(first), flush=True)
        check(reply(first) == reply(again), "the same greedy reply twice (the second from a snapshot)")

        code, streamed = post(base, "/v1/chat/completions",
                              chat(m, "Count to five.", max_tokens=24, temperature=0.7, seed=3, stream=True))
        events = [l[6:] for l in streamed.splitlines() if l.startswith("data: ")]
        check(code == 200 and events and events[-1] == "[DONE]", f"streamed reply ends in [DONE] ({len(events)} events)")
        chunks = [json.loads(e) for e in events[:-1]]
        check(all(c["object"] == "chat.completion.chunk" for c in chunks), "every event is a chunk")

        results = [None, None]

        def client(i):
            results[i] = post(base, "/v1/chat/completions", chat(m, f"Client {i} says hello.", max_tokens=16, temperature=0))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        check(all(r and r[0] == 200 for r in results), f"two clients at once: {[r and r[0] for r in results]}")

        code, body = post(base, "/v1/chat/completions", b"{not json")
        check(400 <= code < 500, f"malformed JSON gets {code}: {body[:200]}")
        code, body = post(base, "/v1/chat/completions", chat(m, "word " * 9000, max_tokens=4))
        check(400 <= code < 500, f"a prompt past the context gets {code}: {body[:200]}")
        code, _ = post(base, "/v1/chat/completions", greedy)
        check(code == 200, "still serving after the bad requests")

        # Each prompt starts with its own number, so no snapshot of an earlier one is reused.
        long_prompt = lambda i: f"Request {i}. " + "The quick brown fox jumps over the lazy dog. " * 100
        code, body = post(base, "/v1/chat/completions", chat(m, long_prompt(0), max_tokens=1, temperature=0))
        check(code == 200, "a ~1K-token prompt")
        tokens = usage(body)["prompt_tokens"]
        before = server_sums(base)
        runs = [stream_times(base, chat(m, long_prompt(i), max_tokens=4, temperature=0, stream=True))
                for i in range(1, 8)]
        after = server_sums(base)
        check(all(texts for _, texts in runs), "every streamed long reply carried a token")
        times = [texts[0] for _, texts in runs if texts]
        print(f"time to first token, {tokens}-token prompt, 7 requests: median {statistics.median(times) * 1e3:.1f} ms"
              f" (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})", flush=True)
        # Where the time goes: the first event (the role chunk) against the text chunks after it,
        # each token's chunk when none is held back.
        ms = lambda xs: " ".join(f"{x * 1e3:.1f}" for x in xs)
        for first_event, texts in runs:
            print(f"  first event {first_event * 1e3:.1f} ms, text chunks at {ms(texts)} ms", flush=True)
        for h, (total, n) in after.items():
            total, n = total - before[h][0], n - before[h][1]
            print(f"  the server's own {h.replace('_', ' ')}: mean {total / max(n, 1) * 1e3:.1f} ms over {n:.0f}",
                  flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        tail = "".join(log[-15:])
        print("server log (tail):\n" + tail, flush=True)


if __name__ == "__main__":
    main()

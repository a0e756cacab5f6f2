#!/usr/bin/env python3
"""Decode throughput of `lily serve` with 1, 2, 4 and 8 streaming clients at once (standard library only).

    python3 tools/gpu_serve_load.py [--lily .gpu/lily] [--model synthetic:qwen3.6-35b-a3b] [--json out.json]

Starts the server (`--max-batch 8`) on a free port. For each client count, every client streams one
greedy completion of `--tokens` tokens from its own prompt, all sent at once. Per client: the time to
its first token and its decode rate (tokens after the first over the time from the first to the
last); in all: the tokens generated over the span from the first request to the last token. The
prompts differ, so no client reuses another's state. Prints a table (and writes JSON with --json).
"""

import argparse
import http.client
import json
import sys
import threading
import time

from gpu_serve_check import start_server


def stream_completion(port, model, prompt, tokens, out):
    """One streamed greedy completion; fills out with timings and the token count."""
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    })
    sent = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
        return
    first = last = None
    usage = None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if event.get("usage"):
            usage = event["usage"]
        if any(c.get("text") for c in event.get("choices", [])):
            now = time.monotonic()
            first = first or now
            last = now
    conn.close()
    out.update(sent=sent, first=first, last=last,
               tokens=usage["completion_tokens"] if usage else None)


def run_clients(port, model, n, tokens, round_no):
    outs = [dict() for _ in range(n)]
    threads = [
        threading.Thread(target=stream_completion,
                         args=(port, model, f"Client {i} of round {round_no} asks: tell a long story about {i * 7 + n}.",
                               tokens, outs[i]))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, o in enumerate(outs):
        if "error" in o or o.get("first") is None or not o.get("tokens"):
            sys.exit(f"client {i} of {n}: {o}")
    start = min(o["sent"] for o in outs)
    end = max(o["last"] for o in outs)
    total = sum(o["tokens"] for o in outs)
    per_client = [(o["tokens"] - 1) / (o["last"] - o["first"]) for o in outs if o["last"] > o["first"]]
    return {
        "clients": n,
        "tokens": total,
        "total_tok_s": total / (end - start),
        "per_client_decode_tok_s": per_client,
        "first_token_s": [o["first"] - o["sent"] for o in outs],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lily", default=".gpu/lily")
    ap.add_argument("--model", default="synthetic:qwen3.6-35b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--json")
    a = ap.parse_args()
    server, base, _ = start_server(a.lily, a.model, a.device, "--max-batch", "8")
    port = int(base.rsplit(":", 1)[1])
    try:
        # One warm-up round: graphs captured, kernels loaded.
        run_clients(port, a.model, 1, 16, 0)
        rows = []
        for round_no, n in enumerate(int(c) for c in a.clients.split(",")):
            r = run_clients(port, a.model, n, a.tokens, round_no + 1)
            rows.append(r)
            per = r["per_client_decode_tok_s"]
            print(f"{n} clients: {r['total_tok_s']:.1f} tok/s in all; per client {min(per):.1f}-{max(per):.1f} "
                  f"tok/s; first token {min(r['first_token_s']) * 1e3:.0f}-{max(r['first_token_s']) * 1e3:.0f} ms",
                  flush=True)
        print("\n| clients | total tok/s | per client tok/s (min-max) | first token ms (min-max) |")
        print("|---:|---:|---:|---:|")
        for r in rows:
            per, ft = r["per_client_decode_tok_s"], r["first_token_s"]
            print(f"| {r['clients']} | {r['total_tok_s']:.1f} | {min(per):.1f}-{max(per):.1f} | "
                  f"{min(ft) * 1e3:.0f}-{max(ft) * 1e3:.0f} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"model": a.model, "tokens_per_client": a.tokens, "rounds": rows}, f, indent=2)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()

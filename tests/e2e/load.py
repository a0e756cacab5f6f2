"""Load figures for docs/RELIABILITY.md (not run in CI: a few minutes on two cores).

1. 64 streaming clients at once against `--queue-size 64`: all must complete, each text equal to
   the same request sent alone (greedy); wall time and latency percentiles are printed.
2. A soak of 10,000 requests, eight at a time: one in ten a short generation, the rest cheap
   (models, health, errors). Every answer must have its expected status; the server's resident
   memory is printed after a warm-up and every 2,000 requests.

Usage: python3 tests/e2e/load.py path/to/lily
"""

import concurrent.futures
import json
import sys
import time

from hardening import call, chat_body, open_stream
from openai_client import REQUEST_TIMEOUT_S, Server

CLIENTS = 64
SOAK = 10_000


def timed_stream(server, content):
    """(text, seconds to the first content, seconds in all) of one greedy 16-token stream."""
    started = time.monotonic()
    connection, response = open_stream(server, 16, [{"role": "user", "content": content}])
    first = None
    try:
        events = []
        deadline = time.monotonic() + REQUEST_TIMEOUT_S * 4
        while time.monotonic() < deadline:
            line = response.readline()
            if not line:
                break
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.monotonic() - started
    finally:
        connection.close()
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return text, first or 0.0, time.monotonic() - started


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def load_run(binary):
    server = Server(binary, "--queue-size", str(CLIENTS))
    try:
        prompts = [f"Write item {i} of a shopping list." for i in range(CLIENTS)]
        started = time.monotonic()
        alone = [timed_stream(server, p)[0] for p in prompts]
        sequential_s = time.monotonic() - started
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            together = list(pool.map(lambda p: timed_stream(server, p), prompts))
        wall = time.monotonic() - started
        same = sum(t[0] == a for t, a in zip(together, alone))
        firsts = [t[1] for t in together]
        totals = [t[2] for t in together]
        print(f"{CLIENTS} clients: {len(together)} completed, {same} equal to sequential, "
              f"{wall:.1f} s at once vs {sequential_s:.1f} s one by one; first content p50 "
              f"{percentile(firsts, 50):.2f} s, max {max(firsts):.2f} s; total p50 "
              f"{percentile(totals, 50):.2f} s, p95 {percentile(totals, 95):.2f} s", flush=True)
        assert same == CLIENTS
    finally:
        server.stop()


def rss_mib(server):
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def soak_request(server, i):
    kind = i % 10
    if kind == 0:
        status = call(server, "POST", "/v1/chat/completions", chat_body(max_tokens=2, seed=i))[0]
        return status == 200
    if kind in (1, 2):
        return call(server, "GET", "/v1/models")[0] == 200
    if kind == 3:
        return call(server, "GET", "/health")[0] == 200
    if kind in (4, 5):
        return call(server, "POST", "/v1/chat/completions", chat_body(temperature=9))[0] == 400
    if kind == 6:
        return call(server, "POST", "/v1/completions", b"{not json", {})[0] == 400
    if kind == 7:
        return call(server, "GET", f"/nowhere/{i}")[0] == 404
    return call(server, "POST", "/v1/chat/completions", chat_body(model="other"))[0] == 404


def soak(binary):
    server = Server(binary, "--queue-size", "16")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert all(pool.map(lambda i: soak_request(server, i), range(200)))
            before = rss_mib(server)
            print(f"soak: after a 200-request warm-up, {before:.1f} MiB resident", flush=True)
            errors = 0
            started = time.monotonic()
            for block in range(SOAK // 2000):
                ok = list(pool.map(lambda i: soak_request(server, i),
                                   range(block * 2000, (block + 1) * 2000)))
                errors += ok.count(False)
                print(f"soak: {(block + 1) * 2000} requests, {errors} unexpected answers, "
                      f"{rss_mib(server):.1f} MiB resident, {time.monotonic() - started:.0f} s",
                      flush=True)
        metrics = call(server, "GET", "/metrics")[2].decode()
        print("\n".join(line for line in metrics.splitlines()
                        if line.startswith("lily_requests_total")), flush=True)
        assert errors == 0
    finally:
        server.stop()


if __name__ == "__main__":
    load_run(sys.argv[1])
    soak(sys.argv[1])

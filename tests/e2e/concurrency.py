"""Several clients at once against `lily serve --model synthetic:tiny --max-batch 4`, with the
official `openai` client (issue 17).

1. Four concurrent greedy streams give exactly the tokens (the text, the count and the finish)
   that each gives alone.
2. Four concurrent 200-token streams against the same four one after the other: both wall times
   are printed for docs/BENCHMARKS.md (no timing assertion).
3. A short request sent while a long one generates streams its first token before the long one
   finishes, and the long one keeps streaming after it: the newcomer waited for one prefill
   chunk, not for the other generation. Asserted on the order of events, not on wall time.
4. `--max-tokens` is the reply length of a request that sets none.
5. The inter-token gaps of a stream before and while a newcomer's prompt of one prefill chunk
   (~490 tokens; the CPU's chunk is 512) comes in: printed for docs/BENCHMARKS.md, the bound
   being one chunk's prefill plus one batched step.

Usage: python3 tests/e2e/concurrency.py path/to/lily
"""

import queue
import sys
import threading
import time

from openai_client import MODEL, NO_THINKING, REQUEST_TIMEOUT_S, Server, run_checks

BATCH = 4
DEFAULT_MAX_TOKENS = 7
PROMPTS = [
    "Hello, how are you?",
    "Name three rivers of Europe and say which is longest.",
    "Write a haiku.",
    "Count from one to twenty in French, then explain what a prime number is.",
]


def stream(client, content, max_tokens, on_event=None):
    """(text, completion tokens, finish reason) of one greedy streamed chat reply; `on_event`
    sees "text" for each piece of content and "done" at the end."""
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINKING,
    )
    text, usage, finish = [], None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
                if on_event:
                    on_event("text")
            finish = choice.finish_reason or finish
    if on_event:
        on_event("done")
    assert usage is not None, "no usage chunk"
    return "".join(text), usage.completion_tokens, finish


def concurrently(fns):
    """Runs every function on its own thread; their results in order."""
    results = [None] * len(fns)
    errors = []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # reported below, never lost with the thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S * 4)
    assert not any(t.is_alive() for t in threads), "a client never finished"
    if errors:
        raise errors[0]
    return results


def check_concurrent_equals_alone(server):
    alone = [stream(server.client, p, 40) for p in PROMPTS]
    together = concurrently([lambda p=p: stream(server.client, p, 40) for p in PROMPTS])
    for prompt, a, t in zip(PROMPTS, alone, together):
        assert a == t, (prompt, a, t)
        assert a[1] > 0, (prompt, a)
    print(f"{BATCH} concurrent greedy streams equal their runs alone: "
          f"{[a[1] for a in alone]} tokens", flush=True)


def check_concurrent_throughput(server):
    started = time.monotonic()
    alone = [stream(server.client, p, 200) for p in PROMPTS]
    sequential_s = time.monotonic() - started
    started = time.monotonic()
    together = concurrently([lambda p=p: stream(server.client, p, 200) for p in PROMPTS])
    concurrent_s = time.monotonic() - started
    assert alone == together, "the 200-token streams differ when run together"
    tokens = sum(a[1] for a in alone)
    print(
        f"{BATCH} x 200-token streams ({tokens} tokens): sequential {sequential_s:.2f} s "
        f"({tokens / sequential_s:.1f} tok/s), concurrent {concurrent_s:.2f} s "
        f"({tokens / concurrent_s:.1f} tok/s), {sequential_s / concurrent_s:.2f}x",
        flush=True,
    )


def check_newcomer_waits_one_chunk(server):
    events = queue.Queue()
    long_started = threading.Event()

    def on_long(kind):
        events.put(("long", kind))
        long_started.set()

    long_thread = threading.Thread(
        target=lambda: stream(server.client, PROMPTS[3], 300, on_long), daemon=True
    )
    long_thread.start()
    assert long_started.wait(REQUEST_TIMEOUT_S), "the long stream never started"
    text, tokens, _ = stream(server.client, PROMPTS[0], 4, lambda kind: events.put(("short", kind)))
    long_thread.join(timeout=REQUEST_TIMEOUT_S * 2)
    assert not long_thread.is_alive(), "the long stream never finished"
    order = []
    while not events.empty():
        order.append(events.get())
    first_short = order.index(("short", "text"))
    long_done = order.index(("long", "done"))
    assert first_short < long_done, order
    # The long one was still streaming after the newcomer's first token: they ran together.
    assert ("long", "text") in order[first_short:long_done], order
    assert tokens == 4 and text, (text, tokens)
    print(f"a short stream's first token came at event {first_short} of the long one's "
          f"{long_done}", flush=True)


def check_default_max_tokens(server):
    reply = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        # "Hello" at every step, so that no end-of-turn token cuts the reply short.
        logit_bias={"9419": 100},
        extra_body=NO_THINKING,
    )
    assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS, reply.usage
    assert reply.choices[0].finish_reason == "length", reply


def measure_gaps_during_a_prefill(server):
    arrivals = []

    def generate():
        chunks = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=300,
            temperature=0, stream=True, logit_bias={"9419": 100}, extra_body=NO_THINKING,
        )
        for _ in chunks:
            arrivals.append(time.monotonic())

    streaming = threading.Thread(target=generate, daemon=True)
    streaming.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while len(arrivals) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = time.monotonic()
    newcomer = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "word " * 480}], max_tokens=2,
        temperature=0, extra_body=NO_THINKING,
    )
    prefilled = time.monotonic()
    streaming.join(timeout=REQUEST_TIMEOUT_S)
    assert not streaming.is_alive(), "the stream never finished"
    gaps = [(b - a, a) for a, b in zip(arrivals, arrivals[1:])]
    before = sorted(g for g, at in gaps if at < sent)
    during = sorted(g for g, at in gaps if sent <= at < prefilled)
    # A measurement, not a check: what the gaps are depends on the machine and its load.
    median = f"{before[len(before) // 2] * 1e3:.0f} ms" if before else "none seen"
    largest = f"{during[-1] * 1e3:.0f} ms over {len(during)} gaps" if during else "none seen"
    print(
        f"a {newcomer.usage.prompt_tokens}-token prompt came in in {prefilled - sent:.2f} s; "
        f"the stream's gaps before: median {median}; meanwhile: max {largest}",
        flush=True,
    )


def main():
    binary = sys.argv[1]
    server = Server(binary, "--max-batch", str(BATCH), "--snapshot-cache-mb", "0",
                    "--max-tokens", str(DEFAULT_MAX_TOKENS))
    checks = [
        ("concurrent streams equal their runs alone", check_concurrent_equals_alone),
        ("concurrent throughput", check_concurrent_throughput),
        ("a newcomer waits one prefill chunk", check_newcomer_waits_one_chunk),
        ("the server's --max-tokens", check_default_max_tokens),
        ("inter-token gaps during a newcomer's prefill", measure_gaps_during_a_prefill),
    ]
    run_checks([(name, lambda check=check: check(server)) for name, check in checks], {"server": server})


if __name__ == "__main__":
    main()

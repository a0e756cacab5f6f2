"""`lily chat` in a pseudo-terminal, as a person uses it: the line editor's history (Up),
a pasted block of lines as one message, Ctrl-C stopping a reply while the conversation goes
on, and the slash commands. Every wait is bounded; any failure exits non-zero.

Usage: python3 tests/e2e/chat_terminal.py path/to/lily
"""

import json
import os
import sys
import tempfile

import pexpect

TIMEOUT_S = 120
STATS = r"\[(\d+) tokens, [\d.]+ tok/s, (\d+) of (\d+) prompt tokens reused, (\w+)\]"
PROMPT = "> "


def start(binary, *flags):
    child = pexpect.spawn(
        binary,
        ["chat", "--model", "synthetic:tiny", "--no-thinking", "--temperature", "0", *flags],
        encoding="utf-8", timeout=TIMEOUT_S, dimensions=(40, 200),
        env={**os.environ, "TERM": "xterm"},
    )
    child.expect("/help lists the commands")
    child.expect_exact(PROMPT)
    return child


def say(child, text):
    """Sends a line; returns the stats of the reply it got."""
    child.sendline(text)
    child.expect(STATS)
    stats = child.match.groups()
    child.expect_exact(PROMPT)
    return int(stats[0]), int(stats[1]), int(stats[2]), stats[3]


def check_commands_and_history(binary, folder):
    child = start(binary, "--max-tokens", "4")
    child.sendline("/help")
    child.expect("/think on\\|off")
    child.expect("/save FILE")
    child.expect_exact(PROMPT)
    # /help went to no model: the first message is the first turn (nothing reused).
    tokens, reused, prompt, _ = say(child, "Hello, how are you?")
    assert 0 < tokens <= 4 and reused == 0, (tokens, reused)
    # Up brings the last line back; Enter sends it again as a second turn.
    child.send("\x1b[A")
    child.expect_exact("Hello, how are you?")
    child.send("\r")
    child.expect(STATS)
    _, reused, second_prompt, _ = map(str, child.match.groups())
    assert int(reused) > 0 and int(second_prompt) > prompt, child.match.groups()
    child.expect_exact(PROMPT)
    # A pasted block of two lines is one message (bracketed paste), not two turns.
    child.send("\x1b[200~line one\nline two\x1b[201~")
    child.send("\r")
    child.expect(STATS)
    child.expect_exact(PROMPT)
    saved = os.path.join(folder, "chat.json")
    child.sendline(f"/save {saved}")
    child.expect_exact("(saved 6 messages")
    child.expect_exact(PROMPT)
    with open(saved) as f:
        messages = json.load(f)["messages"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == ["Hello, how are you?", "Hello, how are you?", "line one\nline two"], users
    # /reset, /system and /load.
    child.sendline("/reset")
    child.expect_exact("(conversation cleared)")
    child.sendline("/system Be brief.")
    child.expect_exact("(system message set)")
    child.sendline(f"/load {saved}")
    child.expect_exact("(loaded 6 messages")
    child.sendline("/think maybe")
    child.expect_exact("/think takes on or off")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.exitstatus


def check_ctrl_c(binary):
    """Ctrl-C stops a long reply, the session goes on, and the next turn has the partial one."""
    child = start(binary, "--max-tokens", "400")
    child.sendline("Tell me a long story.")
    # Wait past the terminal's echo of the line for the reply to start streaming, then interrupt.
    child.expect_exact("Tell me a long story.")
    child.expect_exact("\n")
    child.expect(r"\S")
    child.sendintr()
    child.expect(r"\(stopped\)")
    child.expect(STATS)
    tokens, _, _, finish = child.match.groups()
    assert finish == "Cancelled" and 0 < int(tokens) < 400, child.match.groups()
    child.expect_exact(PROMPT)
    child.sendline("/save " + os.devnull)
    child.expect_exact("(saved 2 messages")
    child.expect_exact(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)


def main():
    binary = sys.argv[1]
    checks = [("commands, history, paste", check_commands_and_history), ("Ctrl-C", check_ctrl_c)]
    with tempfile.TemporaryDirectory() as folder:
        for name, check in checks:
            print(f"check: {name}", flush=True)
            if check is check_commands_and_history:
                check(binary, folder)
            else:
                check(binary)
    print(f"{len(checks)} passed, 0 failed")


if __name__ == "__main__":
    main()

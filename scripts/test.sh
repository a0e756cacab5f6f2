#!/usr/bin/env bash
# The whole test suite: what README's test command runs and what CI calls.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CLI tests check that numpy itself reads the logits `lily score` writes.
python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q numpy
cargo test --workspace --all-targets
# Every CUDA kernel compiles with NVRTC (no GPU needed): the 13.0 line, as the H200 driver
# loads its PTX. Installed into a scratch folder, never cached across runs.
nvrtc_dir=$(mktemp -d)
python3 -m pip install -q --target "$nvrtc_dir" "nvidia-cuda-nvrtc==13.0.*"
LD_LIBRARY_PATH="$nvrtc_dir/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}" \
  cargo test -p lily-cuda --test nvrtc -- --ignored
rm -rf "$nvrtc_dir"
# The fuzz targets (their own workspace; running them needs cargo-fuzz) still compile.
cargo check --manifest-path fuzz/Cargo.toml --bins
# The server against the official OpenAI client (streaming, tools, errors, multi-turn reuse).
python3 -c "import openai" 2>/dev/null || python3 -m pip install -q "openai>=1.40"
cargo build -p lily
timeout 600 python3 tests/e2e/openai_client.py "${CARGO_TARGET_DIR:-target}/debug/lily"
# Constrained decoding: every output of many generated schemas validates (jsonschema checks it).
python3 -c "import jsonschema" 2>/dev/null || python3 -m pip install -q "jsonschema>=4.0"
timeout 600 python3 tests/e2e/structured_output.py "${CARGO_TARGET_DIR:-target}/debug/lily"
# Several clients at once: batched streams equal their runs alone, a newcomer waits one chunk.
timeout 600 python3 tests/e2e/concurrency.py "${CARGO_TARGET_DIR:-target}/debug/lily"
# /v1/messages against the official Anthropic client (blocks, streaming events, tools, errors).
python3 -c "import anthropic" 2>/dev/null || python3 -m pip install -q "anthropic>=0.40"
timeout 300 python3 tests/e2e/anthropic_client.py "${CARGO_TARGET_DIR:-target}/debug/lily"
# `lily chat` in a pseudo-terminal: history, a pasted block, Ctrl-C during a reply, commands.
python3 -c "import pexpect" 2>/dev/null || python3 -m pip install -q "pexpect>=4.8"
timeout 300 python3 tests/e2e/chat_terminal.py "${CARGO_TARGET_DIR:-target}/debug/lily"
# Hardening: API keys and CORS, request limits, 5,000 generated bad requests, /metrics, SIGTERM.
timeout 300 python3 tests/e2e/hardening.py "${CARGO_TARGET_DIR:-target}/debug/lily"

#!/usr/bin/env bash
# Builds what a GPU run needs into .gpu/ (git-ignored): the release `lily` binary and the CUDA
# test binary. Then run tools/gpu-check.sh on the GPU machine with `.gpu` carried.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release -p lily
cp "${CARGO_TARGET_DIR:-target}/release/lily" .gpu/lily
# Every lily-cuda test binary named gpu* (they need a GPU), as .gpu/test-<name>.
rm -f .gpu/test-*
cargo test --release -p lily-cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"].startswith("gpu") and m.get("executable"):
        print(m["target"]["name"], m["executable"])' \
  | while read -r name bin; do cp "$bin" ".gpu/test-$name"; done
strip .gpu/lily .gpu/test-* 2>/dev/null || true
ls -la .gpu

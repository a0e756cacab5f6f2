#!/usr/bin/env bash
# The whole test suite: what README's test command runs and what CI calls.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CLI tests check that numpy itself reads the logits `lily score` writes.
python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q numpy
cargo test --workspace --all-targets

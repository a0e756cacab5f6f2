#!/usr/bin/env bash
# The whole test suite: what README's test command runs and what CI calls.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets

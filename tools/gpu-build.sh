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
# The kernels' PTX for the full-size model as the binaries look it up (compile.rs's cache, keyed
# by source and options), packed for gpu-check.sh: a fresh GPU machine then skips NVRTC (~40 s a
# binary). Needs libnvrtc.so.13 (the nvidia-cuda-nvrtc wheel) on LD_LIBRARY_PATH; without it the
# machine compiles there as before. KERNEL_CACHE gathers several trees' PTX (build each in turn).
if [ -n "${NVRTC_LIB:-}" ]; then
  cache=${KERNEL_CACHE:-/tmp/lily-kernel-ptx}
  cargo build --release -p lily-cuda --example kernel_ptx
  LD_LIBRARY_PATH=$NVRTC_LIB LILY_KERNEL_CACHE=$cache \
    "${CARGO_TARGET_DIR:-target}/release/examples/kernel_ptx" qwen3.6-35b-a3b sm_90 "$cache/by-file" > /dev/null
  rm -rf "$cache/by-file"
  tar -C "$cache" -cf - . | xz -T0 -9 > .gpu/kernels.txz
fi

#!/usr/bin/env bash
# Builds what a GPU run needs into .gpu/ (git-ignored): the release `lily` binary, every CUDA
# test binary, with NVRTC_LIB the kernels' PTX, with VARIANTS other revisions' `lily` (below).
# Then run tools/gpu-check.sh on the GPU machine with `.gpu` carried (64 MiB with the tracked
# files: `xz -9` the binaries a call does not need unpacked; `ab` unpacks them).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cache=${KERNEL_CACHE:-/tmp/lily-kernel-ptx}
# The kernels' PTX for the full-size model as the binaries look it up (compile.rs's cache, keyed
# by source and options), gathered over every tree built here. Needs libnvrtc.so.13 (the
# nvidia-cuda-nvrtc wheel) in NVRTC_LIB; without it the GPU machine compiles there (~40 s a binary).
kernel_ptx() {
  [ -n "${NVRTC_LIB:-}" ] || return 0
  cargo build -q --release -p lily-cuda --example kernel_ptx
  LD_LIBRARY_PATH=$NVRTC_LIB LILY_KERNEL_CACHE=$cache \
    "${CARGO_TARGET_DIR:-target}/release/examples/kernel_ptx" qwen3.6-35b-a3b sm_90 "$cache/by-file" > /dev/null
  rm -rf "$cache/by-file"
}
# VARIANTS="NAME:REV ...": `lily` of each revision too, as .gpu/lily-NAME inside one solid
# .gpu/lilies.txz (they differ only in their kernel sources, so five pack into ~8.5 MB where one
# alone is 8), for `VARIANTS=... tools/gpu-check.sh ab`. Each revision is checked out here in
# turn: one target folder shared by two worktrees has built stale binaries.
if [ -n "${VARIANTS:-}" ]; then
  [ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "VARIANTS needs a clean tree" >&2; exit 1; }
  home=$(git rev-parse --abbrev-ref HEAD)
  [ "$home" != HEAD ] || home=$(git rev-parse HEAD)
  # Every revision resolved first: HEAD~1 means something else once another is checked out.
  revs=()
  for v in $VARIANTS; do revs+=("$(git rev-parse --verify "${v#*:}^{commit}")"); done
  names=()
  i=0
  for v in $VARIANTS; do
    git checkout -q "${revs[$i]}"
    i=$((i + 1))
    cargo build -q --release -p lily
    cp "${CARGO_TARGET_DIR:-target}/release/lily" ".gpu/lily-${v%%:*}"
    strip ".gpu/lily-${v%%:*}"
    kernel_ptx
    names+=("lily-${v%%:*}")
    echo "lily-${v%%:*}: $(git rev-parse --short HEAD)"
  done
  git checkout -q "$home"
  tar -C .gpu -cf - "${names[@]}" | xz -T1 -9e > .gpu/lilies.txz
  (cd .gpu && rm -f "${names[@]}")
fi
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
# The PTX of this tree too, packed for gpu-check.sh.
if [ -n "${NVRTC_LIB:-}" ]; then
  kernel_ptx
  tar -C "$cache" -cf - . | xz -T0 -9 > .gpu/kernels.txz
fi

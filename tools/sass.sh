#!/usr/bin/env bash
# Registers, spills and SASS of the CUDA kernels without a GPU: NVRTC's PTX (the kernel_ptx
# example, the backend's own compile path and defines), then ptxas and cuobjdump from NVIDIA's pip
# wheels, installed into a scratch folder (or LILY_SASS_TOOLS, to keep them between calls).
#
#   tools/sass.sh gemv                    # ptxas -v of every kernel of gemv.cu
#   tools/sass.sh gemv gemv_q4_norm_t1  # and that kernel's SASS, with its instruction mix
#
# MODEL (default qwen3.6-35b-a3b) and ARCH (default sm_90) pick the compile; SASS goes to
# $OUT_DIR/<kernel>.sass (default /tmp/lily-sass). Instruction counts are static: a loop body is
# counted once, a branch not taken is counted too.
set -euo pipefail
cd "$(dirname "$0")/.."
file=${1:?usage: tools/sass.sh KERNEL_FILE [KERNEL]}
kernel=${2:-}
model=${MODEL:-qwen3.6-35b-a3b} arch=${ARCH:-sm_90} out=${OUT_DIR:-/tmp/lily-sass}
if [ -n "${LILY_SASS_TOOLS:-}" ]; then
  tools=$LILY_SASS_TOOLS
else
  tools=$(mktemp -d)
  trap 'rm -rf "$tools"' EXIT
fi
bin=$tools/nvidia/cu13/bin
if [ ! -x "$bin/nvdisasm" ] || [ ! -e "$tools/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install -q --upgrade --target "$tools" "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-nvcc==13.0.*" \
    "nvidia-cuda-cuobjdump==13.*" "nvidia-cuda-nvdisasm==13.*"
fi
mkdir -p "$out"
# PTX of an earlier call for another ARCH would match the glob below too.
rm -f "$out"/*.ptx
LD_LIBRARY_PATH="$tools/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}" LILY_KERNEL_CACHE="$out/cache" \
  cargo run -q --release -p lily-cuda --example kernel_ptx -- "$model" "$arch" "$out" > /dev/null
ptx=$(ls "$out/$file".*.ptx)
target=$(basename "$ptx" .ptx)
target=${target#"$file".}
cubin=$out/$file.cubin
"$bin/ptxas" -arch="$target" -v "$ptx" -o "$cubin" 2>&1 \
  | grep -E "entry function|spill|Used" | sed -E "s/ptxas info *: //; s/Compiling entry function '([^']*)'.*/\1:/"
if [ -n "$kernel" ]; then
  PATH="$bin:$PATH" "$bin/cuobjdump" -sass -fun "$kernel" "$cubin" > "$out/$kernel.sass"
  echo "== $kernel: $out/$kernel.sass"
  grep -oE '^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P[T0-9] )?[A-Z][A-Z0-9_]+' "$out/$kernel.sass" | awk '{print $NF}' \
    | sort | uniq -c | sort -rn | awk '{n += $1; printf "%s %s  ", $2, $1} END {print "\ninstructions: " n}'
fi

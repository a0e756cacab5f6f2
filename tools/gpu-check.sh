#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with .gpu/ carried (tools/gpu-build.sh):
# the CUDA-vs-CPU tests, then the decode benchmark. Logs go to $OUT when it is set.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export LILY_KERNEL_CACHE=/tmp/lily-kernels LILY_FIXTURES=$PWD/tests/fixtures
out=${OUT:-/tmp/lily-out}
mkdir -p "$out" "$LILY_KERNEL_CACHE"
# PTX compiled here with NVRTC (the kernel_ptx example, LILY_KERNEL_CACHE pointed at a folder,
# packed as .gpu/kernels.txz) spares each binary NVRTC's ~40 s on a fresh machine.
[ -f .gpu/kernels.txz ] && tar -xJf .gpu/kernels.txz -C "$LILY_KERNEL_CACHE" --skip-old-files
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
step=${1:-all}
# Binaries packed with xz (to fit a call's carry) unpacked for every step.
(cd .gpu && for f in *.xz */*.xz; do [ -e "${f%.xz}" ] || xz -dk "$f"; chmod +x "${f%.xz}"; done) 2>/dev/null
if [ "$step" = all ] || [ "$step" = test ]; then
  # One binary per test file (tools/gpu-build.sh); FILTER picks tests by name.
  for bin in .gpu/test-*; do
    [ "${bin%.xz}" = "$bin" ] || continue
    echo "== $bin" | tee -a "$out/gpu-tests.log"
    "$bin" --include-ignored --nocapture --test-threads 1 ${FILTER:-} 2>&1 | tee -a "$out/gpu-tests.log"
  done
fi
if [ "$step" = all ] || [ "$step" = persistent ]; then
  # The decode tests again on the persistent step (kernels/decode.cu).
  LILY_DECODE=persistent .gpu/test-gpu --include-ignored --nocapture --test-threads 1 2>&1 \
    | tee "$out/gpu-tests-persistent.log"
fi
if [ "$step" = peer-start ]; then
  # llama.cpp's build and GGUF (~6 min on the CPUs) in a session of their own, so that they go on
  # after this command returns while the machine stays up: start it first, run the tests, then
  # `peer`, which waits for it. /tmp/peer/ready marks the end.
  if [ ! -e /tmp/peer/started ]; then
    mkdir -p /tmp/peer && touch /tmp/peer/started
    setsid bash -c 'bash .gpu/peer/peer.sh build > /tmp/peer/build.txt 2>&1 &&
      bash .gpu/peer/peer.sh gguf > /tmp/peer/gguf.txt 2>&1; touch /tmp/peer/ready' \
      > /dev/null 2>&1 < /dev/null &
  fi
fi
if [ "$step" = peer ]; then
  # llama.cpp beside us (../shared/peer copied to .gpu/peer): build and write its GGUF, or wait
  # for `peer-start`'s, then its GPU figures into $out for `bench` (run that after this, same
  # machine).
  if [ -e /tmp/peer/started ]; then
    for _ in $(seq 1 120); do [ -e /tmp/peer/ready ] && break; sleep 5; done
  else
    bash .gpu/peer/peer.sh build && bash .gpu/peer/peer.sh gguf
  fi
  # Under /tmp/peer too: a later command on the same machine (its own $OUT) benches beside it.
  OUT=/tmp/peer/out bash .gpu/peer/peer.sh gpu && cp /tmp/peer/out/llama-*.json "$out/"
fi
if [ "$step" = ab ]; then
  # A/B in one lease: the test binaries named in TESTS first, then the decode bench of each of
  # VARIANTS (if any) in turn, NAME:BINARY[:VAR=VALUE,...] with BINARY under .gpu/ (.gpu/lilies.txz
  # is unpacked first), e.g. VARIANTS="base:lily-base: new:lily: base:lily-base: new:lily:". One line each
  # with its decode tok/s (B = 1 and 8 at each context, in the table's order); JSON into $out;
  # FAMILIES=1 adds each variant's per-family step profile, SAMPLED=1 the sampled rows.
  # PROMPTS=1024,4096,... benches prefill at those lengths instead (one line of tok/s each, and
  # with FAMILIES=1 the chunk's per-family table).
  # VARIANTS=... tools/gpu-build.sh packs the variants' binaries in one archive.
  [ -f .gpu/lilies.txz ] && tar -xJf .gpu/lilies.txz -C .gpu --skip-old-files
  # TEST_JOBS test binaries at once (they are not timed; the GPU has room for several). An entry
  # BINARY:NAME runs only that binary's tests whose names contain NAME (a short lease's choice).
  test_one() {
    local bin=${1%%:*} filter=${1#*:}
    [ "$filter" = "$1" ] && filter=
    local log="$out/${1//[\/:]/-}.log"
    # shellcheck disable=SC2086
    timeout "${TEST_TIMEOUT:-300}" ".gpu/$bin" --include-ignored --nocapture --test-threads 1 $filter > "$log" 2>&1
    echo "== $1 rc=$? $(grep -E 'test result' "$log")"
  }
  export -f test_one; export out TEST_TIMEOUT
  # shellcheck disable=SC2086
  [ -n "${TESTS:-}" ] && printf '%s\n' $TESTS | xargs -P "${TEST_JOBS:-1}" -I{} bash -c 'test_one {}'
  i=0
  for v in ${VARIANTS:-}; do
    i=$((i + 1)); name=${v%%:*}; rest=${v#*:}; bin=${rest%%:*}; vars=${rest#"$bin"}; vars=${vars#:}
    bin=${bin%.xz}   # a packed binary is named by what it unpacks to
    # shellcheck disable=SC2086
    if [ -n "${PROMPTS:-}" ]; then
      # shellcheck disable=SC2086
      env ${vars//,/ } ".gpu/$bin" bench --model synthetic:qwen3.6-35b-a3b --device cuda --prompt-lens "$PROMPTS" \
        --contexts 256 --decode-steps 8 --runs 2 --json "$out/bench-$i-$name.json" > "/tmp/bench-$i-$name.txt" 2>&1
      echo "== $i $name prefill $(grep -E '^\| prefill' "/tmp/bench-$i-$name.txt" | awk -F'|' '{printf "%s ", $5}')"
      if [ -n "${FAMILIES:-}" ]; then sed -n '/^one prefill chunk/,/^$/p' "/tmp/bench-$i-$name.txt"; fi
      continue
    fi
    env ${vars//,/ } ".gpu/$bin" bench --model synthetic:qwen3.6-35b-a3b --device cuda --prompt-lens 256 \
      --contexts "${CONTEXTS:-256,4096}" --batch "${BATCH:-1,8}" ${SAMPLED:+--sampled} --runs 3 --json "$out/bench-$i-$name.json" \
      > "/tmp/bench-$i-$name.txt" 2>&1
    echo "== $i $name $(grep -E '^\| decode' "/tmp/bench-$i-$name.txt" | awk -F'|' '{printf "%s ", $5}')"
    # FAMILIES=1: bench's per-family profile of a step too (kernels launched one by one), in the
    # output rather than as files, which a call returns only a few of.
    if [ -n "${FAMILIES:-}" ]; then sed -n '/^per decode step/,/^$/p' "/tmp/bench-$i-$name.txt"; fi
  done
fi
if [ "$step" = all ] || [ "$step" = bench ]; then
  peer=()
  [ -f /tmp/peer/out/llama-tg.json ] && peer=(--peer /tmp/peer/out/llama-pp.json,/tmp/peer/out/llama-tg.json)
  .gpu/lily bench --model synthetic:qwen3.6-35b-a3b --device cuda --prompt-lens 256 \
    --contexts "${CONTEXTS:-256,1024,4096}" "${peer[@]}" --json "$out/bench-cuda.json" 2>&1 | tee "$out/bench-cuda.md"
fi
if [ "$step" = bench-long ]; then
  # The protocol's long rows (minutes each; not part of `all`).
  .gpu/lily bench --model synthetic:qwen3.6-35b-a3b --device cuda --prompt-lens "${PROMPTS:-8192,65536,131072}" \
    --contexts "${CONTEXTS:-32768,65536,131072}" --json "$out/bench-long.json" 2>&1 | tee "$out/bench-long.md"
fi
if [ "$step" = all ] || [ "$step" = agree ]; then
  # The first 32 greedy tokens of the full-size synthetic model, CPU against GPU.
  prompt=9419,11,1814,13,576,374,264,1296
  # The prompt goes through the bf16 tensor-core prefill, which this random model is chaotic
  # under (one bf16 rounding at its input moves its logits by 0.2 on the CPU), so the texts may
  # part at once; the bound that holds is tested in gpu_agreement.rs. Decode alone is exact with
  # the f32 KV cache (gpu.rs). Both caches are recorded.
  LILY_KV_CACHE=f32 .gpu/lily generate --model synthetic:qwen3.6-35b-a3b --device cuda --tokens $prompt \
    --max-tokens 32 --temperature 0 --ignore-eos --json 2>&1 | tee "$out/greedy-cuda-f32kv.json"
  .gpu/lily generate --model synthetic:qwen3.6-35b-a3b --device cuda --tokens $prompt --max-tokens 32 \
    --temperature 0 --ignore-eos --json 2>&1 | tee "$out/greedy-cuda.json"
  .gpu/lily generate --model synthetic:qwen3.6-35b-a3b --device cpu --tokens $prompt --max-tokens 32 \
    --temperature 0 --ignore-eos --json 2>&1 | tee "$out/greedy-cpu.json"
fi
if [ "$step" = all ] || [ "$step" = serve ]; then
  # The OpenAI-compatible server on the GPU against real HTTP clients; SERVE_BINS="lily
  # lily-NAME ..." runs each of those binaries in turn (the variants of .gpu/lilies.txz).
  [ -f .gpu/lilies.txz ] && tar -xJf .gpu/lilies.txz -C .gpu --skip-old-files
  for bin in ${SERVE_BINS:-lily}; do
    python3 tools/gpu_serve_check.py --lily ".gpu/$bin" 2>&1 | tee "$out/serve-$bin.log"
  done
fi
if [ "$step" = all ] || [ "$step" = profile ]; then
  # Every kernel of the first decode steps, timed by Nsight Compute (clocks left alone); the
  # synthetic model's writing and the prefill launch other kernels, which the names leave out.
  decode='regex:^(embed_rows|gemv_mma|gemv_q4|gemv_b|gemv_norm|gemv_add|gemv_rows|gdn_decode_step$|gdn_step$|attn_prep$|attn_split$|attn_combine$|moe_route|moe_gate_up|moe_down|argmax)'
  ncu --clock-control none --graph-profiling node --kernel-name "$decode" --launch-count 972 --csv \
    --metrics gpu__time_duration.sum .gpu/lily generate --model synthetic:qwen3.6-35b-a3b \
    --device cuda --tokens 1 --max-tokens 4 --temperature 0 --ignore-eos > "$out/ncu.csv" 2>"$out/ncu.err"
  python3 tools/ncu_summary.py "$out/ncu.csv" | tee "$out/ncu-summary.md"
fi
if [ "$step" = ncu-detail ]; then
  # One launch of each named decode kernel mid-step, with Nsight Compute's occupancy, scheduler,
  # warp-state, instruction and memory sections (KERNELS: a regex alternation of names).
  .gpu/lily generate --model synthetic:qwen3.6-35b-a3b --device cuda --tokens 1 --max-tokens 2 \
    --temperature 0 --ignore-eos > /dev/null 2>&1
  # Warps stalled a cycle an issue, by reason: no_instruction is the instruction fetch (1.8 in
  # moe_route_gate_up at 83 KB of SASS, 0.3-0.9 in the other decode kernels; docs/BENCHMARKS.md,
  # twelfth session), long_scoreboard global and local loads, barrier and membar the block's and
  # the grid's syncs. Caches are flushed between ncu's passes, so the fetch is cold here.
  stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' no_instruction \
    long_scoreboard barrier membar wait short_scoreboard math_pipe_throttle lg_throttle branch_resolving)
  stalls=${stalls%,}
  ncu --clock-control none --graph-profiling node \
    --kernel-name "regex:^(${KERNELS:-gemv_mma_norm_b4_t1|gemv_mma_add_b4_t1|moe_route_gate_up_b4_r8|moe_down_b4_r1|gdn_decode_step})$" \
    --launch-skip "${SKIP:-30}" --launch-count "${COUNT:-5}" --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --metrics "$stalls" .gpu/lily generate --model synthetic:qwen3.6-35b-a3b --device cuda \
    --tokens 1 --max-tokens 4 --temperature 0 --ignore-eos > "$out/ncu-detail.txt" 2> "$out/ncu-detail.err"
  grep -E "^  [a-z_0-9]+ \(|Duration|Executed Instructions  |Registers Per|Achieved Active Warps|Eligible Warps|DRAM Throughput|Grid Size|issue_stalled" \
    "$out/ncu-detail.txt"
fi
if [ "$step" = ncu-prefill ]; then
  # The prefill GEMMs of one 4K chunk under Nsight Compute: the sections of ncu-detail and the
  # compute pipes' load (is the tensor pipe waiting on the loads, or the loads on the pipe?).
  stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' no_instruction \
    long_scoreboard barrier membar wait short_scoreboard math_pipe_throttle lg_throttle mio_throttle \
    dispatch_stall sleeping)
  stalls=${stalls%,}
  ncu --clock-control none \
    --kernel-name "regex:^(${KERNELS:-gemm_wgmma_grouped64_b4|gemm_wgmma_b4})$" \
    --launch-skip "${SKIP:-40}" --launch-count "${COUNT:-6}" --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --metrics "$stalls" \
    .gpu/lily bench --model synthetic:qwen3.6-35b-a3b --device cuda --prompt-lens 4096 --contexts 256 \
    --decode-steps 1 --runs 1 > "$out/ncu-prefill.txt" 2> "$out/ncu-prefill.err"
  grep -E "^  [a-z_0-9]+ \(|Duration|Executed Instructions  |Registers Per|Achieved Active Warps|Eligible Warps|DRAM Throughput|Compute \(SM\) Throughput|L1/TEX Hit|L2 Hit|Grid Size|Block Limit|issue_stalled|Issue Slots Busy|Executed Ipc A" \
    "$out/ncu-prefill.txt"
fi
if [ "$step" = prefill-kernels ]; then
  # Every kernel of one prefill chunk of PROMPT tokens (4,096) timed by Nsight Compute, summed by
  # name: the families of bench's chunk table, kernel by kernel.
  ncu --clock-control none --kernel-name "regex:^(embed_b|add_rms_norm|gemm|attn_prep_rows|attn_prefill|gdn_|moe_)" \
    --launch-count "${COUNT:-1500}" --csv --metrics gpu__time_duration.sum .gpu/lily bench \
    --model synthetic:qwen3.6-35b-a3b --device cuda --prompt-lens "${PROMPT:-4096}" --contexts 256 \
    --decode-steps 1 --runs 1 > "$out/ncu-prefill-kernels.csv" 2> "$out/ncu-prefill-kernels.err"
  python3 tools/ncu_summary.py --one-span --launches="${LAUNCHES:-64}" "$out/ncu-prefill-kernels.csv" | tee "$out/ncu-prefill-kernels.md"
fi
if [ "$step" = peer-cpu ]; then
  # llama.cpp for the CPU only (~2 min on 16 cores) while its GGUF is written, for `cpu` next.
  bash .gpu/peer/peer.sh >/dev/null 2>&1
  bash .gpu/peer/peer.sh build-cpu > "$out/peer-build.txt" 2>&1 &
  bash .gpu/peer/peer.sh gguf > "$out/peer-gguf.txt" 2>&1
  wait
  cat "$out/peer-build.txt" "$out/peer-gguf.txt" | tail -3
fi
if [ "$step" = all ] || [ "$step" = cpu ]; then
  # llama.cpp on the CPU first, in the same run, when its build and GGUF are there (peer.sh build,
  # peer.sh gguf); then the CPU numerics beside it.
  peer=()
  if [ -x /tmp/peer/lcpp/build/bin/llama-bench ] && [ -f /tmp/peer/model.gguf ]; then
    OUT=$out bash .gpu/peer/peer.sh cpu "$(nproc)" 2>&1 | tee "$out/peer-cpu.txt"
    peer=(--peer "$out/llama-cpu.json")
  fi
  for nx in f32 int8 int8x2; do
    LILY_CPU_NUMERICS=$nx .gpu/lily bench --model synthetic:qwen3.6-35b-a3b --device cpu \
      --prompt-lens 256 --contexts "${CONTEXTS:-256}" --runs "${RUNS:-2}" "${peer[@]}" --json "$out/bench-cpu-$nx.json" 2>&1 \
      | tee "$out/bench-cpu-$nx.md"
  done
fi
# A call brings back only a few of $OUT's files (8 in this workplace, the first by name), so
# everything this run wrote is also packed into the one that sorts first.
if [ -n "${OUT:-}" ]; then
  (cd "$out" && find . -type f ! -name 0-all.txz | tar -cJf 0-all.txz -T -) 2>/dev/null || true
fi

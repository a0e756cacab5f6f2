#!/usr/bin/env python3
"""ptxas statistics and the main loop's SASS of a kernel file, without a GPU.

Compiles crates/lily-cuda/src/kernels/FILE.cu as the backend does (common.cuh prepended, the
model's -D constants) but to an sm_90 CUBIN through NVRTC (--arch sm_90a for gemm_wgmma), prints
ptxas -v (registers, spills, shared memory) per kernel and any ptxas warning (such as wgmma
serialised), and, with cuobjdump, each kernel's main loop (the backward branch around the most
HMMA or HGMMA; without them, the innermost one with 16-byte global loads and 32+ FFMAs) as an
opcode histogram with its load instructions.

    pip install --target /tmp/nvrtc13 "nvidia-cuda-nvrtc==13.0.*"
    pip install --target /tmp/cudatools nvidia-cuda-cuobjdump
    LD_LIBRARY_PATH=/tmp/nvrtc13/nvidia/cu13/lib python3 tools/kernel_sass.py gemm [--hot] [--sass OUT]

--hot compiles with the 16-byte-aligned paths taken (x_vec / w_vec true), so the loop is the one
aligned prefill inputs run. The defines are qwen3.6-35b-a3b's, as compile.rs model_defines gives
them; the GEMM uses none of them.
"""

import argparse
import collections
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

DEFINES = {
    "NH": "16", "NKV": "2", "HD": "256", "ROT": "64", "ROPE_THETA": "10000000.0f", "NK": "16",
    "NV": "32", "DK": "128", "DV": "128", "CONV_K": "4", "NE": "256", "TOPK": "8",
    "NORM_TOPK": "1", "KV_F32": "0",
}
KERNELS = os.path.join(os.path.dirname(__file__), "..", "crates", "lily-cuda", "src", "kernels")
# The shared device code each file is compiled with after common.cuh (compile.rs, KernelFile::headers).
HEADERS = {
    "attention": ["heads.cuh", "attn_decode.cuh"],
    "attention_prefill": ["heads.cuh"],
    "gdn": ["gdn_decode.cuh"],
    "moe": ["gemv_staged.cuh", "route.cuh", "moe_decode.cuh"],
    "moe_prefill": ["route.cuh"],
    "gemv": ["gemv_staged.cuh"],
    "decode": ["gemv_staged.cuh", "gemv_stream.cuh", "gdn_decode.cuh", "heads.cuh", "attn_decode.cuh", "route.cuh", "moe_decode.cuh"],
}
# decode.cu's weight formats (decode.rs, StepFormats::MLX_4BIT; --dense: every format f32).
STEP_FORMATS = {"BITS_EMBED": 4, "BITS_LM": 4, "BITS_GDN_IN": 4, "BITS_GDN_OUT": 4, "BITS_ATTN_IN": 4,
                "BITS_ATTN_OUT": 4, "BITS_ROUTER": 8, "BITS_EXPERT": 4}


def compile_cubin(source, arch):
    lib = ctypes.CDLL("libnvrtc.so.13")
    opts = [f"-D{k}={v}" for k, v in DEFINES.items()]
    opts += [f"--gpu-architecture={arch}", "--std=c++17", "--ptxas-options=-v"]
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return log.value.decode(), cubin.raw


def ptxas_summary(log):
    name = None
    for line in log.splitlines():
        if "warning" in line.lower():
            print(line.strip())
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = f"spill stores {m.group(1)} B, loads {m.group(2)} B"
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line) or re.search(r"Used (\d+) registers", line)
        m2 = re.search(r"(\d+) bytes stack frame", line)
        if m2 and int(m2.group(1)) and name:
            print(f"{name:20s} {m2.group(1)} B stack frame")
        if m and name:
            smem = f", {m.group(2)} B shared" if m.lastindex == 2 else ""
            print(f"{name:20s} {m.group(1):>3s} registers, {spills}{smem}")


def loops(sass):
    for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S):
        ins = [(int(a, 16), op, rest) for a, op, rest in
               re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", body)]
        where = {a: i for i, (a, _, _) in enumerate(ins)}
        best = None
        for i, (a, op, rest) in enumerate(ins):
            t = re.search(r"0x([0-9a-f]+)", rest)
            if op.startswith("BRA") and t and int(t.group(1), 16) < a and int(t.group(1), 16) in where:
                j = where[int(t.group(1), 16)]
                body = ins[j:i + 1]
                n = sum(1 for x in body if x[1].startswith(("HMMA", "HGMMA")))
                # Without HMMA (the GEMVs), the innermost loop with 16-byte loads and a
                # dequantisation's worth of FFMAs (not the staging or RMS loops).
                wide = any(x[1].startswith(("LDG.E.128", "LD.E.128")) for x in body)
                ffma = sum(1 for x in body if x[1].startswith("FFMA"))
                key = (n, wide and ffma >= 32, -len(body))
                if best is None or key > best[0]:
                    best = (key, j, i)
        if best is None:
            continue
        loop = ins[best[1]:best[2] + 1]
        hist = collections.Counter(op.split(".")[0] for _, op, _ in loop)
        loads = collections.Counter(op for _, op, _ in loop if op.startswith(("LDG", "LD.", "LDS", "LDL")))
        print(f"{name}: loop of {len(loop)} instructions, {best[0][0]} HMMA/HGMMA, "
              + ", ".join(f"{k} {v}" for k, v in sorted(loads.items())))
        print("   " + ", ".join(f"{k} {v}" for k, v in hist.most_common()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file", help="kernel file name without .cu, e.g. gemm")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--hot", action="store_true", help="take the aligned paths")
    ap.add_argument("--sass", help="also write the whole SASS here")
    ap.add_argument("--dense", action="store_true", help="decode.cu with f32 weights")
    a = ap.parse_args()
    if a.file == "decode":
        for k, v in STEP_FORMATS.items():
            DEFINES[k] = "32" if a.dense else str(v)
        DEFINES["STEP_PERSISTENT"] = "1"
        DEFINES["STREAM_WARP_BYTES"] = "18432"   # decode.rs, stream_warp_bytes on an H100/H200
    source = open(os.path.join(KERNELS, "common.cuh")).read() + "\n"
    for h in HEADERS.get(a.file, []):
        source += open(os.path.join(KERNELS, h)).read() + "\n"
    kernel = open(os.path.join(KERNELS, a.file + ".cu")).read()
    if a.hot:
        kernel = re.sub(r"const bool (x|w)_vec = [^;]*;", r"const bool \1_vec = true;", kernel)
    log, cubin = compile_cubin(source + kernel, a.arch)
    ptxas_summary(log)
    tool = shutil.which("cuobjdump") or "/tmp/cudatools/nvidia/cu13/bin/cuobjdump"
    if not os.path.exists(tool):
        print("(no cuobjdump: pip install nvidia-cuda-cuobjdump for the loops)")
        return
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    if a.sass:
        open(a.sass, "w").write(sass)
    loops(sass)


if __name__ == "__main__":
    main()

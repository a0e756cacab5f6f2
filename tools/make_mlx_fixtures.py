#!/usr/bin/env python3
"""MLX oracle fixtures: affine quantise/dequantise cases and a tiny qwen3_5_moe converted by mlx-lm.

    pip install mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2
    python3 tools/make_mlx_fixtures.py --out tests/fixtures [--lily target/release/lily]

Writes
- tests/fixtures/mlx-quant/: `cases.safetensors` + `cases.json`: bf16 matrices, what `mx.quantize`
  makes of them at 4 and 8 bits (codes, bf16 scales and biases), and `mx.dequantize` of those
  with the bf16 scales (bf16 output) and with the scales widened to f32 (f32 output).
- tests/fixtures/tiny-mlx-hf/: a random bf16 checkpoint in the official multimodal layout (wrapper
  config, fused experts, two shards, vision/MTP tensors to skip) whose dims are multiples of 64,
  with a minimal word-level tokenizer so that `mlx_lm.convert` runs on it unchanged.
- tests/fixtures/tiny-mlx-q4/: what `mlx_lm.convert(..., quantize=True)` (4-bit, group 64, 8-bit
  router and shared-expert gate, bf16) makes of it, plus `cases.json` and `logits_*.npy`:
  mlx-lm's teacher-forced logits and greedy tokens on that checkpoint, computed in f32 (every bf16
  parameter -- scales, biases, norms -- widened to f32 after loading, so the oracle's arithmetic is
  f32 like ours; the 4-bit weights are the checkpoint's own).

With `--lily BIN` the script also runs `BIN quantize` on tiny-mlx-hf and checks that every tensor
it writes is byte-identical to mlx-lm's, and that mlx-lm loads the result and gives the same logits.

The seed is searched (base, base+1, ...) until routing has no near-ties and greedy steps have clear
winners in the f32 oracle, so that an f32 engine with a different summation order must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (the transformers fixture helpers: configs, weights, layout)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_map  # noqa: E402

MIN_ROUTER_GAP = 1e-5
MIN_GREEDY_MARGIN = 5e-2
MIN_TF_MARGIN = 1e-2
GREEDY_PROMPT_LEN = 8
GREEDY_NEW_TOKENS = 24
MAX_SEED_TRIES = 100

L, F = "linear_attention", "full_attention"

# Every matrix's input dim is a multiple of 64, so group-64 quantisation applies to all of them
# (hidden 128 gives two groups per row; o_proj 2x64, out_proj 4x32 and down 64 inputs).
TINY = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=[L, L, L, F],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_section=[4, 2, 2], mrope_interleaved=True),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
BASE_SEED = 3000
SEQUENCES = [("short", 9), ("long", 100)]


# --------------------------------------------------------------------------------------------------
# Quantise / dequantise cases
# --------------------------------------------------------------------------------------------------


def edge_rows(cols: int) -> np.ndarray:
    """Groups that take the quantiser's unusual branches."""
    rng = np.random.default_rng(7)
    rows = [
        np.full(cols, 0.3),  # constant: range 0, scale clamps to eps, bias = edge
        np.zeros(cols),  # all zero: q0 = 0, bias 0
        -np.abs(rng.normal(0, 1, cols)),  # negative only: |min| > |max|
        np.abs(rng.normal(0, 1, cols)),  # positive only
        rng.normal(0, 1e3, cols),  # large
        rng.normal(0, 1e-9, cols),  # below eps * range
        np.round(rng.normal(0, 4, cols)),  # integers: many exact ties in rounding
        np.linspace(-1, 1, cols),
    ]
    return np.stack(rows)


def quant_cases(out_dir: str) -> None:
    d = os.path.join(out_dir, "mlx-quant")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    rng = np.random.default_rng(1234)
    inputs = {
        "normal": rng.normal(0, 0.05, (6, 256)),
        "wide": rng.normal(0, 1.0, (3, 512)) * np.linspace(0.1, 3, 512),
        "edge": edge_rows(128),
    }
    tensors, cases = {}, []
    for name, w in inputs.items():
        w = mx.array(w.astype(np.float32)).astype(mx.bfloat16)
        tensors[f"{name}.w"] = w
        for bits, group in [(4, 64), (8, 64), (4, 32), (4, 128), (8, 128)]:
            if w.shape[1] % group:
                continue
            key = f"{name}.b{bits}g{group}"
            q, s, b = mx.quantize(w, group_size=group, bits=bits)
            assert s.dtype == mx.bfloat16 and q.dtype == mx.uint32
            tensors[f"{key}.codes"] = q
            tensors[f"{key}.scales"] = s
            tensors[f"{key}.biases"] = b
            tensors[f"{key}.deq_bf16"] = mx.dequantize(q, s, b, group_size=group, bits=bits)
            tensors[f"{key}.deq_f32"] = mx.dequantize(
                q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
            assert tensors[f"{key}.deq_f32"].dtype == mx.float32
            cases.append({"input": name, "key": key, "bits": bits, "group_size": group,
                          "rows": w.shape[0], "cols": w.shape[1]})
    mx.save_safetensors(os.path.join(d, "cases.safetensors"), tensors)
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump({"mlx_version": mx.__version__, "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"mlx-quant: {len(cases)} cases")


# --------------------------------------------------------------------------------------------------
# The tiny model
# --------------------------------------------------------------------------------------------------


def write_tokenizer(d: str, vocab: int) -> None:
    """A word-level tokenizer (token i is "t{i}"): mlx_lm.convert loads and saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(d)


class GateRecorder(nn.Module):
    """Wraps a router; records the smallest softmax gap between the k-th and (k+1)-th expert."""

    def __init__(self, inner, k, log):
        super().__init__()
        self.inner, self.k, self.log = inner, k, log

    def __call__(self, x):
        y = self.inner(x)
        p = mx.softmax(y.astype(mx.float32), axis=-1, precise=True)
        top = mx.sort(p, axis=-1)[..., ::-1]
        self.log.append(float(mx.min(top[..., self.k - 1] - top[..., self.k])))
        return y


def load_f32(path: str):
    model, _ = mlx_lm.load(path)
    widen = lambda p: p.astype(mx.float32) if p.dtype == mx.bfloat16 else p  # noqa: E731
    model.update(tree_map(widen, model.parameters()))
    return model


def record_routers(model, k):
    log = []
    for layer in model.layers:
        layer.mlp.gate = GateRecorder(layer.mlp.gate, k, log)
    return log


def logits_of(model, tokens):
    out = model(mx.array([tokens]))
    return np.array(out[0].astype(mx.float32))


def greedy(model, prompt):
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    gen, margin = [], float("inf")
    for _ in range(GREEDY_NEW_TOKENS):
        row = np.array(logits.astype(mx.float32))
        top2 = np.sort(row)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        tok = int(row.argmax())
        gen.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return gen, margin


def top2_margin(logits):
    top = np.sort(logits, axis=-1)[:, -2:]
    return float((top[:, 1] - top[:, 0]).min())


def evaluate(q4_dir, seqs, prompt):
    model = load_f32(q4_dir)
    log = record_routers(model, TINY["num_experts_per_tok"])
    res = {"logits": {name: logits_of(model, toks) for name, toks in seqs.items()}}
    res["generated"], res["greedy_margin"] = greedy(model, prompt)
    full = logits_of(model, prompt + res["generated"])
    res["greedy_teacher_forced_agrees"] = full[len(prompt) - 1:-1].argmax(-1).tolist() == res["generated"]
    res["min_router_gap"] = min(log)
    res["tf_margin"] = min(top2_margin(v) for v in res["logits"].values())
    return res


def acceptable(res):
    if not all(np.isfinite(v).all() for v in res["logits"].values()):
        return "non-finite logits"
    if res["min_router_gap"] < MIN_ROUTER_GAP:
        return f"router gap {res['min_router_gap']:.3g}"
    if res["greedy_margin"] < MIN_GREEDY_MARGIN:
        return f"greedy margin {res['greedy_margin']:.3g}"
    if res["tf_margin"] < MIN_TF_MARGIN:
        return f"teacher-forced margin {res['tf_margin']:.3g}"
    if not res["greedy_teacher_forced_agrees"]:
        return "cached greedy and teacher-forced argmax disagree"
    return ""


def convert(hf_dir, q4_dir):
    mlx_lm.convert(hf_dir, q4_dir, quantize=True)  # the defaults: affine, group 64, 4 bits


def build_tiny(out_dir: str, work: str):
    config = mf.make_config(TINY)
    model = mf.new_model(config)
    for attempt in range(MAX_SEED_TRIES):
        seed = BASE_SEED + attempt
        state = mf.random_state(model, seed)
        hf_dir, q4_dir = os.path.join(work, f"hf-{seed}"), os.path.join(work, f"q4-{seed}")
        mf.write_official(hf_dir, mf.official_tensors(state, TINY, seed), TINY)
        write_tokenizer(hf_dir, TINY["vocab_size"])
        convert(hf_dir, q4_dir)
        seqs, prompt = mf.make_tokens(seed, TINY["vocab_size"], SEQUENCES)
        res = evaluate(q4_dir, seqs, prompt)
        why = acceptable(res)
        if not why:
            break
        print(f"  seed {seed} rejected: {why}")
    else:
        raise RuntimeError("no acceptable seed")
    print(f"  seed {seed}: router gap {res['min_router_gap']:.3e}, greedy margin {res['greedy_margin']:.3f}, "
          f"teacher-forced margin {res['tf_margin']:.3e}")

    hf_out, q4_out = os.path.join(out_dir, "tiny-mlx-hf"), os.path.join(out_dir, "tiny-mlx-q4")
    for src, dst in [(hf_dir, hf_out), (q4_dir, q4_out)]:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    entries = []
    for name, toks in seqs.items():
        fn = f"logits_{name}.npy"
        np.save(os.path.join(q4_out, fn), res["logits"][name].astype(np.float32))
        entries.append({"name": name, "tokens": toks, "logits": fn})
    cases = {
        "seed": seed,
        "oracle": "mlx_lm.load, every bf16 parameter widened to f32, f32 forward",
        "min_router_gap": res["min_router_gap"],
        "min_greedy_logit_margin": res["greedy_margin"],
        "min_teacher_forced_logit_margin": res["tf_margin"],
        "sequences": entries,
        "greedy": [{"prompt": prompt, "generated": res["generated"]}],
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
    }
    with open(os.path.join(q4_out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    return hf_out, q4_out, seqs


def check_lily(lily: str, hf_dir: str, q4_dir: str, seqs, work: str):
    """`lily quantize` must write mlx-lm's bytes, and mlx-lm must load what it writes."""
    out = os.path.join(work, "lily-q4")
    subprocess.run([lily, "quantize", "--model", hf_dir, "--out", out], check=True)
    theirs, ours = {}, {}
    for d, into in [(q4_dir, theirs), (out, ours)]:
        for fn in os.listdir(d):
            if fn.endswith(".safetensors"):
                into.update(mx.load(os.path.join(d, fn)))
    assert sorted(theirs) == sorted(ours), sorted(set(theirs) ^ set(ours))
    for name, t in theirs.items():
        o = ours[name]
        assert t.dtype == o.dtype and t.shape == o.shape, (name, t.dtype, o.dtype, t.shape, o.shape)
        assert mx.array_equal(t, o).item(), f"{name} differs"
    with open(os.path.join(q4_dir, "config.json")) as f:
        q_theirs = json.load(f)["quantization"]
    with open(os.path.join(out, "config.json")) as f:
        q_ours = json.load(f)["quantization"]
    assert q_theirs == q_ours, (q_theirs, q_ours)
    a, b = load_f32(q4_dir), load_f32(out)
    for toks in seqs.values():
        assert np.array_equal(logits_of(a, toks), logits_of(b, toks))
    print(f"  lily quantize: {len(ours)} tensors byte-identical to mlx-lm's; mlx-lm loads them")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--lily", help="a lily binary whose `quantize` to check against mlx-lm")
    args = ap.parse_args()
    print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}")
    quant_cases(args.out)
    with tempfile.TemporaryDirectory() as work:
        hf_dir, q4_dir, seqs = build_tiny(args.out, work)
        if args.lily:
            check_lily(args.lily, hf_dir, q4_dir, seqs, work)


if __name__ == "__main__":
    main()

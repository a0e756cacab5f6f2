#!/usr/bin/env python3
"""Independent float64 NumPy implementation of /work/shared/spec/model.md (text path), written from
the spec, not from transformers. Recomputes every teacher-forced sequence of a fixture directory and
compares with the logits transformers produced (exit 1 if the relative error exceeds 1e-4).

    python3 tools/spec_reference.py tests/fixtures/tiny-a

Reads both layouts: save_pretrained's per-expert f32 `model.safetensors`, and the official
multimodal layout (sharded bf16, `model.language_model.` prefix, fused experts). Slow and simple on
purpose: recurrent (token-by-token) Gated DeltaNet, one expert at a time.
"""
import json, sys, os
import numpy as np
from safetensors.numpy import load_file
d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
W = {}
if os.path.exists(f"{d}/model.safetensors"):
    W = {k: v.astype(np.float64) for k, v in load_file(f"{d}/model.safetensors").items()}
    pre = "model."
else:
    import torch
    from safetensors.torch import load_file as lt
    idx = json.load(open(f"{d}/model.safetensors.index.json"))
    for fn in set(idx["weight_map"].values()):
        W.update({k: v.float().numpy().astype(np.float64) for k, v in lt(f"{d}/{fn}").items()})
    cfg = cfg["text_config"]; pre = "model.language_model."
H = cfg["hidden_size"]; eps = cfg["rms_norm_eps"]
def rms1p(x, w): return x / np.sqrt((x*x).mean(-1, keepdims=True) + eps) * (1 + w)
def silu(x): return x / (1 + np.exp(-x))
def sigmoid(x): return 1 / (1 + np.exp(-x))
def softplus(x): return np.log1p(np.exp(x))
def l2(x): return x / np.sqrt((x*x).sum(-1, keepdims=True) + 1e-6)
rp = cfg["rope_parameters"]
def experts(p, e):
    if f"{p}mlp.experts.gate_up_proj" in W:
        gu = W[f"{p}mlp.experts.gate_up_proj"][e]; I = gu.shape[0]//2
        return gu[:I], gu[I:], W[f"{p}mlp.experts.down_proj"][e]
    return (W[f"{p}mlp.experts.{e}.gate_proj.weight"], W[f"{p}mlp.experts.{e}.up_proj.weight"], W[f"{p}mlp.experts.{e}.down_proj.weight"])
def moe(p, x):
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    lg = x @ W[f"{p}mlp.gate.weight"].T
    pr = np.exp(lg - lg.max(-1, keepdims=True)); pr /= pr.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-pr[t])[:k]; w = pr[t, top] / pr[t, top].sum()
        for wi, e in zip(w, top):
            g, u, dn = experts(p, e)
            out[t] += wi * ((silu(x[t] @ g.T) * (x[t] @ u.T)) @ dn.T)
    sh = (silu(x @ W[f"{p}mlp.shared_expert.gate_proj.weight"].T) * (x @ W[f"{p}mlp.shared_expert.up_proj.weight"].T)) @ W[f"{p}mlp.shared_expert.down_proj.weight"].T
    return out + sigmoid(x @ W[f"{p}mlp.shared_expert_gate.weight"].T) * sh
def attn(p, x):
    T = x.shape[0]; nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    qg = (x @ W[f"{p}self_attn.q_proj.weight"].T).reshape(T, nh, 2*hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh*hd)
    k = (x @ W[f"{p}self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
    v = (x @ W[f"{p}self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    q = rms1p(q, W[f"{p}self_attn.q_norm.weight"]); k = rms1p(k, W[f"{p}self_attn.k_norm.weight"])
    rd = int(hd * rp["partial_rotary_factor"]); half = rd // 2
    inv = rp["rope_theta"] ** (-np.arange(half) * 2 / rd)
    th = np.arange(T)[:, None] * inv[None]; c, s = np.cos(th)[:, None], np.sin(th)[:, None]
    def rope(z):
        z = z.copy(); a, b = z[..., :half].copy(), z[..., half:rd].copy()
        z[..., :half] = a*c - b*s; z[..., half:rd] = b*c + a*s; return z
    q, k = rope(q), rope(k)
    o = np.zeros((T, nh, hd)); g = nh // nkv
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for h in range(nh):
        sc = q[:, h] @ k[:, h//g].T / np.sqrt(hd) + mask
        sc = np.exp(sc - sc.max(-1, keepdims=True)); sc /= sc.sum(-1, keepdims=True)
        o[:, h] = sc @ v[:, h//g]
    return (o.reshape(T, -1) * sigmoid(gate)) @ W[f"{p}self_attn.o_proj.weight"].T
def gdn(p, x):
    T = x.shape[0]; nk, nv, dk, dv, K = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    m = x @ W[f"{p}linear_attn.in_proj_qkv.weight"].T
    z = (x @ W[f"{p}linear_attn.in_proj_z.weight"].T).reshape(T, nv, dv)
    b = x @ W[f"{p}linear_attn.in_proj_b.weight"].T; a = x @ W[f"{p}linear_attn.in_proj_a.weight"].T
    cw = W[f"{p}linear_attn.conv1d.weight"][:, 0, :]
    mp = np.concatenate([np.zeros((K-1, m.shape[1])), m])
    c = silu(np.stack([(mp[t:t+K] * cw.T).sum(0) for t in range(T)]))
    q = l2(c[:, :nk*dk].reshape(T, nk, dk)) / np.sqrt(dk); k = l2(c[:, nk*dk:2*nk*dk].reshape(T, nk, dk)); v = c[:, 2*nk*dk:].reshape(T, nv, dv)
    beta = sigmoid(b); g = -np.exp(W[f"{p}linear_attn.A_log"]) * softplus(a + W[f"{p}linear_attn.dt_bias"])
    S = np.zeros((nv, dk, dv)); o = np.zeros((T, nv, dv)); r = nv // nk
    for t in range(T):
        for j in range(nv):
            kk, qq = k[t, j//r], q[t, j//r]
            S[j] *= np.exp(g[t, j]); d = beta[t, j] * (v[t, j] - S[j].T @ kk)
            S[j] += np.outer(kk, d); o[t, j] = S[j].T @ qq
    n = o / np.sqrt((o*o).mean(-1, keepdims=True) + eps) * W[f"{p}linear_attn.norm.weight"] * silu(z)
    return n.reshape(T, -1) @ W[f"{p}linear_attn.out_proj.weight"].T
worst = 0.0
cases = json.load(open(f"{d}/cases.json"))
for sq in cases["sequences"]:
    toks = sq["tokens"]; h = W[f"{pre}embed_tokens.weight"][toks]
    for i, lt_ in enumerate(cfg["layer_types"]):
        p = f"{pre}layers.{i}."
        xn = rms1p(h, W[f"{p}input_layernorm.weight"])
        h = h + (gdn(p, xn) if lt_ == "linear_attention" else attn(p, xn))
        h = h + moe(p, rms1p(h, W[f"{p}post_attention_layernorm.weight"]))
    logits = rms1p(h, W[f"{pre}norm.weight"]) @ W["lm_head.weight"].T
    ref = np.load(f"{d}/{sq['logits']}")
    err = np.abs(logits - ref).max() / np.abs(ref).max()
    worst = max(worst, err)
    print(os.path.basename(os.path.normpath(d)), sq["name"], f"rel err vs transformers: {err:.2e}",
          "argmax agree:", bool((logits.argmax(-1) == ref.argmax(-1)).all()))
sys.exit(0 if worst <= 1e-4 else 1)

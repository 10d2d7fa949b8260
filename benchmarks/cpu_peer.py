#!/usr/bin/env python3
"""PyTorch eager peer of `foldmoe bench model --device cpu --model tiny`.

The same model and step as foldmoe's default model `tiny`
(models/src/tiny.rs): bytes in (V 256), D 128, S 128; block 0 with a dense
SwiGLU MLP (ffn 384), blocks 1..3 MoE (16 experts of ffn 128, softmax
router, top-2, one shared expert of ffn 128, switch aux loss 1e-2, z-loss
1e-3); every block GQA attention (4 query / 2 kv heads of 32) with RoPE
(theta 1e4) through `scaled_dot_product_attention`; RMSNorm (eps 1e-5),
untied head, cross-entropy; AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8,
weight decay 0.1) after clipping the gradient norm to 1.0. f32 throughout,
as foldmoe's CPU default. The experts run one `matmul` per expert on the
tokens routed to it (what eager PyTorch users write).

The parameter count is printed and must equal foldmoe's
(`bench model` prints it as dims.params); `--expect-params N` checks it.

    python3 benchmarks/cpu_peer.py --threads 2 --tokens 4096 --layers 4

prints one JSON line: time_ms (median), time_ms_min, tokens_per_s, params.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

TINY = dict(vocab=256, hidden=128, seq=128, heads=4, kv_heads=2, head_dim=32,
            dense_ffn=384, experts=16, top_k=2, expert_ffn=128, shared_ffn=128,
            aux_coef=1e-2, z_coef=1e-3, eps=1e-5, theta=1e4, dense_layers=1)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq, hd, theta):
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def rope(x, cos, sin):
    # x: [B, H, S, hd]; pairs are the two halves (rotate_half).
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, h, kv, hd = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"]
        self.h, self.kv, self.hd = h, kv, hd
        self.wq = nn.Linear(d, h * hd, bias=False)
        self.wk = nn.Linear(d, kv * hd, bias=False)
        self.wv = nn.Linear(d, kv * hd, bias=False)
        self.wo = nn.Linear(h * hd, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, self.h * self.hd))


class SwiGlu(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Moe(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, e, f = c["hidden"], c["experts"], c["expert_ffn"]
        self.e, self.k = e, c["top_k"]
        self.aux_coef, self.z_coef = c["aux_coef"], c["z_coef"]
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w3 = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w2 = nn.Parameter(torch.randn(e, f, d) * 0.02)
        self.shared = SwiGlu(d, c["shared_ffn"])

    def forward(self, x):
        t = x.shape[0]
        logits = self.router(x)
        probs = logits.softmax(-1)
        weights, experts = probs.topk(self.k, dim=-1)
        # Switch aux loss: E · Σ_e f_e · P_e, f the routed share, P the mean prob.
        counts = torch.bincount(experts.flatten(), minlength=self.e).float()
        aux = self.e * (counts / (t * self.k) * probs.mean(0)).sum() * self.aux_coef
        z = torch.logsumexp(logits, -1).pow(2).mean() * self.z_coef
        out = self.shared(x)
        order = experts.flatten().argsort()
        token_of = order // self.k
        w_sorted = weights.flatten()[order]
        start = 0
        for j, n in enumerate(counts.long().tolist()):
            if n == 0:
                continue
            idx = token_of[start:start + n]
            h = x[idx]
            y = (F.silu(h @ self.w1[j]) * (h @ self.w3[j])) @ self.w2[j]
            out = out.index_add(0, idx, y * w_sorted[start:start + n, None])
            start += n
        return out, aux + z


class Block(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.attn_norm = RMSNorm(c["hidden"], c["eps"])
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c["hidden"], c["eps"])
        self.moe = moe
        self.ffn = Moe(c) if moe else SwiGlu(c["hidden"], c["dense_ffn"])

    def forward(self, x, cos, sin):
        h = x + self.attn(self.attn_norm(x), cos, sin)
        b, s, d = h.shape
        y = self.ffn_norm(h).reshape(b * s, d)
        if self.moe:
            y, aux = self.ffn(y)
        else:
            y, aux = self.ffn(y), h.new_zeros(())
        return h + y.view(b, s, d), aux


class Tiny(nn.Module):
    def __init__(self, c, layers):
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["hidden"])
        self.blocks = nn.ModuleList(Block(c, i >= c["dense_layers"]) for i in range(layers))
        self.norm = RMSNorm(c["hidden"], c["eps"])
        self.head = nn.Linear(c["hidden"], c["vocab"], bias=False)
        cos, sin = rope_tables(c["seq"], c["head_dim"], c["theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids, targets):
        x = self.embed(ids)
        aux = x.new_zeros(())
        for blk in self.blocks:
            x, a = blk(x, self.cos, self.sin)
            aux = aux + a
        logits = self.head(self.norm(x))
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ce + aux, ce


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expect-params", type=int, default=None,
                   help="fail unless the model has exactly this many parameters")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    c = TINY
    if a.tokens % c["seq"]:
        sys.exit(f"--tokens {a.tokens} is not a multiple of seq {c['seq']}")
    model = Tiny(c, a.layers)
    params = sum(q.numel() for q in model.parameters())
    if a.expect_params is not None and params != a.expect_params:
        sys.exit(f"the peer has {params} parameters, foldmoe's model {a.expect_params}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    gen = torch.Generator().manual_seed(a.seed + 1)
    batch = a.tokens // c["seq"]
    data = torch.randint(0, c["vocab"], (batch, c["seq"] + 1), generator=gen)
    ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    losses, times = [], []
    for i in range(a.warmup + a.iters):
        t0 = time.perf_counter()
        loss, ce = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= a.warmup:
            times.append(dt)
        losses.append(ce.item())
    med = statistics.median(times)
    print(json.dumps(dict(bench="model", peer="pytorch-eager", torch=torch.__version__,
                          threads=a.threads, layers=a.layers, tokens=a.tokens, params=params,
                          time_ms=med * 1e3, time_ms_min=min(times) * 1e3,
                          tokens_per_s=a.tokens / med, first_loss=losses[0],
                          last_loss=losses[-1],
                          uniform_loss=math.log(c["vocab"]))))


if __name__ == "__main__":
    main()

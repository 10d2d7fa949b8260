#!/usr/bin/env python3
"""PyTorch peer benchmark for foldmoe.

Measures the same two workloads as the Rust CUDA benchmarks, in eager
PyTorch, so the two can be compared on one GPU:

  moe-layer  forward + backward of one dropless top-k MoE layer (bf16)
  model      one training step (forward, backward, AdamW) of Qwen3-30B-A3B
             cut to --layers layers, every layer MoE
  gemm       the layer's grouped GEMMs alone (torch._grouped_mm): fc1 and fc2
             shapes, forward, data gradient and weight gradient, in TFLOP/s
             (2*M*K*N each), --tokens * --top-k rows in --experts equal groups
  attention  causal scaled_dot_product_attention, forward and backward alone,
             with the flash and cuDNN backends (kv heads repeated, and
             enable_gqa where the backend takes it); --head-dim, --seq, and
             --mla (query/key 192, value 128); FLOPs count the causal half:
             forward B*Hq*S^2*(Dqk + Dv), backward twice that

--compile (moe-layer, model) wraps the layer / the model in torch.compile;
--compile-mode passes its mode (reduce-overhead: replayed as CUDA graphs).

The last line on stdout is one JSON object; everything else (tracebacks,
warnings) goes to stderr. See benchmarks/README.md for the FLOP formulas.
"""

import argparse
import json
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

# Dense bf16 tensor-core peak of one H200 (SXM), the denominator of "mfu".
PEAK_BF16_FLOPS = 989e12

# Dims of Qwen3-30B-A3B (the real model has 48 layers; --layers cuts it).
PRESETS = {
    "qwen3-30b-a3b": dict(
        tokens=16384, hidden=2048, experts=128, top_k=8, expert_ffn=768,
        heads=32, kv_heads=4, head_dim=128, vocab=151936, seq=4096, layers=4,
    ),
    # Small enough for a CPU in seconds; same structure (GQA, top-k > 1).
    "tiny": dict(
        tokens=256, hidden=64, experts=8, top_k=2, expert_ffn=32,
        heads=4, kv_heads=2, head_dim=16, vocab=512, seq=64, layers=2,
    ),
}


# --------------------------------------------------------------------------
# Grouped matmul
# --------------------------------------------------------------------------

def find_grouped_mm():
    """The public op appeared in 2.9; older builds only have the private one."""
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        fn = getattr(torch, "_grouped_mm", None)
    return fn


def grouped_mm_loop(a, b, offs):
    """Reference grouped matmul: one plain matmul per group.

    Same contract as grouped_mm for 2D a [rows, K] x 3D b [G, K, N] with
    offs [G] = cumulative END row of each group. Rows past offs[-1] (only
    present with --group-align) come out as zeros.
    """
    ends = offs.tolist()
    parts, start = [], 0
    for g, end in enumerate(ends):
        parts.append(a[start:end] @ b[g])
        start = end
    if start < a.shape[0]:
        parts.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))
    return torch.cat(parts, dim=0)


def make_gmm(impl):
    if impl == "loop":
        return grouped_mm_loop
    fn = find_grouped_mm()
    if fn is None:
        raise RuntimeError(
            "this PyTorch has neither torch.nn.functional.grouped_mm nor "
            "torch._grouped_mm; use --expert-impl loop")

    def gmm(a, b, offs):
        return fn(a, b, offs=offs)
    return gmm


# --------------------------------------------------------------------------
# MoE layer (shared by both benchmarks)
# --------------------------------------------------------------------------

def moe_forward(x, router_w, w1, w2, top_k, aux_coef, gmm, group_align=1):
    """Dropless top-k MoE with SwiGLU experts; returns (out bf16 [T,H], aux).

    x: [T, H] any float dtype. router_w: [E, H]. w1: [E, H, 2F] (gate | up
    along the last dim). w2: [E, F, H]. Parameters may be fp32 masters: the
    casts below are autograd-tracked, so their gradients land in fp32.
    """
    T, H = x.shape
    E = router_w.shape[0]

    # Routing runs in fp32 even inside an autocast region: small logit
    # differences decide the top-k, and bf16 would blur them.
    with torch.autocast(device_type=x.device.type, enabled=False):
        logits = x.float() @ router_w.float().t()           # [T, E]
        probs = torch.softmax(logits, dim=-1)
        top_w, top_e = probs.topk(top_k, dim=-1)            # [T, k]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)     # norm_topk_prob

        flat_e = top_e.reshape(-1)                          # [T*k], t-major
        # Per-expert counts without a host sync (bincount on CUDA syncs to
        # size its output; scatter_add into a fixed-size buffer does not).
        counts = torch.zeros(E, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_e, torch.ones_like(flat_e))

        # Switch-style load-balancing loss; f carries no gradient, P does.
        f = counts.float() / (T * top_k)
        p_mean = probs.mean(dim=0)
        aux = aux_coef * E * (f * p_mean).sum()

    # Permute: group the T*k assignments by expert. Stable so rows keep token
    # order inside a group, which makes runs reproducible.
    order = torch.argsort(flat_e, stable=True)
    token_of_row = order // top_k
    row_w = top_w.reshape(-1)[order]

    xb = x.to(torch.bfloat16)
    x_perm = xb.index_select(0, token_of_row)               # [T*k, H]
    ends = torch.cumsum(counts, dim=0)
    w1b = w1.to(torch.bfloat16)
    w2b = w2.to(torch.bfloat16)

    if group_align > 1:
        # Escape hatch for builds whose kernel wants every group's row count
        # aligned: scatter rows into groups padded with zero rows. The buffer
        # has a static worst-case size so no host sync is needed; rows past
        # the last offset are never read back.
        padded = (counts + group_align - 1) // group_align * group_align
        pad_ends = torch.cumsum(padded, dim=0)
        sorted_e = flat_e.index_select(0, order)
        rank_in_group = torch.arange(T * top_k, device=x.device) - (ends - counts)[sorted_e]
        dest = (pad_ends - padded)[sorted_e] + rank_in_group
        cap = T * top_k + E * (group_align - 1)
        x_in = x_perm.new_zeros(cap, H).index_copy(0, dest, x_perm)
        offs = pad_ends.to(torch.int32)
    else:
        x_in = x_perm
        offs = ends.to(torch.int32)

    h = gmm(x_in, w1b, offs)                                # [rows, 2F]
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up                                 # [rows, F]
    y = gmm(act, w2b, offs)                                 # [rows, H]
    if group_align > 1:
        y = y.index_select(0, dest)

    y = y * row_w.to(torch.bfloat16).unsqueeze(-1)
    # Unpermute: sum each token's k expert outputs; fp32 accumulation so the
    # order of the k additions does not matter at bf16 resolution.
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    out = out.index_add(0, token_of_row, y.float())
    return out.to(torch.bfloat16), aux


@torch.no_grad()
def moe_reference(x, router_w, w1, w2, top_k):
    """Independent fp32 formulation (mask per expert, no permutation), used by
    --check to catch permutation/unpermutation mistakes."""
    T, H = x.shape
    E = router_w.shape[0]
    F_ = w2.shape[1]
    xf = x.float()
    probs = torch.softmax(xf @ router_w.float().t(), dim=-1)
    top_w, top_e = probs.topk(top_k, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (top_e == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xf[tok] @ w1[e].float()
        y = (F.silu(h[:, :F_]) * h[:, F_:]) @ w2[e].float()
        out.index_add_(0, tok, y * top_w[tok, slot].unsqueeze(-1))
    return out


# --------------------------------------------------------------------------
# Model (Qwen3-MoE shaped, every layer MoE)
# --------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # fp32 statistics regardless of autocast; output stays fp32 and the
        # following matmul's autocast cast turns it into bf16.
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq, head_dim, theta, device):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)                 # [S, d], half-split
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    # Half-split rotation (HF "rotate_half"), the layout Qwen3 uses.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.nh, self.nkv, self.d = a.heads, a.kv_heads, a.head_dim
        self.wq = nn.Linear(a.hidden, a.heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.heads * a.head_dim, a.hidden, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.nh, self.d).transpose(1, 2)
        k = self.wk(x).view(B, S, self.nkv, self.d).transpose(1, 2)
        v = self.wv(x).view(B, S, self.nkv, self.d).transpose(1, 2)
        # RoPE multiplies by fp32 tables; cast back so SDPA sees bf16 and can
        # use a flash kernel.
        q = apply_rope(q, cos, sin).to(torch.bfloat16)
        k = apply_rope(k, cos, sin).to(torch.bfloat16)
        v = v.to(torch.bfloat16)
        if self.nkv != self.nh:
            # Explicit KV repeat instead of enable_gqa=True: every SDPA
            # backend accepts it, and the copy is small next to the rest.
            rep = self.nh // self.nkv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, self.nh * self.d))


class MoE(nn.Module):
    def __init__(self, a, gmm):
        super().__init__()
        self.top_k, self.aux_coef, self.gmm, self.align = a.top_k, a.aux_coef, gmm, a.group_align
        E, H, Fd = a.experts, a.hidden, a.expert_ffn
        self.router = nn.Parameter(torch.randn(E, H) * 0.02)
        self.w1 = nn.Parameter(torch.randn(E, H, 2 * Fd) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, Fd, H) * 0.02)

    def forward(self, x):
        return moe_forward(x, self.router, self.w1, self.w2, self.top_k,
                           self.aux_coef, self.gmm, self.align)


class Block(nn.Module):
    def __init__(self, a, gmm):
        super().__init__()
        self.ln1 = RMSNorm(a.hidden, a.norm_eps)
        self.attn = Attention(a)
        self.ln2 = RMSNorm(a.hidden, a.norm_eps)
        self.moe = MoE(a, gmm)

    def forward(self, x, cos, sin):
        h = x + self.attn(self.ln1(x), cos, sin)
        B, S, H = h.shape
        m, aux = self.moe(self.ln2(h).reshape(B * S, H))
        return h + m.view(B, S, H), aux


class Model(nn.Module):
    def __init__(self, a, gmm):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Block(a, gmm) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, a.norm_eps)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False)    # untied
        cos, sin = rope_tables(a.seq, a.head_dim, a.rope_theta, self.head.weight.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids, targets):
        x = self.embed(ids)                                     # fp32 residual stream
        aux_total = x.new_zeros(())
        for blk in self.layers:
            x, aux = blk(x, self.cos, self.sin)
            aux_total = aux_total + aux
        logits = self.head(self.norm(x))                        # bf16 under autocast
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return ce + aux_total, ce


# --------------------------------------------------------------------------
# FLOP formulas (kept in sync with benchmarks/README.md and the Rust bench)
# --------------------------------------------------------------------------

def moe_flops_per_token_fwd(a):
    # router + k experts of (fc1 [H -> 2F] + fc2 [F -> H]); 2 FLOPs per MAC
    return 2 * a.hidden * a.experts + a.top_k * (2 * a.hidden * 2 * a.expert_ffn
                                                 + 2 * a.expert_ffn * a.hidden)


def moe_layer_flops(a):
    # backward = 2x forward
    return 3 * a.tokens * moe_flops_per_token_fwd(a)


def model_flops_per_step(a):
    H, qd, kvd = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    per_layer = (2 * H * (qd + 2 * kvd)          # q, k, v projections
                 + 2 * qd * H                     # output projection
                 + moe_flops_per_token_fwd(a)     # router + experts
                 + 4 * a.seq * qd)                # QK^T and PV over the full S (Megatron)
    head = 2 * H * a.vocab
    return 3 * a.tokens * (a.layers * per_layer + head)


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

def time_it(fn, warmup, iters, device):
    """Median and min milliseconds per call, after warmup."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = []
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


# --------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------

def bench_moe_layer(a, device, gmm, result):
    T, H, E, Fd = a.tokens, a.hidden, a.experts, a.expert_ffn
    bf16 = torch.bfloat16
    x = torch.randn(T, H, device=device, dtype=bf16).requires_grad_()
    router_w = (torch.randn(E, H, device=device) * 0.02).to(bf16).requires_grad_()
    w1 = (torch.randn(E, H, 2 * Fd, device=device) * 0.02).to(bf16).requires_grad_()
    w2 = (torch.randn(E, Fd, H, device=device) * 0.02).to(bf16).requires_grad_()
    grad_seed = torch.randn(T, H, device=device)
    leaves = (x, router_w, w1, w2)

    if a.check:
        out, _ = moe_forward(x.detach(), router_w.detach(), w1.detach(), w2.detach(),
                             a.top_k, a.aux_coef, gmm, a.group_align)
        ref = moe_reference(x.detach(), router_w.detach(), w1.detach(), w2.detach(), a.top_k)
        err = (out.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        result["check_max_abs_err"] = err
        result["check_ref_max_abs"] = scale
        result["check_rel_err"] = err / max(scale, 1e-30)

    layer = moe_forward
    if a.compile:
        layer = torch.compile(moe_forward, mode=a.compile_mode)

    graphs = a.compile and a.compile_mode == "reduce-overhead"

    def step():
        if graphs:
            # Each call is a new step: cudagraph trees may reuse its buffers.
            torch.compiler.cudagraph_mark_step_begin()
        for p in leaves:
            p.grad = None
        out, aux = layer(x, router_w, w1, w2, a.top_k, a.aux_coef, gmm, a.group_align)
        loss = (out.float() * grad_seed).sum() + aux
        loss.backward()
        return loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    med, mn = time_it(step, a.warmup, a.iters, device)
    flops = moe_layer_flops(a)
    result.update(time_ms=med, time_ms_min=mn, flops=flops,
                  tflops=flops / (med * 1e-3) / 1e12)
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30


def bench_gemm(a, device, result):
    """The grouped GEMMs of the MoE layer alone, the calls autograd makes."""
    fn = find_grouped_mm()
    if fn is None:
        raise RuntimeError("this PyTorch has no grouped_mm")
    M, G = a.tokens * a.top_k, a.experts
    if M % G:
        raise ValueError(f"{M} routed rows do not split into {G} equal groups")
    bf16 = torch.bfloat16
    offs = torch.arange(1, G + 1, device=device, dtype=torch.int32) * (M // G)
    rows = []
    for name, K, N in (("fc1", a.hidden, a.expert_ffn), ("fc2", a.expert_ffn, a.hidden)):
        x = torch.randn(M, K, device=device, dtype=bf16)
        w = (torch.randn(G, K, N, device=device) * 0.02).to(bf16)
        dy = torch.randn(M, N, device=device, dtype=bf16)
        flops = 2.0 * M * K * N
        products = (
            ("forward", lambda: fn(x, w, offs=offs)),
            ("dgrad", lambda: fn(dy, w.transpose(-2, -1), offs=offs)),
            ("wgrad", lambda: fn(x.t(), dy, offs=offs)),
        )
        for product, call in products:
            med, _ = time_it(call, a.warmup, a.iters, device)
            rows.append(dict(shape=name, product=product, m=M, k=K, n=N, groups=G,
                             time_ms=med, tflops=flops / (med * 1e-3) / 1e12))
    result["results"] = rows


def bench_attention(a, device, result):
    """Causal SDPA forward and backward per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if a.tokens % a.seq:
        raise ValueError(f"--tokens {a.tokens} is not a multiple of --seq {a.seq}")
    B, S, Hq, Hkv = a.tokens // a.seq, a.seq, a.heads, a.kv_heads
    Dqk, Dv = (192, 128) if a.mla else (a.head_dim, a.head_dim)
    bf16 = torch.bfloat16
    q = torch.randn(B, Hq, S, Dqk, device=device, dtype=bf16, requires_grad=True)
    k = torch.randn(B, Hkv, S, Dqk, device=device, dtype=bf16, requires_grad=True)
    v = torch.randn(B, Hkv, S, Dv, device=device, dtype=bf16, requires_grad=True)
    do = torch.randn(B, Hq, S, Dv, device=device, dtype=bf16)
    fwd_flops = float(B * Hq * S * S * (Dqk + Dv))
    rows = []
    for backend, bname in ((SDPBackend.FLASH_ATTENTION, "flash"),
                           (SDPBackend.CUDNN_ATTENTION, "cudnn")):
        for gqa in ("repeat", "enable_gqa"):
            row = dict(backend=bname, gqa=gqa)
            try:
                with sdpa_kernel(backend):
                    def fwd():
                        if gqa == "repeat":
                            kk = k.repeat_interleave(Hq // Hkv, dim=1)
                            vv = v.repeat_interleave(Hq // Hkv, dim=1)
                            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True)
                    with torch.no_grad():
                        fmed, _ = time_it(fwd, a.warmup, a.iters, device)
                    out = fwd()
                    bmed, _ = time_it(lambda: torch.autograd.grad(out, (q, k, v), do,
                                                                  retain_graph=True),
                                      a.warmup, a.iters, device)
                row.update(forward_ms=fmed, forward_tflops=fwd_flops / (fmed * 1e-3) / 1e12,
                           backward_ms=bmed,
                           backward_tflops=2 * fwd_flops / (bmed * 1e-3) / 1e12)
            except Exception as exc:  # a backend that refuses the shape
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
    result["dims"].update(batch=B, qk_head_dim=Dqk, v_head_dim=Dv, causal=True)
    result["results"] = rows


def bench_model(a, device, gmm, result):
    if a.tokens % a.seq != 0:
        raise ValueError(f"--tokens {a.tokens} is not a multiple of --seq {a.seq}")
    batch = a.tokens // a.seq
    if a.heads % a.kv_heads != 0:
        raise ValueError("--heads must be a multiple of --kv-heads")

    # Built directly on the device: at full size the fp32 masters are ~12 GB (3.1 B params)
    # and building on the host first would only add a copy.
    with torch.device(device):
        model = Model(a, gmm)
    result["params"] = sum(p.numel() for p in model.parameters())
    forward = torch.compile(model, mode=a.compile_mode) if a.compile else model

    # Mixed precision: fp32 master parameters, AdamW on them, bf16 compute via
    # autocast; the MoE casts its expert weights to bf16 itself because
    # grouped_mm has no autocast rule.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            fused=device.type == "cuda")

    gen = torch.Generator(device="cpu").manual_seed(a.seed + 1)
    tokens = torch.randint(0, a.vocab, (batch, a.seq + 1), generator=gen).to(device)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    last = {}

    def step():
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss, ce = forward(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last["loss"], last["ce"] = loss.detach(), ce.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    med, mn = time_it(step, a.warmup, a.iters, device)
    flops = model_flops_per_step(a)
    tflops = flops / (med * 1e-3) / 1e12
    result.update(time_ms=med, time_ms_min=mn, flops=flops, flops_per_step=flops,
                  tflops=tflops, tokens_per_s=a.tokens / (med * 1e-3),
                  mfu=tflops * 1e12 / PEAK_BF16_FLOPS,
                  loss=last["loss"].item(), ce=last["ce"].item())
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

DIM_FLAGS = [  # (name, type)
    ("tokens", int), ("hidden", int), ("experts", int), ("top_k", int),
    ("expert_ffn", int), ("heads", int), ("kv_heads", int), ("head_dim", int),
    ("vocab", int), ("seq", int), ("layers", int),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", choices=["moe-layer", "model", "gemm", "attention"])
    p.add_argument("--device", default="cuda", help="cuda (the real run) or cpu (tiny smoke run)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="dims preset; default qwen3-30b-a3b on cuda, tiny on cpu. "
                        "Each dim flag below overrides the preset.")
    for name, typ in DIM_FLAGS:
        flags = ["--" + name.replace("_", "-")]
        if "_" in name:
            flags.append("--" + name)
        p.add_argument(*flags, dest=name, type=typ, default=None)
    p.add_argument("--rope-theta", "--rope_theta", dest="rope_theta", type=float, default=1e6)
    p.add_argument("--norm-eps", "--norm_eps", dest="norm_eps", type=float, default=1e-6)
    p.add_argument("--aux-coef", "--aux_coef", dest="aux_coef", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-impl", choices=["grouped", "loop"], default=None,
                   help="grouped = torch grouped_mm (default on cuda); "
                        "loop = one matmul per expert (default on cpu)")
    p.add_argument("--group-align", type=int, default=1,
                   help="pad each expert's rows to a multiple of this (1 = no padding)")
    p.add_argument("--compile", action="store_true",
                   help="moe-layer / model: time torch.compile of the layer / the model")
    p.add_argument("--compile-mode", default=None,
                   choices=["default", "reduce-overhead", "max-autotune",
                            "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode (reduce-overhead replays CUDA graphs)")
    p.add_argument("--mla", action="store_true",
                   help="attention: MLA's head dims (query/key 192, value 128)")
    p.add_argument("--check", action="store_true",
                   help="moe-layer: compare the layer's forward with an fp32 reference first")
    a = p.parse_args(argv)

    preset = PRESETS[a.preset or ("tiny" if a.device.startswith("cpu") else "qwen3-30b-a3b")]
    for name, _ in DIM_FLAGS:
        if getattr(a, name) is None:
            setattr(a, name, preset[name])
    if a.expert_impl is None:
        a.expert_impl = "loop" if a.device.startswith("cpu") else "grouped"
    if a.warmup < 0 or a.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    return a


def main(argv=None):
    a = parse_args(argv)
    result = {"peer": "pytorch", "torch": torch.__version__, "bench": a.bench}
    try:
        device = torch.device(a.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            result["device"] = torch.cuda.get_device_name(device)
        else:
            result["device"] = "cpu"
        result["dims"] = {name: getattr(a, name) for name, _ in DIM_FLAGS}
        result["dims"].update(rope_theta=a.rope_theta, norm_eps=a.norm_eps, aux_coef=a.aux_coef)
        if a.bench == "model":
            result["dims"]["batch"] = a.tokens // a.seq
        result.update(expert_impl=a.expert_impl, group_align=a.group_align,
                      warmup=a.warmup, iters=a.iters, compile=a.compile,
                      compile_mode=a.compile_mode)

        torch.manual_seed(a.seed)
        gmm = make_gmm(a.expert_impl)
        if a.bench == "moe-layer":
            bench_moe_layer(a, device, gmm, result)
        elif a.bench == "gemm":
            bench_gemm(a, device, result)
        elif a.bench == "attention":
            bench_attention(a, device, result)
        else:
            bench_model(a, device, gmm, result)
    except Exception as exc:  # OOM included: still one JSON line for the caller
        traceback.print_exc(file=sys.stderr)
        result["error"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
        if torch.cuda.is_available():
            result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(json.dumps(result), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

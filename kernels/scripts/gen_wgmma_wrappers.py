#!/usr/bin/env python3
"""Prints the wgmma wrappers of kernels/src/cuda/attention_sm90.cu.

Usage: gen_wgmma_wrappers.py ss:128 ss:96 rs:64 rs:128 rs:192
(ss: A and B from shared memory; rs: A from registers; the number is N of
m64nNk16, bf16 operands, f32 accumulators). The output is pasted between
the helpers and the kernels of the .cu file.
"""
import sys
def ss(n):
    r = n // 2
    regs = ", ".join(f"%{i}" for i in range(r))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
    return f'''// d[0..{r-1}] (+)= A · B, m64n{n}k16, A and B from shared memory (descriptors);
// TA / TB: A / B stored MN-major (1) or K-major (0); acc = 0 overwrites d.
template <int TA, int TB>
__device__ __forceinline__ void fa3_ss(float (&d)[{r}], unsigned long long da, unsigned long long db, int acc) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r+4}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, %{r}, %{r+1}, p, 1, 1, %{r+2}, %{r+3};\\n}}\\n"
        : {outs}
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(acc));
}}
'''
def rs(n):
    r = n // 2
    regs = ", ".join(f"%{i}" for i in range(r))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
    return f'''// d[0..{r-1}] (+)= A · B, m64n{n}k16, A from registers (a[0..3], the accumulator
// layout of 16 columns packed to bf16), B from shared memory; TB: B MN-major (1)
// or K-major (0).
template <int TB>
__device__ __forceinline__ void fa3_rs(float (&d)[{r}], const unsigned (&a)[4], unsigned long long db, int acc) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r+6}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, {{%{r}, %{r+1}, %{r+2}, %{r+3}}}, %{r+4}, p, 1, 1, %{r+5};\\n}}\\n"
        : {outs}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB), "r"(acc));
}}
'''
out = []
for spec in sys.argv[1:]:
    k, n = spec.split(":")
    out.append((ss if k == "ss" else rs)(int(n)))
print("\n".join(out))

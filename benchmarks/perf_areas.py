#!/usr/bin/env python3
"""Shares of a CPU training step by op area, from perf's call stacks.

    perf record -F 199 --call-graph dwarf,16384 -o step.data \\
        foldmoe bench model --device cpu --model tiny --layers 4 --tokens 4096 --iters 3
    perf script -i step.data | python3 benchmarks/perf_areas.py

Each sample goes to the innermost frame of foldmoe's CPU backend on its
stack (`foldmoe_kernels::cpu::<area>`, the op being run; a GEMM's frames
belong to the op that called it, and a GEMM job stolen by another rayon
worker to `linalg`), to the engine when no backend frame is on it, else to
the leaf's library (rayon's idle spinning, the kernel)."""
import collections
import re
import sys

BACKEND = re.compile(r"foldmoe_kernels::cpu::([a-z_0-9]+)")
ENGINE = re.compile(r"foldmoe_core::")

counts = collections.Counter()
stack = []




def flush():
    if not stack:
        return
    area = None
    for frame in stack:  # leaf first
        # The op's module, wherever it is named in the (inlined) frame;
        # `bf16` names only the Bf16 type of folded instantiations, `simd`
        # the wrapper that runs an op's loop compiled for AVX2, `pool` the
        # buffer pool an op takes its output from.
        mods = [m for m in BACKEND.findall(frame) if m not in ("bf16", "simd", "pool")]
        if mods:
            area = mods[0]
            break
    if area is None:
        if any("gemm_f32" in f or "gemm_common" in f for f in stack):
            # A GEMM's job run by another rayon worker: its stack starts
            # at the worker, without the op that queued it.
            area = "linalg"
        elif any(ENGINE.search(f) for f in stack):
            area = "engine (outside backend ops)"
        else:
            leaf = stack[0]
            area = "idle / runtime: " + ("kernel" if "[kernel" in leaf else
                                        "rayon" if "rayon" in leaf else "other")
    counts[area] += 1
    stack.clear()


for line in sys.stdin:
    if not line.strip():
        flush()
    elif line.startswith((" ", "\t")):
        stack.append(line.strip())
flush()
total = sum(counts.values()) or 1
print(f"| area | share of {total} samples |")
print("|---|---|")
for area, n in counts.most_common():
    print(f"| {area} | {100 * n / total:.1f} % |")

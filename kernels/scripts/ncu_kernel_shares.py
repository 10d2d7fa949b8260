"""Kernel shares of an ncu CSV (--metrics gpu__time_duration.sum --csv), summed
by kernel name per profiled step.  Usage: ncu_kernel_shares.py prof.csv [top]"""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
i = next(j for j, r in enumerate(rows) if r and r[0] == "ID")
h = rows[i]; ki = h.index("Kernel Name"); vi = h.index("Metric Value")
t = collections.defaultdict(float); c = collections.Counter()
for r in rows[i + 1:]:
    if len(r) <= vi: continue
    try: v = float(r[vi].replace(",", ""))
    except ValueError: continue
    k = r[ki][:50]; t[k] += v; c[k] += 1
# Steps: the router's top-k runs once a step (the grouped GEMM counts change
# with the fused kernels); the older profiles' three nn GEMMs a step otherwise.
topk = sum(v for k, v in c.items() if k.startswith("topk_"))
steps = topk or c.get("grouped_mm_wgmma_bf16_nn", c.get("grouped_mm_tc_bf16_nn", 3)) / 3
tot = sum(t.values())
print(f"launches {sum(c.values())}; total {tot/1e6:.2f} ms over {steps:.0f} profiled steps (~{tot/1e6/steps:.2f} ms per step)")
for k, v in sorted(t.items(), key=lambda x: -x[1])[:int(sys.argv[2]) if len(sys.argv) > 2 else 14]:
    print(f"  {v/1e6/steps:7.3f} ms/step {100*v/tot:5.1f}% x{c[k]/steps:3.0f}/step {k}")

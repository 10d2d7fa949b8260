#!/usr/bin/env bash
# One training step of `tiny` on the CPU: foldmoe against its PyTorch eager
# peer (benchmarks/cpu_peer.py, the same model and step), back to back, on
# 2 threads and on 1. Prints each side's JSON, then a table with the ratio.
#
#   benchmarks/cpu_vs_torch.sh [PYTHON] [FOLDMOE]
#
# PYTHON: an interpreter with torch 2.11 (default python3); FOLDMOE: the
# release binary (default target/release/foldmoe). Environment: TOKENS
# (4096), LAYERS (4), ITERS (10), WARMUP (3), THREADS ("2 1").
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
bin=${2:-target/release/foldmoe}
tokens=${TOKENS:-4096}
layers=${LAYERS:-4}
iters=${ITERS:-10}
warmup=${WARMUP:-3}
threads=${THREADS:-2 1}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

for n in $threads; do
  RAYON_NUM_THREADS=$n "$bin" bench model --device cpu --model tiny --layers "$layers" \
    --tokens "$tokens" --iters "$iters" --warmup "$warmup" > "$out/foldmoe-$n.json"
  params=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["dims"]["params"])' \
    "$out/foldmoe-$n.json")
  "$py" benchmarks/cpu_peer.py --threads "$n" --tokens "$tokens" --layers "$layers" \
    --iters "$iters" --warmup "$warmup" --expect-params "$params" > "$out/torch-$n.json"
  cat "$out/foldmoe-$n.json" "$out/torch-$n.json"
done

"$py" - "$out" $threads <<'EOF'
import json, sys
out, threads = sys.argv[1], sys.argv[2:]
print("| threads | foldmoe ms | foldmoe tok/s | PyTorch eager ms | PyTorch tok/s | ratio (tok/s) |")
print("|---|---|---|---|---|---|")
for n in threads:
    f = json.load(open(f"{out}/foldmoe-{n}.json"))
    t = json.load(open(f"{out}/torch-{n}.json"))
    print(f"| {n} | {f['time_ms']:.1f} | {f['tokens_per_s']:.0f} | {t['time_ms']:.1f} | "
          f"{t['tokens_per_s']:.0f} | {f['tokens_per_s'] / t['tokens_per_s']:.2f} |")
EOF

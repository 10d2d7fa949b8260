#!/bin/bash
# One device call for the grouped GEMMs (issue 18): the CUDA tests, the
# sanitizer on the small wgmma case, the timings and the PyTorch peer.
# Usage (repo root, on the GPU machine):
#   kernels/scripts/grouped_gemm_device.sh <test binary> [steps] [foldmoe binary]
# steps: any of tests,all,san,time,peer,layer,prof,f8overlap,pdl (default
# tests,san,time,peer); layer, prof, f8overlap and pdl need the foldmoe binary.
# f8overlap: the fp8 tests and a memcheck of V3's chained tiles with
# FOLDMOE_F8_OVERLAP=1, then bench gemm --fp8 and bench moe-layer --fp8 at
# OVERLAP 0 / 1 alternated (with `all`: the tests at the default too).
# pdl: every CUDA test with FOLDMOE_PDL=1 (programmatic dependent launches),
# then bench moe-layer, attention (alternated twice) and model at PDL 0 / 1.
# Logs go to /tmp/gg, packed into $OUT/logs.tgz at the end; the tables are
# printed last.
set -u
BIN=$(realpath "$1"); STEPS=${2:-tests,san,time,peer}; FM=$(realpath "${3:-/nonexistent}" 2>/dev/null)
ROOT=$(pwd)
O=/tmp/gg; rm -rf "$O"; mkdir -p "$O"
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
cd kernels
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$O/gpu.txt" 2>&1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has tests; then
  timeout -s KILL 240 "$BIN" --test-threads=1 linalg > "$O/tests.log" 2>&1; echo "linalg tests rc=$?" >> "$O/summary.txt"
fi
if has all; then
  # One thread: the graph-capture test captures in global mode, which makes
  # other threads' stream creation fail while it runs.
  timeout -s KILL 400 "$BIN" --test-threads=1 cuda > "$O/tests_all.log" 2>&1; echo "all cuda tests rc=$?" >> "$O/summary.txt"
fi
if has san; then
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    timeout -s KILL 120 "$CS" --tool $tool "$BIN" --test-threads=1 --exact cuda::linalg::tests::wgmma_grouped_gemms_small > "$O/san_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$O/san_$tool.log" | tr '\n' ' ')" >> "$O/summary.txt"
  done
fi
if has time; then
  timeout -s KILL 240 "$BIN" --ignored --nocapture --exact cuda::linalg::tests::grouped_gemm_timings > "$O/timings.log" 2>&1; echo "timings rc=$?" >> "$O/summary.txt"
fi
if has peer; then
  PYTHONUNBUFFERED=1 timeout -s KILL 180 python3 scripts/grouped_gemm_peer.py > "$O/peer.log" 2>&1; echo "peer rc=$?" >> "$O/summary.txt"
fi
if has layer; then
  for i in 1 2; do
    timeout -s KILL 120 "$FM" bench moe-layer --device cuda > "$O/layer_wgmma_$i.json" 2>&1
    FOLDMOE_GROUPED_GEMM=mma timeout -s KILL 120 "$FM" bench moe-layer --device cuda > "$O/layer_mma_$i.json" 2>&1
  done
  (cd "$ROOT" && PYTHONUNBUFFERED=1 timeout -s KILL 180 python3 benchmarks/torch_peer.py moe-layer > "$O/layer_torch.log" 2>&1)
  echo "layer rc=$?" >> "$O/summary.txt"
fi
if has prof; then
  for v in wgmma mma; do
    if [ $v = mma ]; then export FOLDMOE_GROUPED_GEMM=mma; else unset FOLDMOE_GROUPED_GEMM; fi
    timeout -s KILL 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      "$FM" bench moe-layer --device cuda --iters 1 --warmup 1 > "$O/prof_$v.csv" 2>/dev/null
    python3 "$ROOT/kernels/scripts/ncu_kernel_shares.py" "$O/prof_$v.csv" 16 > "$O/prof_$v.txt"
  done
  unset FOLDMOE_GROUPED_GEMM
  echo "prof done" >> "$O/summary.txt"
fi
if has f8overlap; then
  FOLDMOE_F8_OVERLAP=1 timeout -s KILL 90 "$BIN" --test-threads=1 fp8 > "$O/tests_f8overlap.log" 2>&1; echo "fp8 tests, OVERLAP=1 rc=$?" >> "$O/summary.txt"
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  FOLDMOE_F8_OVERLAP=1 timeout -s KILL 120 "$CS" --tool memcheck "$BIN" --test-threads=1 fp8_v3_chained > "$O/san_f8overlap.log" 2>&1
  echo "memcheck, OVERLAP=1 rc=$? $(grep 'ERROR SUMMARY' "$O/san_f8overlap.log" | tr '\n' ' ')" >> "$O/summary.txt"
  for r in 1 2; do for v in 0 1; do
    FOLDMOE_F8_OVERLAP=$v timeout -s KILL 60 "$FM" bench gemm --device cuda --fp8 --iters 10 --warmup 2 > "$O/gemm_f8overlap${v}_$r.json" 2>/dev/null
    FOLDMOE_F8_OVERLAP=$v timeout -s KILL 60 "$FM" bench moe-layer --device cuda --fp8 --iters 20 > "$O/layer_f8overlap${v}_$r.json" 2>&1
  done; done
  for f in "$O"/gemm_f8overlap*.json; do
    echo "$(basename $f): $(python3 -c 'import json,sys; print(*(r["shape"] + "/" + r["product"] + "=" + str(round(r["tflops"])) for r in json.load(open(sys.argv[1]))["results"]))' "$f" 2>&1)"
  done
fi
if has pdl; then
  FOLDMOE_PDL=1 timeout -s KILL 400 "$BIN" --test-threads=1 cuda > "$O/tests_pdl.log" 2>&1; echo "all cuda tests, PDL=1 rc=$?" >> "$O/summary.txt"
  for r in 1 2; do for v in 0 1; do
    FOLDMOE_PDL=$v timeout -s KILL 60 "$FM" bench moe-layer --device cuda --iters 20 > "$O/layer_pdl${v}_$r.json" 2>/dev/null
    FOLDMOE_PDL=$v timeout -s KILL 60 "$FM" bench attention --device cuda --iters 20 > "$O/attn_pdl${v}_$r.json" 2>/dev/null
  done; done
  for v in 0 1; do
    FOLDMOE_PDL=$v timeout -s KILL 120 "$FM" bench model --device cuda > "$O/model_pdl${v}.json" 2>/dev/null
  done
  for f in "$O"/attn_pdl*.json "$O"/model_pdl*.json; do
    echo "$(basename $f): $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items() if k in ("forward_ms","forward_tflops","backward_ms","backward_tflops","time_ms","time_ms_min","mfu")})' "$f" 2>&1)"
  done
fi
cat "$O/gpu.txt"
grep -E "test result|FAILED|panicked" "$O/tests.log" "$O/tests_all.log" "$O/tests_f8overlap.log" "$O/tests_pdl.log" 2>/dev/null | tail -12
grep "^|" "$O/timings.log" 2>/dev/null
grep -v "^|" "$O/timings.log" 2>/dev/null | tail -5
cat "$O/peer.log" 2>/dev/null | tail -30
for f in "$O"/layer_*.json; do [ -f "$f" ] && echo "$(basename $f): $(grep -E '"time_ms|"tflops"|host_waits|error' $f | tr -d '\n ')"; done
tail -8 "$O/layer_torch.log" 2>/dev/null
cat "$O"/prof_*.txt 2>/dev/null
cat "$O/summary.txt"
[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C /tmp gg

#!/bin/bash
# One device call for the grouped GEMMs (issue 18): the CUDA tests, the
# sanitizer on the small wgmma case, the timings and the PyTorch peer.
# Usage (repo root, on the GPU machine): kernels/scripts/grouped_gemm_device.sh <test binary> [steps]
# steps: any of tests,all,san,time,peer (default tests,san,time,peer).
# Logs go to $OUT (or /tmp/gg), the tables are printed last.
set -u
BIN=$(realpath "$1"); STEPS=${2:-tests,san,time,peer}
O=${OUT:-/tmp/gg}; mkdir -p "$O"
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
cd kernels
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$O/gpu.txt" 2>&1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has tests; then
  timeout -s KILL 240 "$BIN" --test-threads=1 linalg > "$O/tests.log" 2>&1; echo "linalg tests rc=$?" >> "$O/summary.txt"
fi
if has all; then
  timeout -s KILL 400 "$BIN" --test-threads=8 cuda > "$O/tests_all.log" 2>&1; echo "all cuda tests rc=$?" >> "$O/summary.txt"
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
cat "$O/gpu.txt"
grep -E "^test |test result|panicked|assert" "$O/tests.log" "$O/tests_all.log" 2>/dev/null | tail -40
grep "^|" "$O/timings.log" 2>/dev/null
grep -v "^|" "$O/timings.log" 2>/dev/null | tail -5
cat "$O/peer.log" 2>/dev/null | tail -30
cat "$O/summary.txt"

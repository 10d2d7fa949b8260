#!/bin/bash
# A prepared device call (session 50; no device started): CUDA tests at the default, fp8 tests + memcheck with FOLDMOE_F8_OVERLAP=1,
# bench gemm --fp8 and bench moe-layer --fp8 at OVERLAP 0/1 alternated.
# Build here, then carry $D (git-ignored):
#   cargo build --release
#   RUSTFLAGS='--cfg foldmoe_gpu_tests' CARGO_TARGET_DIR=target/gpu cargo test -p foldmoe-kernels --release --lib --no-run
#   mkdir -p .device/f8 && cp target/release/foldmoe .device/f8/foldmoe && cp <the test binary named> .device/f8/kt && strip .device/f8/*
# run: bash kernels/scripts/f8_overlap_device.sh   (carry [".device/f8"], ~300 s; summary last)
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
D=${D:-.device/f8}; L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $L/gpu.txt
t() { local n=$1; shift; local s=$(date +%s); timeout -s KILL "$@" > $L/$n.log 2> $L/$n.err; echo "$n rc=$? $(( $(date +%s)-s ))s" >> $L/rc.txt; }
t tests_default 150 $D/kt --test-threads=1 cuda
t tests_overlap 90 env FOLDMOE_F8_OVERLAP=1 $D/kt --test-threads=1 fp8
t memcheck_overlap 120 env FOLDMOE_F8_OVERLAP=1 compute-sanitizer --tool memcheck --error-exitcode 9 $D/kt --test-threads=1 fp8_v3_chained
for r in a b; do for o in 0 1; do
  t gemm_o${o}_$r 60 env FOLDMOE_F8_OVERLAP=$o $D/foldmoe bench gemm --device cuda --fp8 --iters 10 --warmup 2
done; done
for r in a b; do for o in 0 1; do
  t layer_o${o}_$r 60 env FOLDMOE_F8_OVERLAP=$o $D/foldmoe bench moe-layer --device cuda --fp8 --iters 20
done; done
python3 - <<'PY' > $OUT/summary.txt 2>&1
import json,glob,os,re
L=os.environ['OUT']+'/logs'
print(open(L+'/gpu.txt').read().strip()); print(open(L+'/rc.txt').read())
for n in ['tests_default','tests_overlap','memcheck_overlap']:
    s=open(f'{L}/{n}.log',errors='replace').read()+open(f'{L}/{n}.err',errors='replace').read()
    print(n, re.findall(r'test result:.*',s)[-1:] , re.findall(r'ERROR SUMMARY.*',s)[-1:], [l for l in s.splitlines() if 'FAILED' in l or 'panicked' in l][:5])
for f in sorted(glob.glob(L+'/gemm_*.log')):
    try:
        o=json.load(open(f)); print(os.path.basename(f), ' '.join(f"{r['shape']}/{r['product']}={r['tflops']:.0f}" for r in o['results']))
    except Exception as e: print(f, 'parse error', e)
for f in sorted(glob.glob(L+'/layer_*.log')):
    try:
        o=json.load(open(f)); print(os.path.basename(f), f"median {o['time_ms']:.3f} min {o['time_ms_min']:.3f} ms {o['tflops']:.0f} TFLOP/s waits {o['host_waits_per_iter']}")
    except Exception as e: print(f, 'parse error', e)
PY
cd $OUT && tar czf logs.tgz logs && rm -rf logs
cat $OUT/summary.txt

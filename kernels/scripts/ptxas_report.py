#!/usr/bin/env python3
"""Compiles one of kernels/src/cuda/*.cu as compile.rs does (common.cuh
prepended, the same options) with `-Xptxas -v` through libnvrtc, and prints
ptxas's report: registers, spills and the C75xx remarks (wgmma serialised)
of every kernel. Needs only NVRTC, no GPU: point NVRTC_LIB at libnvrtc.so
(for example the nvidia-cuda-nvrtc 13.0 wheel's) and CUDA_HOME at a root
whose include/ holds cuda_bf16.h (the nvidia-cuda-runtime and -crt wheels).

usage: ptxas_report.py MODULE.cu [ARCH] [-DNAME=VALUE ...]
"""
import ctypes
import os
import re
import sys

here = os.path.dirname(os.path.abspath(__file__))
cuda_dir = os.path.join(here, "..", "src", "cuda")
args = sys.argv[1:]
if not args:
    sys.exit(__doc__)
module = args[0]
arch = args[1] if len(args) > 1 and not args[1].startswith("-D") else "sm_90a"
defines = [a for a in args[1:] if a.startswith("-D")]
src = open(os.path.join(cuda_dir, "common.cuh")).read() + "\n" + open(os.path.join(cuda_dir, module)).read()
lib = ctypes.CDLL(os.environ.get("NVRTC_LIB", "libnvrtc.so"))
prog = ctypes.c_void_p()
rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), module.encode(), 0, None, None)
if rc:
    sys.exit(f"nvrtcCreateProgram: {rc}")
root = os.environ.get("CUDA_HOME", "/usr/local/cuda")
opts = [f"--gpu-architecture={arch}", f"--include-path={root}/include", "--std=c++17", "--ftz=false",
        "--prec-div=true", "--prec-sqrt=true", "-Xptxas", "-v"] + defines
copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
size = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
lib.nvrtcGetProgramLog(prog, log)
text = log.value.decode(errors="replace")
if rc:
    sys.exit(f"compile failed ({rc}):\n{text}")
# One line a kernel: name, registers, spills; then any C75xx remark.
name = None
for line in text.splitlines():
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
        name = m.group(1)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name:
        spill = f"spill {m.group(1)}/{m.group(2)}"
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        print(f"{name}: {m.group(1)} registers, {spill}")
    if re.search(r"C75\d\d", line):
        print(f"  {line.strip()}")

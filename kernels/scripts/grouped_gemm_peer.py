"""PyTorch peer of foldmoe's grouped_gemm_timings (kernels/src/cuda/linalg.rs):
torch grouped_mm on the same Qwen3-30B-A3B expert shapes and group sizes,
bf16, CUDA-event timing (median of 20 after 3 warm-ups).

    python3 kernels/scripts/grouped_gemm_peer.py

Products, as foldmoe names them (x [rows, K], w [G, K, N], dy [rows, N]):
  nn    = grouped_mm(x, w, offs)                     -> [rows, N]
  nt    = grouped_mm(dy, w.transpose(-2, -1), offs)  -> [rows, K]
  wgrad = grouped_mm(x.t(), dy, offs)                -> [G, K, N]
(what autograd runs for grouped_mm's forward and its two gradients).
"""
import torch
import torch.nn.functional as F

ROWS, H, FF, E = 131072, 2048, 768, 128


def uneven_sizes(g, rows):
    # Same formula as uneven_sizes in linalg.rs's tests.
    w = [64 + (i * 37) % 128 for i in range(g)]
    total = sum(w)
    s = [rows * wi // total for wi in w]
    s[-1] += rows - sum(s)
    return s


def bench(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2] / 1e3


def main():
    gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, grouped_mm = {gmm.__module__}.{gmm.__name__}")
    print("| product | groups | shape | kernel | ms | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, sizes in [("uniform", [ROWS // E] * E), ("uneven", uneven_sizes(E, ROWS))]:
        offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for name, k, n in [("fc1", H, FF), ("fc2", FF, H)]:
            flop = 2.0 * ROWS * k * n
            x = torch.randn(ROWS, k, device="cuda", generator=g).bfloat16()
            w = torch.randn(E, k, n, device="cuda", generator=g).bfloat16()
            dy = torch.randn(ROWS, n, device="cuda", generator=g).bfloat16()
            # nn with w row-major as stored, and with w column-major (the
            # layout torch's kernels may prefer); the faster is the peer.
            w_cm = w.transpose(-2, -1).contiguous().transpose(-2, -1)
            runs = [
                ("nn", f"{name} fwd {ROWS}x{k}x{n}", "w row-major", lambda: gmm(x, w, offs=offs)),
                ("nn", f"{name} fwd {ROWS}x{k}x{n}", "w col-major", lambda: gmm(x, w_cm, offs=offs)),
                ("nt", f"{name} dgrad {ROWS}x{n}x{k}", "w.mT", lambda: gmm(dy, w.transpose(-2, -1), offs=offs)),
                ("wgrad", f"{name} wgrad {E}x{k}x{n}", "x.t()", lambda: gmm(x.t(), dy, offs=offs)),
            ]
            for prod, shape, kern, fn in runs:
                try:
                    s = bench(fn)
                    print(f"| {prod} | {label} | {shape} | torch {kern} | {s * 1e3:.3f} | {flop / s / 1e12:.1f} |")
                except Exception as ex:  # noqa: BLE001
                    print(f"| {prod} | {label} | {shape} | torch {kern} | failed: {type(ex).__name__}: {str(ex)[:120]} | |")
            del x, w, dy, w_cm
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

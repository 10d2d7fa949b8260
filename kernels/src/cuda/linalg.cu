// The grouped GEMM over consecutive row blocks whose sizes live on the device
// (the MoE experts' GEMM), and its weight gradient. Dense GEMMs go through
// cuBLAS (linalg.rs). Shape letters: M rows, K inner, N columns, G groups.
//
// This is the simple, correct version: one thread per output element, the
// group found by binary search over the offsets. A tensor-core version will
// replace it; the interface (sizes read on the device, no host sync) stays.

// Offsets [G + 1] from sizes [G], on one thread (G is the expert count).
// Negative sizes and a total above M are reported, and the offsets clamped
// to [0, M] so no later kernel can read or write out of bounds.
extern "C" __global__ void group_offsets(const int* sizes, int g, i64 m, i64* offs, ErrRec* err,
                                         unsigned int code_negative, unsigned int code_total) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    i64 t = 0;
    offs[0] = 0;
    for (int i = 0; i < g; ++i) {
        i64 s = sizes[i];
        if (s < 0) {
            report_err(err, code_negative, i, (double)s);
            s = 0;
        }
        t += s;
        offs[i + 1] = t;
    }
    if (t > m) {
        report_err(err, code_total, t, (double)t);
        for (int i = 0; i <= g; ++i) offs[i] = offs[i] < m ? offs[i] : m;
    }
}

// The group of `row`: the last g with offs[g] <= row, or -1 past the end.
__device__ __forceinline__ int find_group(const i64* offs, int g, i64 row) {
    if (row >= offs[g]) return -1;
    int lo = 0, hi = g - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (offs[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// out[r, n] = Σ_k x[r, k] · w[g(r), k, n] (w[g, n, k] with trans_w); rows past
// the last group are zero. Block (16, 16): x = column, y = row.
template <typename T>
__device__ void grouped_mm_impl(const T* x, const T* w, const i64* offs, T* out, i64 m, i64 k, i64 n, int g, int trans_w) {
    typedef acc_t<T> A;
    extern __shared__ i64 so[];
    for (int i = threadIdx.y * blockDim.x + threadIdx.x; i <= g; i += blockDim.x * blockDim.y) so[i] = offs[i];
    __syncthreads();
    i64 row = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= m || col >= n) return;
    int grp = find_group(so, g, row);
    A acc = 0;
    if (grp >= 0) {
        const T* xr = x + row * k;
        const T* wg = w + (i64)grp * k * n;
        if (trans_w) {
            const T* wc = wg + col * k;
            for (i64 j = 0; j < k; ++j) acc += to_acc(xr[j]) * to_acc(wc[j]);
        } else {
            for (i64 j = 0; j < k; ++j) acc += to_acc(xr[j]) * to_acc(wg[j * n + col]);
        }
    }
    out[row * n + col] = from_acc<T>(acc);
}
#define GROUPED_MM(sfx, T) \
    extern "C" __global__ void grouped_mm_##sfx(const T* x, const T* w, const i64* offs, T* out, i64 m, i64 k, i64 n, int g, int trans_w) { \
        grouped_mm_impl<T>(x, w, offs, out, m, k, n, g, trans_w); }
FOR_FLOATS(GROUPED_MM)

// dw[g, kk, nn] = Σ_{r in group g} x[r, kk] · dy[r, nn]; grid z = group.
template <typename T>
__device__ void grouped_wgrad_impl(const T* x, const T* dy, const i64* offs, T* dw, i64 k, i64 n) {
    typedef acc_t<T> A;
    i64 g = blockIdx.z;
    i64 kk = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    i64 nn = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (kk >= k || nn >= n) return;
    A acc = 0;
    for (i64 r = offs[g]; r < offs[g + 1]; ++r) acc += to_acc(x[r * k + kk]) * to_acc(dy[r * n + nn]);
    dw[(g * k + kk) * n + nn] = from_acc<T>(acc);
}
#define GROUPED_WGRAD(sfx, T) \
    extern "C" __global__ void grouped_wgrad_##sfx(const T* x, const T* dy, const i64* offs, T* dw, i64 k, i64 n) { \
        grouped_wgrad_impl<T>(x, dy, offs, dw, k, n); }
FOR_FLOATS(GROUPED_WGRAD)
